"""GDN verify + commit at Qwen3.5-35B-A3B shapes: ours vs the default verifier vs fla's chunk kernel (what HF runs).

Shapes: 30 GDN layers, H = 16 key heads, HV = 32 value heads, dk = dv = 128, fp32 state, bf16 q/k/v/beta,
fp32 g, conv state [B, 8192, 4] bf16; batch 1 and 8; w = 2, 4, 8, 16; random inputs.
Every figure is the median over many replays of one CUDA graph per shape that runs the step for all 30 layers on
each of several input sets in turn (sets together larger than the L2), divided by the number of sets run.

Methods side by side: "ours" (gdn_triton.py's verify and one-launch commit at the code defaults: dk slices, fp32
dots, forward substitution) and "default" (per-token states + copy, default_verifier.py). The w = 1 table is a plain
decoding step: `gdn_decode_step` (one recurrent step in place) against verify(w = 1) + commit, and the whole GDN
step between the projections and out_proj: today's four launches (conv_silu with the window roll, gdn_gates,
gdn_decode_step, gated_rms_norm) against `gdn_step_triton.gdn_step` (one launch with BV = dv and the norm inside;
with a smaller BV the norm is a second launch), every STEP_FUSED_VARIANTS config of it.

    python benchmarks/gdn_kernels.py --out DIR [--sweep] [--fla] [--check] [--step-only]

`--step-only`: only the w = 1 table (with --check: the fused step against the four launches on the GPU first).

Writes DIR/gdn_kernels.json and DIR/gdn_kernels.md. `--sweep` times tile sizes / warps of the default verifier at
w = 4 and 16 and of the decode step at w = 1 first and runs the main table with the fastest. `--fla-worker` is the
isolated fla timing (a subprocess: fla once hit an illegal memory access when one process captured many shapes).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "hybridspec_hf" not in sys.modules:
    # kernels/ is a leaf (torch + triton): load it without the package __init__ (the transformers integration), so
    # the benchmark runs from a bare source checkout on the GPU image
    _package = types.ModuleType("hybridspec_hf")
    _package.__path__ = [os.path.join(REPO, "hybridspec_hf")]
    sys.modules["hybridspec_hf"] = _package

from common import capture, time_graph  # noqa: E402

from hybridspec_hf.kernels import gdn_torch as ref  # noqa: E402
from hybridspec_hf.kernels.default_verifier import (  # noqa: E402
    DefaultVerifyResult,
    PendingDefaultLayer,
    commit_default_states_triton,
    default_verify_triton,
    gdn_decode_step,
)
from hybridspec_hf.kernels.gdn_prologue_triton import conv_silu, gdn_gates  # noqa: E402
from hybridspec_hf.kernels.gdn_step_triton import gdn_step  # noqa: E402
from hybridspec_hf.kernels.gdn_triton import (  # noqa: E402
    GDNVerifyResult,
    PendingGDNLayer,
    commit_gdn_states_triton,
    gdn_verify_triton,
)
from hybridspec_hf.kernels.norm_triton import gated_rms_norm  # noqa: E402

LAYERS, H, HV, DK, DV, CONV_K = 30, 16, 32, 128, 128, 4
CONV_DIM = 2 * H * DK + HV * DV  # 8192
L2_BYTES = 60e6
DEV = "cuda"


# ----------------------------------------------------------------------------------------------------------------
# inputs


def make_layer(batch: int, w: int, gen: torch.Generator) -> dict:
    """One GDN layer's verification inputs and caches (random, realistic ranges)."""
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    a_log = torch.rand(HV, generator=gen, device=DEV) * 2.77  # A ~ U(1, 16)
    g = -a_log.exp() * torch.nn.functional.softplus(randn(batch, w, HV, dtype=torch.float32) - 2.0)
    conv_input = randn(batch, w, CONV_DIM).transpose(1, 2)  # [B, C, T] view, as transformers hands it over
    # the whole step's inputs: column slices of one projection output [B, w, C + HV·dv + 2·HV] (the GEMM's layout)
    x, z, b, a = randn(batch, w, CONV_DIM + HV * DV + 2 * HV).split([CONV_DIM, HV * DV, HV, HV], dim=-1)
    return dict(
        q=randn(batch, w, H, DK), k=randn(batch, w, H, DK), v=randn(batch, w, HV, DV), g=g,
        beta=randn(batch, w, HV, dtype=torch.float32).sigmoid().to(torch.bfloat16),
        state=randn(batch, HV, DK, DV, dtype=torch.float32) * 0.05,
        conv_state=randn(batch, CONV_DIM, CONV_K), conv_input=conv_input,
        x=x, z=z.reshape(batch, w, HV, DV), b=b, a=a, conv_weight=randn(CONV_DIM, CONV_K) * 0.5, A_log=a_log,
        dt_bias=randn(HV), norm_weight=1.0 + 0.1 * randn(DV),
    )


class InputSet:
    """All layers of one input set plus every approach's scratch for it."""

    def __init__(self, batch: int, w: int, gen: torch.Generator, default_buffer: bool = True):
        self.batch, self.w = batch, w
        self.layers = [make_layer(batch, w, gen) for _ in range(LAYERS)]
        self.num_committed = torch.full((batch,), w, dtype=torch.int32, device=DEV)
        self.ours = [GDNVerifyResult(
            out=torch.empty(batch, w, HV, DV, dtype=torch.bfloat16, device=DEV),
            z=torch.empty(batch, HV, w, DV, device=DEV), g_cum=torch.empty(batch, HV, w, device=DEV),
        ) for _ in range(LAYERS)]
        self.pending = [PendingGDNLayer(x["state"], x["conv_state"], x["conv_input"], x["k"], r)
                        for x, r in zip(self.layers, self.ours)]
        self.buffer = torch.empty(LAYERS, batch, w, HV, DK, DV, device=DEV) if default_buffer else None
        self.default_pending = None
        self.valid = None  # [B] int32: the valid tokens of a max-shape window (`bench_max_shape`), else all

    def set_accepted(self, mode: str, gen: torch.Generator) -> list[int]:
        if mode == "all":
            m = torch.full((self.batch,), self.w, dtype=torch.int32)
        else:  # rejection at a random position: m uniform in 1..w
            m = torch.randint(1, self.w + 1, (self.batch,), generator=gen, device=DEV, dtype=torch.int32).cpu()
        self.num_committed.copy_(m)
        return m.tolist()


def ours_verify(s: InputSet, **cfg) -> None:
    for x, r in zip(s.layers, s.ours):
        gdn_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], valid_len=s.valid, outputs=r,
                          **cfg.get("verify", {}))


def ours_commit(s: InputSet, **cfg) -> None:
    commit_gdn_states_triton(s.pending, s.num_committed, **cfg.get("commit", {}))


def default_verify_all(s: InputSet, **cfg) -> None:
    results = []
    for i, x in enumerate(s.layers):
        results.append(default_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], s.buffer[i],
                                             valid_len=s.valid, **cfg.get("default", {})))
    if s.default_pending is None:  # the per-token state views are static: build once (outside any capture)
        s.default_pending = [PendingDefaultLayer(x["state"], x["conv_state"], x["conv_input"],
                                                 DefaultVerifyResult(out=r.out, states=r.states))
                             for x, r in zip(s.layers, results)]


def default_commit(s: InputSet, **cfg) -> None:
    commit_default_states_triton(s.default_pending, s.num_committed)


def ours_step(s: InputSet, **cfg) -> None:
    """A plain decoding step (w = 1): one recurrent step per layer, each state updated in place."""
    for x in s.layers:
        gdn_decode_step(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], **cfg.get("step", {}))


def four_launches_step(s: InputSet, **cfg) -> None:
    """The GDN step between projections and out_proj as the fused route runs it today, per layer: conv_silu (window
    rolled in place), gdn_gates, gdn_decode_step (state in place), gated_rms_norm."""
    for x in s.layers:
        four_launches(x, **cfg.get("step", {}))


def four_launches(x: dict, **step_cfg) -> torch.Tensor:
    batch = x["x"].shape[0]
    mixed = conv_silu(x["conv_state"], x["x"], x["conv_weight"], None, roll_state=True)
    g, beta = gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    q, k, v = torch.split(mixed, [H * DK, H * DK, HV * DV], dim=-1)
    out = gdn_decode_step(q.view(batch, 1, H, DK), k.view(batch, 1, H, DK), v.view(batch, 1, HV, DV), g, beta,
                          x["state"], **step_cfg)
    return gated_rms_norm(out, x["z"], x["norm_weight"], 1e-6)


def fused_step(s: InputSet, **cfg) -> None:
    """The same step by `gdn_step`: one launch per layer (two with block_v < dv)."""
    for x in s.layers:
        one_launch(x, **cfg.get("fused_step", {}))


def one_launch(x: dict, **fused_cfg) -> torch.Tensor:
    return gdn_step(x["x"], x["conv_state"], x["conv_weight"], None, x["a"], x["b"], x["A_log"], x["dt_bias"],
                    x["state"], x["z"], x["norm_weight"], 1e-6, H, **fused_cfg)


def check_fused_step(gen: torch.Generator) -> dict:
    """`gdn_step` (every variant) against the four launches on the GPU: three steps in a row from the same caches;
    the worst relative error of y (over its largest magnitude) and of the state, and whether the rolled conv
    windows are identical."""
    result = {}
    for batch in (1, 3):
        layer = make_layer(batch, 1, gen)
        layer["state"] = layer["state"] * 20
        tokens = [make_layer(batch, 1, gen) for _ in range(3)]

        def run(fn, **kw):
            x = dict(layer, state=layer["state"].clone(), conv_state=layer["conv_state"].clone())
            outs = []
            for t in tokens:
                x.update(x=t["x"], z=t["z"], a=t["a"], b=t["b"])
                outs.append(fn(x, **kw))
            return outs, x["state"], x["conv_state"]

        ref_outs, ref_state, ref_window = run(four_launches)
        for name, kw in STEP_FUSED_VARIANTS.items():
            outs, state, window = run(one_launch, **kw)
            result[f"b{batch}/{name}"] = dict(
                y=max(((o.double() - r.double()).abs().max() / r.double().abs().max()).item()
                      for o, r in zip(outs, ref_outs)),
                state=rel(state, ref_state), window_equal=bool(torch.equal(window, ref_window)))
    return result


def total_step(verify, commit):
    def step(s: InputSet, **cfg) -> None:
        verify(s, **cfg)
        commit(s, **cfg)
    return step


# ----------------------------------------------------------------------------------------------------------------
# timing


def time_step(sets: list[InputSet], body, repeat: int, **cfg) -> dict:
    """One graph: `body` on every set in turn, `repeat` times; µs per call (all 30 layers of one set)."""
    def run():
        for _ in range(repeat):
            for s in sets:
                body(s, **cfg)
    graph = capture(run)
    result = time_graph(graph, repeat * len(sets))
    del graph
    return result


def copy_bandwidth() -> dict:
    """Device-to-device copy, bytes read + written per second (the memory ceiling for the rooflines). Buffers of
    256 Mi and 128 Mi fp32 elements (1 GiB / 512 MiB: 32-bit indexing), the faster one."""
    best = None
    for n in (1 << 28, 1 << 27):
        src = torch.randn(n, device=DEV)
        dst = torch.empty_like(src)
        graph = capture(lambda: dst.copy_(src))
        for _ in range(200):  # clocks up from idle first
            graph.replay()
        t = time_graph(graph, 1, replays=50)
        result = dict(TBps=2 * n * 4 / (t["median_us"] * 1e-6) / 1e12, bytes=2 * n * 4, **t)
        best = result if best is None or result["TBps"] > best["TBps"] else best
        del src, dst, graph
    return best


def n_sets_for(batch: int, w: int) -> int:
    """Enough sets that consecutive steps never find their state in L2 (>= 3x L2 of state in rotation)."""
    state_bytes = LAYERS * batch * HV * DK * DV * 4
    return max(2, min(4, int(3 * L2_BYTES // state_bytes) + 1))


# ----------------------------------------------------------------------------------------------------------------
# bytes (fewest moved: each input read once, each output written once) and memory


def bytes_model(batch: int, w: int, m: list[int]) -> dict:
    state = HV * DK * DV * 4
    committed = sum(1 for x in m if x > 0)
    inputs = w * (2 * H * DK * 2 + HV * DV * 2 + HV * 4 + HV * 2)  # q, k, v bf16; g fp32; beta bf16
    verify_common = batch * (state + inputs + w * HV * DV * 2)  # + out bf16
    ours_verify = verify_common + batch * HV * w * (DV + 1) * 4  # + z, g_cum
    conv = sum(2 * CONV_DIM * CONV_K * 2 + CONV_DIM * x * 2 for x in m if x > 0)
    ours_commit = committed * 2 * state + sum(x * (H * DK * 2 + HV * (DV + 1) * 4) for x in m) + conv
    default_verify = verify_common + batch * w * state
    default_commit = committed * 2 * state + conv
    return {name: LAYERS * b for name, b in dict(
        ours_verify=ours_verify, ours_commit=ours_commit, ours_total=ours_verify + ours_commit,
        default_verify=default_verify, default_commit=default_commit, default_total=default_verify + default_commit,
    ).items()}


def extra_memory_mib(batch: int, w: int) -> dict:
    """Scratch each approach keeps between verify and commit (the outputs o are needed by both)."""
    return dict(ours=LAYERS * batch * HV * w * (DV + 1) * 4 / 2**20,
                default=LAYERS * batch * w * HV * DK * DV * 4 / 2**20)


# ----------------------------------------------------------------------------------------------------------------
# correctness on the GPU (compiled kernels; the CPU tests run the interpreter)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_correctness(cfg: dict, gen: torch.Generator) -> dict:
    """Real head sizes, grouped heads, bf16 inputs; every prefix m = 0..16 against the float64 recurrence.
    cfg: a method's {"verify": gdn_verify_triton keywords, "commit": commit_gdn_states_triton keywords}."""
    batch, w = 17, 16
    x = make_layer(batch, w, gen)
    x["state"] = x["state"] * 20  # a state of norm ~1 per column
    out64, states64 = ref.gdn_recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    res = gdn_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], **cfg["verify"])
    verify64 = ref.gdn_verify(*(x[n].double() for n in ("q", "k", "v", "g", "beta", "state")))
    m = torch.arange(batch, dtype=torch.int32, device=DEV)  # request b commits m = b
    state = x["state"].clone()
    commit_gdn_states_triton([PendingGDNLayer(state, x["conv_state"].clone(), x["conv_input"], x["k"], res)], m,
                             **cfg["commit"])
    s_err = max(rel(state[b], states64[b, b - 1] if b else x["state"][b]) for b in range(batch))
    fp32_cfg = {k: v for k, v in cfg["verify"].items() if k != "precision"}  # fp32 q/k take an fp32 precision
    fp32 = gdn_verify_triton(*(x[n].float() for n in ("q", "k", "v", "g", "beta", "state")), **fp32_cfg)
    step_state = x["state"].clone()
    step_out = gdn_decode_step(x["q"][:, :1], x["k"][:, :1], x["v"][:, :1], x["g"][:, :1], x["beta"][:, :1],
                               step_state)
    return dict(
        out_vs_recurrence64=rel(res.out.float(), out64.float()),  # includes the bf16 rounding of out
        out_fp32_vs_recurrence64=rel(fp32.out, out64),  # the kernel's own arithmetic
        z_vs_fp64=rel(res.z, verify64.z), state_every_m_vs_recurrence64=s_err,
        decode_step_out_vs_recurrence64=rel(step_out.float(), out64[:, :1].float()),
        decode_step_state_vs_recurrence64=rel(step_state, states64[:, 0]),
    )


def check_default(gen: torch.Generator) -> dict:
    """The default verifier on the same kind of inputs (its per-token states and the copied S_m)."""
    batch, w = 17, 16
    x = make_layer(batch, w, gen)
    x["state"] = x["state"] * 20
    out64, states64 = ref.gdn_recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    m = torch.arange(batch, dtype=torch.int32, device=DEV)
    buffer = torch.empty(batch, w, HV, DK, DV, device=DEV)
    dres = default_verify_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"], buffer)
    dstate = x["state"].clone()
    commit_default_states_triton([PendingDefaultLayer(dstate, x["conv_state"].clone(), x["conv_input"], dres)], m)
    d_err = max(rel(dstate[b], states64[b, b - 1] if b else x["state"][b]) for b in range(batch))
    return dict(default_out_vs_recurrence64=rel(dres.out.float(), out64.float()),
                default_states_vs_recurrence64=rel(dres.states, states64), default_commit_vs_recurrence64=d_err)


def drift(cfg: dict, rounds: int, gen: torch.Generator) -> dict:
    """verify -> commit rounds vs the float64 recurrence of the committed tokens. Each round is a 16-token max shape
    with a random valid_len w (one compiled kernel, as in a max-shape CUDA graph) and random m in 1..w."""
    batch, heads, v_heads, t = 2, 2, 4, 16
    state = torch.randn(batch, v_heads, DK, DV, generator=gen, device=DEV) * 0.5
    state64 = state.double()
    errors = []
    for _ in range(rounds):
        w = int(torch.randint(1, t + 1, (1,), generator=gen, device=DEV))
        q, k = (torch.randn(batch, t, heads, DK, generator=gen, device=DEV).bfloat16() for _ in range(2))
        v = torch.randn(batch, t, v_heads, DV, generator=gen, device=DEV).bfloat16()
        g = -torch.rand(batch, t, v_heads, generator=gen, device=DEV) * 0.5
        beta = torch.rand(batch, t, v_heads, generator=gen, device=DEV)
        m = torch.randint(1, w + 1, (batch,), generator=gen, device=DEV, dtype=torch.int32)
        valid = torch.full((batch,), w, dtype=torch.int32, device=DEV)
        res = gdn_verify_triton(q, k, v, g, beta, state, valid_len=valid, **cfg["verify"])
        conv = torch.randn(batch, 8, CONV_K, device=DEV)
        commit_gdn_states_triton([PendingGDNLayer(state, conv, torch.randn(batch, 8, t, device=DEV), k, res)], m,
                                 **cfg["commit"])
        _, states64 = ref.gdn_recurrence(q[:, :w], k[:, :w], v[:, :w], g[:, :w], beta[:, :w], state64)
        state64 = states64[torch.arange(batch, device=DEV), m.long() - 1]
        errors.append(rel(state, state64))
    return dict(rounds=rounds, max_rel=max(errors), final_rel=errors[-1], first_rel=errors[0])


# ----------------------------------------------------------------------------------------------------------------
# sweeps and the main table

METHODS = {  # {"kernel": ours_verify's kernel, "verify": its keywords, "commit": commit_gdn_states_triton keywords}
    "ours": dict(verify={}, commit={}),  # the code defaults (the shipped kernels: kernel "auto")
    "block": dict(verify=dict(kernel="block"), commit={}),  # the block form at every w
    # the verify token by token (z and G out, no state per token) + the same commit; --sweep: its fastest tiles
    "recurrent": dict(verify=dict(kernel="recurrent"), commit={}),
}


def bench_shape(batch: int, w: int, cfgs: dict, gen: torch.Generator, modes=("all", "random")) -> list[dict]:
    """One shape, every method: cfgs = {method: cfg} for ours plus "default": {"default": default_verify keywords}."""
    sets = [InputSet(batch, w, gen) for _ in range(n_sets_for(batch, w))]
    ours = {name: cfg for name, cfg in cfgs.items() if name != "default"}
    for s in sets:  # warm: JIT for this T, pointer tables, per-token views
        for cfg in ours.values():
            ours_verify(s, **cfg)
            ours_commit(s, **cfg)
        default_verify_all(s, **cfgs["default"])
        default_commit(s)
    torch.cuda.synchronize()
    repeat = 2
    verify = {name: time_step(sets, ours_verify, repeat, **cfg) for name, cfg in ours.items()}
    verify["default"] = time_step(sets, default_verify_all, repeat, **cfgs["default"])
    rows = []
    for mode in modes:
        ms = [s.set_accepted(mode, gen) for s in sets]
        commit = {name: time_step(sets, ours_commit, repeat, **cfg) for name, cfg in ours.items()}
        commit["default"] = time_step(sets, default_commit, repeat)
        both = total_step(ours_verify, ours_commit)
        total = {name: time_step(sets, both, repeat, **cfg) for name, cfg in ours.items()}
        total["default"] = time_step(sets, total_step(default_verify_all, default_commit), repeat, **cfgs["default"])
        rows.append(dict(batch=batch, w=w, accept=mode, m_first_set=ms[0], n_sets=len(sets),
                         verify_us={k: v["median_us"] for k, v in verify.items()},
                         commit_us={k: v["median_us"] for k, v in commit.items()},
                         total_us={k: v["median_us"] for k, v in total.items()},
                         spread=dict(verify=verify, commit=commit, total=total),
                         bytes=bytes_model(batch, w, ms[0]), extra_memory_MiB=extra_memory_mib(batch, w)))
    del sets
    torch.cuda.empty_cache()
    return rows


def bench_max_shape(batch: int, windows, cfgs: dict, gen: torch.Generator) -> dict:
    """The verify as resident rounds run it: one 16-token graph whose valid_len says how many tokens count (the
    block form's cost is that of 16 tokens; the recurrent one's loop stops at the valid ones). µs of 30 layers'
    verify per method (no commit), {f"w{w}": {method: µs}}."""
    sets = [InputSet(batch, 16, gen) for _ in range(n_sets_for(batch, 16))]
    methods = {name: cfg for name, cfg in cfgs.items() if name != "default"}
    result = {}
    for w in windows:
        for s in sets:
            s.valid = torch.full((batch,), w, dtype=torch.int32, device=DEV)
            for cfg in methods.values():
                ours_verify(s, **cfg)
            default_verify_all(s, **cfgs["default"])
        torch.cuda.synchronize()
        row = {name: time_step(sets, ours_verify, 2, **cfg)["median_us"] for name, cfg in methods.items()}
        row["default"] = time_step(sets, default_verify_all, 2, **cfgs["default"])["median_us"]
        result[f"w{w}"] = row
        print(f"b{batch} max-shape w{w}", {k: round(v, 1) for k, v in row.items()}, flush=True)
    del sets
    torch.cuda.empty_cache()
    return result


def bench_decode_step(batch: int, cfgs: dict, gen: torch.Generator) -> dict:
    """w = 1, m = 1 (a plain decoding step's GDN work for 30 layers): `gdn_decode_step` in place against each
    verifier's verify(w = 1) + commit (which also rolls the conv window; the step's conv roll rides in conv_silu)."""
    sets = [InputSet(batch, 1, gen) for _ in range(n_sets_for(batch, 1))]
    for s in sets:
        s.set_accepted("all", gen)
        ours_step(s, **cfgs["ours"])
        for name, cfg in cfgs.items():
            if name != "default":
                total_step(ours_verify, ours_commit)(s, **cfg)
        total_step(default_verify_all, default_commit)(s, **cfgs["default"])
    torch.cuda.synchronize()
    result = {"decode_step": time_step(sets, ours_step, 2, **cfgs["ours"])["median_us"]}
    result["four_launches"] = time_step(sets, four_launches_step, 2, **cfgs["ours"])["median_us"]
    result["fused_step"] = {}
    for name, kw in STEP_FUSED_VARIANTS.items():
        cfg = {"fused_step": kw}
        for s in sets:
            fused_step(s, **cfg)
        result["fused_step"][name] = time_step(sets, fused_step, 2, **cfg)["median_us"]
    both = total_step(ours_verify, ours_commit)
    for name, cfg in cfgs.items():
        if name != "default":
            result[f"{name}_verify_commit"] = time_step(sets, both, 2, **cfg)["median_us"]
    result["default_verify_commit"] = time_step(sets, total_step(default_verify_all, default_commit), 2,
                                                **cfgs["default"])["median_us"]
    del sets
    torch.cuda.empty_cache()
    return result


def step_only(batch: int, gen: torch.Generator) -> dict:
    """The w = 1 table without the verifiers: gdn_decode_step alone, the four launches, every gdn_step variant."""
    sets = [InputSet(batch, 1, gen, default_buffer=False) for _ in range(n_sets_for(batch, 1))]
    for s in sets:
        ours_step(s)
        four_launches_step(s)
    torch.cuda.synchronize()
    result = {"decode_step": time_step(sets, ours_step, 2)["median_us"],
              "four_launches": time_step(sets, four_launches_step, 2)["median_us"], "fused_step": {}}
    for name, kw in STEP_FUSED_VARIANTS.items():
        cfg = {"fused_step": kw}
        for s in sets:
            fused_step(s, **cfg)
        result["fused_step"][name] = time_step(sets, fused_step, 2, **cfg)["median_us"]
    del sets
    torch.cuda.empty_cache()
    return result


DEFAULT_VARIANTS = {  # default_verify_triton keywords
    "bv8_w1": dict(block_v=8, num_warps=1),
    "bv16_w2": dict(block_v=16, num_warps=2),
    "bv32_w4": dict(block_v=32, num_warps=4),
}
STEP_VARIANTS = {  # gdn_decode_step keywords (w = 1 only)
    "bv8_w1": dict(block_v=8, num_warps=1),
    "bv16_w2": dict(block_v=16, num_warps=2),
    "bv16_w4": dict(block_v=16, num_warps=4),
    "bv32_w4": dict(block_v=32, num_warps=4),
}
STEP_FUSED_VARIANTS = {  # gdn_step keywords: bv128 = one launch (norm inside), smaller BV = + the norm's launch
    "bv128_w4": dict(block_v=128, num_warps=4),
    "bv128_w8": dict(block_v=128, num_warps=8),  # the default (step_config)
    "bv128_w16": dict(block_v=128, num_warps=16),
    "bv64_w4+norm": dict(block_v=64, num_warps=4),
    "bv32_w4+norm": dict(block_v=32, num_warps=4),
    "bv16_w2+norm": dict(block_v=16, num_warps=2),
    "bv8_w1+norm": dict(block_v=8, num_warps=1),
}
# gdn_verify_triton keywords. Runs 4-8 (gdn_kernels_gpu_runs.md) also timed, in options since removed, the dk loop
# unrolled (3.2-6.3 ms: its FMA dots spill), a block-doubling solve (226.6 µs against 226.8 at w = 4), a commit
# program per state slice (83-164 µs against 60) and the state commit folded into the next verify (+33 µs a round)
VERIFY_VARIANTS = {
    "block_bv32_bk32_w4": dict(kernel="block", block_v=32, block_k=32, num_warps=4),
    "recurrent_bv8_w1": dict(kernel="recurrent", block_v=8, num_warps=1),
    "recurrent_bv16_w2": dict(kernel="recurrent", block_v=16, num_warps=2),
    "recurrent_bv16_w4": dict(kernel="recurrent", block_v=16, num_warps=4),
    "recurrent_bv32_w4": dict(kernel="recurrent", block_v=32, num_warps=4),
}
KINDS = (("default", DEFAULT_VARIANTS, default_verify_all), ("verify", VERIFY_VARIANTS, ours_verify))


def sweep(gen: torch.Generator, batches, windows) -> dict:
    """Every variant above on 30-layer graphs, all drafts accepted: {shape: {kind/variant: µs}}; the decode step
    at w = 1."""
    out = {}
    for batch in batches:
        for w in [*windows, 1]:
            sets = [InputSet(batch, w, gen) for _ in range(n_sets_for(batch, w))]
            key = f"b{batch}_w{w}"
            out[key] = {}
            kinds = (("step", STEP_VARIANTS, ours_step),) if w == 1 else KINDS
            for kind, variants, step in kinds:
                for name, kw in variants.items():
                    c = {kind: kw}
                    try:
                        for s in sets:
                            step(s, **c)
                        out[key][f"{kind}/{name}"] = time_step(sets, step, 2, **c)["median_us"]
                    except Exception as e:  # a variant that fails to build must not end the run
                        out[key][f"{kind}/{name}"] = float("inf")
                        print("variant failed", kind, name, repr(e)[-1500:], flush=True)
            print(key, json.dumps({k: round(v, 1) for k, v in out[key].items()}), flush=True)
            del sets
            torch.cuda.empty_cache()
    return out


def best_config(sweep_result: dict, batch: int) -> dict:
    """Per batch: the fastest default verifier (summed over the swept windows) and decode step; ours keeps the code
    defaults."""
    def fastest(kind: str, names: list[str], shapes: list[str]) -> dict:
        return dict(VARIANTS[kind][min(names, key=lambda n: sum(sweep_result[s][f"{kind}/{n}"] for s in shapes))])

    shapes = [k for k in sweep_result if k.startswith(f"b{batch}_") and k != f"b{batch}_w1"]
    ours = dict(METHODS["ours"], step=fastest("step", list(STEP_VARIANTS), [f"b{batch}_w1"]))
    recurrent = [name for name in VERIFY_VARIANTS if name.startswith("recurrent")]
    return dict(ours=ours, block=METHODS["block"],
                recurrent=dict(verify=fastest("verify", recurrent, shapes), commit={}),
                default=dict(default=fastest("default", list(DEFAULT_VARIANTS), shapes)))


VARIANTS = dict(default=DEFAULT_VARIANTS, step=STEP_VARIANTS, verify=VERIFY_VARIANTS)


# ----------------------------------------------------------------------------------------------------------------
# fla (isolated process)


def fla_worker(batches, windows, out_path: str) -> None:
    """fla 0.6.0 chunk_gated_delta_rule for 30 layers, as transformers calls it (q/k repeated to HV heads,
    l2norm in kernel, initial state in, final state out). Warm every shape before any capture."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator(device=DEV).manual_seed(7)
    shapes = [(b, w) for b in batches for w in windows]
    inputs = {}
    for b, w in shapes:
        sets = []
        for _ in range(n_sets_for(b, w)):
            layers = []
            for _ in range(LAYERS):
                x = make_layer(b, w, gen)
                x["q"] = x["q"].repeat_interleave(HV // H, dim=2)
                x["k"] = x["k"].repeat_interleave(HV // H, dim=2)
                layers.append(x)
            sets.append(layers)
        inputs[(b, w)] = sets

    def step(layers):
        for x in layers:
            chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["state"],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)

    for shape in shapes:  # autotune / JIT everything first
        for layers in inputs[shape]:
            step(layers)
    torch.cuda.synchronize()
    results = {}
    for shape in shapes:
        sets = inputs[shape]

        def run():
            for layers in sets:
                step(layers)
        try:
            graph = capture(run)
            results[f"b{shape[0]}_w{shape[1]}"] = time_graph(graph, len(sets), replays=20)["median_us"]
            del graph
        except Exception as e:  # record and go on: one shape's failure must not lose the others
            results[f"b{shape[0]}_w{shape[1]}"] = f"error: {e!r}"[:300]
        json.dump(results, open(out_path, "w"), indent=1)
        print("fla", shape, results[f"b{shape[0]}_w{shape[1]}"], flush=True)


def run_fla(batches, windows, out_dir: str, timeout: int) -> dict:
    path = os.path.join(out_dir, "fla_chunk.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--fla-worker", path, "--batches", *map(str, batches),
           "--windows", *map(str, windows)]
    try:
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        status = f"rc={proc.returncode}" + ("" if proc.returncode == 0 else f" {proc.stderr[-1500:]}")
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout} s"
    results = json.load(open(path)) if os.path.exists(path) else {}
    try:
        import fla
        version = fla.__version__
    except Exception as e:  # noqa: BLE001
        version = f"not importable: {e!r}"
    return dict(status=status, version=version, us=results)


# ----------------------------------------------------------------------------------------------------------------
# report


NOMINAL_COPY_TBPS = 4.25  # H200 device-to-device copy measured in earlier sessions


GOALS = {4: 2.0, 16: 4.0}  # issue 12: verify + commit at least this many times faster than the default (batch 1)


def markdown(report: dict) -> str:
    bw = report["copy_bandwidth"]["TBps"]
    fla = report.get("fla", {})
    lines = [
        f"# GDN verify + commit, Qwen3.5-35B-A3B shapes ({report['gpu']}, {report['date']})",
        "",
        f"torch {report['torch']}, triton {report['triton']}, fla {fla.get('version', 'not run')} "
        f"({fla.get('status', '')}); {report['inputs']} inputs; command `{report['command']}`.",
        f"Copy bandwidth measured in this run: {bw:.2f} TB/s (read + write); rooflines are given at it and at "
        f"{NOMINAL_COPY_TBPS} TB/s.",
        f"Configs (per batch): `{json.dumps(report.get('config', {}))}`.",
        "",
        "All 30 GDN layers per figure, µs: median of CUDA-graph replays over rotating input sets. 'ours' = the shipped "
        "verify + one-launch commit at the code defaults (kernel 'auto': windows of up to RECURRENT_UPTO valid tokens "
        "token by token, longer ones in the block form); 'block' = the block verify (one launch per layer, dk in "
        "slices) at every w + the commit; 'recurrent' = "
        "the verify token by token with the state tile in registers, writing the block form's Z and G and no state "
        "per token (`gdn_verify_triton(kernel='recurrent')`), + the same commit. 'default' = token-by-token verify "
        "storing S per token + one-launch copy of the accepted one; fla = "
        "`chunk_gated_delta_rule` (verify only, what transformers runs; it has no commit). accept 'random' = m "
        "uniform in 1..w per request. Goal (issue 12, batch 1): default / ours >= 2 at w = 4, >= 4 at w = 16 (the "
        "goal cell judges the best of our methods).",
        "",
    ]
    methods = [name for name in report["rows"][0]["total_us"] if name != "default"] if report["rows"] else []
    lines += [
        "| B | w | accept | " + " | ".join(f"{n} verify | {n} commit | {n} total | default / {n}" for n in methods)
        + " | default verify | default commit | default total | goal | fla chunk |",
        "|" + "---|" * (3 + 4 * len(methods) + 5),
    ]
    for r in report["rows"]:
        v, c, t = r["verify_us"], r["commit_us"], r["total_us"]
        f = fla.get("us", {}).get(f"b{r['batch']}_w{r['w']}")
        goal = GOALS.get(r["w"]) if r["batch"] == 1 else None
        best = max(t["default"] / t[n] for n in methods)
        goal_cell = "—" if goal is None else f"{goal:.0f}× {'met' if best >= goal else 'missed'}"
        cells = " | ".join(f"{v[n]:.1f} | {c[n]:.1f} | {t[n]:.1f} | {t['default'] / t[n]:.2f}×" for n in methods)
        lines.append(
            f"| {r['batch']} | {r['w']} | {r['accept']} | {cells} | "
            f"{v['default']:.1f} | {c['default']:.1f} | {t['default']:.1f} | "
            f"{goal_cell} | {f'{f:.1f}' if isinstance(f, float) else '—'} |"
        )
    for batch, rows in report.get("max_shape", {}).items():
        names = list(next(iter(rows.values())))
        lines += ["", f"Max-shape verify ({batch}; resident rounds' graphs: 16 tokens, valid_len = w), 30 layers, µs "
                      "(verify only):", "", "| w | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
        lines += [f"| {w[1:]} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |" for w, row in rows.items()]
    if report.get("decode_step"):
        lines += [
            "",
            "Plain decoding step (w = 1, m = 1), 30 layers, µs: `gdn_decode_step` (one recurrent step, state read and "
            "written once in place; its conv roll rides in conv_silu and is not in this figure) against verify(1) + "
            "commit (which include the conv roll) of each method.",
            "",
            "| B | decode step | " + " | ".join(f"{n} verify + commit" for n in methods)
            + " | default verify + commit |",
            "|" + "---|" * (3 + len(methods)),
        ]
        for batch, d in report["decode_step"].items():
            if "ours_verify_commit" in d:
                lines.append(f"| {batch} | {d['decode_step']:.1f} | "
                             + " | ".join(f"{d.get(f'{n}_verify_commit', float('nan')):.1f}" for n in methods)
                             + f" | {d['default_verify_commit']:.1f} |")
        lines += [
            "",
            "The whole GDN step between the projections and out_proj (w = 1), 30 layers, µs: today's four launches "
            "per layer (conv_silu + window roll, gdn_gates, gdn_decode_step, gated_rms_norm) against "
            "`gdn_step` (bv128: one launch, norm inside; +norm: a second launch for the norm).",
            "",
            "| B | four launches | " + " | ".join(f"gdn_step {n}" for n in STEP_FUSED_VARIANTS) + " |",
            "|" + "---|" * (2 + len(STEP_FUSED_VARIANTS)),
        ]
        for batch, d in report["decode_step"].items():
            lines.append(f"| {batch} | {d['four_launches']:.1f} | " +
                         " | ".join(f"{d['fused_step'][n]:.1f}" for n in STEP_FUSED_VARIANTS) + " |")
    lines += [
        "",
        "Bytes = fewest bytes moved (each input read once, each output written once; the default verifier's per-token "
        "states included). Achieved = bytes / measured total time. Scratch = memory each approach keeps between verify "
        "and commit (ours: Z + G; default: one state per token).",
        "",
        "| B | w | accept | ours MB | ours TB/s | ours % copy | ours × roofline (measured / 4.25) | default MB | "
        "default TB/s | default % copy | default × roofline (measured / 4.25) | scratch ours MiB | scratch default MiB |",
        "|" + "---|" * 13,
    ]
    for r in report["rows"]:
        b, t = r["bytes"], r["total_us"]
        cells = []
        for who in ("ours", "default"):
            tbps = b[f"{who}_total"] / (t[who] * 1e-6) / 1e12
            cells += [f"{b[f'{who}_total'] / 1e6:.0f}", f"{tbps:.2f}", f"{100 * tbps / bw:.0f}%",
                      f"{bw / tbps:.2f} / {NOMINAL_COPY_TBPS / tbps:.2f}"]
        lines.append(f"| {r['batch']} | {r['w']} | {r['accept']} | " + " | ".join(cells) +
                     f" | {r['extra_memory_MiB']['ours']:.1f} | {r['extra_memory_MiB']['default']:.0f} |")
    if "sweep" in report:
        lines += ["", "Sweep (µs, 30 layers, all accepted; w = 1 rows: the decode step):", ""]
        for shape, res in report["sweep"].items():
            ranked = sorted(res.items(), key=lambda kv: kv[1])
            lines.append(f"- {shape}: " + ", ".join(f"{k} {v:.0f}" for k, v in ranked))
    if "fused_step_check" in report:
        lines += ["", f"gdn_step vs the four launches on the GPU (3 steps; y rel. to max, state rel. norm, conv "
                      f"window identical): `{json.dumps(report['fused_step_check'])}`."]
    if "correctness" in report:
        lines += ["", f"GPU correctness vs float64 (relative): `{json.dumps(report['correctness'])}`; "
                      f"drift: `{json.dumps(report.get('drift'))}`."]
    return "\n".join(lines) + "\n"


def table(report: dict) -> str:
    """The console summary: batch, w, accept, µs per method and the speedups."""
    out = []
    for r in report["rows"]:
        t = r["total_us"]
        out.append(f"B{r['batch']} w{r['w']:>2} {r['accept']:>6}: " + ", ".join(
            f"{n} {v:.1f}" + ("" if n == "default" else f" ({t['default'] / v:.2f}x)") for n, v in t.items()))
    for batch, d in report.get("decode_step", {}).items():
        if "ours_verify_commit" in d:
            out.append(f"{batch} w=1 step: decode_step {d['decode_step']:.1f}, ours verify+commit "
                       f"{d['ours_verify_commit']:.1f}, default verify+commit {d['default_verify_commit']:.1f} µs")
        best = min(d["fused_step"], key=d["fused_step"].get)
        out.append(f"{batch} w=1 whole step: four launches {d['four_launches']:.1f}, gdn_step {best} "
                   f"{d['fused_step'][best]:.1f} µs")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--windows", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--sweep", action="store_true", help="time the default verifier's and the decode step's "
                        "tiles/warps and use the best")
    parser.add_argument("--sweep-windows", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--check", action="store_true", help="GPU correctness + drift before timing")
    parser.add_argument("--fla", action="store_true", help="time fla chunk_gated_delta_rule in a subprocess")
    parser.add_argument("--fla-timeout", type=int, default=200)
    parser.add_argument("--fla-json", default=None, help="fla timings of an earlier run (fla_chunk.json) to report")
    parser.add_argument("--drift-rounds", type=int, default=200)
    parser.add_argument("--step-only", action="store_true", help="only the w = 1 table (decode steps)")
    parser.add_argument("--max-shape", type=int, nargs="*", default=None,
                        help="also time the verify in 16-token graphs with valid_len = each of these w")
    parser.add_argument("--fla-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fla_worker:
        fla_worker(args.batches, args.windows, args.fla_worker)
        return
    os.makedirs(args.out, exist_ok=True)
    import triton

    gen = torch.Generator(device=DEV).manual_seed(0)
    report = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]), inputs="random", rows=[], decode_step={},
    )
    path = os.path.join(args.out, "gdn_kernels.json")

    def save():
        json.dump(report, open(path, "w"), indent=1)
        open(os.path.join(args.out, "gdn_kernels.md"), "w").write(markdown(report))

    t0 = time.time()
    report["copy_bandwidth"] = copy_bandwidth()
    print("copy", report["copy_bandwidth"], flush=True)
    if args.check:
        report["fused_step_check"] = check_fused_step(gen)
        print("fused step vs four launches", json.dumps(report["fused_step_check"]), flush=True)
    if args.step_only:
        for batch in args.batches:
            report["decode_step"][f"b{batch}"] = step_only(batch, gen)
            print(f"b{batch} w1 step", report["decode_step"][f"b{batch}"], f"[{time.time() - t0:.0f} s]", flush=True)
            save()
        print(markdown(report))
        print(table(report))
        return
    if args.check:
        report["correctness"] = {name: check_correctness(cfg, gen) for name, cfg in METHODS.items()}
        report["correctness"]["default"] = check_default(gen)
        report["drift"] = {name: drift(cfg, args.drift_rounds, gen) for name, cfg in METHODS.items()}
        print("correctness", json.dumps(report["correctness"]), "\ndrift", json.dumps(report["drift"]), flush=True)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    if args.sweep:
        report["sweep"] = sweep(gen, args.batches, args.sweep_windows)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    report["config"] = {}
    for batch in args.batches:
        cfgs = dict(METHODS, default=dict(default={}))  # code defaults
        if args.sweep:
            cfgs = best_config(report["sweep"], batch)
        report["config"][f"b{batch}"] = cfgs
        for w in args.windows:
            report["rows"] += bench_shape(batch, w, cfgs, gen)
            r = report["rows"][-2:]
            print(f"b{batch} w{w}", [(x["accept"], x["total_us"]) for x in r], f"[{time.time() - t0:.0f} s]", flush=True)
            save()
        report["decode_step"][f"b{batch}"] = bench_decode_step(batch, cfgs, gen)
        print(f"b{batch} w1 step", report["decode_step"][f"b{batch}"], f"[{time.time() - t0:.0f} s]", flush=True)
        if args.max_shape:
            report.setdefault("max_shape", {})[f"b{batch}"] = bench_max_shape(batch, args.max_shape, cfgs, gen)
        save()
    if args.fla:
        report["fla"] = run_fla(args.batches, args.windows, args.out, args.fla_timeout)
        print("fla", report["fla"], flush=True)
    elif args.fla_json:
        report["fla"] = dict(version="0.6.0", status=f"from an earlier run on the same GPU kind: {args.fla_json}",
                             us=json.load(open(args.fla_json)))
    save()
    print(markdown(report))
    print(table(report))
    print(f"[{time.time() - t0:.0f} s total]", flush=True)


if __name__ == "__main__":
    main()
