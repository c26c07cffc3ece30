"""Generate with HybridSpec and stream the text as rounds are accepted.

    python examples/generate_streaming.py                       # the shipped tiny pair on the CPU
    python examples/generate_streaming.py --target Qwen/Qwen3.5-35B-A3B --drafter z-lab/Qwen3.5-35B-A3B-DFlash \\
        --prompt "Write a Python function that merges two sorted lists."

Tokens appear as each round is accepted (several at a time when drafts are accepted). Then the same prompt runs
with plain autoregressive decoding to show the text is identical (greedy) and to compare speed.
"""
import argparse
import time

import torch
from _pair import add_model_arguments, encode, load_pair
from transformers import TextStreamer

import hybridspec_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", default="def binary_search(items, value):\n")
    parser.add_argument("--strategy", default="hybridspec", choices=hybridspec_hf.STRATEGIES)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    target, drafter, tokenizer = load_pair(args)
    input_ids = encode(tokenizer, args.prompt, target.device)
    spec = dict(assistant_model=drafter, generation_strategy=args.strategy, do_sample=False)
    target.generate(input_ids, max_new_tokens=4, **spec)  # warm-up; the first use on a machine also calibrates
    streamer = TextStreamer(tokenizer, skip_prompt=False)
    start = time.perf_counter()
    out = target.generate(input_ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **spec)
    seconds = time.perf_counter() - start
    print("\n" + hybridspec_hf.get_telemetry(target).summary())

    start = time.perf_counter()
    ar = target.generate(input_ids, do_sample=False, max_new_tokens=args.max_new_tokens)
    ar_seconds = time.perf_counter() - start
    print(f"identical to autoregressive decoding: {torch.equal(out, ar)}; speedup {ar_seconds / seconds:.2f}x")


if __name__ == "__main__":
    main()
