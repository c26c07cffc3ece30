"""Where the GPU time of a resident round goes: every kernel the captured graphs launch, by kind, per replay.

    python benchmarks/breakdown.py                       # one H200: Qwen3.5-35B-A3B shape, random bf16 weights
    python benchmarks/breakdown.py --model tiny          # the harness on a CPU (no kernels to trace: timings only)

After warm-up calls of generate() (which capture the graphs), the graphs are replayed on their own under the torch
profiler: the plain AR step, HybridSpec's exact-length parts — the draft graph (drafting + choosing w0) and the
verify graphs at w = 1, 4, 8, 16 (each verifies, accepts and commits) — and the round as the default CUDA path runs
it: one max-shape graph (draft, choose, verify the whole block with a device-side valid length, accept, commit, hand
off), beside the same target forward captured alone in a graph of its own (`ResidentRounds._verify_forward` with the
round's valid length and routing window; no drafting, acceptance or commit) at T = B and T = 1. The round's wall
minus the forward's is the time outside the target's forward (issue 15; goal <= 1.0 ms at B = 16), of which the
draft graph's share is printed. `--round-lengths 1,4,16` adds the max-shape round with its length forced to each w
(`ForcedLength` beside HybridSpec's selector work, as calibration times C(w)): what a round costs at small w that a
plain step does not. Every kernel traced while a graph replays is that graph's, so per replay we report the kernel
count, the GPU busy time (sum of kernel durations) and the wall time of a replay (CUDA events, no profiler), with
kernels grouped by kind (GEMMs, our Triton kernels by name, elementwise, reductions, copies, ...). The bytes
roofline of each part is printed beside it: weights the part must read (routed experts counted as the distinct
experts its tokens reach under a uniform router; the embedding as the rows read; the LM head as its int8 copy where
the part takes greedy tokens from it, `part_bytes`), the GDN state read and written, the KV cache read, at 4.25
TB/s (the H200's copy bandwidth) and at this GPU's own (`e2e.copy_tbps`); for the forced rounds (batch 1) also
with their routed experts counted as their routers picked them (`measured_routing`: a capture of its own with hooks
copying each router's ids; the rows below the round's valid length). With PDL
kernels overlap, so each part also charges every µs of its middle traced replay to the kernel the GPU waited for
(`common.frontier`, as kernel_costs.py). Random weights, random drafter (acceptance ≈ 0: the cache grows by one
token per round). Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_switches, apply_switches, environment, frontier, switch_settings, timeline,  # noqa: E402
                    traced_kernels, write_results)
from e2e import HBM_TBPS, build, copy_tbps, roofline_bytes, uniform_distinct  # noqa: E402

from hybridspec_hf import HybridSpecConfig, patches, release_graphs  # noqa: E402
from hybridspec_hf.generation.calibration import ForcedLength, shadow_selector  # noqa: E402
from hybridspec_hf.graphs.capture import Replay  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import int8_rows_bytes  # noqa: E402
from hybridspec_hf.patches.experts import fused_experts_for  # noqa: E402
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
    """fn() run eagerly once under the profiler (with Python stacks), each kernel charged to the innermost module it
    ran under, the aten op and the Python line that launched it (`attribute_events`; the graphs replay exactly these
    kernels)."""
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
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        prof.export_chrome_trace(handle.name)
        events = json.loads(Path(handle.name).read_text())["traceEvents"]
    return attribute_events(events)


SITE_PACKAGES = ("hybridspec_hf/", "transformers/")  # the Python frames a launch's site is named by


def attribute_events(events: list[dict]) -> dict:
    """A profiler's chrome-trace events -> {"module | op | site": {kernels, us}}: each kernel (memcpy, memset) matched
    to its launch by correlation id, the launch to the CPU ops, module ranges ("hs:" annotations) and Python frames
    around it by time on the launching thread; module and op the innermost of each, site the innermost Python frame
    of our package or transformers ("file(line): function", with_stack), else "?"."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"
                if "correlation" in e.get("args", {})}
    cpu = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
                 key=lambda e: e["ts"])
    table = collections.defaultdict(lambda: [0, 0.0])
    for kernel in (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        module, op, site = "(round code)", "?", "?"
        if launch is not None:
            around = [e for e in cpu if e["tid"] == launch["tid"] and e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
            names = [e["name"] for e in around if e.get("cat") != "python_function"]
            module = next((n[3:] for n in reversed(names) if n.startswith("hs:")), module)
            op = next((n for n in reversed(names) if not n.startswith("hs:")), kernel["name"][:40])
            frames = [e["name"] for e in around if e.get("cat") == "python_function"]
            site = next((_site(n) for n in reversed(frames) if any(p in n for p in SITE_PACKAGES)), site)
        entry = table[f"{module} | {op} | {site}"]
        entry[0] += 1
        entry[1] += float(kernel.get("dur", 0.0))
    return {k: {"kernels": c, "us": us} for k, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])}


def _site(frame: str) -> str:
    """"…/site-packages/hybridspec_hf/x/y.py(12): f" -> "hybridspec_hf/x/y.py(12): f" (from the package down)."""
    starts = [frame.rfind(p) for p in SITE_PACKAGES if p in frame]
    return frame[max(starts):] if starts else frame


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
            "by_kind": per_replay(by_kind), "top_kernels": per_replay(by_name, 25), "all_kernels": per_replay(by_name)}


def part_bytes(target, drafter, tokens: int, context: int, drafting: bool, distinct: float | None = None,
               int8_head: bool = False) -> dict:
    """Fewest bytes a part moves: its target forward over `tokens` tokens (`e2e.roofline_bytes`, uniform router or
    `distinct` experts a layer as measured; none for 0) and, when it drafts, the drafter's own weights and the LM
    head it shares with the target. `int8_head`: the forward takes greedy tokens from the head's int8 copy
    (`resident.INT8_GREEDY_HEAD`), so its head counts as that copy and its float32 row scales (the candidate rows it
    reads of the head itself, ≈ 0.1-0.3 % of them, left out); the drafter's head likewise where its config
    quantizes it."""
    moved = dict(roofline_bytes(target, tokens, None, context, distinct)) if tokens else {}
    head = target.get_output_embeddings().weight
    int8_bytes = int8_rows_bytes(*head.shape)
    if tokens and int8_head:
        moved[DENSE] -= head.numel() * head.element_size()
        moved["LM head's int8 copy (greedy tokens)"] = int8_bytes
    if drafting:
        moved["drafter weights"] = sum(p.numel() * p.element_size() for n, p in drafter.named_parameters()
                                       if "lm_head" not in n and "embed" not in n)
        quantized = getattr(drafter.config, "head_quantization", None) == "int8"
        moved["LM head"] = int8_bytes if quantized else head.numel() * head.element_size()
    return moved


# A graph to trace: `tokens` the target's forward in it takes (0: none), whether it drafts, and what to run before
# its replays (a verify graph replays the last draft, all its tokens valid; the forward alone, a fresh round's block)
# greedy: the part's forward ends in greedy tokens (from the head's int8 copy where `greedy_from_copy`), not logits
Part = collections.namedtuple("Part", "replay tokens drafting before greedy", defaults=(True,))
AR_STEP, DRAFT, ROUND = "AR step (w = 1)", "draft (drafting + choosing w0)", "round, max shape (one graph)"
HS_STEP = "HybridSpec plain step (w = 1, no append)"
OUTSIDE_GOAL_MS = 1.0  # issue 15, at B = 16
DENSE = "dense weights (LM head included)"  # e2e.roofline_bytes's key


def forward_label(tokens: int) -> str:
    return f"target forward alone, T = {tokens}"


def target_forward(rounds, tokens: int) -> Replay:
    """The max-shape round's target forward captured alone: the first `tokens` of the last drafted block through
    `ResidentRounds._verify_forward`. At the whole block it takes the round's own valid length and routing window
    (the buffers the round graph's last replay wrote); at fewer tokens, all of them valid and no window."""
    all_valid = torch.full((1,), tokens, dtype=torch.long, device=rounds.device)

    def forward():  # reads the round's buffers when called (captured: the round graph's; eager: the last round's)
        if tokens == rounds.verify_tokens:
            return rounds._verify_forward(rounds.block, rounds.round_valid, rounds.choice)
        return rounds._verify_forward(rounds.block[:, :tokens], all_valid, None)

    experts = fused_experts_for(rounds.moe) if rounds.device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), experts:  # captured as the rounds' graphs are (our experts kernel on CUDA)
        return Replay(forward, device=rounds.device)


def captured_rounds(target, prompt: torch.Tensor, capacity: int, kwargs: dict):
    """`target`'s resident rounds for generate(prompt, **kwargs), captured for `capacity` new tokens, with the cache
    left near the prompt and every round free to verify the whole block and commit (for replays on their own)."""
    target.generate(prompt, max_new_tokens=capacity, **kwargs)  # captures for this capacity
    target.generate(prompt, max_new_tokens=8, **kwargs)  # reuses the rounds, leaves the cache near the prompt
    rounds = target.__dict__.get("_hybridspec_resident")
    rounds.limit.fill_(10**9)  # every round may verify the whole block
    rounds.live.fill_(1)  # and commits (the call that ended left its row finished)
    return rounds


def forced_label(w: int) -> str:
    return f"round, max shape, w = {w} forced"


def parts_of(rounds, strategy: str, verify_shape: str, lengths: list[int], round_lengths: list[int] = (),
             forced: ForcedLength | None = None) -> dict[str, Part]:
    """The graphs of one set of resident rounds to trace, by label. verify_shape "forced": the max-shape round
    captured with the `forced` selector, replayed at each of `round_lengths` (its device w set before each)."""
    if strategy == "ar":
        return {AR_STEP: Part(rounds.step, 1, False, lambda: None)}
    if verify_shape == "plain":  # HybridSpec's plain step, to set beside AR's (the same forward, m = 1)
        # its features park in the deferred buffer's next column: start each measurement from column 0
        return {HS_STEP: Part(rounds.step, 1, False, lambda: rounds.deferred_count.zero_())}
    if verify_shape == "exact":
        def last_draft_all_valid(n):
            rounds.draft()
            rounds.round_valid.fill_(n)
        parts = {DRAFT: Part(rounds.draft, 0, True, lambda: None)}
        for n in lengths:
            parts[f"verify w = {n} (+ accept, commit)"] = Part(rounds.verifies[n], n, False,
                                                              lambda n=n: last_draft_all_valid(n))
        return parts
    block = rounds.verify_tokens
    if verify_shape == "forced":
        return {forced_label(n): Part(rounds.spec, n, True, lambda n=n: forced.set(n)) for n in round_lengths}
    parts = {ROUND: Part(rounds.spec, block, True, lambda: None)}
    for n in (block, 1):
        parts[forward_label(n)] = Part(target_forward(rounds, n), n, False, rounds.spec, greedy=False)  # logits
    return parts


def outside_the_forward(parts: dict, block: int) -> dict:
    """Issue 15: the wall time of a max-shape round outside the target's forward (drafting, choosing, acceptance,
    commit, hand-off) = round - the same forward alone, and the draft graph's share of it."""
    round_ms, forward_ms = parts[ROUND]["wall_ms"], parts[forward_label(block)]["wall_ms"]
    outside = round_ms - forward_ms
    draft_ms = parts[DRAFT]["wall_ms"]
    return {"block": block, "round_ms": round_ms, "forward_ms": forward_ms, "outside_ms": outside,
            "goal_ms": OUTSIDE_GOAL_MS, "draft_ms": draft_ms, "draft_share": draft_ms / outside if outside > 0 else None,
            "forward_1_ms": parts[forward_label(1)]["wall_ms"], "ar_step_ms": parts[AR_STEP]["wall_ms"]}


def outside_lines(o: dict) -> list[str]:
    share = "n/a (no time outside the forward)" if o["draft_share"] is None else f"{o['draft_share']:.0%} of it"
    met = "met" if o["outside_ms"] <= o["goal_ms"] else "missed"
    return [f"Outside the target's forward (issue 15), B = {o['block']}, wall ms per replay:", "",
            f"- {ROUND}: {o['round_ms']:.3f}",
            f"- {forward_label(o['block'])}: {o['forward_ms']:.3f}",
            f"- outside the forward (round - forward): {o['outside_ms']:.3f} (goal <= {o['goal_ms']}: {met})",
            f"- {DRAFT}, its own graph: {o['draft_ms']:.3f}, {share}",
            f"- {forward_label(1)}: {o['forward_1_ms']:.3f} (AR step: {o['ar_step_ms']:.3f})"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--lengths", default="1,4,8,16", help="verify graphs to trace")
    parser.add_argument("--name", default="breakdown_qwen35_35b_a3b")
    parser.add_argument("--batch", type=int, default=1, help="rows per call (the graphs of that batch's bucket)")
    parser.add_argument("--plain-only", action="store_true",
                        help="only the plain steps: AR's and HybridSpec's (where the two differ, kernel by kernel)")
    parser.add_argument("--round-lengths", default="",
                        help="also the max-shape round with its length forced to each w (comma list; as "
                             "calibration times C(w): HybridSpec's selector work runs beside it, its answer discarded)")
    parser.add_argument("--routing", action=argparse.BooleanOptionalAction, default=True,
                        help="with --round-lengths at batch 1: count the distinct experts the forced rounds' "
                             "routers pick (a capture of its own) and price their roofline by them")
    parser.add_argument("--attribute", action="store_true",
                        help="also run each part eagerly under the profiler: kernels by (module, aten op, the "
                             "Python line of our package or transformers that launched it)")
    add_switches(parser, "moe-one-pass", "moe-decode", "defer-appends", "pdl", "early-reads", "gdn-norm-fold",
                 "wide-direct", "align-kernel", "int8-greedy-head", "greedy-two-pass", "bounded-candidates")
    args = parser.parse_args(argv)
    apply_switches(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = build(args.model, args.layers, device)
    vocab = target.config.get_text_config().vocab_size
    context = 256
    prompt = torch.randint(0, vocab, (args.batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    capacity_tokens = 80 * args.replays + 64  # room for the replays below (the random drafter's rounds grow the cache ≈ 1)
    lengths = [int(n) for n in args.lengths.split(",")]
    parts = {}
    # the plain step; the exact-length draft and verify graphs; the max-shape round (the default on CUDA)
    round_lengths = [int(n) for n in args.round_lengths.split(",") if n]
    runs = [("ar", "exact"), ("hybridspec", "plain")] if args.plain_only else \
        [("ar", "exact"), ("hybridspec", "plain"), ("hybridspec", "exact"), ("hybridspec", "max")] + \
        ([("hybridspec", "forced")] if round_lengths else [])
    forced = ForcedLength(drafter.config.block_size, shadow_selector(target, drafter.config.block_size)) \
        if round_lengths else None
    for strategy, verify_shape in runs:
        kwargs = generate_kwargs(strategy, verify_shape, prompt, drafter, forced)
        rounds = captured_rounds(target, prompt, capacity_tokens, kwargs)
        for label, part in parts_of(rounds, strategy, verify_shape, lengths, round_lengths, forced).items():
            part.before()
            start_length = int(rounds.target.length.max())
            kernels = traced_kernels(part.replay, args.replays)
            row = summarize(kernels, args.replays)
            row["frontier"] = frontier(timeline(kernels, args.replays))
            committed = int(rounds.target.length.max()) - start_length
            part.before()
            start_length = int(rounds.target.length.max())
            row["wall_ms"] = wall_ms(part.replay, args.replays)
            committed += int(rounds.target.length.max()) - start_length
            row["committed_per_replay"] = committed / (2 * args.replays)
            if verify_shape == "forced":  # the tokens the last replay verified: the forced w, read back
                row["verified"] = int(rounds.round_valid.max())
            if args.attribute and device == "cuda":
                saved = dict(rounds.__dict__)  # the eager call rebinds round buffers; the graphs keep reading these
                try:  # a diagnostic: a failure here must not cost the run its timings
                    with torch.no_grad(), fused_experts_for(rounds.moe):
                        row["attributed"] = attributed_kernels(target, drafter, part.replay.fn)
                except Exception as error:
                    row["attributed"] = {f"failed: {type(error).__name__}: {error}": {"kernels": 0, "us": 0.0}}
                finally:
                    rounds.__dict__.update(saved)
                for key, value in list(row["attributed"].items())[:80]:
                    print(f"    {value['kernels']:5d} {value['us']:8.1f} us  {key}", flush=True)
            length = int(rounds.target.length.max())
            row["context_tokens"] = length
            row["int8_head"] = part.greedy and rounds.greedy_from_copy(part.tokens)
            row["bytes"] = part_bytes(target, drafter, part.tokens * args.batch, length, part.drafting,
                                      int8_head=row["int8_head"])
            row["roofline_ms"] = sum(row["bytes"].values()) / (HBM_TBPS * 1e12) * 1e3
            parts[label] = row
            print(f"{label}: {row['kernels']:.0f} kernels, busy {row['busy_us'] / 1e3:.3f} ms, wall "
                  f"{row['wall_ms']:.3f} ms, roofline {row['roofline_ms']:.3f} ms", flush=True)
            for kind, value in row["by_kind"].items():
                print(f"    {kind:40s} {value['kernels']:7.1f} kernels {value['us']:9.1f} us", flush=True)
    if HS_STEP in parts:
        print(step_difference(parts[AR_STEP], parts[HS_STEP]), flush=True)
    bandwidth = copy_tbps(device) if device == "cuda" else None
    if round_lengths and args.routing and args.batch == 1:
        release_graphs(target)  # the timed graphs go; the routing pass captures its own (with the ids' copies)
        distinct = measured_routing(target, prompt, capacity_tokens, generate_kwargs("hybridspec", "forced", prompt,
                                                                                     drafter, forced),
                                    forced, round_lengths, args.replays)
        for n, measured in distinct.items():
            row = parts[forced_label(n)]
            row["routing"] = measured
            length = row["context_tokens"]
            row["bytes_measured_routing"] = part_bytes(target, drafter, n, length, True, measured["distinct_per_layer"],
                                                       int8_head=row["int8_head"])
    for row in parts.values():
        measured = row.get("bytes_measured_routing", row["bytes"])
        row["roofline_measured_routing_ms"] = sum(measured.values()) / (HBM_TBPS * 1e12) * 1e3
        if bandwidth is not None:
            row["roofline_this_gpu_ms"] = sum(measured.values()) / (bandwidth * 1e12) * 1e3
    write(args, target, parts, None if args.plain_only else outside_the_forward(parts, drafter.config.block_size),
          bandwidth)


def generate_kwargs(strategy: str, verify_shape: str, prompt: torch.Tensor, drafter,
                    forced: ForcedLength | None) -> dict:
    """generate()'s arguments for one set of resident rounds: "exact" / "max" verify shapes with a stand-in latency
    model (what is traced does not depend on it: no calibration), "forced" with the forced-length selector."""
    latency = LatencyModel(cost=torch.linspace(7e-3, 10e-3, 16)[None], cost_ar=torch.tensor([5e-3]),
                           context_lens=torch.tensor([prompt.shape[1]]))
    settings = HybridSpecConfig(cuda_graphs="on", verify_shape=verify_shape if verify_shape == "exact" else "max",
                                latency_model=None if verify_shape == "forced" else latency,
                                selector=forced if verify_shape == "forced" else None)
    return dict(generation_strategy=strategy, hybridspec_config=settings, attention_mask=torch.ones_like(prompt),
                assistant_model=drafter if strategy != "ar" else None, do_sample=False, pad_token_id=0)


def measured_routing(target, prompt: torch.Tensor, capacity: int, kwargs: dict, forced: ForcedLength,
                     round_lengths: list[int], replays: int) -> dict[int, dict]:
    """The distinct experts a max-shape round reads per MoE layer at each forced w, counted from its routers' ids:
    forward hooks that copy each router's ids [T, k] into a buffer, captured with the round (a capture of its own,
    after the timed graphs are released, so that those carry no copies); per replay the rows below the round's valid
    length (after the routing correction), the mean over layers and `replays` replays."""
    blocks = patches.moe_blocks(target)
    block = kwargs["assistant_model"].config.block_size
    buffers = torch.full((len(blocks), block, blocks[0].gate.top_k), -1, dtype=torch.long, device=prompt.device)

    def copier(i):
        def hook(module, args, output):
            ids = output[2]
            if ids.shape[0] <= block:  # a round's rows (the prefill's are many more)
                buffers[i, :ids.shape[0]].copy_(ids)
                buffers[i, ids.shape[0]:].fill_(-1)
        return hook

    handles = [b.gate.register_forward_hook(copier(i)) for i, b in enumerate(blocks)]
    try:
        rounds = captured_rounds(target, prompt, capacity, kwargs)
        out = {}
        for n in round_lengths:
            forced.set(n)
            counts, valid = [], []
            for _ in range(replays):
                rounds.spec()
                v = int(rounds.round_valid.max())
                ids = buffers[:, :v].cpu()
                counts += [len(set(layer[layer >= 0].tolist())) for layer in ids]
                valid.append(v)
            out[n] = dict(distinct_per_layer=sum(counts) / len(counts), valid_tokens=sum(valid) / len(valid),
                          uniform_per_layer=uniform_distinct(target, n), replays=replays)
            print(f"routing at w = {n}: {out[n]}", flush=True)
        return out
    finally:
        for handle in handles:
            handle.remove()
        release_graphs(target)


def step_difference(ar: dict, hs: dict) -> str:
    """HybridSpec's plain step less AR's: wall and busy time, and the kernels (by name) whose count or time differ."""
    lines = [f"HybridSpec plain step - AR step: wall {hs['wall_ms'] - ar['wall_ms']:+.3f} ms, busy "
             f"{(hs['busy_us'] - ar['busy_us']) / 1e3:+.3f} ms, kernels {hs['kernels'] - ar['kernels']:+.0f}"]
    names = set(ar["all_kernels"]) | set(hs["all_kernels"])
    zero = {"kernels": 0.0, "us": 0.0}
    rows = sorted(((hs["all_kernels"].get(n, zero)["us"] - ar["all_kernels"].get(n, zero)["us"],
                    hs["all_kernels"].get(n, zero)["kernels"] - ar["all_kernels"].get(n, zero)["kernels"], n)
                   for n in names), key=lambda r: -abs(r[0]))
    lines += [f"    {us:+8.1f} us {count:+5.1f} kernels  {name}" for us, count, name in rows[:25]
              if abs(us) >= 0.5 or count]
    return "\n".join(lines)


def write(args, target, parts: dict, outside: dict, bandwidth: float | None = None) -> None:
    config = target.config.get_text_config()
    here = f"{bandwidth:.2f}" if bandwidth is not None else "-"
    lines = [f"{args.model}, {config.num_hidden_layers} layers, random bf16 weights, random drafter; graphs replayed "
             f"on their own ({args.replays} replays each), batch {args.batch}. Busy = sum of kernel durations (with "
             "programmatic dependent launch kernels overlap, so busy may exceed wall); wall = CUDA-event time of a "
             f"replay; roofline = fewest bytes / {HBM_TBPS} TB/s (the H200's copy bandwidth) with the routed "
             "experts as the distinct experts a uniform router picks for the part's tokens; measured routing: the "
             "forced rounds' distinct experts as their routers picked them (`measured_routing`), the other parts "
             f"as the uniform router's; this GPU: the same bytes at this GPU's copy bandwidth ({here} TB/s, "
             "`e2e.copy_tbps`); committed = tokens a replay commits. Switches: "
             + ", ".join(f"{k} {v}" for k, v in switch_settings().items()) + ".", "",
             "| part | kernels | busy ms | wall ms | roofline ms (uniform) | wall / roofline | roofline ms (measured "
             f"routing) | wall / it | at this GPU's {here} TB/s: roofline ms | wall / it | idle share | committed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, row in parts.items():
        measured = row["roofline_measured_routing_ms"]
        here_ms = row.get("roofline_this_gpu_ms")
        lines.append(f"| {label} | {row['kernels']:.0f} | {row['busy_us'] / 1e3:.3f} | {row['wall_ms']:.3f} | "
                     f"{row['roofline_ms']:.3f} | {row['wall_ms'] / row['roofline_ms']:.1f}× | {measured:.3f} | "
                     f"{row['wall_ms'] / measured:.2f}× | "
                     + (f"{here_ms:.3f} | {row['wall_ms'] / here_ms:.2f}× | " if here_ms else "- | - | ")
                     + f"{max(0.0, 1 - row['busy_us'] / 1e3 / row['wall_ms']):.0%} | "
                     f"{row['committed_per_replay']:.2f} |")
    routed = {label: row["routing"] for label, row in parts.items() if "routing" in row}
    if routed:
        lines += ["", "Routing as measured (the forced rounds, their own capture; distinct experts per MoE layer over "
                  "the rows below the round's valid length, mean over layers and replays):", "",
                  "| part | valid tokens | distinct experts / layer | uniform router's | replays |", "|---|---|---|---|---|"]
        lines += [f"| {label} | {r['valid_tokens']:.2f} | {r['distinct_per_layer']:.1f} | {r['uniform_per_layer']:.1f} "
                  f"| {r['replays']} |" for label, r in routed.items()]
    if outside is not None:
        lines += ["", *outside_lines(outside)]
    for label, row in parts.items():
        lines += ["", f"### {label}", "", "| kind | kernels / replay | µs / replay |", "|---|---|---|"]
        lines += [f"| {k} | {v['kernels']:.1f} | {v['us']:.1f} |" for k, v in row["by_kind"].items()]
        lines += ["", "Top kernels: " + "; ".join(f"`{k}` ×{v['kernels']:.0f} {v['us']:.0f} µs"
                                                  for k, v in list(row["top_kernels"].items())[:12])]
        if row["frontier"]["by_kernel"]:  # traced (CUDA): each µs of the middle replay charged to one kernel
            lines += ["", f"By the kernel each µs of the middle replay waited for (`common.frontier`; span "
                      f"{row['frontier']['total']:.0f} µs): " + "; ".join(
                          f"`{k[:60]}` ×{v['kernels']} {v['us']:.0f} µs"
                          for k, v in list(row["frontier"]["by_kernel"].items())[:15])]
    payload = {"title": f"Kernel breakdown of the resident graphs ({args.model})", "environment": environment(),
               "weights": "random", "switches": switch_settings(), "copy_tbps_this_gpu": bandwidth,
               "parts": parts, "outside_the_forward": outside,
               "notes": __doc__.split("\n\n")[2]}
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
