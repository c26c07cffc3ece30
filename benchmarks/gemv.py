"""The resident forward's projections at M = 1..16 rows: F.linear (cuBLAS) against our skinny GEMM (gemv_triton).

    PYTHONPATH=$PWD python benchmarks/gemv.py              # one H200: ≈ 2 minutes (most of it Triton compiling)
    PYTHONPATH=$PWD python benchmarks/gemv.py --smoke      # any machine: tiny shapes, Triton interpreter on a CPU

For every projection shape of Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B (weight [N, K], bf16, hidden 2048) and M = 1, 4,
8, 16 rows, each candidate is timed as one CUDA graph of back-to-back calls (at least 50) over rotating copies of the
weight, 128 MiB of copies per shape (the L2 holds 50 MB, so no call finds its weight cached), replayed after
warm-up and timed by CUDA events: µs per call = median replay time / calls. TB/s = weight bytes / µs (x, from L2,
and y are not counted); % = of 4.25 TB/s (the H200 read ceiling of benchmarks/results/moe_experts.md). Candidates:
F.linear, and our kernel in a few tile / split-K configs (tensor-core dots for every M, fp32 FMAs for M ≤ 4), each
first checked against the fp32 reference (relative Frobenius error) and for determinism (three calls, equal bits);
a config that fails is reported and not timed. The winner of a cell is our best config where it beats F.linear by
≥ 3%, and the script prints the TABLE dict to paste into hybridspec_hf/kernels/gemv_triton.py (key: N, K, M bucket;
M = 1, 4, 8, 16 are the buckets' largest sizes) and what the table would save per AR step (M = 1) at the 35B-A3B
layer counts. Stops starting new shapes past --budget-s. Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the smoke run: kernels in the Triton interpreter (read at launch)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_graph, write_results  # noqa: E402

from hybridspec_hf.kernels.gemv_triton import GemvConfig, fit_config, gemv, linear_reference  # noqa: E402

HBM_TBPS = 4.25
SMS = 132  # H200
COPY_BYTES = 128 << 20  # rotating weight copies per shape
MIN_CALLS = 50
ROWS = (1, 4, 8, 16)
MARGIN = 0.97  # ours must be at least 3% faster to enter the table
MAX_REL_ERR = 1e-2  # bf16 output: one rounding (≤ 2^-9 relative) plus fp32 accumulation-order noise

# (N, K): the projections of that shape, and how many run per AR step of Qwen3.5-35B-A3B (40 layers: 30 GDN,
# 10 attention, every layer MoE); ordered by what cuBLAS spends on them per step (benchmarks/results/breakdown_*)
SHAPES = {
    (2048, 4096): ("GDN out_proj, attention o_proj", 40),
    (12352, 2048): ("GDN in_proj (qkv|z|b|a, one copy)", 30),
    (1032, 2048): ("shared expert gate|up|gate logit (copy, rows padded to 8)", 40),
    (256, 2048): ("router (35B-A3B)", 40),
    (2048, 512): ("shared expert down", 40),
    (9216, 2048): ("attention q|k|v (one copy: q_proj (+ output gate), k_proj, v_proj)", 10),
    (512, 2048): ("router (Qwen3-Next); attention k_proj, v_proj without the q|k|v copy", 0),
    (8192, 2048): ("attention q_proj without the q|k|v copy", 0),
    (12288, 2048): ("Qwen3-Next in_proj_qkvz; DFlash drafter gate|up (copy, draft graph M = 16)", 0),
    (64, 2048): ("Qwen3-Next in_proj_ba", 0),
    # the 5-layer DFlash drafter of the 35B-A3B (drafter/fused.py): not in the AR step (count 0); its o_proj is
    # (2048, 4096) above
    (5120, 2048): ("drafter q|k|v per layer (copy, M = 16); drafter context k|v of all 5 layers (copy, M = 1..16)", 0),
    (2048, 6144): ("drafter down_proj (draft graph, M = 16)", 0),
    (2048, 10240): ("drafter fc over 5 target layers' features (context append, M = 1..16)", 0),
}
SMOKE_SHAPES = {(48, 64): ("smoke", 1), (16, 96): ("smoke", 1)}


def auto_split(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """The smallest power-of-two K split that gives ≥ `programs` programs (at most one slice per BLOCK_K step)."""
    tiles, split = -(-n // block_n), 1
    while tiles * split < programs and 2 * split * block_k <= k:
        split *= 2
    return split


def candidates(n: int, k: int, rows: int, smoke: bool) -> list[GemvConfig]:
    """Our kernel's configs for one cell: narrow to wide row blocks, K split to fill the SMs, FMAs for ≤ 4 rows."""
    if smoke:
        configs = [GemvConfig(16, 32, 2), GemvConfig(32, 16, 1), GemvConfig(4, 32, 2, dot=False)]
    else:
        configs = [
            GemvConfig(16, 256, auto_split(n, k, 16, 256, 2 * SMS), 4, 3),
            GemvConfig(32, 128, auto_split(n, k, 32, 128, 2 * SMS), 4, 4),
            GemvConfig(64, 128, auto_split(n, k, 64, 128, 2 * SMS), 4, 4),
            GemvConfig(64, 128, 1, 4, 4),
            GemvConfig(64, 256, 1, 4, 3),
            GemvConfig(128, 64, auto_split(n, k, 128, 64, SMS), 4, 4),
            GemvConfig(4, 512, auto_split(n, k, 4, 512, 2 * SMS), 4, 2, dot=False),
            GemvConfig(8, 256, auto_split(n, k, 8, 256, 2 * SMS), 4, 3, dot=False),
            # deeper pipelines with narrow row blocks and no or little split (the 2048 x 4096 shape ran at 51 % of
            # the roofline with the configs above: the split-K reduction and too few bytes in flight per SM)
            GemvConfig(16, 256, 1, 4, 4),
            GemvConfig(16, 512, 1, 4, 3),
            GemvConfig(32, 256, 2, 4, 4),
            GemvConfig(32, 128, 4, 4, 6),
            GemvConfig(16, 128, auto_split(n, k, 16, 128, 4 * SMS), 4, 6),
        ]
    configs = [c for c in configs if c.dot or rows <= 4]  # FMAs only for few rows
    return list(dict.fromkeys(fit_config(c, rows, n, k) for c in configs))  # as launched, without repeats


# ----------------------------------------------------------------------------------------------------------------
# timing


def time_calls(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int) -> float:
    """µs per call of fn(x, weight) over the rotating weights: one CUDA graph of max(50, copies) calls (CUDA), or
    eager calls (CPU smoke run: interpreter times, meaningless)."""
    calls = max(MIN_CALLS, len(weights))
    if x.device.type != "cuda":
        start = time.perf_counter()
        for i in range(len(weights)):
            fn(x, weights[i])
        return (time.perf_counter() - start) * 1e6 / len(weights)
    fn(x, weights[0])  # compiles (Triton) and makes the split-K counters, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x, weights[i % len(weights)]) for i in range(calls)]
    us = time_graph(graph, calls, replays)["median_us"]
    del graph, outs
    return us


def check(fn, x: torch.Tensor, weight: torch.Tensor, truth: torch.Tensor) -> dict:
    """Relative Frobenius error against the fp32 truth, and whether three calls give the same bits."""
    outs = [fn(x, weight) for _ in range(3)]
    error = ((outs[0].float() - truth).norm() / truth.norm()).item()
    deterministic = all(torch.equal(outs[0], o) for o in outs[1:])
    return dict(rel_err=error, deterministic=deterministic, ok=deterministic and error < MAX_REL_ERR)


def run_shape(n: int, k: int, device: str, dtype: torch.dtype, replays: int, smoke: bool) -> list[dict]:
    gen = torch.Generator(device).manual_seed(n + k)
    bytes_per_copy = n * k * dtype.itemsize
    copies = 2 if smoke else max(2, -(-COPY_BYTES // bytes_per_copy))
    weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype) for _ in range(copies)]
    cells = []
    for rows in ROWS if not smoke else (1, 4):
        x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
        truth = linear_reference(x.float(), weights[0].float())
        torch_fn = lambda x, w: torch.nn.functional.linear(x, w)  # noqa: E731
        cell = dict(m=rows, f_linear=dict(us=time_calls(torch_fn, weights, x, replays),
                                          **check(torch_fn, x, weights[0], truth)), configs=[])
        for config in candidates(n, k, rows, smoke):
            ours = lambda x, w, c=config: gemv(x, w, None, c)  # noqa: E731
            row = dict(config=dataclasses.asdict(config))
            try:  # a config Triton cannot compile (e.g. out of shared memory) is written down, not fatal
                row.update(check(ours, x, weights[0], truth))
                if row["ok"]:
                    row["us"] = time_calls(ours, weights, x, replays)
            except Exception as error:  # noqa: BLE001
                row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:200]}")
            cell["configs"].append(row)
        for row in [cell["f_linear"], *cell["configs"]]:
            if "us" in row:
                row["tbps"] = bytes_per_copy / row["us"] / 1e6
        timed = [c for c in cell["configs"] if "us" in c]
        best = min(timed, key=lambda c: c["us"]) if timed else None
        cell["best"] = best
        cell["ours_wins"] = best is not None and best["us"] < MARGIN * cell["f_linear"]["us"]
        cells.append(cell)
        print(f"  N={n} K={k} M={rows}: F.linear {cell['f_linear']['us']:.2f} µs, best ours "
              f"{best['us'] if best else float('nan'):.2f} µs {best['config'] if best else ''}", flush=True)
    del weights
    if device == "cuda":
        torch.cuda.empty_cache()
    return cells


# ----------------------------------------------------------------------------------------------------------------
# report


def config_literal(config: dict) -> str:
    return "GemvConfig(" + ", ".join(f"{key}={value}" for key, value in config.items()) + ")"


def label(config: dict) -> str:
    kind = "dot" if config["dot"] else "fma"
    return (f"{kind} {config['block_n']}x{config['block_k']} split {config['split_k']} w{config['num_warps']} "
            f"s{config['num_stages']}")


def table_dict(shapes: list[dict]) -> str:
    """The TABLE dict of gemv_triton.py: the winning config of every cell where ours beats F.linear."""
    lines = ["TABLE: dict[tuple[int, int, int], GemvConfig] = {"]
    for shape in shapes:
        for cell in shape["cells"]:
            if cell["ours_wins"]:
                key = (shape["n"], shape["k"], cell["m"])
                lines.append(f"    {key}: {config_literal(cell['best']['config'])},  # {cell['best']['us']:.1f} µs "
                             f"vs F.linear {cell['f_linear']['us']:.1f}")
    lines.append("}")
    return "\n".join(lines)


def step_saving_us(shapes: list[dict]) -> float:
    """µs per AR step (M = 1) the table would save at the 35B-A3B layer counts."""
    saving = 0.0
    for shape in shapes:
        for cell in shape["cells"]:
            if cell["m"] == 1 and cell["ours_wins"]:
                saving += shape["per_step"] * (cell["f_linear"]["us"] - cell["best"]["us"])
    return saving


def markdown(shapes: list[dict]) -> str:
    def cell_text(row):
        return f"{row['us']:.2f} ({row['tbps']:.2f} TB/s, {100 * row['tbps'] / HBM_TBPS:.0f}%)"

    lines = ["| shape (N × K) | projections | MB | M | F.linear µs | best ours µs | config | ours / F.linear |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        for cell in shape["cells"]:
            best = cell["best"]
            ours = cell_text(best) if best else "—"
            config = config_literal(best["config"]) + (" ✓" if cell["ours_wins"] else "") if best else "—"
            ratio = f"{best['us'] / cell['f_linear']['us']:.2f}" if best else "—"
            lines.append(f"| {shape['n']} × {shape['k']} | {shape['names']} | {shape['mb']:.1f} | {cell['m']} | "
                         f"{cell_text(cell['f_linear'])} | {ours} | {config} | {ratio} |")
    lines += ["", "Every config (µs per call; ✗ = failed the check):", ""]
    for shape in shapes:
        for cell in shape["cells"]:
            timings = ", ".join(f"{label(row['config'])} " + (f"{row['us']:.2f}" if "us" in row else "✗")
                                for row in cell["configs"])
            lines.append(f"- {shape['n']} × {shape['k']}, M = {cell['m']}: F.linear {cell['f_linear']['us']:.2f}; "
                         f"{timings}")
    failed = [(shape["n"], shape["k"], cell["m"], label(row["config"]),
               row.get("error") or f"rel err {row['rel_err']:.2g}, deterministic {row['deterministic']}")
              for shape in shapes for cell in shape["cells"] for row in cell["configs"] if not row["ok"]]
    lines.append("")
    lines.append(f"✓ = in the table (≥ {100 * (1 - MARGIN):.0f}% faster than F.linear). Configs that failed the "
                 f"check (not timed): {failed if failed else 'none'}.")
    lines.append(f"\nPer AR step (M = 1, 35B-A3B layer counts) the table saves {step_saving_us(shapes):.0f} µs.")
    lines.append("\n```python\n" + table_dict(shapes) + "\n```")
    return "\n".join(lines)


def triton_version() -> dict:
    import triton

    return {"triton": triton.__version__}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (implied without CUDA)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=140.0, help="no new shape after this many seconds")
    parser.add_argument("--name", default="gemv", help="results stem (a path, or a name under benchmarks/results)")
    parser.add_argument("--shapes", default=None, help="only these N x K shapes, e.g. 2048x4096,9216x2048")
    args = parser.parse_args(argv)
    wanted = None if args.shapes is None else {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or device == "cpu"
    dtype = torch.bfloat16
    start = time.perf_counter()
    shapes, skipped = [], []
    for (n, k), (names, per_step) in (SMOKE_SHAPES if smoke else SHAPES).items():
        if wanted is not None and not smoke and (n, k) not in wanted:
            continue
        if time.perf_counter() - start > args.budget_s:
            skipped.append((n, k))
            continue
        print(f"N={n} K={k} ({names})", flush=True)
        shapes.append(dict(n=n, k=k, names=names, per_step=per_step, mb=n * k * dtype.itemsize / 1e6,
                           cells=run_shape(n, k, device, dtype, args.replays, smoke)))
    table = markdown(shapes)
    notes = __doc__.split("\n\n")[2] + "\n\nWeights and inputs: random (normal, scaled by K^-1/2), bf16; no model and no " \
        "acceptance involved (single projections)." + (f"\n\nSkipped past the time budget: {skipped}." if skipped else "")
    if smoke:
        notes += "\n\nSmoke run (Triton interpreter on the CPU): the times are meaningless."
    payload = {"title": "Skinny GEMMs: F.linear vs gemv_triton (bf16)", "environment": environment() | triton_version(),
               "notes": notes, "shapes": shapes, "skipped": skipped, "table": table_dict(shapes),
               "step_saving_us": step_saving_us(shapes), "seconds": time.perf_counter() - start}
    write_results(args.name, payload, table)
    print(table)
    print(f"\n{time.perf_counter() - start:.0f} s. Paste into hybridspec_hf/kernels/gemv_triton.py:\n")
    print(table_dict(shapes))
    return payload


if __name__ == "__main__":
    main()
