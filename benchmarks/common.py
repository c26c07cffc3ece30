"""Shared by the benchmark scripts: environment facts, result writing (JSON + markdown), CUDA-graph timing."""
from __future__ import annotations

import collections
import contextlib
import datetime
import gzip
import importlib
import json
import platform
import re
import statistics
import sys
import tempfile
import types
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


# A/B switches a benchmark may set before it captures: flag -> (module, attribute, what it switches on)
SWITCHES = {
    "moe-one-pass": ("hybridspec_hf.patches._moe", "SHARED_EXPERT_SLOT", "the one-pass MoE block"),
    "moe-decode": ("hybridspec_hf.kernels.moe_triton", "DECODE_PATH", "the MoE decode kernels up to DECODE_MAX_TOKENS"),
    "defer-appends": ("hybridspec_hf.generation.resident", "DEFER_CONTEXT_APPENDS",
                      "plain steps park the drafter's features for the next speculative round"),
    "trust-drafts": ("hybridspec_hf.selector.length_rules", "TRUST_DRAFTS",
                     "HybridSpec's draft decision trusts the drafts' G(w) until emitted tokens confirm it"),
    "probe-net": ("hybridspec_hf.selector.length_rules", "PROBE_NET",
                  "HybridSpec spaces its probes by their time less the plain steps their expected tokens replace"),
    "carry-evidence": ("hybridspec_hf.selector.length_rules", "CARRY_EVIDENCE",
                       "HybridSpec's resident rounds keep the speculative evidence of the calls before"),
    "pdl": ("hybridspec_hf.kernels.pdl", "ENABLED",
            "programmatic dependent launch of our Triton kernels (Hopper: a kernel starts as the one before ends)"),
    "early-reads": ("hybridspec_hf.kernels.pdl", "EARLY_READS",
                    "reads of what kernels two back wrote before the PDL wait (MoE decode down, GDN step state)"),
    "wide-direct": ("hybridspec_hf.kernels.moe_triton", "WIDE_DIRECT",
                    "the MoE direct rows (no sort, shared expert as a slot) up to 32 tokens instead of 16"),
    "align-kernel": ("hybridspec_hf.kernels.moe_triton", "ALIGN_KERNEL",
                     "the sorted MoE blocks' alignment in one launch instead of ≈ 25 torch launches"),
    "whole-slice": ("hybridspec_hf.kernels.gemv_triton", "WHOLE_SLICE",
                    "our skinny GEMM loads a program's whole weight slice (≤ 32 KB) before the PDL wait"),
    "pdl-shapes": ("hybridspec_hf.kernels.gemv_triton", "PDL_SHAPES",
                   "our skinny GEMM (PDL) also where it only ties cuBLAS alone (the attention's q|k|v copy)"),
    "pdl-wide": ("hybridspec_hf.kernels.gemv_triton", "PDL_WIDE",
                 "our skinny GEMM (PDL) for the q|k|v copies of verifications and drafts (M = 2-16), not cuBLAS"),
    "conv-gates": ("hybridspec_hf.kernels.gdn_prologue_triton", "CONV_GATES",
                   "a GDN verification's conv + silu and gates in one launch instead of two"),
    "gdn-loads-first": ("hybridspec_hf.kernels.gdn_step_triton", "LOADS_FIRST",
                        "the GDN step loads the gates' inputs with the conv's, reads the window counter late"),
    "moe-fused-route": ("hybridspec_hf.patches._moe", "FUSED_ROUTE",
                        "the decoder's residual add, post-attention norm, MoE router GEMM and top-k in one launch"),
    "route-one-warp": ("hybridspec_hf.kernels.router_triton", "ROUTE_ONE_WARP",
                       "the one-launch add, norm and router: 2 router rows and one warp per program (else 4 and 4)"),
    "route-wide-rounds": ("hybridspec_hf.kernels.router_triton", "ROUTE_WIDE_ROUNDS",
                          "the one-launch add, norm and router past 2 tokens: 4 router rows and 4 warps per program"),
    "shared-first": ("hybridspec_hf.kernels.moe_triton", "SHARED_FIRST",
                     "the MoE decode gate_up's shared-expert programs first, their weights loaded before the PDL wait"),
    "norm-prologue": ("hybridspec_hf.kernels.gemv_triton", "NORM_PROLOGUE",
                      "the decoder's input RMSNorm in the prologue of the GDN / q|k|v projection GEMM"),
    "gdn-norm-fold": ("hybridspec_hf.kernels.gdn_step_triton", "FOLD_NORM",
                      "the GDN step's gated RMSNorm by the head's last program, no launch of its own"),
    "rope-table": ("hybridspec_hf.patches._rope", "TABLE",
                   "cos/sin gathered from the static target's RoPE table (one launch instead of ≈ 14)"),
    "mask-on-demand": ("hybridspec_hf.graphs.static_target", "MASK_ON_DEMAND",
                       "the dense attention mask only for layers that run transformers' attention function"),
    "step-tail": ("hybridspec_hf.generation.resident", "FUSED_STEP_TAIL",
                  "a plain step's bookkeeping after its token in one launch instead of ≈ 20 torch launches"),
    "round-end": ("hybridspec_hf.generation.resident", "FUSED_ROUND_END",
                  "a speculative round's draft decision and selector update in one compiled region, not two"),
    "direct-shared-first": ("hybridspec_hf.kernels.moe_triton", "DIRECT_SHARED_FIRST",
                            "the MoE direct rows' shared-expert programs first, dead slots leaving before row loads"),
    "direct-deep-k": ("hybridspec_hf.kernels.moe_triton", "DIRECT_DEEP_K",
                      "the MoE direct rows at 5-16 tokens with 256-deep K steps in 3 stages (not 128 in 4)"),
    "round-tail": ("hybridspec_hf.generation.resident", "FUSED_ROUND_TAIL",
                   "a round's acceptance, commit count and hand-off in compiled regions, not ≈ 40 launches"),
    "draft-tokens": ("hybridspec_hf.generation.resident", "FUSED_DRAFT_TOKENS",
                     "a round's drafts out of the draft-signals kernel (bf16 logits), not torch's argmax of fp32 ones"),
    "commit-beside": ("hybridspec_hf.generation.resident", "COMMIT_BESIDE",
                      "a round's GDN commit on a side stream beside the selector update, append and advance"),
    "short-verify": ("hybridspec_hf.generation.resident", "SHORT_VERIFY",
                     "a max-shape round choosing w <= 2 verifies 2 tokens (a CUDA graph conditional branch; torch 2.13)"),
    "int8-greedy-head": ("hybridspec_hf.generation.resident", "INT8_GREEDY_HEAD",
                         "greedy tokens from the LM head's int8 copy and its candidate rows, not the bf16 head's argmax"),
    "greedy-two-pass": ("hybridspec_hf.kernels.head_argmax_triton", "TWO_PASS",
                        "the int8 greedy head judges candidates against the token's bound (a first launch), not a block's"),
    "bounded-candidates": ("hybridspec_hf.kernels.head_argmax_triton", "BOUNDED_CANDIDATES",
                           "the int8 greedy head's candidates' loop runs as many steps as a block has candidates"),
    "gdn-recurrent": ("hybridspec_hf.kernels.gdn_triton", "RECURRENT_SHORT",
                      "GDN verify windows of <= RECURRENT_UPTO valid tokens token by token, not in the block form"),
}

# A/B switches of the drafter's config (a method variant sets them on the drafter passed to `method_variant`):
# flag -> (config attribute, its value when on (off: None), what it switches on)
DRAFTER_SWITCHES = {
    "int8-head": ("head_quantization", "int8",
                  "the drafter multiplies by an int8 copy of the target's LM head (per-row scales), not the bf16 head"),
    "int8-layers": ("layers_quantization", "int8",
                    "the drafter's fused path multiplies by int8 copies of its layers' projections (per-row scales)"),
}

# switches the resident rounds' key records (resident._Key): a variant needs no release of the kept rounds
KEYED = {"defer-appends", "trust-drafts", "carry-evidence", "probe-net", "int8-head", "int8-layers"}


@contextlib.contextmanager
def profile_elsewhere(profile):
    """Inside: `profile` (an acceptance profile replayed in timing mode, or None) replays the stretch half its rows
    past the timed call's start row. For warm-up calls: HybridSpec's resident rounds keep the speculative evidence of
    the calls before (HybridSpec.carry_rounds), which must not come from the timed call's own rows."""
    if profile is None:
        yield
        return
    start = getattr(profile, "start_row", 0)
    profile.start_row = start + profile.accepted.shape[0] // 2
    try:
        yield
    finally:
        profile.start_row = start


def add_switches(parser, *flags: str) -> None:
    """--FLAG on|off for each of `flags` (keys of SWITCHES); `apply_switches` sets them."""
    for flag in flags:
        module, attribute, what = SWITCHES[flag]
        parser.add_argument(f"--{flag}", choices=["on", "off"], default=None,
                            help=f"set {module}.{attribute} ({what}) before capture (A/B)")


def apply_switches(args) -> None:
    """Set every switch the command line named (`add_switches`); the others keep the package's default."""
    for flag, (module, attribute, _) in SWITCHES.items():
        value = getattr(args, flag.replace("-", "_"), None)
        if value is not None:
            setattr(importlib.import_module(module), attribute, value == "on")


@contextlib.contextmanager
def method_variant(method: str, target=None, drafter=None):
    """A method named "BASE+FLAG" or "BASE-FLAG" (FLAG a key of SWITCHES or DRAFTER_SWITCHES; several may follow
    one another, e.g. "ar-early-reads-gdn-norm-fold") runs BASE with those switches on or off, then puts them back:
    an A/B inside one run, sharing the model and the calibration. Yields BASE. A drafter switch sets `drafter`'s
    config (required then). Rounds captured under one setting must not serve another, so `target`'s captured rounds
    are released on both sides of a variant, unless the rounds' key records every switch it sets (KEYED)."""
    base, settings = method, []
    flags = sorted([*SWITCHES, *DRAFTER_SWITCHES], key=len, reverse=True)
    while True:
        # the longest flag first: "direct-shared-first" also ends with the flag "shared-first"
        found = next(((mark, flag) for flag in flags for mark in "+-" if base.endswith(mark + flag)), None)
        if found is None:
            break
        mark, flag = found
        base = base[: -len(flag) - 1]
        settings.append((flag, mark == "+"))
    if not settings:
        yield base
        return
    keyed = all(flag in KEYED for flag, _ in settings)  # kept rounds record the settings: kept side by side
    release = (lambda: None) if target is None or keyed else (
        lambda: importlib.import_module("hybridspec_hf").release_graphs(target))
    release()
    before = []
    for flag, on in settings:
        if flag in DRAFTER_SWITCHES:
            if drafter is None:
                raise ValueError(f"method {method!r}: the drafter switch {flag!r} needs the drafter")
            attribute, value, _ = DRAFTER_SWITCHES[flag]
            before.append((drafter.config, attribute, getattr(drafter.config, attribute)))
            setattr(drafter.config, attribute, value if on else None)
            continue
        module, attribute, _ = SWITCHES[flag]
        owner = importlib.import_module(module)
        before.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, on)
    try:
        yield base
    finally:
        for owner, attribute, value in reversed(before):
            setattr(owner, attribute, value)
        release()


def variant_base(method: str) -> str:
    """BASE of a method variant "BASE+FLAG" / "BASE-FLAG" (`method_variant`), nothing set; an unknown flag stays
    part of BASE."""
    with method_variant(method, drafter=_no_drafter()) as base:
        return base


def _no_drafter():
    """A stand-in drafter whose config has none of DRAFTER_SWITCHES set."""
    return types.SimpleNamespace(
        config=types.SimpleNamespace(**{attribute: None for attribute, _, _ in DRAFTER_SWITCHES.values()}))


def variant_switches(method: str, drafter=None) -> dict:
    """Every switch's setting under a method variant ("BASE+FLAG" / "BASE-FLAG", flags may follow one another);
    the drafter switches as they would be set on `drafter` (a drafter whose config has none of them set if None)."""
    holder = drafter if drafter is not None else _no_drafter()
    with method_variant(method, drafter=holder):
        return switch_settings(holder)


def switch_settings(drafter=None) -> dict:
    """Every switch as the run used it, by attribute name (for the results); with `drafter`, its config's drafter
    switches too."""
    settings = {attribute: bool(getattr(importlib.import_module(module), attribute))
                for module, attribute, _ in SWITCHES.values()}
    if drafter is not None:
        settings.update({attribute: getattr(drafter.config, attribute, None)
                         for attribute, _, _ in DRAFTER_SWITCHES.values()})
    return settings


def tiny_pair_setup(prompts: int, block_size: int | None = None):
    """The CPU strategy benchmarks' common start: the shipped tiny pair (the drafter's block size overridden by
    `block_size` if given), `prompts` held-out prompts as token ids, C(w) calibrated on them in this process, and
    HybridSpec settings with that calibration and the shipped acceptance estimator (fitted on training-split traces
    by acceptance_traces.py, where it exists). Returns (target, drafter, prompts, latency model, settings)."""
    from hybridspec_hf import HybridSpecConfig
    from hybridspec_hf.generation.calibration import calibrate_latency
    from hybridspec_hf.tiny_pair import ASSETS_DIR, heldout_prompts, load_tiny_pair

    target, drafter, tokenizer = load_tiny_pair()
    if block_size:
        drafter.config.block_size = block_size
    ids = [tokenizer(t, return_tensors="pt").input_ids for t in heldout_prompts(prompts)]
    latency = calibrate_latency(target, drafter, context_lens=(64, 256), repeats=3, prompt_ids=torch.cat(ids, 1))
    fitted = ASSETS_DIR / "acceptance_estimator.json"
    settings = HybridSpecConfig(latency_model=latency, acceptance_estimator=str(fitted) if fitted.exists() else None)
    return target, drafter, ids, latency, settings


def environment() -> dict:
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def results_path(name: str) -> Path:
    """Where a results name's files go (no suffix): a bare stem ("batch_b1") under benchmarks/results; a path under
    benchmarks/results as earlier commands wrote it ("benchmarks/results/batch_b1", from any folder) there too; any
    other path where it says (relative to the current folder). A .json / .md suffix is dropped."""
    path = Path(name)
    if path.suffix in (".json", ".md"):
        path = path.with_suffix("")
    if len(path.parts) == 1 or (not path.is_absolute() and path.parent.parts[-2:] == ("benchmarks", "results")):
        return RESULTS / path.name
    return path.resolve()


def read_json(path: str | Path):
    """A results JSON, plain or gzip-compressed: "x.json.gz" is read through gzip, and a "x.json" that is not there
    is read from "x.json.gz" beside it (results over 100 KB are committed compressed: the GPU machine takes at most
    64 MiB of working tree a call)."""
    path = Path(path)
    if not path.exists() and path.suffix == ".json" and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as handle:
            return json.load(handle)
    return json.loads(path.read_text())


COMPRESS_OVER = 100_000  # characters of JSON: larger results are written gzip-compressed (read them with read_json)


def write_results(name: str, payload: dict, table: str) -> None:
    """<name>.md (title, environment, notes, table) and the payload as <name>.json, or as <name>.json.gz when its
    text passes COMPRESS_OVER characters (traces: the GPU machine takes at most 64 MiB of working tree a call, and
    tests/test_repo_size.py keeps the tracked files under it); the other form of the name is removed."""
    stem = results_path(name)
    stem.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2, default=str) + "\n"
    plain, packed = stem.with_name(f"{stem.name}.json"), stem.with_name(f"{stem.name}.json.gz")
    if len(text) > COMPRESS_OVER:
        with gzip.open(packed, "wt", compresslevel=9) as handle:
            handle.write(text)
        plain.unlink(missing_ok=True)
    else:
        plain.write_text(text)
        packed.unlink(missing_ok=True)
    env = payload["environment"]
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    stem.with_name(f"{stem.name}.md").write_text(f"# {payload['title']}\n\n{header}\n\n{payload.get('notes', '')}\n\n{table}\n")


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn() in a CUDA graph, after one eager call on a side stream (which also compiles Triton kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, per_replay: int, replays: int = 40) -> dict:
    """Median (p10, p90) over `replays` timed replays, µs per unit (per_replay units per replay), after 20 untimed."""
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) * 1e3 / per_replay for start, end in events)
    last = len(times) - 1  # nearest-rank percentiles, valid for any number of replays (smoke runs time one)
    return dict(median_us=statistics.median(times), p10_us=times[round(0.1 * last)], p90_us=times[round(0.9 * last)],
                replays=replays)


def traced_kernels(replay, n: int) -> list[dict]:
    """Kernels (and memcpy/memset) traced while replay() runs n times: [{name, us, ts}] (ts: start, µs)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():  # the CPU twin runs eagerly: nothing to trace (the harness's own check)
        for _ in range(n):
            replay()
        return []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
        prof.export_chrome_trace(handle.name)
        events = json.loads(Path(handle.name).read_text())["traceEvents"]
    return [{"name": e["name"], "us": float(e.get("dur", 0.0)), "ts": float(e.get("ts", 0.0))} for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def timeline(kernels: list[dict], n: int) -> dict:
    """The middle one of n traced replays in launch order: [name, start µs from the replay's first kernel, µs], and
    the spans outside our kernels (before the first, after the last: the step's bookkeeping and the LM head), the
    other kernels between them by name. Empty on a CPU (nothing traced)."""
    if not kernels:
        return {"kernels": [], "head_us": 0.0, "tail_us": 0.0, "between": {}}
    per = len(kernels) // n
    replay = sorted(kernels, key=lambda k: k["ts"])[(n // 2) * per: (n // 2 + 1) * per]
    start = replay[0]["ts"]
    rows = [[k["name"][:80], round(k["ts"] - start, 2), round(k["us"], 2)] for k in replay]
    ours = [i for i, k in enumerate(replay) if re.fullmatch(r"_\w+_kernel", k["name"])]
    if not ours:
        return {"kernels": rows, "head_us": 0.0, "tail_us": 0.0, "between": {}}
    first, last = ours[0], ours[-1]
    end = max(k["ts"] + k["us"] for k in replay)
    between = collections.Counter(k["name"][:80] for k in replay[first:last] if not re.fullmatch(r"_\w+_kernel",
                                                                                              k["name"]))
    return {"kernels": rows, "head_us": replay[first]["ts"] - start, "head_kernels": first,
            "tail_us": end - (replay[last]["ts"] + replay[last]["us"]), "tail_kernels": len(replay) - 1 - last,
            "between": dict(between)}


def frontier(t: dict) -> dict:
    """µs by which each kernel (by name) moves the replay's completion frontier: its end less the latest end of the
    kernels before it (0 for a kernel that ends before another already running). With PDL kernels overlap, so
    durations double-count; this charges every µs of the replay to exactly one kernel (the sum is the trace's span),
    the one whose completion the GPU was waiting for. {name: {kernels, us}}, and "total"."""
    table = collections.defaultdict(lambda: [0, 0.0])
    front = None
    for name, start, us in t["kernels"]:
        end = start + us
        table[name][0] += 1
        table[name][1] += max(0.0, end - (start if front is None else front))
        front = end if front is None else max(front, end)
    ordered = sorted(table.items(), key=lambda kv: -kv[1][1])
    rows = {name: {"kernels": c, "us": round(us, 2)} for name, (c, us) in ordered}
    return {"by_kernel": rows, "total": round(sum(r["us"] for r in rows.values()), 2)}
