"""Calibration passes in one fresh process against what HybridSpec's rounds then cost (tiny pair, bf16, CUDA).

    python benchmarks/calibration_passes.py                    # on the H200 (≈ 200 s)
    python benchmarks/calibration_passes.py --rounds 8,3,8,3   # rounds timed per calibration call, one pass each

Why: run 91 (calibrated in a warm process, after the fp32 part of gpu_rounds.py) priced the tiny pair's rounds at
0.63 ms against 0.59 measured; run 92's calibration, the first work of a fresh process (as a user's first call
calibrates), priced them at 0.70–0.715 ms and HybridSpec stepped plain almost throughout. Each pass here is
`calibrate_latency` as generate() runs it when nothing is cached (random-token prompts, the default repeats), with
the rounds of every calibration call logged (drafted, ms) at DEBUG; then --calls HybridSpec calls on held-out prompts
price their rounds with the last pass and report what the rounds measured. Trained weights (the shipped tiny pair).
Writes benchmarks/results/calibration_passes.{json,md} (or --name).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_results  # noqa: E402
from round_kernels import full_length_prompts  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import HybridSpecConfig  # noqa: E402
from hybridspec_hf.generation.calibration import calibrate_latency  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", default="8,3,8,3", help="rounds_per_call of each pass, in order")
    parser.add_argument("--calls", type=int, default=4, help="HybridSpec calls timed after the passes")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--name", default="calibration_passes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("calibration_passes.py times GPU-resident rounds: it needs a CUDA device.")
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hybridspec_hf.generation.calibration").setLevel(logging.DEBUG)
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    target, drafter, tokenizer = load_tiny_pair(dtype=torch.bfloat16, device="cuda")
    passes = []
    for rounds in (int(r) for r in args.rounds.split(",")):
        start = time.perf_counter()
        model = calibrate_latency(target, drafter, rounds_per_call=rounds, progress=False)
        cost, cost_ar = model.cost_for(64)[0], model.cost_ar_for(64)[0]
        passes.append({"rounds_per_call": rounds, "seconds": time.perf_counter() - start,
                       "C_ms": [round(float(c) * 1e3, 3) for c in cost], "C_ar_ms": round(float(cost_ar) * 1e3, 3)})
        print("pass", passes[-1], flush=True)
    settings = HybridSpecConfig(latency_model=model)
    prompts = full_length_prompts(target, tokenizer, heldout_prompts(8 * args.calls), args.calls, args.tokens)
    target.generate(prompts[0], do_sample=False, max_new_tokens=args.tokens, assistant_model=drafter,
                    generation_strategy="hybridspec", hybridspec_config=settings)  # captures
    drafted, plain = [], []
    for prompt in prompts:
        target.generate(prompt, do_sample=False, max_new_tokens=args.tokens, assistant_model=drafter,
                        generation_strategy="hybridspec", hybridspec_config=settings)
        rounds = hybridspec_hf.get_telemetry(target).rounds
        drafted += [r.wall_s * 1e3 for r in rounds[1:] if r.drafted]
        plain += [r.wall_s * 1e3 for r in rounds[1:] if not r.drafted]
    measured = {"drafted_ms": round(statistics.median(drafted), 3) if drafted else None,
                "drafted_rounds": len(drafted), "plain_ms": round(statistics.median(plain), 3) if plain else None,
                "plain_steps": len(plain)}
    print("measured", measured, flush=True)
    lines = ["| pass | rounds per call | seconds | C(1) | C(8) | C(16) | C_ar (ms, context 64) |",
             "|---|---|---|---|---|---|---|"]
    for index, p in enumerate(passes, 1):
        c = p["C_ms"]
        lines.append(f"| {index} | {p['rounds_per_call']} | {p['seconds']:.1f} | {c[0]:.3f} | {c[min(7, len(c) - 1)]:.3f}"
                     f" | {c[-1]:.3f} | {p['C_ar_ms']:.3f} |")
    lines += ["", f"HybridSpec with the last pass, {args.calls} held-out prompts × {args.tokens} tokens (each call's "
              f"first round left out): drafted rounds {measured['drafted_ms']} ms (median of "
              f"{measured['drafted_rounds']}), plain steps {measured['plain_ms']} ms (median of "
              f"{measured['plain_steps']})."]
    table = "\n".join(lines)
    write_results(args.name, {"title": "Calibration passes in one process (tiny pair, bf16)",
                              "environment": environment(), "passes": passes, "measured": measured,
                              "notes": __doc__.split("\n\n")[2].replace("\n", " ")}, table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
