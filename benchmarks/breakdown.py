"""Where the GPU time of a resident round goes: every kernel the captured graphs launch, by kind, per replay.

    python benchmarks/breakdown.py                       # one H200: Qwen3.5-35B-A3B shape, random bf16 weights
    python benchmarks/breakdown.py --model tiny          # the harness on a CPU (no kernels to trace: timings only)

After warm-up calls of generate() (which capture the graphs), the graphs are replayed on their own under the torch
profiler: the plain AR step, and HybridSpec's exact-length parts — the draft graph (drafting + choosing w0) and the
verify graphs at w = 1, 4, 8, 16 (each verifies, accepts and commits). Every kernel traced while a graph replays is
that graph's, so per replay we report the kernel count, the GPU busy time (sum of kernel durations) and the wall time
of a replay (CUDA events, no profiler), with kernels grouped by kind (GEMMs, our Triton kernels by name, elementwise,
reductions, copies, ...). The bytes roofline of each part is printed beside it: weights the part must read (routed
experts counted as the distinct experts its tokens reach under a uniform router; the embedding as the rows read), the
GDN state read and written, the KV cache read, at 4.25 TB/s. Random weights, random drafter (acceptance ≈ 0: the
cache grows by one token per round). Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, traced_kernels, write_results  # noqa: E402
from e2e import HBM_TBPS, build, roofline_bytes  # noqa: E402

from hybridspec_hf import HybridSpecConfig  # noqa: E402
from hybridspec_hf.selector.latency import LatencyModel  # noqa: E402

KERNELS = Path(__file__).resolve().parent.parent / "hybridspec_hf" / "kernels"
OURS = sorted({name for path in KERNELS.glob("*.py") for name in re.findall(r"def (_\w+_kernel)\(", path.read_text())})
KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|splitK|cublas|Kernel2"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("reduce", r"reduce|Reduce"),
    ("copy/cat", r"[Cc]opy|Memcpy|Memset|CatArray|fill"),
    ("index/scatter/gather", r"index|scatter|gather|Index"),
    ("softmax/topk/sort", r"softmax|topk|sort|Sort|radix|mbtopk"),
]


def kind_of(name: str) -> str:
    for ours in OURS:
        if name == ours or name.startswith(ours + "_"):
            return f"ours: {ours}"
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def attributed_kernels(model, drafter, fn) -> dict:
    """fn() run eagerly once under the profiler, each kernel charged to the innermost module it ran under and the aten
    op that launched it: {"module | op": {kernels, us}}. Matches a kernel to its launch by correlation id and the
    launch to the CPU ops around it by time on the launching thread (the graphs replay exactly these kernels)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    handles, ranges = [], []
    modules = [(name, m) for name, m in model.named_modules() if "layers." in name and name.count(".") <= 5]
    if drafter is not None:
        modules += [(f"drafter.{name}", m) for name, m in drafter.named_modules() if name and name.count(".") <= 3]
    for name, module in modules:
        parts = name.split(".")
        short = "hs:" + ".".join("N" if p.isdigit() else p for p in (parts[2:] if parts[0] == "model" else parts))

        def pre(m, a, s=short):
            ranges.append(record_function(s))
            ranges[-1].__enter__()

        def post(m, a, o):
            ranges.pop().__exit__(None, None, None)
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        prof.export_chrome_trace(handle.name)
        events = json.loads(Path(handle.name).read_text())["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"
                if "correlation" in e.get("args", {})}
    cpu = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"])
    table = collections.defaultdict(lambda: [0, 0.0])
    for kernel in (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        module, op = "(round code)", "?"
        if launch is not None:
            around = [e for e in cpu if e["tid"] == launch["tid"] and e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
            names = [e["name"] for e in around]
            module = next((n[3:] for n in reversed(names) if n.startswith("hs:")), module)
            op = next((n for n in reversed(names) if not n.startswith("hs:")), kernel["name"][:40])
        entry = table[f"{module} | {op}"]
        entry[0] += 1
        entry[1] += float(kernel.get("dur", 0.0))
    return {k: {"kernels": c, "us": us} for k, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])}


def wall_ms(replay, n: int) -> float:
    """Median wall time of one replay, by CUDA events around each (the GPU's time, launch included)."""
    times = []
    if not torch.cuda.is_available():
        for _ in range(n):
            start = time.perf_counter()
            replay()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def summarize(kernels: list[dict], n: int) -> dict:
    by_kind, by_name = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        for table, key in ((by_kind, kind_of(k["name"])), (by_name, k["name"][:90])):
            table[key][0] += 1
            table[key][1] += k["us"]

    def per_replay(table, top=None):
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return {key: {"kernels": c / n, "us": us / n} for key, (c, us) in rows}
    return {"kernels": len(kernels) / n, "busy_us": sum(k["us"] for k in kernels) / n,
            "by_kind": per_replay(by_kind), "top_kernels": per_replay(by_name, 25)}


def part_bytes(target, drafter, tokens: int, context: int, drafting: bool) -> dict:
    """Fewest bytes a part moves: a target forward (`e2e.roofline_bytes`, uniform router), or drafting (the
    drafter's own weights and the LM head it shares with the target)."""
    if not drafting:
        return roofline_bytes(target, tokens, None, context)
    own = sum(p.numel() * p.element_size() for n, p in drafter.named_parameters()
              if "lm_head" not in n and "embed" not in n)
    head = target.get_output_embeddings().weight
    return {"drafter weights": own, "LM head": head.numel() * head.element_size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--lengths", default="1,4,8,16", help="verify graphs to trace")
    parser.add_argument("--name", default="breakdown_qwen35_35b_a3b")
    parser.add_argument("--attribute", action="store_true",
                        help="also run each part eagerly under the profiler: kernels by (module, aten op)")
    parser.add_argument("--moe-one-pass", choices=["on", "off"], default=None,
                        help="set patches._moe.SHARED_EXPERT_SLOT (the one-pass MoE block) before capture (A/B)")
    args = parser.parse_args()
    if args.moe_one_pass is not None:
        from hybridspec_hf.patches import _moe

        _moe.SHARED_EXPERT_SLOT = args.moe_one_pass == "on"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = build(args.model, args.layers, device)
    vocab = target.config.get_text_config().vocab_size
    context = 256
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    capacity_tokens = 80 * args.replays + 64  # room for the replays below (the random drafter's rounds grow the cache ≈ 1)
    parts = {}
    for strategy in ("ar", "hybridspec"):
        # a stand-in latency model (what is traced does not depend on it): no calibration needed
        latency = LatencyModel(cost=torch.linspace(7e-3, 10e-3, 16)[None], cost_ar=torch.tensor([5e-3]),
                               context_lens=torch.tensor([context]))
        settings = HybridSpecConfig(cuda_graphs="on", verify_shape="exact",
                                    latency_model=latency)
        kwargs = dict(generation_strategy=strategy, hybridspec_config=settings,
                      assistant_model=drafter if strategy != "ar" else None, do_sample=False)
        target.generate(prompt, max_new_tokens=capacity_tokens, **kwargs)  # captures for this capacity
        target.generate(prompt, max_new_tokens=8, **kwargs)  # reuses the rounds, leaves the cache near the prompt
        rounds = target.__dict__.get("_hybridspec_resident")
        rounds.max_length.fill_(10**9)  # every verify graph sees all its tokens valid
        if strategy == "ar":
            graphs = {"AR step (w = 1)": (rounds.step, 1, False)}
        else:
            graphs = {"draft (drafting + choosing w0)": (rounds.draft, 16, True)}
            for n in map(int, args.lengths.split(",")):
                graphs[f"verify w = {n} (+ accept, commit)"] = (rounds.verifies[n], n, False)
        for label, (graph, tokens, drafting) in graphs.items():
            if strategy != "ar" and not drafting:  # a verify graph alone, on the last draft, all its tokens valid
                rounds.draft()
                rounds.round_valid.fill_(tokens)
            row = summarize(traced_kernels(graph, args.replays), args.replays)
            row["wall_ms"] = wall_ms(graph, args.replays)
            if args.attribute and device == "cuda":
                from hybridspec_hf.patches.experts import fused_experts_for

                fn = {"AR step (w = 1)": rounds._step}.get(label) or (
                    rounds._draft if drafting else (lambda n=tokens: rounds._verify(n)))
                saved = dict(rounds.__dict__)  # the eager call rebinds round buffers; the graphs keep reading these
                try:  # a diagnostic: a failure here must not cost the run its timings
                    with torch.no_grad(), fused_experts_for(rounds.moe):
                        row["attributed"] = attributed_kernels(target, drafter, fn)
                except Exception as error:
                    row["attributed"] = {f"failed: {type(error).__name__}: {error}": {"kernels": 0, "us": 0.0}}
                finally:
                    rounds.__dict__.update(saved)
                for key, value in list(row["attributed"].items())[:40]:
                    print(f"    {value['kernels']:5d} {value['us']:8.1f} us  {key}", flush=True)
            length = int(rounds.target.length)
            row["bytes"] = part_bytes(target, drafter, tokens, length, drafting)
            row["roofline_ms"] = sum(row["bytes"].values()) / (HBM_TBPS * 1e12) * 1e3
            parts[label] = row
            print(f"{label}: {row['kernels']:.0f} kernels, busy {row['busy_us'] / 1e3:.3f} ms, wall "
                  f"{row['wall_ms']:.3f} ms, roofline {row['roofline_ms']:.3f} ms", flush=True)
            for kind, value in row["by_kind"].items():
                print(f"    {kind:40s} {value['kernels']:7.1f} kernels {value['us']:9.1f} us", flush=True)
    write(args, target, parts)


def write(args, target, parts: dict) -> None:
    config = target.config.get_text_config()
    lines = [f"{args.model}, {config.num_hidden_layers} layers, random bf16 weights, random drafter; graphs replayed "
             f"on their own ({args.replays} replays each). Busy = sum of kernel durations; wall = CUDA-event time of a "
             f"replay; roofline = fewest bytes / {HBM_TBPS} TB/s (uniform router).", "",
             "| part | kernels | busy ms | wall ms | roofline ms | wall / roofline | idle share |",
             "|---|---|---|---|---|---|---|"]
    for label, row in parts.items():
        lines.append(f"| {label} | {row['kernels']:.0f} | {row['busy_us'] / 1e3:.3f} | {row['wall_ms']:.3f} | "
                     f"{row['roofline_ms']:.3f} | {row['wall_ms'] / row['roofline_ms']:.1f}× | "
                     f"{max(0.0, 1 - row['busy_us'] / 1e3 / row['wall_ms']):.0%} |")
    for label, row in parts.items():
        lines += ["", f"### {label}", "", "| kind | kernels / replay | µs / replay |", "|---|---|---|"]
        lines += [f"| {k} | {v['kernels']:.1f} | {v['us']:.1f} |" for k, v in row["by_kind"].items()]
        lines += ["", "Top kernels: " + "; ".join(f"`{k}` ×{v['kernels']:.0f} {v['us']:.0f} µs"
                                                  for k, v in list(row["top_kernels"].items())[:12])]
    payload = {"title": f"Kernel breakdown of the resident graphs ({args.model})", "environment": environment(),
               "weights": "random", "parts": parts, "notes": __doc__.split("\n\n")[2]}
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
