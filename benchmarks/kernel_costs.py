"""What each kind of kernel costs the captured AR step where it runs: every launch of one kernel doubled.

A profiler trace of the resident AR step (breakdown.py) says how long each kernel ran, but with programmatic
dependent launch (kernels/pdl.py) a kernel's traced time includes the time it sat waiting for the one before, and
without PDL the step is another step. This benchmark asks the graph itself: for each of our Triton kernels, every
launch of that kernel is issued twice in a row (the same arguments; the kernels are pure functions of their inputs
or update state the step owns, so the second launch recomputes or advances it and the step's work stays finite and
the routing uniform), the step is captured again, and

    in-situ cost per launch = (wall of the step with that kernel doubled - wall of the plain step) / launches

which is what that kernel adds to the chain as it stands, its start-up, its dependency on the kernel before and its
bytes included (a second read of a weight that fits the L2 is cheaper: small GEMMs read low). Set beside the bytes a
launch must move, it says where the step loses its time against the roofline.

Each variant's rounds are captured afresh (the doubled launches are in the graph), and the plain step is measured
first and last (its spread is the noise floor). `--variants` adds A/B switches (common.SWITCHES) as rows of their
own: "+whole-slice" measures the step with that switch on, "gemv+whole-slice" the doubled GEMV under it.
Tiles can be set per variant for a sweep inside the step (a kernel's tiles timed alone read its weights from a warm
L2 and see no neighbours): "plain@gate_up=32x256s8w8@down=16x256w4@gdn=32w4@gemv:2048x4096=32x128s8w4t4" sets the
MoE decode kernels' tiles at one token (BLOCK_N x BLOCK_K, s: split-K, w: warps), the GDN step's (BV, warps) and
our GEMV's config for one (N x K) shape at M = 1 (t: stages).
Random bf16 weights; the AR step at batch 1 (the static cache of `--context` prompt tokens).
Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from breakdown import parts_of, summarize, wall_ms  # noqa: E402
from common import (SWITCHES, environment, frontier, method_variant, switch_settings, timeline,  # noqa: E402
                    read_json, traced_kernels, write_results)
from e2e import HBM_TBPS, build  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import HybridSpecConfig  # noqa: E402
from hybridspec_hf.selector.latency import LatencyModel  # noqa: E402

# kernel name -> the module holding its launcher (`_LazyJit`), for the kernels of the AR step
KERNELS = {
    "_gemv_kernel": "hybridspec_hf.kernels.gemv_triton",
    "_gate_up_decode_kernel": "hybridspec_hf.kernels.moe_triton",
    "_down_decode_kernel": "hybridspec_hf.kernels.moe_triton",
    "_gdn_step_kernel": "hybridspec_hf.kernels.gdn_step_triton",
    "_add_rms_norm_kernel": "hybridspec_hf.kernels.norm_triton",
    "_rms_norm_kernel": "hybridspec_hf.kernels.norm_triton",
    "_route_topk_kernel": "hybridspec_hf.kernels.router_triton",
    "_add_norm_route_kernel": "hybridspec_hf.kernels.router_triton",
    "_attention_kernel": "hybridspec_hf.kernels.attention_triton",
    "_combine_kernel": "hybridspec_hf.kernels.attention_triton",
    "_qk_prologue_kernel": "hybridspec_hf.kernels.attention_prologue_triton",
}
SHORT = {name.strip("_").removesuffix("_kernel"): name for name in KERNELS}


class Doubled:
    """A `_LazyJit` whose every launch runs twice with the same arguments."""

    def __init__(self, lazy):
        self.lazy = lazy

    def __getitem__(self, grid):
        launch = self.lazy[grid]

        def twice(*args, **kwargs):
            launch(*args, **kwargs)
            return launch(*args, **kwargs)
        return twice


@contextlib.contextmanager
def doubled(kernel: str | None):
    """Inside: every launch of `kernel` (a key of KERNELS; None: none) runs twice."""
    if kernel is None:
        yield
        return
    module = importlib.import_module(KERNELS[kernel])
    lazy = getattr(module, kernel)
    setattr(module, kernel, Doubled(lazy))
    try:
        yield
    finally:
        setattr(module, kernel, lazy)


def parse_tiles(spec: str) -> dict:
    """"gate_up=32x256s8w8", "down=16x256w4", "gdn=32w4", "gemv:2048x4096=32x128s8w4t4" -> {what: numbers}: the
    tile overrides of one variant (`tiles_set`); a clear SystemExit for anything else."""
    patterns = {"gate_up": r"(\d+)x(\d+)s(\d+)w(\d+)", "down": r"(\d+)x(\d+)w(\d+)", "gdn": r"(\d+)w(\d+)",
                "gemv": r"(\d+)x(\d+)s(\d+)w(\d+)t(\d+)"}
    what, _, value = spec.partition("=")
    kind, _, shape = what.partition(":")
    match = re.fullmatch(patterns.get(kind, "(?!)"), value)
    shape_match = re.fullmatch(r"(\d+)x(\d+)", shape) if kind == "gemv" else not shape
    if match is None or not shape_match:
        raise SystemExit(f"unknown tiles {spec!r}: gate_up=BNxBKsSPLITwWARPS, down=BNxBKwWARPS, gdn=BVwWARPS or "
                         f"gemv:NxK=BNxBKsSPLITwWARPStSTAGES")
    numbers = tuple(int(g) for g in match.groups())
    key = what if kind != "gemv" else (kind, int(shape_match.group(1)), int(shape_match.group(2)))
    return {key: numbers}


@contextlib.contextmanager
def tiles_set(tiles: dict):
    """Inside: the MoE decode kernels at one token, the GDN step and our GEMV at M = 1 take `tiles` (parse_tiles)."""
    from hybridspec_hf.kernels import gdn_step_triton, gemv_triton, moe_triton

    saved = [(moe_triton, "default_tiles", moe_triton.default_tiles),
             (gdn_step_triton, "step_config", gdn_step_triton.step_config)]
    table = dict(gemv_triton.TABLE)
    if "gate_up" in tiles or "down" in tiles:
        original = moe_triton.default_tiles

        def default_tiles(num_tokens, mode):
            block_m, gate_up, down = original(num_tokens, mode)
            if mode == "decode" and num_tokens == 1:
                if "gate_up" in tiles:
                    bn, bk, split, warps = tiles["gate_up"]
                    gate_up = moe_triton.Tiles(bn, bk, warps, 1, split_k=split)
                if "down" in tiles:
                    bn, bk, warps = tiles["down"]
                    down = moe_triton.Tiles(bn, bk, warps, 1)
            return block_m, gate_up, down
        moe_triton.default_tiles = default_tiles
    if "gdn" in tiles:
        original_step = gdn_step_triton.step_config
        gdn_step_triton.step_config = lambda dv, rows, block_v=None, num_warps=None: original_step(
            dv, rows, block_v or tiles["gdn"][0], num_warps or tiles["gdn"][1])
    for key, numbers in tiles.items():
        if isinstance(key, tuple):  # ("gemv", N, K): (BN, BK, split, warps, stages) at M = 1
            gemv_triton.TABLE[(key[1], key[2], 1)] = gemv_triton.GemvConfig(*numbers, True)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        gemv_triton.TABLE.clear()
        gemv_triton.TABLE.update(table)


def parse_variant(variant: str) -> tuple[str | None, str]:
    """"gemv+whole-slice" -> ("_gemv_kernel", "ar+whole-slice"); "plain" -> (None, "ar"); "+whole-slice" -> (None,
    "ar+whole-slice")."""
    variant = variant.split("@")[0]
    head, flags = variant, ""
    for index, char in enumerate(variant):
        if char in "+-" and any(variant[index + 1:].startswith(flag) for flag in SWITCHES):
            head, flags = variant[:index], variant[index:]
            break
    kernel = None if head in ("", "plain") else SHORT.get(head)
    if head not in ("", "plain") and kernel is None:
        raise SystemExit(f"unknown variant {variant!r}: a kernel of {sorted(SHORT)} or 'plain', then +FLAG/-FLAG "
                         f"switches of {sorted(SWITCHES)}")
    return kernel, "ar" + flags


def measure(target, prompt: torch.Tensor, variant: str, replays: int, capacity: int) -> dict:
    """The AR step's wall (median of `replays`) and its traced kernels, captured afresh under `variant`."""
    kernel, method = parse_variant(variant)
    tiles = {k: v for spec in variant.split("@")[1:] for k, v in parse_tiles(spec).items()}
    context = prompt.shape[-1]
    latency = LatencyModel(cost=torch.linspace(7e-3, 10e-3, 16)[None], cost_ar=torch.tensor([5e-3]),
                           context_lens=torch.tensor([context]))
    settings = HybridSpecConfig(cuda_graphs="on", latency_model=latency)
    kwargs = dict(generation_strategy="ar", hybridspec_config=settings, attention_mask=torch.ones_like(prompt),
                  do_sample=False, pad_token_id=0)
    hybridspec_hf.release_graphs(target)
    with method_variant(method, target), doubled(kernel), tiles_set(tiles):
        target.generate(prompt, max_new_tokens=capacity, **kwargs)  # captures the step (with the doubled launches)
        target.generate(prompt, max_new_tokens=8, **kwargs)  # leaves the cache near the prompt
        rounds = target.__dict__.get("_hybridspec_resident")
        part = next(iter(parts_of(rounds, "ar", "exact", []).values()))
        kernels = traced_kernels(part.replay, 5)
        traced = summarize(kernels, 5)
        wall = [wall_ms(part.replay, replays) for _ in range(3)]
        settings_used = switch_settings()
    hybridspec_hf.release_graphs(target)
    return {"variant": variant, "kernel": kernel, "method": method, "wall_ms": sorted(wall)[1], "wall_ms_all": wall,
            "kernels": traced["kernels"], "all_kernels": traced["all_kernels"], "switches": settings_used,
            "timeline": (line := timeline(kernels, 5)), "frontier": frontier(line)}


def report(rows: list[dict], base_ms: float) -> str:
    base = rows[0]
    lines = ["| variant | kernels / step | wall ms | Δ wall µs | launches doubled | µs per launch in situ | "
             "traced µs per launch |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        delta = (row["wall_ms"] - base_ms) * 1e3
        if row["kernel"] is not None:
            entry = base["all_kernels"].get(row["kernel"], {"kernels": 0.0, "us": 0.0})
            launches = entry["kernels"]
            per = f"{delta / launches:.2f}" if launches else "n/a"
            traced = f"{entry['us'] / launches:.2f}" if launches else "n/a"
            extra = f"{launches:.0f}"
        else:
            per = traced = extra = "-"
        lines.append(f"| {row['variant']} | {row['kernels']:.0f} | {row['wall_ms']:.3f} | {delta:+.1f} | {extra} | "
                     f"{per} | {traced} |")
    return "\n".join(lines)


def frontier_table(rows: list[dict], top: int = 12) -> str:
    """The frontier's µs per kernel name (the first row's largest `top`, then the rest as one) for every variant."""
    first = rows[0]["frontier"]["by_kernel"]
    names = list(first)[:top]
    header = "| variant | trace µs | " + " | ".join(n[:24] for n in names) + " | rest |"
    lines = [header, "|" + "---|" * (len(names) + 3)]
    for row in rows:
        f = row["frontier"]["by_kernel"]
        rest = row["frontier"]["total"] - sum(f.get(n, {"us": 0.0})["us"] for n in names)
        lines.append(f"| {row['variant']} | {row['frontier']['total']:.1f} | "
                     + " | ".join(f"{f.get(n, {'us': 0.0})['us']:.0f}" for n in names) + f" | {rest:.0f} |")
    return "\n".join(lines)


def timeline_line(t: dict) -> str:
    """The plain step's spans outside our kernels, in words."""
    if not t["kernels"]:
        return "No kernels traced (CPU): no timeline."
    between = ", ".join(f"{name} ×{count}" for name, count in sorted(t["between"].items(), key=lambda kv: -kv[1]))
    return (f"The plain step's timeline (its middle traced replay, in the JSON): {t['head_us']:.1f} µs and "
            f"{t['head_kernels']} kernels before our first kernel, {t['tail_us']:.1f} µs and {t['tail_kernels']} "
            f"kernels after our last (the LM head among them); other kernels between ours: {between or 'none'}.")


def compare(sources: list[str], name: str) -> dict:
    """Before and after: the plain rows of kernel_costs results (JSON files, each with timelines) side by side, per
    kernel name: launches per step and µs of the traced span it held (the mean over each source's plain rows), with
    the step's kernels, wall and span. Measures nothing; writes <name>.{json,md}."""
    columns = []
    for source in sources:
        report = read_json(source)
        plains = [row for row in report["rows"] if row["variant"] == "plain" and row["timeline"]["kernels"]]
        if not plains:
            raise SystemExit(f"{source}: no plain row with a timeline (kernel_costs.py from 2026-12-03 on writes them)")
        by_kernel = collections.defaultdict(lambda: [0.0, 0.0])
        for row in plains:
            for kernel, entry in frontier(row["timeline"])["by_kernel"].items():
                by_kernel[kernel][0] += entry["kernels"] / len(plains)
                by_kernel[kernel][1] += entry["us"] / len(plains)
        columns.append({"source": source, "date": report["environment"]["date"], "by_kernel": dict(by_kernel),
                        "kernels": sum(r["kernels"] for r in plains) / len(plains),
                        "wall_ms": [r["wall_ms"] for r in plains],
                        "span_us": sum(frontier(r["timeline"])["total"] for r in plains) / len(plains)})
    names = sorted({k for c in columns for k in c["by_kernel"]},
                   key=lambda k: -max(c["by_kernel"].get(k, [0, 0])[1] for c in columns))
    head = " | ".join(f"{Path(c['source']).stem}: launches | µs" for c in columns)
    lines = [f"| kernel | {head} |", "|---|" + "---|---|" * len(columns)]
    for kernel in names:
        cells = " | ".join(f"{c['by_kernel'].get(kernel, [0, 0])[0]:.0f} | {c['by_kernel'].get(kernel, [0, 0])[1]:.0f}"
                           for c in columns)
        lines.append(f"| {kernel} | {cells} |")
    lines.append("| **step** | " + " | ".join(f"**{c['kernels']:.0f}** | **{c['span_us']:.0f}**" for c in columns)
                 + " |")
    walls = "; ".join(f"{Path(c['source']).stem}: wall {', '.join(f'{w:.3f}' for w in c['wall_ms'])} ms"
                      for c in columns)
    table = "\n".join(lines) + f"\n\n{walls}."
    notes = ("The plain AR step's traced span by the kernel each µs waited for (`frontier`: a kernel's end less the "
             "latest end before it), the mean over each source's plain rows; launches per step. Random bf16 weights "
             "(kernel_costs.py builds e2e.py's model), AR steps: no drafts, no acceptance. Sources (each with its "
             "own command, GPU and versions in its file): " + ", ".join(f"{c['source']} ({c['date']})"
                                                                      for c in columns) + ".")
    payload = {"title": "The resident AR step, kernel by kernel: " + " against ".join(Path(c["source"]).stem
                                                                                     for c in columns),
               "environment": environment(), "notes": notes, "columns": columns}
    write_results(name, payload, table)
    return payload


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--replays", type=int, default=30, help="replays per wall measurement (3 measurements)")
    parser.add_argument("--variants", default=",".join(["plain", *SHORT, "plain"]),
                        help="comma-separated: 'plain', a kernel (" + ", ".join(SHORT) + ") to double, either "
                             "followed by +FLAG / -FLAG switches (" + ", ".join(SWITCHES) + ")")
    parser.add_argument("--name", default="kernel_costs")
    parser.add_argument("--compare", default=None,
                        help="A.json,B.json,...: set earlier results' plain steps side by side (measures nothing)")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(args.compare.split(","), args.name)
    variants = args.variants.split(",")
    for variant in variants:  # unknown names fail before the model is built
        parse_variant(variant)
        for spec in variant.split("@")[1:]:
            parse_tiles(spec)
    if variants[0] != "plain":
        raise SystemExit("the first variant must be 'plain' (the step every other row is compared with)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, _ = build(args.model, args.layers, device)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    capacity = 3 * args.replays + 5 * 2 + 32  # every replay commits one token into the static cache
    rows = []
    for variant in variants:
        row = measure(target, prompt, variant, args.replays, capacity)
        rows.append(row)
        print(f"{variant:28s} {row['kernels']:5.0f} kernels  wall {row['wall_ms']:.3f} ms  "
              f"({', '.join(f'{w:.3f}' for w in row['wall_ms_all'])})", flush=True)
    plains = [row["wall_ms"] for row in rows if row["variant"] == "plain"]
    base_ms = sum(plains) / len(plains)
    table = report(rows, base_ms)
    config = target.config.get_text_config()
    notes = (f"{args.model}, {config.num_hidden_layers} layers, random bf16 weights; the resident AR step at batch 1 "
             f"after a {args.context}-token prompt, captured afresh per variant; wall = median over 3 × "
             f"{args.replays} replays (CUDA events). Δ wall against the mean of the plain rows ({base_ms:.3f} ms; "
             f"their spread {max(plains) - min(plains):.3f} ms is the noise). Doubling a kernel issues each of its "
             f"launches twice with the same arguments: the in-situ µs per launch is what one more such launch adds "
             f"to the chain (a second read of weights that fit the {HBM_TBPS} TB/s HBM's L2 reads low). Traced µs: "
             f"the plain step's profiler durations (with PDL they include waiting for the kernel before).")
    payload = {"title": f"In-situ cost of each kernel in the resident AR step ({args.model})",
               "environment": environment(), "notes": notes, "rows": rows, "base_ms": base_ms,
               "switches": switch_settings()}
    table += "\n\n" + timeline_line(rows[0]["timeline"])
    if rows[0]["timeline"]["kernels"]:
        table += ("\n\nThe traced replay's time by the kernel that moved its completion frontier (µs; a kernel's end "
                  "less the latest end before it: each µs charged once, so PDL's overlap is not double-counted):\n\n"
                  + frontier_table(rows))
    print(table, flush=True)
    write_results(args.name, payload, table)
    return payload


if __name__ == "__main__":
    main()
