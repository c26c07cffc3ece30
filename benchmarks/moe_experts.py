"""One MoE experts layer at the Qwen3.5-35B-A3B shape: ours (experts_implementation="hybridspec") vs transformers'
grouped_mm and batched_mm, set on the same `Qwen3_5MoeExperts` modules.

Shape: E = 256 experts, top-k = 8, H = 2048, I = 512, bf16 weights (6 MiB per expert), random non-zero weights.
Routing: "random" (a random router: softmax, top-8, renormalised, like Qwen3.5's) and "reuse" (every token takes 6
of one shared pool of 8 experts plus 2 random others, as consecutive draft tokens often do); T = 1, 2, 4, 8, 16.
Every figure is µs per layer: the median over >= 50 replays of one CUDA graph that runs the experts of `--layers`
layers (distinct weights, 1.5 GiB each, so nothing stays in the L2 from one layer to the next), after warm-up
(Triton compiles there, before capture; there is no autotuning), divided by the number of layers.
Bytes: distinct experts x 6 MiB, the least any implementation must read; "%" = those bytes per µs against 4.25 TB/s
(the H200 copy ceiling of earlier sessions) and against this run's own device-to-device copy.
Outputs of every implementation are checked against `fused_experts_reference` (fp32) on layer 0.

    python benchmarks/moe_experts.py [--out DIR] [--layers 8] [--replays 100] [--no-sweep] [--budget-s 480]

Writes DIR/moe_experts.json and DIR/moe_experts.md (default DIR: benchmarks/results). Also: a sweep of tile sizes
of our two GEMM kernels (T = 1, 4, 16), our "sorted" (prefill) path at decode sizes, a prefill comparison against
grouped_mm (T = 512, 2048), and a host-sync check of our call (`torch.cuda.set_sync_debug_mode("error")`).
Needs only torch, triton, transformers and this checkout (the package need not be installed).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
import types
from dataclasses import asdict

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_from_checkout() -> None:
    """hybridspec_hf.kernels and hybridspec_hf.patches from this checkout, without the package __init__ (the
    generate() integration): the GPU image has no install, and `patches/` maps to `hybridspec_hf.patches` only
    through setup.cfg."""
    if "hybridspec_hf" not in sys.modules:
        package = types.ModuleType("hybridspec_hf")
        package.__path__ = [os.path.join(REPO, "hybridspec_hf")]
        sys.modules["hybridspec_hf"] = package
    if "hybridspec_hf.patches" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "hybridspec_hf.patches", os.path.join(REPO, "patches", "__init__.py"),
            submodule_search_locations=[os.path.join(REPO, "patches")])
        module = importlib.util.module_from_spec(spec)
        sys.modules["hybridspec_hf.patches"] = module
        spec.loader.exec_module(module)


_load_from_checkout()

import transformers  # noqa: E402
import triton  # noqa: E402
from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts  # noqa: E402

from hybridspec_hf.kernels.moe_triton import (  # noqa: E402
    Tiles,
    default_tiles,
    fused_experts_reference,
    fused_experts_triton,
)
from hybridspec_hf.patches.experts import register_experts_implementation  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import time_graph  # noqa: E402

DEV = "cuda"
E, TOP_K, H, INTER = 256, 8, 2048, 512
EXPERT_BYTES = (2 * INTER * H + H * INTER) * 2  # bf16 gate_up + down of one expert: 6 MiB
NOMINAL_TBPS = 4.25
TOKENS = (1, 2, 4, 8, 16)
PREFILL_TOKENS = (512, 2048)
IMPLS = ("hybridspec", "hybridspec-sorted", "grouped_mm", "batched_mm")
GATE_UP_SWEEP = [Tiles(16, 128, 4, 4), Tiles(16, 256, 4, 3), Tiles(16, 64, 4, 6), Tiles(32, 128, 4, 4),
                 Tiles(32, 64, 4, 5), Tiles(32, 128, 8, 4), Tiles(64, 64, 4, 4), Tiles(16, 128, 2, 5)]
DOWN_SWEEP = [Tiles(32, 128, 4, 4), Tiles(32, 64, 4, 5), Tiles(64, 128, 4, 4), Tiles(64, 64, 4, 4),
              Tiles(128, 64, 4, 3), Tiles(16, 128, 4, 4), Tiles(32, 256, 4, 3), Tiles(64, 128, 8, 3)]


# ----------------------------------------------------------------------------------------------------------------
# setup


def make_layers(n: int, gen: torch.Generator) -> list[torch.nn.Module]:
    """n transformers experts modules with random N(0, 0.02) bf16 weights on the GPU (one config object, so one
    `config._experts_implementation` switches all of them)."""
    config = Qwen3_5MoeTextConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            layers = [Qwen3_5MoeExperts(config).requires_grad_(False) for _ in range(n)]
    finally:
        torch.set_default_dtype(default)
    for layer in layers:
        layer.gate_up_proj.normal_(0.0, 0.02, generator=gen)
        layer.down_proj.normal_(0.0, 0.02, generator=gen)
    return layers


def routing(profile: str, tokens: int, hidden: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(top_k_index [T, 8] int64, top_k_weights [T, 8] bf16) on the GPU."""
    if profile == "random":
        router = torch.randn(E, H, device=DEV, generator=gen, dtype=torch.bfloat16) * H**-0.5
        probs = torch.softmax((hidden @ router.T).float(), dim=-1)
        weights, index = probs.topk(TOP_K, dim=-1)
    else:  # reuse: 6 of a shared pool of 8, plus 2 outside it, per token
        perm = torch.randperm(E, device=DEV, generator=gen)
        pool, rest = perm[:8], perm[8:]
        rows = []
        for _ in range(tokens):
            own = pool[torch.randperm(8, device=DEV, generator=gen)[:6]]
            other = rest[torch.randperm(E - 8, device=DEV, generator=gen)[:2]]
            rows.append(torch.cat([own, other]))
        index = torch.stack(rows)
        weights = torch.rand(tokens, TOP_K, device=DEV, generator=gen) + 0.05
    weights = weights / weights.sum(-1, keepdim=True)
    return index, weights.to(torch.bfloat16)


def call(impl: str, layer: torch.nn.Module, x: dict, tiles: dict | None = None) -> torch.Tensor:
    if impl == "hybridspec-sorted" or tiles:
        return fused_experts_triton(x["hidden"], x["index"], x["weights"], layer.gate_up_proj, layer.down_proj,
                                    mode="sorted" if impl == "hybridspec-sorted" else "auto", **(tiles or {}))
    layer.config._experts_implementation = impl
    return layer(x["hidden"], x["index"], x["weights"])


# ----------------------------------------------------------------------------------------------------------------
# timing


def capture(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm up on a side stream (Triton compiles here, before capture), then capture fn once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_impl(impl: str, layers: list, x: dict, replays: int, tiles: dict | None = None) -> dict:
    """One graph running `impl` on every layer in turn; µs per layer, and layer 0's output against the reference."""
    graph, outs = capture(lambda: [call(impl, layer, x, tiles) for layer in layers])
    result = time_graph(graph, len(layers), replays)
    layer = layers[0]
    truth = fused_experts_reference(x["hidden"], x["index"], x["weights"], layer.gate_up_proj, layer.down_proj).float()
    result["rel_err"] = ((outs[0].float() - truth).norm() / truth.norm()).item()
    del graph, outs
    torch.cuda.empty_cache()
    return result


def bandwidth(replays: int) -> dict:
    """Device-to-device copy of 1 GiB (bytes read + written per second) and a 2 GiB bf16 sum (read only)."""
    n = 1 << 29  # bf16 elements: 1 GiB
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    graph, _ = capture(lambda: [dst.copy_(src) for _ in range(4)])
    t = time_graph(graph, 4, replays)
    copy = dict(TBps=2 * n * 2 / (t["median_us"] * 1e-6) / 1e12, bytes_per_copy=2 * n * 2, **t)
    del graph, dst
    big = torch.cat([src, src])
    del src
    graph, _ = capture(lambda: [big.sum(dtype=torch.float32) for _ in range(4)])
    t = time_graph(graph, 4, replays)
    read = dict(TBps=big.numel() * 2 / (t["median_us"] * 1e-6) / 1e12, bytes=big.numel() * 2, **t)
    del graph, big
    torch.cuda.empty_cache()
    return dict(copy=copy, read=read)


def sync_free(layer: torch.nn.Module, x: dict) -> dict:
    """Our call with torch's sync debug mode at "error": any device->host sync raises."""
    result = {}
    for impl in ("hybridspec", "hybridspec-sorted"):
        call(impl, layer, x)  # compiled already; not under the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(impl, layer, x)
            result[impl] = "no sync"
        except RuntimeError as error:
            result[impl] = f"SYNC: {error}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return result


# ----------------------------------------------------------------------------------------------------------------
# report


def percent(distinct: int, us: float, tbps: float) -> float:
    return 100.0 * distinct * EXPERT_BYTES / (us * 1e-6) / (tbps * 1e12)


def markdown(report: dict) -> str:
    env, bw = report["environment"], report["bandwidth"]
    copy_tbps = bw["copy"]["TBps"] if bw else float("nan")
    lines = [
        f"# MoE experts layer, Qwen3.5-35B-A3B shape ({env.get('gpu', '?')}, {env['date']})",
        "",
        f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; command "
        f"`{env['command']}`.",
        f"E = {E}, top-k = {TOP_K}, H = {H}, I = {INTER}, random (non-zero) bf16 weights, routing from a random "
        f"router or a declared reuse profile (no acceptance involved: one layer), {report['layers']} layers per "
        f"graph (distinct "
        f"weights); µs per layer = median of {report['replays']} CUDA-graph replays / layers.",
        f"Measured: device-to-device copy {copy_tbps:.2f} TB/s (read + write), bf16 sum "
        f"{bw['read']['TBps'] if bw else float('nan'):.2f} TB/s (read). Cells: µs (% of {NOMINAL_TBPS} TB/s for "
        "distinct experts x 6 MiB; the same bytes against the measured copy in the JSON).",
        "'hybridspec' = `set_experts_implementation(\"hybridspec\")` (direct path at these T); 'hybridspec-sorted' = "
        "our prefill path (align in torch ops + the same kernels) at decode sizes.",
        f"Host syncs in our call: {report.get('sync_check')}.",
        "",
        "| routing | T | distinct experts | MiB | floor µs | " + " | ".join(IMPLS) + " | max rel err (ours) |",
        "|---|---|---|---|---|" + "---|" * len(IMPLS) + "---|",
    ]
    for row in report["rows"]:
        cells = []
        for impl in IMPLS:
            r = row["impls"].get(impl, {})
            cells.append(f"{r['median_us']:.1f} ({r['pct_nominal']:.0f}%)" if "median_us" in r
                         else r.get("error", "-")[:40])
        ours_err = max([row["impls"][i]["rel_err"] for i in IMPLS[:2] if "rel_err" in row["impls"].get(i, {})],
                       default=float("nan"))
        mib = row["distinct"] * EXPERT_BYTES / 2**20
        lines.append(f"| {row['profile']} | {row['T']} | {row['distinct']} | {mib:.0f} | {row['floor_us']:.1f} | "
                     + " | ".join(cells) + f" | {ours_err:.1e} |")
    errors = {impl: max((row["impls"].get(impl, {}).get("rel_err", 0.0) for row in report["rows"]), default=0.0)
              for impl in IMPLS}
    lines += ["", "Max relative error against the fp32 reference, all rows: "
              + ", ".join(f"{impl} {err:.1e}" for impl, err in errors.items()) + "."]
    if report.get("prefill"):
        lines += ["", "## Prefill (random routing): our sorted path vs grouped_mm", "",
                  "| T | distinct | hybridspec-sorted µs | grouped_mm µs | rel err ours |", "|---|---|---|---|---|"]
        for row in report["prefill"]:
            ours, theirs = row["impls"].get("hybridspec-sorted", {}), row["impls"].get("grouped_mm", {})
            lines.append(f"| {row['T']} | {row['distinct']} | {ours.get('median_us', float('nan')):.1f} | "
                         f"{theirs.get('median_us', float('nan')):.1f} | {ours.get('rel_err', float('nan')):.1e} |")
    if report.get("sweep"):
        lines += ["", "## Tile sweep (random routing, direct path; gate_up with the default down tiles, then down with "
                  "the best gate_up)", "", "| T | kernel | block_n | block_k | warps | stages | µs per layer |",
                  "|---|---|---|---|---|---|---|"]
        for s in report["sweep"]:
            t = s["tiles"]
            lines.append(f"| {s['T']} | {s['kernel']} | {t['block_n']} | {t['block_k']} | {t['num_warps']} | "
                         f"{t['num_stages']} | {s.get('median_us', float('nan')):.1f} {s.get('error', '')[:40]} |")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
    }


# ----------------------------------------------------------------------------------------------------------------
# main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip what is left of sweep/prefill after this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe_experts.py needs a CUDA GPU")
    started = time.time()
    register_experts_implementation()
    gen = torch.Generator(device=DEV).manual_seed(0)
    layers = make_layers(args.layers, gen)
    report = dict(title="MoE experts layer", environment=environment(), layers=args.layers, replays=args.replays,
                  shape=dict(E=E, top_k=TOP_K, H=H, I=INTER, dtype="bfloat16", expert_bytes=EXPERT_BYTES),
                  nominal_TBps=NOMINAL_TBPS, bandwidth=None, rows=[], prefill=[], sweep=[])
    os.makedirs(args.out, exist_ok=True)

    def save():
        with open(os.path.join(args.out, "moe_experts.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        with open(os.path.join(args.out, "moe_experts.md"), "w") as f:
            f.write(markdown(report))

    def guarded(fn, *a, **kw) -> dict:
        try:
            return fn(*a, **kw)
        except Exception as error:  # one failing implementation must not cost the others' numbers
            traceback.print_exc()
            torch.cuda.synchronize()
            return dict(error=f"{type(error).__name__}: {error}")

    report["bandwidth"] = bandwidth(args.replays)
    print("bandwidth", report["bandwidth"], flush=True)
    copy_tbps = report["bandwidth"]["copy"]["TBps"]
    inputs = {}
    for profile in ("random", "reuse"):
        for tokens in TOKENS:
            hidden = torch.randn(tokens, H, device=DEV, generator=gen, dtype=torch.bfloat16)
            index, weights = routing(profile, tokens, hidden, gen)
            x = inputs[profile, tokens] = dict(hidden=hidden, index=index, weights=weights)
            distinct = int(index.unique().numel())
            row = dict(profile=profile, T=tokens, distinct=distinct,
                       floor_us=distinct * EXPERT_BYTES / (NOMINAL_TBPS * 1e6), impls={})
            for impl in IMPLS:
                r = guarded(time_impl, impl, layers, x, args.replays)
                if "median_us" in r:
                    r["pct_nominal"] = percent(distinct, r["median_us"], NOMINAL_TBPS)
                    r["pct_measured_copy"] = percent(distinct, r["median_us"], copy_tbps)
                row["impls"][impl] = r
                print(profile, tokens, impl, {k: r.get(k) for k in ("median_us", "pct_nominal", "rel_err", "error")},
                      flush=True)
            report["rows"].append(row)
            save()
    report["sync_check"] = guarded(sync_free, layers[0], inputs["random", 4])
    print("sync check", report["sync_check"], flush=True)
    save()

    for tokens in PREFILL_TOKENS:
        if time.time() - started > args.budget_s:
            break
        hidden = torch.randn(tokens, H, device=DEV, generator=gen, dtype=torch.bfloat16)
        index, weights = routing("random", tokens, hidden, gen)
        x = dict(hidden=hidden, index=index, weights=weights)
        row = dict(T=tokens, distinct=int(index.unique().numel()), impls={})
        for impl in ("hybridspec-sorted", "grouped_mm"):
            row["impls"][impl] = guarded(time_impl, impl, layers[:2], x, max(50, args.replays // 2))
            print("prefill", tokens, impl, row["impls"][impl].get("median_us"), flush=True)
        report["prefill"].append(row)
        save()

    if not args.no_sweep:
        for tokens in (1, 4, 16):
            x = inputs["random", tokens]
            _, gate_up_default, down_default = default_tiles(tokens, "direct")
            best = (float("inf"), gate_up_default)
            for kernel, candidates in (("gate_up", GATE_UP_SWEEP), ("down", DOWN_SWEEP)):
                for tiles in candidates:
                    if time.time() - started > args.budget_s:
                        break
                    chosen = (dict(gate_up_tiles=tiles, down_tiles=down_default) if kernel == "gate_up"
                              else dict(gate_up_tiles=best[1], down_tiles=tiles))
                    r = guarded(time_impl, "hybridspec", layers, x, max(50, args.replays // 2), tiles=chosen)
                    if kernel == "gate_up" and r.get("median_us", float("inf")) < best[0]:
                        best = (r["median_us"], tiles)
                    report["sweep"].append(dict(T=tokens, kernel=kernel, tiles=asdict(tiles),
                                                gate_up_with=asdict(best[1]) if kernel == "down" else None, **r))
                    print("sweep", tokens, kernel, tiles, r.get("median_us"), r.get("error"), flush=True)
            save()
    report["elapsed_s"] = time.time() - started
    save()
    print(markdown(report))


if __name__ == "__main__":
    main()
