"""The drafter's part of a resident round, fused path (drafter/fused.py) on and off: `draft_static` over a 16-token
block and the context append of 1 and 16 rows, each captured as its own CUDA graph and replayed.

    PYTHONPATH=$PWD python benchmarks/draft_graph.py                 # one H200: Qwen3.5-35B-A3B shapes (≈ 1 minute)
    PYTHONPATH=$PWD python benchmarks/draft_graph.py --model tiny    # any machine: eager smoke (interpreter on a CPU)

The target is built with 4 layers only (the drafter reads its embedding and LM head, which do not depend on the
layer count); the drafter has the 35B-A3B benchmark's shape (5 layers, hidden 2048, 16 heads, 2 KV heads, head_dim
256, intermediate 6144, block 16, fc over 5 feature layers). The context holds `--context` tokens. Per graph and
setting: kernels per replay (torch profiler), median µs per replay (CUDA events), and the largest logit difference
between the two settings (random bf16 weights, so only a sanity check). No acceptance is involved: every replay
drafts one block. Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the smoke run: kernels in the Triton interpreter (read at launch)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, time_graph, write_results  # noqa: E402
from e2e import build  # noqa: E402

from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.drafter import StaticDraftContext, fused  # noqa: E402


def kernels_per_replay(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA") / replays


def parts(drafter, ctx, width: int, device):
    """(name, function) of each graph; every call leaves the context length where it was."""
    anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    one, sixteen = (torch.randn(1, n, width, device=device, dtype=drafter.dtype) for n in (1, 16))
    return [("draft (16-token block)", lambda: drafter.draft_static(anchor, ctx)),
            ("append 1 row", lambda: ctx.append(one, zero)),  # count 0: written, not counted
            ("append 16 rows", lambda: ctx.append(sixteen, zero))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--name", default="draft_graph")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    fused._ON_CPU = not cuda
    _, drafter = build(args.model, 4, device.type)
    width = drafter.fc.in_features
    context = min(args.context, 64) if not cuda else args.context
    ctx = StaticDraftContext(drafter, context + 64, device, drafter.dtype)
    with torch.no_grad():
        ctx.append(torch.randn(1, context, width, device=device, dtype=drafter.dtype), context)
    rows, outputs = {}, {}
    for enabled in (True, False):
        fused.ENABLED = enabled
        setting = "fused" if enabled else "eager static"
        for name, function in parts(drafter, ctx, width, device):
            with torch.no_grad(), patches.fused_kernels():
                if not cuda:  # smoke: one eager call
                    outputs[(name, enabled)] = function()
                    continue
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    function()  # warm-up: Triton compiles
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outputs[(name, enabled)] = function()
            if cuda:
                rows[f"{name} | {setting}"] = dict(kernels=kernels_per_replay(graph), **time_graph(graph, 1))
                del graph
    fused.ENABLED = True
    draft = "draft (16-token block)"
    difference = (outputs[(draft, True)].float() - outputs[(draft, False)].float()).abs().max().item()
    print(f"largest logit difference fused - eager: {difference:.3g}")
    if not cuda:
        return
    lines = ["| graph | setting | kernels / replay | median µs | p10 | p90 |", "|---|---|---|---|---|---|"]
    for key, row in rows.items():
        lines.append(f"| {key.replace(' | ', ' | ')} | {row['kernels']:.0f} | {row['median_us']:.1f} | "
                     f"{row['p10_us']:.1f} | {row['p90_us']:.1f} |")
    table = "\n".join(lines)
    print(table)
    write_results(args.name, dict(title=f"Drafter graphs, fused path on and off ({args.model})",
                                  environment=environment(), rows=rows, logit_difference=difference,
                                  notes=__doc__.split("\n\n", 2)[-1]), table)


if __name__ == "__main__":
    main()
