"""What a grid-wide barrier inside one persistent kernel costs against a kernel boundary in a CUDA graph (GPU).

    python benchmarks/barrier_cost.py --name barrier_cost_runN          # H200: ≈ 1 min

Issue 12: the resident AR step at the 35B-A3B shape is 309 kernels, a chain of dependent stages (the input
projection needs the whole normed hidden state, the GDN step the whole projection, ...), and what is left of its
time over the bytes roofline is ≈ 3 µs of fixed latency per kernel (benchmarks/results/kernel_costs_run110.md);
tiles and prefetching did not remove it (runs 108, 110). A persistent kernel per layer would replace each boundary
by a grid barrier (every program signals an atomic counter, then waits until all have): whether that is cheaper on
this GPU decides if such a kernel is worth building. This benchmark measures it on a chain with the step's
dependency and nothing else:

    y_{s+1} = W_s · y_s,  s < S,  W_s random bf16 [D, D] scaled by D^-1/2 (y stays O(1)), fp32 sums, bf16 between

Every stage needs all of the stage before. Variants, each in one CUDA graph:
- launches: S launches of our skinny GEMM (`gemv_triton.gemv`), PDL on (as in the resident step), the persistent
  kernel's tiles ([BLOCK_N, BLOCK_K] by fp32 FMAs, one program per row block, the first tile before the PDL wait);
- launches, no PDL: the same with PDL off;
- launches, tuned tiles: the same with the tiles our table uses for the step's 2048-wide GEMVs (64 x 128, split K 8,
  tensor cores): how much the plain tiles give up;
- persistent: one launch of P = D / BLOCK_N programs (≤ the GPU's SMs, so all are resident at once), each looping
  over the stages: load its first weight tile of stage s, wait at the barrier for stage s - 1, read y_s past L1,
  write its rows of y_{s+1}, signal;
- persistent, no barrier: the same without waiting: wrong results (reported, not checked), the time of streaming
  the weights with no synchronisation at all.
Reported per stage: the slope of the graph's time between S1 and S2 stages (the graph launch, the counter's reset
and the chain's first stage fall out), its bytes roofline (D·D·2 at 4.25 TB/s), and each variant's results against
a float32 chain rounded to bf16 after every stage (relative L2 error of y_S). A barrier that does not complete within
MAX_POLLS polls gives up and counts a timeout (reported, and the variant marked failed) instead of hanging the GPU.
Weights are random (no model involved); S1, S2 keep each chain's weights ≥ 4x the H200's 50 MB L2.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import capture, environment, time_graph, write_results  # noqa: E402

from hybridspec_hf.kernels import pdl  # noqa: E402
from hybridspec_hf.kernels.gdn_triton import HAS_TRITON, _LazyJit, tl, triton  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import GemvConfig, gemv  # noqa: E402

PROGRAMS = 128  # row blocks (programs) of the persistent kernel: ≤ the SMs of an H100 / H200 (132)
TILE_BYTES = 32 * 1024  # a program's weight tile per load, as gemv_triton.WHOLE_SLICE_BYTES
MAX_POLLS = 1 << 16  # a barrier's polls before it gives up (≈ 0.1 s): a broken barrier costs a timeout, not a hang
HBM_BYTES_PER_S = 4.25e12  # the H200's HBM3e bandwidth
L2_BYTES = 50 * 2**20
TUNED = GemvConfig(64, 128, 8, 4, 4, True)  # gemv_triton.TABLE's (2048, 4096, 1) tiles


def _chain_kernel(w, y, counter, S: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SYNC: tl.constexpr, MAX_POLLS: tl.constexpr):
    """y[s + 1, rows] = W_s[rows] · y[s] for s < S: one program per BLOCK_N rows, all stages in one launch.
    w: [S, D, D]; y: [S + 1, D]; counter: [2] int32 zeros (signals, timeouts)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_tile = w + rn[:, None] * D + rk[None, :]  # [BLOCK_N, BLOCK_K] pointers into W_0
    y_in = y
    for s in range(S):
        b_w = tl.load(w_tile)  # a weight tile (no stage writes weights): before the wait, as before a PDL wait
        if SYNC:
            if s > 0:  # stage s - 1 is complete once every program has signalled s times
                target = s * programs
                seen = tl.atomic_add(counter, 0, sem="acquire")
                polls = 0
                while (seen < target) & (polls < MAX_POLLS):
                    seen = tl.atomic_add(counter, 0, sem="acquire")
                    polls += 1
                if seen < target:
                    tl.atomic_add(counter + 1, 1)
                tl.debug_barrier()
        acc = tl.sum(b_w.to(tl.float32) * tl.load(y_in + rk, cache_modifier=".cg").to(tl.float32)[None, :], axis=1)
        for k in range(BLOCK_K, D, BLOCK_K):
            b_w = tl.load(w_tile + k)
            b_y = tl.load(y_in + k + rk, cache_modifier=".cg")
            acc += tl.sum(b_w.to(tl.float32) * b_y.to(tl.float32)[None, :], axis=1)
        tl.store(y_in + D + rn, acc.to(y.dtype.element_ty))
        if SYNC:
            tl.debug_barrier()  # every thread's rows are written before the signal
            tl.atomic_add(counter, 1, sem="release")
        w_tile += D * D
        y_in += D


if HAS_TRITON:
    _chain_kernel = _LazyJit(_chain_kernel)  # bound at launch: the interpreter's twin under TRITON_INTERPRET=1


def tiles(d: int, programs: int = PROGRAMS) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a D-wide chain: `programs` row blocks, tiles of at most TILE_BYTES of bf16."""
    if d % programs or (d // programs) & (d // programs - 1):
        raise ValueError(f"D={d} must be {programs} times a power of two")
    block_n = d // programs
    return block_n, min(d, TILE_BYTES // 2 // block_n)


def chain_reference(weights: torch.Tensor, y0: torch.Tensor) -> torch.Tensor:
    """The truth: every stage in float32 from the bf16 operands, rounded to y0's dtype. Returns y [S + 1, D]."""
    ys = [y0]
    for w in weights:
        ys.append((w.float() @ ys[-1].float()).to(y0.dtype))
    return torch.stack(ys)


def chain_persistent(weights: torch.Tensor, y0: torch.Tensor, block_n: int, block_k: int, sync: bool = True,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain in one launch of D / block_n programs; returns (y [S + 1, D], counter [2]: signals, timeouts).
    `out`: the (y, counter) buffers to reuse (a captured graph's); the counter is zeroed here."""
    stages, d, _ = weights.shape
    y, counter = out if out is not None else (torch.empty(stages + 1, d, dtype=y0.dtype, device=y0.device),
                                              torch.zeros(2, dtype=torch.int32, device=y0.device))
    y[0].copy_(y0)
    counter.zero_()
    programs = d // block_n
    if sync and y0.is_cuda and programs > torch.cuda.get_device_properties(y0.device).multi_processor_count:
        raise ValueError(f"{programs} programs exceed the GPU's SMs: not all resident at once, the barrier would wait "
                         "for programs that cannot start")
    _chain_kernel[(programs,)](weights, y, counter, stages, D=d, BLOCK_N=block_n, BLOCK_K=block_k, SYNC=sync,
                               MAX_POLLS=MAX_POLLS, num_warps=4)  # read at launch (a test lowers it)
    return y, counter


def chain_launches(weights: torch.Tensor, y0: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """The chain as one `gemv` launch per stage; returns y_S [D]."""
    y = y0[None]
    for w in weights:
        y = gemv(y, w, None, config)
    return y[0]


def relative_error(y: torch.Tensor, truth: torch.Tensor) -> float:
    return float((y.float() - truth.float()).norm() / truth.float().norm())


def _stages(d: int) -> tuple[int, int]:
    """(S1, S2): the chain's weights at S1 stages at least 4x the L2, S2 = 2 S1."""
    s1 = max(8, math.ceil(4 * L2_BYTES / (2 * d * d)))
    return s1, 2 * s1


def measure(d: int, replays: int) -> dict:
    block_n, block_k = tiles(d)
    plain = GemvConfig(block_n, block_k, 1, 4, 1, False)
    s1, s2 = _stages(d)
    gen = torch.Generator(device="cuda").manual_seed(d)
    weights = (torch.randn(s2, d, d, device="cuda", generator=gen) * d ** -0.5).to(torch.bfloat16)
    y0 = torch.randn(d, device="cuda", generator=gen).to(torch.bfloat16)
    truth = chain_reference(weights, y0)
    row = {"D": d, "block_n": block_n, "block_k": block_k, "programs": d // block_n, "stages": [s1, s2],
           "roofline_us": 2 * d * d / HBM_BYTES_PER_S * 1e6, "variants": {}}
    variants = {"launches": ("launch", plain, True), "launches, no PDL": ("launch", plain, False),
                "launches, tuned tiles": ("launch", TUNED, True), "persistent": ("persistent", True, None),
                "persistent, no barrier": ("persistent", False, None)}
    enabled = pdl.ENABLED
    try:
        for name, (kind, option, pdl_on) in variants.items():
            result = {"us": {}}
            for stages in (s1, s2):
                w = weights[:stages]
                if kind == "launch":
                    pdl.ENABLED = pdl_on
                    buffers = None
                    graph = capture(lambda: chain_launches(w, y0, option))
                    y_last = chain_launches(w, y0, option)  # eagerly again, for the check
                else:
                    buffers = (torch.empty(stages + 1, d, dtype=y0.dtype, device="cuda"),
                               torch.zeros(2, dtype=torch.int32, device="cuda"))
                    graph = capture(lambda: chain_persistent(w, y0, block_n, block_k, option, buffers))
                    graph.replay()
                    torch.cuda.synchronize()
                    y_last = buffers[0][stages]
                result["us"][stages] = time_graph(graph, 1, replays)["median_us"]
                result["error"] = relative_error(y_last, truth[stages])
                if buffers is not None and option:
                    result["timeouts"] = int(buffers[1][1])
                    result["signals"] = int(buffers[1][0])
                del graph
            result["us_per_stage"] = (result["us"][s2] - result["us"][s1]) / (s2 - s1)
            result["checked"] = name != "persistent, no barrier"
            result["ok"] = not result["checked"] or (result["error"] < 0.05 and not result.get("timeouts"))
            if "signals" in result:
                result["ok"] = result["ok"] and result["signals"] == s2 * (d // block_n)
            row["variants"][name] = result
            print(f"D={d} {name}: {result['us_per_stage']:.2f} µs/stage, error {result['error']:.2e}"
                  f"{'' if result['ok'] else '  FAILED'}", flush=True)
    finally:
        pdl.ENABLED = enabled
    return row


def table(rows: list[dict]) -> str:
    names = list(rows[0]["variants"])
    lines = ["| D | roofline µs/stage | " + " | ".join(names) + " | barrier − boundary (µs/stage) |",
             "|---|---|" + "---|" * len(names) + "---|"]
    for row in rows:
        v = row["variants"]
        cells = [f"{v[n]['us_per_stage']:.2f}" + ("" if v[n]["ok"] else " (failed)") for n in names]
        saving = v["persistent"]["us_per_stage"] - v["launches"]["us_per_stage"]
        lines.append(f"| {row['D']} | {row['roofline_us']:.2f} | " + " | ".join(cells) + f" | {saving:+.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="1024,2048,4096", help="chain widths D (multiples of 128)")
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--name", default="barrier_cost")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("barrier_cost.py times CUDA graphs on a GPU; its kernel's CPU check is "
                         "tests/test_barrier_cost.py (TRITON_INTERPRET=1)")
    rows = [measure(int(d), args.replays) for d in args.dims.split(",")]
    notes = ("Random bf16 weights (no model, no acceptance involved). Per stage: the slope of each graph's median "
             "replay time (CUDA events) between S1 and S2 stages; error: relative L2 error of y_S against a float32 "
             "chain rounded to bf16 per stage (< 0.05 and no barrier timeout to pass; the barrier-free variant races "
             "by design and is not checked). Tiles: one program per BLOCK_N rows, [BLOCK_N, BLOCK_K] loads of at "
             f"most {TILE_BYTES // 1024} KB, {PROGRAMS} programs.")
    payload = {"title": "A grid barrier in one persistent kernel against a kernel boundary (chained GEMVs)",
               "environment": environment(), "notes": notes, "rows": rows}
    write_results(args.name, payload, table(rows))


if __name__ == "__main__":
    main()
