"""Benchmark AR against HybridSpec strategies on several prompts: tokens/s, speedup, τ, and exactness.

    python examples/benchmark.py                                # the shipped tiny pair, held-out stdlib prompts
    python examples/benchmark.py --target Qwen/Qwen3.5-35B-A3B --drafter z-lab/Qwen3.5-35B-A3B-DFlash \\
        --prompts prompts.jsonl --strategies dflash hybridspec --max-new-tokens 256

Greedy decoding, batch size 1; each prompt runs once per strategy after one warm-up call per strategy (which also
calibrates the calibrated strategies on first use). Prints a markdown table; --json writes every number.
Numbers from a busy machine are noisy: run on an idle one and report the machine next to the table.
"""
import argparse
import json
import time

import torch
from _pair import add_model_arguments, encode, load_pair

import hybridspec_hf
from hybridspec_hf.drafter.training import load_prompts
from hybridspec_hf.tiny_pair import heldout_prompts


def timed(target, input_ids, **kwargs):
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = target.generate(input_ids, do_sample=False, **kwargs)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompts", nargs="+", default=None,
                        help=".jsonl / text files or folders (default: held-out stdlib code for the tiny pair)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts used")
    parser.add_argument("--strategies", nargs="+", default=["dflash", "hybridspec"], choices=hybridspec_hf.STRATEGIES)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="write the per-prompt numbers here")
    args = parser.parse_args()

    target, drafter, tokenizer = load_pair(args)
    texts = load_prompts(args.prompts) if args.prompts else heldout_prompts(args.num_prompts)
    prompts = [encode(tokenizer, text, target.device) for text in texts[: args.num_prompts]]
    runs = {"AR": {}} | {s: dict(assistant_model=drafter, generation_strategy=s) for s in args.strategies}
    for kwargs in runs.values():  # warm-up (and first-use calibration) outside the timings
        target.generate(prompts[0], do_sample=False, max_new_tokens=8, **kwargs)

    rows = {name: [] for name in runs}
    for index, input_ids in enumerate(prompts):
        reference = None
        for name, kwargs in runs.items():
            out, seconds = timed(target, input_ids, max_new_tokens=args.max_new_tokens, **kwargs)
            reference = out if reference is None else reference
            telemetry = hybridspec_hf.get_telemetry(target) if kwargs else None
            rows[name].append({"prompt": index, "new_tokens": out.shape[1] - input_ids.shape[1], "seconds": seconds,
                               "identical_to_ar": torch.equal(out, reference),
                               "tau": telemetry.mean_emitted if telemetry else 1.0,
                               "mean_w": telemetry.mean_verified if telemetry else 1.0})

    ar_seconds = sum(r["seconds"] for r in rows["AR"])
    print(f"{len(prompts)} prompts × {args.max_new_tokens} new tokens, {target.device}, greedy, batch 1\n")
    print("| strategy | tokens/s | speedup | τ | mean w | identical to AR |")
    print("|---|---|---|---|---|---|")
    for name, results in rows.items():
        tokens, seconds = sum(r["new_tokens"] for r in results), sum(r["seconds"] for r in results)
        mean = lambda key: sum(r[key] for r in results) / len(results)  # noqa: E731
        identical = sum(r["identical_to_ar"] for r in results)
        print(f"| {name} | {tokens / seconds:.1f} | {ar_seconds / seconds:.2f}x | {mean('tau'):.2f} | "
              f"{mean('mean_w'):.2f} | {identical}/{len(results)} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": str(target.device), "max_new_tokens": args.max_new_tokens, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
