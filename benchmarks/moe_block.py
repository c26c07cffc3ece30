"""One sparse MoE block plus the decoder layer's residual add at the Qwen3.5-35B-A3B shape, as a resident forward
runs it, by three routes side by side in one process:

  separate  router GEMV + route_topk, shared expert GEMV over [gate; up; gate logit], silu_mul, shared down GEMV,
            experts gate_up / down / sum, gated_add, then `residual + out` (`_moe.SHARED_EXPERT_SLOT` off)
  one pass  router GEMV + route_topk, then gate_up / down / sum over the k routed experts plus the shared expert as
            one more slot, the gated combine and the residual in the sum (`patches.moe_block_add`), the direct-rows
            kernels (`moe_triton.DECODE_PATH` off)
  decode    the same with `moe_triton`'s decode kernels at T <= 4: split-K gate_up, then down with the weighted sum,
            the gated shared expert and the residual in its reduction (two launches); at T = 16 it is "one pass"

Shape: E = 256, top-8, H = 2048, routed and shared I = 512, bf16, random N(0, 0.02) weights (the router too, so
the block routes itself: ≈ 8·T distinct experts); T = 1, 2, 4, 16 tokens. µs per layer = median over CUDA-graph
replays of one graph that runs `--layers` distinct blocks in turn (1.5 GiB each: nothing stays in the L2), divided
by the layers. Launches per layer: kernels of one eager call of one block under the torch profiler (the graphs
replay exactly these). Bytes: (distinct experts + 1 shared) × 6 MiB per layer (mean over the layers); TB/s = those
bytes / µs, floor = bytes at 4.25 TB/s. Outputs are checked against transformers' block + residual (no fused
kernels, experts "hybridspec") on layer 0; a host-sync check runs each route under
`torch.cuda.set_sync_debug_mode("error")`.

The experts kernels alone (`moe_triton.moe_block_triton` on each block's own routing, gate_up + down (+ sum)) are
timed too, per T: the one-pass kernels ("direct") against the decode kernels, in total and per kernel (µs per layer
of each kernel name, traced over 5 graph replays by the torch profiler), and with --decode-sweep every decode
gate_up tile / K split of DECODE_GATE_UP_SWEEP at the default down tile, then every down tile at the best gate_up
(each config first checked: error against the direct kernels, equal bits over two calls). --sweep times the one-pass
kernels' tiles the same way (benchmarks/moe_experts.py's sweep) against `moe_triton.default_tiles`.

    PYTHONPATH=$PWD python benchmarks/moe_block.py [--layers 8] [--replays 100] [--decode-sweep] [--sweep]
                                                   [--name NAME]
    PYTHONPATH=$PWD python benchmarks/moe_block.py --smoke          # any machine: tiny shape, Triton interpreter
    PYTHONPATH=$PWD python benchmarks/moe_block.py --compile-check  # any machine: decode kernels built for sm_90

--decode-sweep on one H200: ≈ 2-3 minutes, most of it Triton compiling. --compile-check compiles the decode kernels
of every swept config at T = 1..4 for sm_90 (no GPU needed; `ptxas -v` registers and spills when triton ships
ptxas). Writes benchmarks/results/<name>.{json,md} (default moe_block).
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available() and "--compile-check" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the smoke run: the Triton interpreter (tests set their own)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture, environment, time_graph, traced_kernels, write_results  # noqa: E402

from hybridspec_hf import patches  # noqa: E402  (the package installs the patches)
from hybridspec_hf.kernels import moe_triton  # noqa: E402
from hybridspec_hf.kernels.moe_triton import Tiles  # noqa: E402
from hybridspec_hf.patches import _moe  # noqa: E402
from hybridspec_hf.patches.experts import fused_experts_for  # noqa: E402


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int

    @property
    def expert_bytes(self) -> int:
        return 3 * self.inter * self.hidden * 2  # gate, up and down of one bf16 expert


FULL = Shape(256, 8, 2048, 512)  # Qwen3.5-35B-A3B: 6 MiB per expert
SMOKE = Shape(8, 2, 64, 32)
NOMINAL_TBPS = 4.25
TOKENS = (1, 2, 4, 16)
ROUTES = {"separate": (False, False), "one pass": (True, False), "decode": (True, True)}  # SLOT, DECODE_PATH
# decode tiles: Tiles(block_n, block_k, num_warps, num_stages, split_k); one load step per program (block_k x split_k
# = H) unless noted. The first two are `default_tiles` (T <= 2, T = 3-4)
DECODE_GATE_UP_SWEEP = [
    Tiles(16, 256, 8, 1, split_k=8), Tiles(8, 512, 8, 1, split_k=4), Tiles(8, 256, 4, 1, split_k=8),
    Tiles(16, 512, 8, 1, split_k=4), Tiles(16, 128, 4, 1, split_k=16), Tiles(32, 256, 8, 1, split_k=8),
    Tiles(16, 256, 8, 1, split_k=4),  # two steps per program
    Tiles(8, 128, 2, 1, split_k=16),
]
DECODE_DOWN_SWEEP = [Tiles(16, 512, 8, 1), Tiles(8, 512, 8, 1), Tiles(8, 512, 4, 1), Tiles(32, 512, 8, 1),
                     Tiles(16, 256, 4, 1), Tiles(4, 512, 4, 1)]
SMOKE_GATE_UP_SWEEP = [Tiles(16, 32, 4, 1, split_k=2)]
SMOKE_DOWN_SWEEP = [Tiles(32, 32, 4, 1)]


def make_blocks(shape: Shape, n: int, gen: torch.Generator, device: str) -> list[torch.nn.Module]:
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                                  shared_expert_intermediate_size=shape.inter, num_experts=shape.experts,
                                  num_experts_per_tok=shape.top_k)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            blocks = [Qwen3_5MoeSparseMoeBlock(config).requires_grad_(False) for _ in range(n)]
    finally:
        torch.set_default_dtype(default)
    for block in blocks:
        for param in block.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    return blocks


def set_route(route: str) -> None:
    _moe.SHARED_EXPERT_SLOT, moe_triton.DECODE_PATH = ROUTES[route]


def layer_call(block, x, residual):
    """The decoder layer's `residual + mlp(x)` as the resident forward makes it."""
    with torch.no_grad(), patches.fused_kernels():
        return patches.moe_block_add(block, x, residual)


def time_layers(fn, layers: int, replays: int) -> dict:
    """µs per layer of fn(), which runs every layer once: CUDA-graph replays (median), or on the CPU one eager call
    (smoke run: interpreter times, meaningless)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return dict(median_us=(time.perf_counter() - start) * 1e6 / layers)
    graph = capture(fn)
    result = time_graph(graph, layers, replays)
    del graph
    torch.cuda.empty_cache()
    return result


def launches(block, x, residual) -> int | None:
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    layer_call(block, x, residual)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer_call(block, x, residual)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def sync_free(block, x, residual) -> str:
    if not torch.cuda.is_available():
        return "n/a (CPU)"
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


def rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    return ((out.float() - truth.float()).norm() / truth.float().norm()).item()


# ----------------------------------------------------------------------------------------------------------------
# the experts kernels alone


def kernel_calls(blocks, x: torch.Tensor, residual: torch.Tensor) -> list[tuple]:
    """Per block: the `moe_block_triton` arguments of its own routing of x [T, H]."""
    calls = []
    with torch.no_grad():
        for block in blocks:
            _, weights, ids = block.gate(x)
            calls.append((x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj,
                          block.__dict__[_moe._CACHE].weight, block.shared_expert.down_proj.weight, residual))
    return calls


def layer_bytes(shape: Shape, calls: list[tuple]) -> float:
    """Mean weight bytes per layer: (distinct experts + the shared one) × expert bytes."""
    return sum((int(c[1].unique().numel()) + 1) * shape.expert_bytes for c in calls) / len(calls)


def experts_call(calls, mode: str, gate_up: Tiles | None = None, down: Tiles | None = None):
    """fn() that runs `moe_block_triton` once per layer."""
    def run():
        with torch.no_grad():
            for args in calls:
                moe_triton.moe_block_triton(*args, mode=mode, gate_up_tiles=gate_up, down_tiles=down)

    return run


def time_kernels(calls, replays: int, mode: str, gate_up: Tiles | None = None, down: Tiles | None = None) -> float:
    return time_layers(experts_call(calls, mode, gate_up, down), len(calls), replays)["median_us"]


def kernel_split(calls, mode: str, replays: int = 5) -> dict[str, float]:
    """µs per layer of each kernel of the experts call at the default tiles (traced over graph replays; empty on
    the CPU)."""
    if not torch.cuda.is_available():
        return {}
    graph = capture(experts_call(calls, mode))
    split = collections.defaultdict(float)
    for kernel in traced_kernels(graph.replay, replays):
        split[kernel["name"]] += kernel["us"] / (replays * len(calls))
    del graph
    torch.cuda.empty_cache()
    return dict(split)


def checked(calls, mode: str, gate_up: Tiles | None = None, down: Tiles | None = None) -> dict:
    """Error of layer 0 against the direct kernels and whether two calls give the same bits."""
    with torch.no_grad():
        first, second = (moe_triton.moe_block_triton(*calls[0], mode=mode, gate_up_tiles=gate_up, down_tiles=down)
                         for _ in range(2))
        direct = moe_triton.moe_block_triton(*calls[0], mode="direct")
    return dict(rel_err=rel_err(first, direct), same_bits=torch.equal(first, second))


def cell(us: float, nbytes: float) -> dict:
    return dict(us=us, tbps=nbytes / us / 1e6)


def decode_sweep(calls, nbytes: float, replays: int, smoke: bool) -> dict:
    """µs per layer and TB/s of the decode kernels per tile choice (module docstring)."""
    gate_up_sweep, down_sweep = (SMOKE_GATE_UP_SWEEP, SMOKE_DOWN_SWEEP) if smoke else (DECODE_GATE_UP_SWEEP,
                                                                                       DECODE_DOWN_SWEEP)
    _, default_gate_up, default_down = moe_triton.default_tiles(calls[0][0].shape[0], "decode")

    def measure(gate_up: Tiles, down: Tiles) -> dict:
        result = checked(calls, "decode", gate_up, down)
        result.update(cell(time_kernels(calls, replays, "decode", gate_up, down), nbytes))
        return result

    gate_up_rows = {tiles: measure(tiles, default_down) for tiles in gate_up_sweep}
    best_gate_up = min(gate_up_rows, key=lambda t: gate_up_rows[t]["us"])
    down_rows = {tiles: measure(best_gate_up, tiles) for tiles in down_sweep}
    best_down = min(down_rows, key=lambda t: down_rows[t]["us"])
    return dict(default=(repr(default_gate_up), repr(default_down)), best=(repr(best_gate_up), repr(best_down)),
                best_cell=down_rows[best_down],
                gate_up={repr(t): r for t, r in gate_up_rows.items()}, down={repr(t): r for t, r in down_rows.items()})


def direct_sweep(calls, replays: int) -> dict:
    """µs per layer of the one-pass kernels per tile choice: gate_up tiles at the default down, then down tiles at
    the best gate_up (benchmarks/moe_experts.py's sweep)."""
    from moe_experts import DOWN_SWEEP, GATE_UP_SWEEP

    tokens = calls[0][0].shape[0]
    _, default_gate_up, default_down = moe_triton.default_tiles(tokens, "direct")
    results = {"default": (repr(default_gate_up), repr(default_down),
                           time_kernels(calls, replays, "direct", default_gate_up, default_down))}
    gate_up_times = {tiles: time_kernels(calls, replays, "direct", tiles, default_down) for tiles in GATE_UP_SWEEP}
    best_gate_up = min(gate_up_times, key=gate_up_times.get)
    down_times = {tiles: time_kernels(calls, replays, "direct", best_gate_up, tiles) for tiles in DOWN_SWEEP}
    best_down = min(down_times, key=down_times.get)
    results["best"] = (repr(best_gate_up), repr(best_down), down_times[best_down])
    results["gate_up (default down)"] = {repr(t): us for t, us in gate_up_times.items()}
    results["down (best gate_up)"] = {repr(t): us for t, us in down_times.items()}
    return results


# ----------------------------------------------------------------------------------------------------------------
# compile check (no GPU)


def compile_check(shape: Shape, swept: bool = True) -> list[dict]:
    """Build both decode kernels for sm_90 (triton.compile, GPUTarget("cuda", 90, 32)) for the default tiles at
    T = 1..4 with and without the shared expert and residual (the block and the experts-only call), and with
    `swept` every config of the decode sweep (block + residual): the interpreter accepts code the compiler refuses.
    Registers and spills by `ptxas -v`. Needs no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    pointers = dict(hidden="*bf16", ids="*i64", w1="*bf16", shared_w1="*bf16", act="*fp32", partials="*fp32",
                    logit_partials="*fp32", logit="*fp32", counters="*i32", weights="*bf16", w2="*bf16",
                    shared_w2="*bf16", residual="*bf16", out="*bf16")
    kernels = {"gate_up": moe_triton._gate_up_decode_kernel.fn, "down": moe_triton._down_decode_kernel.fn}
    plans = [(tokens, flag, None, None) for tokens in (1, 2, 3, 4) for flag in (True, False)]
    if swept:
        plans += [(tokens, True, g, None) for tokens in (1, 2, 3, 4) for g in DECODE_GATE_UP_SWEEP]
        plans += [(tokens, True, DECODE_GATE_UP_SWEEP[0], d) for tokens in (1, 2, 3, 4) for d in DECODE_DOWN_SWEEP]
    built, rows = set(), []
    for tokens, with_shared, gate_up_tiles, down_tiles in plans:
        launches = moe_triton.decode_launches(tokens, shape.hidden, shape.inter, shape.top_k, shared=with_shared,
                                              residual=with_shared, gate_up_tiles=gate_up_tiles,
                                              down_tiles=down_tiles)
        for name, launch in zip(kernels, launches):
            key = (name, tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages)
            if key in built:
                continue
            built.add(key)
            fn = triton.jit(kernels[name])
            signature = {arg: pointers.get(arg, "i32") for arg in fn.arg_names if arg not in launch.constexprs}
            signature.update({arg: "constexpr" for arg in launch.constexprs})
            source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=launch.constexprs)
            compiled = triton.compile(source, target=target,
                                      options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
            rows.append(dict(kernel=name, tokens=tokens, grid=launch.grid, warps=launch.num_warps,
                             constexprs=launch.constexprs, ptxas=_ptxas_info(compiled.asm["ptx"])))
            print(rows[-1]["kernel"], tokens, launch.grid, launch.num_warps,
                  {k: launch.constexprs[k] for k in ("BN", "BK", "STEPS", "SHARED")}, rows[-1]["ptxas"], flush=True)
    return rows


def _ptxas_info(ptx: str) -> str:
    """`ptxas -v` registers and spills for sm_90a, or why not."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path
    except Exception as error:  # noqa: BLE001  (a triton without its ptxas: the compile itself passed)
        return f"no ptxas ({error})"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                                text=True).stderr
    return "; ".join(line.split(":", 1)[-1].strip() for line in report.splitlines() if "Used" in line
                     or "spill" in line)


# ----------------------------------------------------------------------------------------------------------------
# report


def table(rows: list[dict], decode_swept: bool, direct_swept: bool) -> str:
    lines = ["Block + residual per layer (router, experts, shared expert, combine): µs (launches), TB/s of the "
             "experts' bytes.", "",
             "| T | distinct experts | floor µs | " + " | ".join(f"{r} µs (launches) | TB/s" for r in ROUTES)
             + " | rel err (decode) | syncs |",
             "|---|---|---|" + "---|---|" * len(ROUTES) + "---|---|"]
    for row in rows:
        cells = [f"{row['routes'][r]['median_us']:.1f} ({row['routes'][r]['launches']}) | "
                 f"{row['bytes'] / row['routes'][r]['median_us'] / 1e6:.2f}" for r in ROUTES]
        syncs = ", ".join(sorted({row["routes"][r]["sync"] for r in ROUTES}))
        lines.append(f"| {row['T']} | {row['distinct']:.1f} | {row['floor_us']:.1f} | " + " | ".join(cells)
                     + f" | {row['routes']['decode']['rel_err']:.1e} | {syncs} |")
    lines += ["", "Experts kernels alone per layer (moe_block_triton: gate_up, down (+ sum), default tiles): µs, TB/s, "
              "and µs per kernel (traced replays).", "",
              "| T | direct µs | TB/s | direct per kernel | decode µs | TB/s | decode per kernel | decode rel err vs "
              "direct | same bits |", "|---|---|---|---|---|---|---|---|---|"]

    def per_kernel(split: dict) -> str:
        return ", ".join(f"{name.strip('_').removesuffix('_kernel')} {us:.1f}" for name, us in split.items()) or "-"

    for row in rows:
        direct, decode = row["kernels"]["direct"], row["kernels"].get("decode")
        tail = (f"{decode['us']:.1f} | {decode['tbps']:.2f} | {per_kernel(decode['split'])} | {decode['rel_err']:.1e} "
                f"| {decode['same_bits']}" if decode else "- | - | - | - | -")
        lines.append(f"| {row['T']} | {direct['us']:.1f} | {direct['tbps']:.2f} | {per_kernel(direct['split'])} | "
                     f"{tail} |")
    if decode_swept:
        lines += ["", "Decode tile sweep (kernels alone): gate_up tiles at the default down tile, then down tiles at "
                  "the best gate_up. Tiles(block_n, block_k, num_warps, num_stages, split_k).", ""]
        for row in rows:
            sweep = row.get("decode_sweep")
            if not sweep:
                continue
            lines += [f"T = {row['T']}: default {sweep['default'][0]} / {sweep['default'][1]}; best "
                      f"{sweep['best'][0]} / {sweep['best'][1]}: {sweep['best_cell']['us']:.1f} µs, "
                      f"{sweep['best_cell']['tbps']:.2f} TB/s", "",
                      "| kernel | tiles | µs | TB/s | rel err | same bits |", "|---|---|---|---|---|---|"]
            for kernel in ("gate_up", "down"):
                for tiles, r in sweep[kernel].items():
                    lines.append(f"| {kernel} | {tiles} | {r['us']:.1f} | {r['tbps']:.2f} | {r['rel_err']:.1e} | "
                                 f"{r['same_bits']} |")
            lines.append("")
    if direct_swept:
        lines += ["", "One-pass (direct) tile sweep, kernels alone (µs per layer): default tiles against the best "
                  "pair.", "", "| T | default gate_up / down | µs | best gate_up / down | µs |", "|---|---|---|---|---|"]
        for row in rows:
            (dg, dd, dus), (bg, bd, bus) = row["direct_sweep"]["default"], row["direct_sweep"]["best"]
            lines.append(f"| {row['T']} | {dg} / {dd} | {dus:.1f} | {bg} / {bd} | {bus:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--decode-sweep", action="store_true", help="sweep the decode kernels' tiles (T <= 4)")
    parser.add_argument("--sweep", action="store_true", help="sweep the one-pass (direct) kernels' tiles")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, 1 layer (implied without CUDA)")
    parser.add_argument("--compile-check", action="store_true", help="build the decode kernels for sm_90, no GPU")
    parser.add_argument("--name", default="moe_block", help="results stem (a path, or a name under benchmarks/results)")
    args = parser.parse_args(argv)
    if args.compile_check:
        return dict(compiled=compile_check(FULL))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    smoke = args.smoke or device == "cpu"
    shape, layers = (SMOKE, 1) if smoke else (FULL, args.layers)
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = make_blocks(shape, layers, gen, device)
    on_cpu = _moe._ON_CPU
    _moe._ON_CPU = device == "cpu"  # the fused routes on CPU tensors (the smoke run)
    patches.prepare_fused_moe(blocks)
    defaults = (_moe.SHARED_EXPERT_SLOT, moe_triton.DECODE_PATH)  # put back after the routes' A/B
    rows = []
    try:
        with fused_experts_for(blocks) as ours:
            assert ours, "the blocks' experts must dispatch to experts_implementation='hybridspec'"
            for tokens in TOKENS:
                rows.append(measure_tokens(blocks, shape, tokens, gen, args, smoke))
    finally:
        _moe.SHARED_EXPERT_SLOT, moe_triton.DECODE_PATH = defaults
        _moe._ON_CPU = on_cpu
    notes = (f"E = {shape.experts}, top-{shape.top_k}, H = {shape.hidden}, I = {shape.inter} (shared too), random "
             f"N(0, 0.02) bf16 weights, the block's own router; {layers} distinct blocks per graph, median of "
             f"{args.replays} replays / layers. Each route includes the decoder layer's residual add. Random "
             "weights, no acceptance involved." + (" SMOKE RUN (interpreter): times meaningless." if smoke else ""))
    report = dict(title="MoE block + residual, Qwen3.5-35B-A3B shape: separate route vs one pass vs decode kernels",
                  environment=environment(), notes=notes, layers=layers, replays=args.replays, rows=rows)
    text = table(rows, args.decode_sweep, args.sweep)
    write_results(args.name, report, text)
    print(text)
    return report


def measure_tokens(blocks, shape: Shape, tokens: int, gen: torch.Generator, args, smoke: bool) -> dict:
    device = blocks[0].gate.weight.device
    x = torch.randn(1, tokens, shape.hidden, device=device, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, tokens, shape.hidden, device=device, generator=gen).to(torch.bfloat16)
    calls = kernel_calls(blocks, x.view(tokens, -1), residual.view(tokens, -1))
    nbytes = layer_bytes(shape, calls)
    set_route("one pass")  # the truth's experts: the direct kernels
    with torch.no_grad():
        truth = (residual + blocks[0](x)).float()  # transformers' block (experts: ours), eager
    row = dict(T=tokens, distinct=nbytes / shape.expert_bytes - 1, bytes=nbytes,
               floor_us=nbytes / (NOMINAL_TBPS * 1e6), routes={}, kernels={})
    for route in ROUTES:
        set_route(route)
        result = time_layers(lambda: [layer_call(block, x, residual) for block in blocks], len(blocks), args.replays)
        result.update(launches=launches(blocks[0], x, residual), sync=sync_free(blocks[0], x, residual),
                      rel_err=rel_err(layer_call(blocks[0], x, residual), truth))
        row["routes"][route] = result
        print(tokens, route, result, flush=True)
    set_route("decode")
    row["kernels"]["direct"] = dict(cell(time_kernels(calls, args.replays, "direct"), nbytes),
                                    split=kernel_split(calls, "direct"))
    if tokens <= moe_triton.DECODE_KERNEL_MAX_TOKENS:
        row["kernels"]["decode"] = dict(checked(calls, "decode"), **cell(time_kernels(calls, args.replays, "decode"),
                                                                         nbytes), split=kernel_split(calls, "decode"))
        if args.decode_sweep:
            row["decode_sweep"] = decode_sweep(calls, nbytes, args.replays, smoke)
            print(tokens, "decode sweep best", row["decode_sweep"]["best"], row["decode_sweep"]["best_cell"],
                  flush=True)
    print(tokens, "kernels", row["kernels"], flush=True)
    if args.sweep:
        row["direct_sweep"] = direct_sweep(calls, args.replays)
        print(tokens, "direct sweep", row["direct_sweep"]["default"], row["direct_sweep"]["best"], flush=True)
    return row


if __name__ == "__main__":
    main()
