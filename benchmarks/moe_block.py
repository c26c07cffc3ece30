"""One sparse MoE block plus the decoder layer's residual add at the Qwen3.5-35B-A3B shape, as a resident forward
runs it: today's fused route (router GEMV + route_topk, shared expert GEMV over [gate; up; gate logit], silu_mul,
shared down GEMV, experts gate_up / down / sum, gated_add, then `residual + out`) against the one-pass route
(router GEMV + route_topk, then gate_up / down / sum over the k routed experts plus the shared expert as one more
slot, the gated combine and the residual in the sum: `patches.moe_block_add`, `_moe.SHARED_EXPERT_SLOT`).

Shape: E = 256, top-8, H = 2048, routed and shared I = 512, bf16, random N(0, 0.02) weights (the router too, so
the block routes itself: ≈ 8·T distinct experts); T = 1, 4, 16 tokens. µs per layer = median over CUDA-graph
replays of one graph that runs `--layers` distinct blocks in turn (1.5 GiB each: nothing stays in the L2), divided
by the layers. Launches per layer: kernels of one eager call of one block under the torch profiler (the graphs
replay exactly these). Bytes floor: (distinct experts + 1 shared) × 6 MiB at 4.25 TB/s. Outputs are checked
against transformers' block + residual (no fused kernels, experts "hybridspec") on layer 0; a host-sync check runs
each route under `torch.cuda.set_sync_debug_mode("error")`.

    PYTHONPATH=$PWD python benchmarks/moe_block.py [--layers 8] [--replays 100] [--sweep] [--name NAME]

--sweep also times the one-pass kernels alone (gate_up, down, sum: `moe_triton.moe_block_triton` on each block's
own routing) with every gate_up tile of benchmarks/moe_experts.py's sweep at the default down tile, then every down
tile at the best gate_up tile, per T, and reports the best pair against `moe_triton.default_tiles` (what
`default_tiles` should return, if it wins by more than the noise). Writes benchmarks/results/<name>.{json,md}
(default moe_block).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture, environment, time_graph, write_results  # noqa: E402

from hybridspec_hf import patches  # noqa: E402  (the package installs the patches)
from hybridspec_hf.patches import _moe  # noqa: E402
from hybridspec_hf.patches.experts import fused_experts_for  # noqa: E402

E, TOP_K, H, INTER = 256, 8, 2048, 512
EXPERT_BYTES = 3 * INTER * H * 2  # gate, up and down of one bf16 expert: 6 MiB
NOMINAL_TBPS = 4.25
TOKENS = (1, 4, 16)
ROUTES = {"today": False, "one pass": True}  # SHARED_EXPERT_SLOT


def make_blocks(n: int, gen: torch.Generator) -> list[torch.nn.Module]:
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=H, moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
                                  num_experts=E, num_experts_per_tok=TOP_K)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            blocks = [Qwen3_5MoeSparseMoeBlock(config).requires_grad_(False) for _ in range(n)]
    finally:
        torch.set_default_dtype(default)
    for block in blocks:
        for param in block.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    return blocks


def layer_call(block, x, residual):
    """The decoder layer's `residual + mlp(x)` as the resident forward makes it."""
    with torch.no_grad(), patches.fused_kernels():
        return patches.moe_block_add(block, x, residual)


def launches(block, x, residual) -> int:
    from torch.profiler import ProfilerActivity, profile

    layer_call(block, x, residual)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer_call(block, x, residual)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def sync_free(block, x, residual) -> str:
    layer_call(block, x, residual)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer_call(block, x, residual)
        return "no sync"
    except RuntimeError as error:
        return f"SYNC: {error}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def sweep_tiles(blocks, tokens: int, gen: torch.Generator, replays: int) -> dict:
    """µs per layer of the one-pass kernels alone at T = tokens for each tile choice (module docstring)."""
    from moe_experts import DOWN_SWEEP, GATE_UP_SWEEP

    from hybridspec_hf.kernels import moe_triton

    x = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    residual = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    calls = []
    with torch.no_grad():
        for block in blocks:
            _, weights, ids = block.gate(x)
            shared = block.__dict__[_moe._CACHE].weight
            calls.append((block, ids, weights, shared))

    def timed(gate_up, down) -> float:
        def run():
            for block, ids, weights, shared in calls:
                moe_triton.moe_block_triton(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj,
                                            shared, block.shared_expert.down_proj.weight, residual,
                                            gate_up_tiles=gate_up, down_tiles=down)
        with torch.no_grad():
            graph = capture(run)
            us = time_graph(graph, len(calls), replays)["median_us"]
        del graph
        return us

    _, default_gate_up, default_down = moe_triton.default_tiles(tokens, "direct")
    results = {"default": (repr(default_gate_up), repr(default_down), timed(default_gate_up, default_down))}
    gate_up_times = {tiles: timed(tiles, default_down) for tiles in GATE_UP_SWEEP}
    best_gate_up = min(gate_up_times, key=gate_up_times.get)
    down_times = {tiles: timed(best_gate_up, tiles) for tiles in DOWN_SWEEP}
    best_down = min(down_times, key=down_times.get)
    results["best"] = (repr(best_gate_up), repr(best_down), down_times[best_down])
    results["gate_up (default down)"] = {repr(t): us for t, us in gate_up_times.items()}
    results["down (best gate_up)"] = {repr(t): us for t, us in down_times.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="also sweep the one-pass kernels' tiles")
    parser.add_argument("--name", default="moe_block", help="results stem (a path, or a name under benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_block.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = make_blocks(args.layers, gen)
    patches.prepare_fused_moe(blocks)
    rows = []
    with fused_experts_for(blocks) as ours:
        assert ours, "the blocks' experts must dispatch to experts_implementation='hybridspec'"
        for tokens in TOKENS:
            x = torch.randn(1, tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
            residual = torch.randn(1, tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
            with torch.no_grad():
                truth = (residual + blocks[0](x)).float()  # transformers' block (experts: ours), eager
                distinct = int(blocks[0].gate(x.view(-1, H))[2].unique().numel())
            row = dict(T=tokens, distinct=distinct, floor_us=(distinct + 1) * EXPERT_BYTES / (NOMINAL_TBPS * 1e6),
                       routes={})
            for route, slot in ROUTES.items():
                _moe.SHARED_EXPERT_SLOT = slot
                graph = capture(lambda: [layer_call(block, x, residual) for block in blocks])
                r = time_graph(graph, len(blocks), args.replays)
                out = layer_call(blocks[0], x, residual).float()
                r.update(launches=launches(blocks[0], x, residual), sync=sync_free(blocks[0], x, residual),
                         rel_err=((out - truth).norm() / truth.norm()).item())
                row["routes"][route] = r
                print(tokens, route, r, flush=True)
                del graph
                torch.cuda.empty_cache()
            if args.sweep:
                row["sweep"] = sweep_tiles(blocks, tokens, gen, args.replays)
                print(tokens, "sweep", row["sweep"]["default"], row["sweep"]["best"], flush=True)
            rows.append(row)
    _moe.SHARED_EXPERT_SLOT = True
    header = ("| T | distinct experts | floor µs | " + " | ".join(f"{r} µs (launches)" for r in ROUTES)
              + " | saved µs | rel err (one pass) | syncs |")
    lines = [header, "|---|---|---|" + "---|" * len(ROUTES) + "---|---|---|"]
    for row in rows:
        cells = [f"{row['routes'][r]['median_us']:.1f} ({row['routes'][r]['launches']})" for r in ROUTES]
        saved = row["routes"]["today"]["median_us"] - row["routes"]["one pass"]["median_us"]
        syncs = ", ".join(sorted({row["routes"][r]["sync"] for r in ROUTES}))
        lines.append(f"| {row['T']} | {row['distinct']} | {row['floor_us']:.1f} | " + " | ".join(cells)
                     + f" | {saved:.1f} | {row['routes']['one pass']['rel_err']:.1e} | {syncs} |")
    if args.sweep:
        lines += ["", "Tile sweep of the one-pass kernels alone (µs per layer): default tiles against the best pair.",
                  "", "| T | default gate_up / down | µs | best gate_up / down | µs |", "|---|---|---|---|---|"]
        for row in rows:
            (dg, dd, dus), (bg, bd, bus) = row["sweep"]["default"], row["sweep"]["best"]
            lines.append(f"| {row['T']} | {dg} / {dd} | {dus:.1f} | {bg} / {bd} | {bus:.1f} |")
    notes = (f"E = {E}, top-{TOP_K}, H = {H}, I = {INTER} (shared too), random N(0, 0.02) bf16 weights, the block's "
             f"own router; {args.layers} distinct blocks per graph, median of {args.replays} replays / layers. "
             "Each route includes the decoder layer's residual add. Random weights, no acceptance involved.")
    payload = dict(title="MoE block + residual, Qwen3.5-35B-A3B shape: today's fused route vs one pass",
                   environment=environment(), notes=notes, layers=args.layers, replays=args.replays, rows=rows)
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
