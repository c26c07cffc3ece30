"""Static-cache attention on the GPU: ours (kernels/attention_triton.py) against what the resident graphs ran before,
transformers' SDPA with a boolean mask over the whole static capacity.

Shape (default: the Qwen3.5-35B-A3B attention and its drafter): 16 query heads, 2 KV heads, head_dim 256, bf16,
batch 1. Rows: the target's causal verify (T = 16, 4), the AR step (T = 1) and the drafter's non-causal block
(T = 16), at several live lengths inside static capacities of 2,048 and 4,096 slots. Every figure is the median
over replays of one CUDA graph that runs the attention of `--layers` layers, each with its own KV cache (together
larger than the L2), divided by the layers: µs per layer. `--sweep` also times fixed split counts (our auto
choice is `plan`). Each row also gives the max |ours - fp32 reference|.

    python benchmarks/attention_kernel.py [--sweep] [--layers 20]

Writes benchmarks/results/attention_kernel.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "hybridspec_hf" not in sys.modules:  # kernels/ is a leaf (torch + triton): no package __init__ needed
    _package = types.ModuleType("hybridspec_hf")
    _package.__path__ = [os.path.join(REPO, "hybridspec_hf")]
    sys.modules["hybridspec_hf"] = _package

from common import capture, environment, time_graph, write_results  # noqa: E402

from hybridspec_hf.kernels.attention_triton import attention_reference, plan, static_attention, visible_keys  # noqa: E402


def graph_us(fn, layers: int) -> float:
    """Median µs per layer of a CUDA graph running fn(layer) for every layer."""
    return time_graph(capture(lambda: [fn(i) for i in range(layers)]), layers)["median_us"]


def sdpa_masked(q, k, v, mask, scaling):
    """What transformers' sdpa_attention_forward runs for these layers inside the graphs (GQA by enable_gqa)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)[0]


def bench(args, tokens: int, causal: bool, capacity: int, length: int, splits_list) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens + capacity + length)
    dt, hq, hk, d = torch.bfloat16, args.q_heads, args.kv_heads, args.head_dim
    q = [torch.randn(1, hq, tokens, d, device="cuda", generator=gen, dtype=dt) for _ in range(args.layers)]
    k = [torch.randn(1, hk, capacity, d, device="cuda", generator=gen, dtype=dt) for _ in range(args.layers)]
    v = [torch.randn(1, hk, capacity, d, device="cuda", generator=gen, dtype=dt) for _ in range(args.layers)]
    n = torch.tensor([length], device="cuda")
    scaling = d**-0.5
    mask = visible_keys(n, tokens, capacity, causal)
    error = (static_attention(q[0], k[0], v[0], n, scaling, causal=causal).float()
             - attention_reference(q[0], k[0], v[0], n, scaling, causal=causal).float()).abs().max().item()
    row = dict(tokens=tokens, causal=causal, capacity=capacity, length=length, max_abs_error=error,
               sdpa_us=graph_us(lambda i: sdpa_masked(q[i], k[i], v[i], mask, scaling), args.layers),
               ours_us=graph_us(lambda i: static_attention(q[i], k[i], v[i], n, scaling, causal=causal),
                                args.layers))
    row["auto_splits"] = plan(q[0], k[0]).splits
    for splits in splits_list:
        row[f"splits_{splits}_us"] = graph_us(
            lambda i, s=splits: static_attention(q[i], k[i], v[i], n, scaling, causal=causal, num_splits=s),
            args.layers)
    live = (length + tokens) * hk * d * 2 * 2
    row["live_kv_bytes_us_at_4.25TBps"] = live / 4.25e12 * 1e6
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--capacities", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1000, 2000])
    parser.add_argument("--sweep", action="store_true", help="also time fixed split counts 4, 8, 16, 32, 64")
    args = parser.parse_args()
    splits_list = (4, 8, 16, 32, 64) if args.sweep else ()
    rows = []
    for capacity in args.capacities:
        for length in [n for n in args.lengths if n + 16 <= capacity]:
            for tokens, causal in ((16, True), (4, True), (1, True), (16, False)):
                rows.append(bench(args, tokens, causal, capacity, length, splits_list))
    title = "Static-cache attention: ours vs SDPA over the whole capacity (µs per layer, CUDA graph)"
    columns = ["tokens", "causal", "capacity", "length", "sdpa_us", "ours_us", "auto_splits",
               *[f"splits_{s}_us" for s in splits_list], "live_kv_bytes_us_at_4.25TBps", "max_abs_error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c])
                                       for c in columns) + " |")
    notes = (f"{args.q_heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, bf16, batch 1, "
             f"{args.layers} layers per graph (own KV caches), random inputs; causal = the target's verify / AR step, "
             "non-causal = the drafter's block.")
    write_results("attention_kernel", dict(title=title, environment=environment(), notes=notes, rows=rows),
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
