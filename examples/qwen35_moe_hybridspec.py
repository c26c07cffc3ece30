"""HybridSpec with a real checkpoint on one GPU (needs the weights locally or hub access; not run in CI).

    python examples/qwen35_moe_hybridspec.py --target Qwen/Qwen3.5-35B-A3B --drafter z-lab/Qwen3.5-35B-A3B-DFlash

Prints AR and HybridSpec side by side (greedy) with tokens/s, whether the texts are identical (in bf16 a w-token
verification can round differently from one-token AR steps, so they may part at a near-tie) and the per-round
summary. On a GPU the
rounds are not yet captured in CUDA graphs, so expect the transformers eager forward's host-bound speed.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridspec_hf
from hybridspec_hf import DFlashDrafter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompt", default="Write a Python function that merges two sorted lists.")
    parser.add_argument("--strategy", default="hybridspec", choices=list(hybridspec_hf.STRATEGIES))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16, device_map="cuda")
    drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=torch.bfloat16).to("cuda").bind_target(target)
    messages = [{"role": "user", "content": args.prompt}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").to("cuda")

    outputs = {}
    for name, kwargs in (("AR", {}), (args.strategy, dict(assistant_model=drafter, generation_strategy=args.strategy))):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs[name] = target.generate(input_ids, do_sample=False, max_new_tokens=args.max_new_tokens, **kwargs)
        torch.cuda.synchronize()
        new = outputs[name].shape[1] - input_ids.shape[1]
        print(f"{name}: {new / (time.perf_counter() - start):.1f} tokens/s")
    print("identical:", torch.equal(outputs["AR"], outputs[args.strategy]))
    print(tokenizer.decode(outputs[args.strategy][0, input_ids.shape[1]:]))
    print(hybridspec_hf.get_telemetry(target).summary())


if __name__ == "__main__":
    main()
