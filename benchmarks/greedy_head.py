"""The int8 greedy head (`kernels/head_argmax_triton.py`) alone: what a greedy step's LM head costs either way.

    PYTHONPATH=$PWD python benchmarks/greedy_head.py --name greedy_head_runNNN     # a GPU
    PYTHONPATH=$PWD python benchmarks/greedy_head.py --vocab 4096 --hidden 256 --name /tmp/x   # a CPU smoke run

Greedy decoding needs only the LM head's argmax. At the Qwen3.5-35B-A3B shape the head is 248 320 x 2 048 bf16
(1.02 GB), the largest single read of an AR step. For each of `--rows` tokens (1: an AR step; 4, 16: verifications)
this times, each call captured alone in a CUDA graph (median of `--replays` replays, CUDA events; 1 GB per call
leaves nothing of it in L2):
  - "bf16 head + argmax": F.linear on the bf16 head (cuBLAS), then argmax: what the model path does;
  - "int8 GEMV alone": the head's int8 copy times h (`gemv_triton.linear_int8`), the first kernel of the int8 path;
  - "int8 greedy, two passes" / "one pass": `greedy_tokens` with `head_argmax_triton.TWO_PASS` True / False;
  - "int8 greedy, two passes, every step": the same with `BOUNDED_CANDIDATES` False (the candidates' loop walks every
    step of its block, as before run 167, instead of as many as the block has candidates).
Beside each: weight bytes, TB/s, and whether its tokens equal the truth (`greedy_tokens_plain`: the head's logits
rounded to bf16, first argmax) on every row; for the int8 rows, the head's rows multiplied (candidates against the
token's bound, and against each block's own bound: what one pass multiplies). Weights random N(0, 0.02) bf16, hidden
states random N(0, 1) (`--seed`): a random head's logits are close together, so its candidates are more than a
trained head's peaked logits would leave. On a CPU the kernels run in the Triton interpreter (no timing).
Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU runs: kernels in the Triton interpreter (read at launch)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture, environment, time_graph, write_results  # noqa: E402

from hybridspec_hf.kernels import head_argmax_triton  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import linear_int8, quantize_rows  # noqa: E402
from hybridspec_hf.kernels.head_argmax_triton import (_candidates, greedy_tokens,  # noqa: E402
                                                      greedy_tokens_plain)


def with_switches(function, two_pass: bool, bounded: bool = True):
    """function() with head_argmax_triton.TWO_PASS and BOUNDED_CANDIDATES set for its launch (read at each launch:
    captures keep them)."""
    def call():
        kept = head_argmax_triton.TWO_PASS, head_argmax_triton.BOUNDED_CANDIDATES
        head_argmax_triton.TWO_PASS, head_argmax_triton.BOUNDED_CANDIDATES = two_pass, bounded
        try:
            return function()
        finally:
            head_argmax_triton.TWO_PASS, head_argmax_triton.BOUNDED_CANDIDATES = kept
    return call


def timed(device: torch.device) -> bool:
    """Whether calls on `device` are captured and timed (CUDA; the CPU's interpreter runs only check tokens)."""
    return device.type == "cuda"


def rows_of(hidden: int, rows: int, seed: int, replays: int, weight, quantized) -> list[dict]:
    device = weight.device
    generator = torch.Generator(device=device).manual_seed(seed + rows)
    x = torch.randn(rows, hidden, device=device, generator=generator).to(torch.bfloat16)
    truth = greedy_tokens_plain(x, weight)
    approx = linear_int8(x, quantized)
    per_token = _candidates(x, approx, quantized.scale).sum(-1).float()
    per_block = _candidates(x, approx, quantized.scale, block=head_argmax_triton.BLOCK_V if rows <= 4
                            else head_argmax_triton.BLOCK_V_WIDE).sum(-1).float()
    int8_bytes = quantized.nbytes
    variants = [
        ("bf16 head + argmax", lambda: torch.nn.functional.linear(x, weight).argmax(-1), weight.numel() * 2, {}),
        ("int8 GEMV alone", lambda: linear_int8(x, quantized), int8_bytes, {}),
        ("int8 greedy, two passes", with_switches(lambda: greedy_tokens(x, weight, quantized), True), int8_bytes,
         {"candidate_rows_mean": per_token.mean().item(), "candidate_rows_max": per_token.max().item()}),
        ("int8 greedy, two passes, every step", with_switches(lambda: greedy_tokens(x, weight, quantized), True,
                                                               bounded=False), int8_bytes,
         {"candidate_rows_mean": per_token.mean().item(), "candidate_rows_max": per_token.max().item()}),
        ("int8 greedy, one pass", with_switches(lambda: greedy_tokens(x, weight, quantized), False), int8_bytes,
         {"candidate_rows_mean": per_block.mean().item(), "candidate_rows_max": per_block.max().item()}),
    ]
    out = []
    for name, function, weight_bytes, extra in variants:
        result = function()
        row = dict(rows=rows, variant=name, weight_bytes=weight_bytes, **extra)
        if name != "int8 GEMV alone":
            row["tokens_equal_truth"] = int((result.view(-1) == truth).sum().item())
        if timed(device):
            graph = capture(function)
            timing = time_graph(graph, 1, replays)
            del graph
            row.update(timing, tb_per_s=weight_bytes / (timing["median_us"] * 1e-6) / 1e12)
        print(row, flush=True)
        out.append(row)
    return out


def table(results: list[dict]) -> str:
    lines = ["| rows | variant | µs median (p10-p90) | vs bf16 | weight MB | TB/s | tokens = truth | "
             "head rows multiplied (mean / max) |", "|---|---|---|---|---|---|---|---|"]
    base = {r["rows"]: r.get("median_us") for r in results if r["variant"] == "bf16 head + argmax"}
    for r in results:
        timing = (f"{r['median_us']:.1f} ({r['p10_us']:.1f}-{r['p90_us']:.1f})" if "median_us" in r else "-")
        ratio = (f"{base[r['rows']] / r['median_us']:.2f}x" if "median_us" in r and base.get(r["rows"]) else "-")
        tbs = f"{r['tb_per_s']:.2f}" if "tb_per_s" in r else "-"
        equal = f"{r['tokens_equal_truth']}/{r['rows']}" if "tokens_equal_truth" in r else "-"
        cands = (f"{r['candidate_rows_mean']:.0f} / {r['candidate_rows_max']:.0f}" if "candidate_rows_mean" in r
                 else "-")
        lines.append(f"| {r['rows']} | {r['variant']} | {timing} | {ratio} | {r['weight_bytes'] / 1e6:.0f} | {tbs} | "
                     f"{equal} | {cands} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", default="1,2,4,8,16", help="tokens per call, comma-separated (each <= 16)")
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--block-v-wide", type=int, default=None,
                        help="head rows per program past 4 tokens (head_argmax_triton.BLOCK_V_WIDE; default its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="greedy_head")
    args = parser.parse_args(argv)
    rows_list = [int(v) for v in args.rows.split(",")]
    if any(not 1 <= r <= 16 for r in rows_list):
        raise SystemExit(f"--rows: each count must be 1-16 (the kernel's MAX_ROWS), got {args.rows!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(args.seed)
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    quantized = quantize_rows(weight)
    if args.block_v_wide is not None:
        if args.block_v_wide < 16 or args.block_v_wide & (args.block_v_wide - 1):
            raise SystemExit(f"--block-v-wide: a power of two >= 16, got {args.block_v_wide}")
        head_argmax_triton.BLOCK_V_WIDE = args.block_v_wide
    results = []
    with torch.no_grad():  # the captures too: with grad on, linear_int8 takes its torch reference (run 163: 2.3 ms)
        for rows in rows_list:
            results.extend(rows_of(args.hidden, rows, args.seed, args.replays, weight, quantized))
    notes = (f"Head {args.vocab} x {args.hidden} bf16, random N(0, 0.02) weights, random N(0, 1) hidden states "
             f"(seed {args.seed}); BLOCK_V {head_argmax_triton.BLOCK_V} up to 4 rows, BLOCK_V_WIDE "
             f"{head_argmax_triton.BLOCK_V_WIDE} past them; each call captured alone in a CUDA graph, median of "
             f"{args.replays} replays. "
             "'tokens = truth': rows whose token equals the first argmax of the head's bf16-rounded logits. "
             "'head rows multiplied': candidates against the token's bound (two passes) or each block's own "
             "(one pass), from the torch rule (`_candidates`).")
    payload = {"title": "Greedy head: bf16 head + argmax against the int8 greedy head", "environment": environment(),
               "notes": notes, "args": vars(args), "results": results}
    write_results(args.name, payload, table(results))
    return payload


if __name__ == "__main__":
    main()
