"""Train a DFlash drafter for a target, then generate with it.

    python examples/train_drafter.py --steps 3                  # the shipped tiny target on the CPU (seconds)
    python examples/train_drafter.py --target Qwen/Qwen3.5-35B-A3B --prompts prompts.jsonl \\
        --output-dir runs/qwen35-drafter --steps 2000 --max-new-tokens 512

The target answers every prompt first (the drafter learns the target's own distribution), then the drafter learns
to predict blocks of those answers from the target's hidden states. The command-line equivalent, with every
option: `hybridspec train-drafter --help`. For the tiny target the default prompts are stdlib training-split code;
a drafter trained for a few steps drafts poorly — the shipped one trained for about an hour.
"""
import argparse

from _pair import add_model_arguments, encode, load_pair

import hybridspec_hf
from hybridspec_hf.drafter.training import load_prompts, train_drafter
from hybridspec_hf.tiny_pair import code_prompts, heldout_prompts, stdlib_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompts", nargs="+", default=None,
                        help=".jsonl / text files or folders (default: stdlib training-split code for the tiny pair)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts used from the default source")
    parser.add_argument("--output-dir", default="runs/example-drafter")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens the target answers per prompt")
    args = parser.parse_args()

    target, _, tokenizer = load_pair(args, with_drafter=False)
    if args.prompts:
        prompts = load_prompts(args.prompts)
        eval_prompts = None
    else:
        prompts = code_prompts(stdlib_files("train"), args.num_prompts)
        eval_prompts = heldout_prompts(2)
    drafter = train_drafter(target, prompts, args.output_dir, tokenizer=tokenizer, num_layers=1,
                            block_size=args.block_size, steps=args.steps, batch_size=args.batch_size,
                            num_anchors=16, max_new_tokens=args.max_new_tokens, regen_batch_size=16,
                            eval_prompts=eval_prompts, eval_block_sizes=(args.block_size,),
                            log_every=max(1, args.steps // 10))

    input_ids = encode(tokenizer, "def read_config(path):\n", target.device)
    target.generate(input_ids, assistant_model=drafter, generation_strategy="dflash", do_sample=False,
                    max_new_tokens=32)
    print(f"saved in {args.output_dir}; " + hybridspec_hf.get_telemetry(target).summary())


if __name__ == "__main__":
    main()
