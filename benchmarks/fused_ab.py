"""Our fused kernels on and off, side by side in one process: the captured AR step and a whole-block round.

    python benchmarks/fused_ab.py                      # one H200: Qwen3.5-35B-A3B shape, random bf16 weights
    python benchmarks/fused_ab.py --model tiny         # the harness on a CPU (fused kernels only act on CUDA)

The fused kernels (RMSNorms, RoPE, GDN prologue, MoE router and shared expert; inside resident forwards only) are
switched off with HYBRIDSPEC_FUSED_KERNELS=0; the graphs are released and captured again for each setting. Vanilla
DFlash with the random drafter (τ ≈ 1) times a round verifying the whole block. Random bf16 weights; no acceptance
profile (AR emits one token per step; DFlash's random drafter gets almost nothing accepted). Writes
benchmarks/results/fused_ab.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_results  # noqa: E402
from e2e import build, run_method  # noqa: E402

import hybridspec_hf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--name", default="fused_ab")
    parser.add_argument("--methods", default="ar,dflash", help="ar and/or dflash")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = build(args.model, args.layers, device)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, 256), generator=torch.Generator().manual_seed(0)).to(device)
    rows = {}
    for setting in ("1", "0", "1"):  # on, off, on again (drift check)
        os.environ["HYBRIDSPEC_FUSED_KERNELS"] = setting
        for method in args.methods.split(","):
            hybridspec_hf.release_graphs(target)
            row = run_method(target, drafter, prompt, method, None, args.tokens)
            rows.setdefault(f"{method}, fused {'on' if setting == '1' else 'off'}", []).append(
                {k: row[k] for k in ("ms_per_token", "round_ms", "capture_s")})
            print(method, setting, rows, flush=True)
    os.environ.pop("HYBRIDSPEC_FUSED_KERNELS")
    lines = ["| setting | ms/token (decoding) | round ms (median) | capture s |", "|---|---|---|---|"]
    for name, runs in rows.items():
        for run in runs:
            lines.append(f"| {name} | {run['ms_per_token']:.3f} | {run['round_ms']:.3f} | {run['capture_s']:.1f} |")
    payload = {"title": f"Fused kernels on/off ({args.model}, random weights)", "environment": environment(),
               "rows": rows, "notes": __doc__.split("\n\n")[2]}
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
