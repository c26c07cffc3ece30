"""The GDN layer's plain decoding step (one token, committed) in one launch, between its projections and out_proj.

At the AR step of a resident forward each GDN layer otherwise runs four launches after its input projection:
`conv_silu` (with the window roll), `gdn_gates`, `gdn_decode_step` (the recurrence, state in place) and the gated
RMSNorm, each a few µs of mostly latency on the H200 (30 layers: 71 + 76 + 111 + 39 µs per step). `gdn_step` does
them in one kernel, for one token of each request:

    conv:  x_c = silu(bias_c + Σ_j w[c, j] · [conv_state ‖ x][c, j + 1])   conv_state <- its columns 1..K   (q ‖ k ‖ v)
    gates: g = -exp(A_log) · softplus(a + dt_bias),  beta = sigmoid(b)
    step:  q, k l2-normalised (q also by dk^-1/2);  S <- e^g S + k zᵀ,  z = beta (v - e^g Sᵀ k),  o = Sᵀ q
    norm:  y = ((w · (o · rsqrt(mean(o²) + eps))) · silu(z_gate))                (transformers' RMSNormGated)

with transformers' roundings: the conv rounds to the conv weight's dtype, silu to it again, then to x's dtype (as
`conv_silu`); beta rounds to b's dtype; g, the state and all reductions are fp32; o rounds to v's dtype before the
norm, the normed o and w · (normed o) to that dtype too (as `gated_rms_norm`). `gdn_step_reference` is the same
sequence in torch (transformers' own functions where they exist). Only the order of fp32 sums differs, and the two
reductions of the step read the same decayed state (o = e^g Sᵀ q + (q · k) z, as default_verifier.py).

Grid: one program per (dv tile of BV columns, value head, request); it owns its [dk, BV] state tile (read and
written once, in place) and its BV value channels of the conv window. With BV = dv a program holds a whole head's
output, so the gated RMSNorm runs in its registers: ONE launch, 32 programs at the 35B-A3B shape (HV = 32). With
BV < dv (more programs: BV = 16 gives 256) each program stores its o tile and the last of the head's programs to
arrive (a (request, value head) counter, as below) reads the whole head back and applies the norm in place: one
launch too (`FOLD_NORM`; off, `norm_triton.gated_rms_norm` follows as a second launch). On the H200 the narrow
tiles with the norm's own launch won at batch 1 (237 µs against 277 for BV = dv, 30 layers: `step_config`, the
default).

The q and k channels of a key head are read by every program of its GROUP value heads and dv tiles, so none of
them may roll that window while another may still read it: each program bumps its (request, key head) counter
after its reads (a barrier, then an acq_rel atomic, as gemv_triton's split-K), and the one that arrives last rolls
the q/k window and zeroes the counter for the next launch. The counters are one int32 buffer per device shared by
every launch, which is right while launches on a device do not overlap (the resident rounds replay their graphs on
one stream). Kernels bind to `triton.jit` at launch (`_LazyJit`); call once before CUDA-graph capture (the warm-up
also makes the counters outside the capture).
"""
from __future__ import annotations

import torch

from . import pdl
from .gdn_prologue_triton import SOFTPLUS_THRESHOLD, _softplus, conv_silu_reference, gdn_gates_reference
from .gdn_torch import commit_conv_state, compute_dtype, gdn_recurrence
from .gdn_triton import HAS_TRITON, _LazyJit, _last_dim_contiguous, tl, tl_dtype, triton
from .norm_triton import gated_norm_row, gated_rms_norm, gated_rms_norm_reference

FUSED_STEP = True  # the switch: False keeps the four launches (conv_silu, gdn_gates, gdn_decode_step, gated norm)
# With narrow tiles (BV < dv) the last of a head's programs to arrive applies the gated RMSNorm to the whole head in
# the same launch; False: the norm's own launch after the step (A/B)
FOLD_NORM = True
# True: every input of a program (the conv's, the gates') is loaded in one round trip after the PDL wait, the q/k
# window's counter is bumped before the step's math and read after it (its round trip overlaps the math); False:
# the gates' inputs after the counter's round trip, which the window roll waited for (A/B, `ar-gdn-loads-first`).
# Run 69 (kernel_costs_run69.md): each doubled step launch 5.81 µs in situ against 6.82, the steps' share of the
# traced AR step 214 against 227 µs; the whole step within the noise (off: -10 µs, the GEMVs' share lower).
LOADS_FIRST = True


def gdn_step_reference(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                       conv_bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, state: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                       norm_eps: float, num_k_heads: int) -> torch.Tensor:
    """The unfused step in torch (transformers' sequence), conv_state and state updated in place. x [B, 1, C]
    (C = 2·H·dk + HV·dv, the conv input [q ‖ k ‖ v]); conv_state [B, C, K]; conv_weight [C, K]; a, b [B, 1, HV];
    state [B, HV, dk, dv]; z [B, 1, HV, dv] -> y [B, 1, HV, dv] in x's dtype. The recurrence runs in fp32, or in
    float64 when x is float64 (the oracle: pass every input upcast)."""
    batch, _, num_v_heads, dv = z.shape
    dk = state.shape[2]
    mixed = conv_silu_reference(conv_state, x, conv_weight, conv_bias)  # [B, 1, C] in x's dtype
    commit_conv_state(conv_state, x.transpose(1, 2), torch.ones(batch, dtype=torch.long, device=x.device))
    g, beta = gdn_gates_reference(a, b, A_log, dt_bias)
    q, k, v = torch.split(mixed, [num_k_heads * dk, num_k_heads * dk, num_v_heads * dv], dim=-1)
    q, k = (t.reshape(batch, 1, num_k_heads, dk) for t in (q, k))
    out, states = gdn_recurrence(q, k, v.reshape(batch, 1, num_v_heads, dv), g, beta, state,
                                 dtype=compute_dtype(x, state))
    state.copy_(states[:, -1])
    return gated_rms_norm_reference(out.to(x.dtype), z, norm_weight, norm_eps)


# ----------------------------------------------------------------------------------------------------------------
# kernel


def _conv_silu_one(p_state, p_x, w, bias, channels, mask, stride_sc, stride_sk, stride_wc, stride_wk,
                   K: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, X_DTYPE: tl.constexpr,
                   W_DTYPE: tl.constexpr):
    """silu(conv) of one new input for `channels` [BC] (`conv_silu`'s roundings): [BC] fp32 holding X_DTYPE values,
    0 where masked."""
    acc = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + channels, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):  # taps 0 .. K-2 read the window's columns 1 .. K-1
        v = tl.load(p_state + channels * stride_sc + (j + 1) * stride_sk, mask=mask, other=0.0)
        w_j = tl.load(w + channels * stride_wc + j * stride_wk, mask=mask, other=0.0).to(tl.float32)
        acc += w_j * v.to(X_DTYPE).to(W_DTYPE).to(tl.float32)
    v = tl.load(p_x + channels, mask=mask, other=0.0)  # tap K-1: the new input
    w_j = tl.load(w + channels * stride_wc + (K - 1) * stride_wk, mask=mask, other=0.0).to(tl.float32)
    acc += w_j * v.to(W_DTYPE).to(tl.float32)
    conv = acc.to(W_DTYPE).to(tl.float32)  # conv1d's output in the weight dtype
    silu = (conv / (1.0 + tl.exp(-conv))).to(W_DTYPE)  # silu in fp32, rounded to its input's dtype
    return silu.to(X_DTYPE).to(tl.float32)


def _rolled_window(p_state, p_x, channels, mask, stride_sc, stride_sk, K: tl.constexpr, BW: tl.constexpr):
    """Columns 1 .. K of [conv_state ‖ x] for `channels`: the window after committing the one token, [BW, BC]."""
    rj = tl.arange(0, BW)
    col = rj + 1  # the column of [conv_state ‖ x] that becomes column rj
    tile = (rj < K)[:, None] & mask[None, :]
    from_state = (col < K)[:, None]
    old = tl.load(p_state + channels[None, :] * stride_sc + col[:, None] * stride_sk, mask=tile & from_state,
                  other=0.0)
    new = tl.load(p_x + channels[None, :] + 0 * col[:, None], mask=tile & ~from_state, other=0.0)
    return tl.where(from_state, old, new.to(old.dtype))


def _store_window(p_state, window, channels, mask, stride_sc, stride_sk, K: tl.constexpr, BW: tl.constexpr):
    rj = tl.arange(0, BW)
    tl.store(p_state + channels[None, :] * stride_sc + rj[:, None] * stride_sk, window,
             mask=(rj < K)[:, None] & mask[None, :])


def _gate_inputs(a, b, dt_bias, i_b, i_h, stride_ab, stride_bb):
    """(a + dt_bias, b) of one (request, value head), fp32."""
    b_a = tl.load(a + i_b * stride_ab + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    return b_a, tl.load(b + i_b * stride_bb + i_h).to(tl.float32)


def _gdn_step_kernel(
    x, conv_state, conv_w, conv_bias, a, b, A_log, dt_bias, state, z, norm_w, out, counters,
    stride_xb, stride_cb, stride_cc, stride_ck, stride_wc, stride_wk, stride_ab, stride_bb,
    stride_sb, stride_sh, stride_sk, stride_zb, stride_zh,
    HV, GROUP, DK, DV, scale, threshold, eps, HEAD_COUNTERS,
    K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
    ARRIVALS: tl.constexpr, TILES: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    FOLD_NORM: tl.constexpr, EARLY: tl.constexpr, LOADS_FIRST: tl.constexpr, X_DTYPE: tl.constexpr,
    W_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    if not EARLY:
        pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // GROUP
    key_dim = HV // GROUP * DK
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    mask_kv = mk[:, None] & mv[None, :]
    p_s = state + i_b * stride_sb + i_h * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    b_alog = tl.load(A_log + i_h).to(tl.float32)  # a weight: before the PDL wait when EARLY
    # [BK, BV] fp32, issued first: the largest read. EARLY (pdl.EARLY_READS): before the PDL wait, past L1 (the state
    # was written by this layer's previous step, long before the input projection this kernel waits for)
    if EARLY:
        b_s = tl.load(p_s, mask=mask_kv, other=0.0, cache_modifier=".cg")
        pdl.enter(PDL)  # the conv window and x (the input projection's) from here on
    else:
        b_s = tl.load(p_s, mask=mask_kv, other=0.0)

    p_c = conv_state + i_b * stride_cb
    p_x = x + i_b * stride_xb
    cq = i_hk * DK + rk  # this program's channels of [q ‖ k ‖ v]
    ck = key_dim + cq
    cv = 2 * key_dim + i_h * DV + rv
    b_q = _conv_silu_one(p_c, p_x, conv_w, conv_bias, cq, mk, stride_cc, stride_ck, stride_wc, stride_wk,
                         K, BK, HAS_BIAS, X_DTYPE, W_DTYPE)
    b_k = _conv_silu_one(p_c, p_x, conv_w, conv_bias, ck, mk, stride_cc, stride_ck, stride_wc, stride_wk,
                         K, BK, HAS_BIAS, X_DTYPE, W_DTYPE)
    b_v = _conv_silu_one(p_c, p_x, conv_w, conv_bias, cv, mv, stride_cc, stride_ck, stride_wc, stride_wk,
                         K, BV, HAS_BIAS, X_DTYPE, W_DTYPE)
    # the windows after this token; written once every reader of the old one is done
    w_q = _rolled_window(p_c, p_x, cq, mk, stride_cc, stride_ck, K, BW)
    w_k = _rolled_window(p_c, p_x, ck, mk, stride_cc, stride_ck, K, BW)
    w_v = _rolled_window(p_c, p_x, cv, mv, stride_cc, stride_ck, K, BW)
    if LOADS_FIRST:  # the gates' inputs in the same round trip as the conv's
        b_a, b_b = _gate_inputs(a, b, dt_bias, i_b, i_h, stride_ab, stride_bb)
    tl.debug_barrier()  # every thread of this program has read its columns before any is overwritten
    _store_window(p_c, w_v, cv, mv, stride_cc, stride_ck, K, BW)  # this program's own value channels
    if ARRIVALS > 1:  # q/k channels shared: the last program of their key head writes them (the barrier above
        # orders this program's reads before the signal, the acq_rel atomic releases them)
        p_count = counters + i_b * (HV // GROUP) + i_hk
        arrived = tl.atomic_add(p_count, 1, sem="acq_rel")
        if not LOADS_FIRST:
            if arrived == ARRIVALS - 1:
                _store_window(p_c, w_q, cq, mk, stride_cc, stride_ck, K, BW)
                _store_window(p_c, w_k, ck, mk, stride_cc, stride_ck, K, BW)
                tl.store(p_count, 0)  # zero again for the next launch
    else:
        _store_window(p_c, w_q, cq, mk, stride_cc, stride_ck, K, BW)
        _store_window(p_c, w_k, ck, mk, stride_cc, stride_ck, K, BW)
    if not LOADS_FIRST:
        b_a, b_b = _gate_inputs(a, b, dt_bias, i_b, i_h, stride_ab, stride_bb)

    # gates of this (request, value head)
    b_g = -tl.exp(b_alog) * _softplus(b_a, threshold)
    b_beta = (1.0 / (1.0 + tl.exp(-b_b))).to(BETA_DTYPE).to(tl.float32)

    # the recurrent step on the [dk, BV] tile (default_verifier's, T = 1)
    b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale)
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_s = b_s * tl.exp(b_g)
    b_sk = tl.sum(b_s * b_k[:, None], 0)  # [BV] e^{g} Sᵀ k
    b_sq = tl.sum(b_s * b_q[:, None], 0)  # [BV] e^{g} Sᵀ q, independent of the update
    b_z = b_beta * (b_v - b_sk)
    b_s = b_s + b_k[:, None] * b_z[None, :]
    tl.store(p_s, b_s, mask=mask_kv)
    b_o = (b_sq + tl.sum(b_q * b_k, 0) * b_z).to(X_DTYPE)  # the recurrence's output in v's dtype
    if LOADS_FIRST and ARRIVALS > 1:  # the window's counter, read only now: its round trip overlapped the math
        if arrived == ARRIVALS - 1:
            _store_window(p_c, w_q, cq, mk, stride_cc, stride_ck, K, BW)
            _store_window(p_c, w_k, ck, mk, stride_cc, stride_ck, K, BW)
            tl.store(p_count, 0)  # zero again for the next launch

    p_head = out + (i_b * HV + i_h) * DV
    p_z = z + i_b * stride_zb + i_h * stride_zh
    if NORM:  # this program holds the whole head: the gated RMSNorm in registers
        gated_norm_row(tl.where(mv, b_o.to(tl.float32), 0.0), rv, mv, p_head, p_z, norm_w, DV, eps, X_DTYPE)
    else:
        tl.store(p_head + rv, b_o, mask=mv)
        if FOLD_NORM:  # the last of the head's TILES programs to arrive norms the whole head (o in out, in place)
            tl.debug_barrier()  # every thread's o is written before the signal (release below)
            p_count = counters + HEAD_COUNTERS + i_b * HV + i_h
            arrived = tl.atomic_add(p_count, 1, sem="acq_rel")
            if arrived == TILES - 1:
                rd = tl.arange(0, BD)
                md = rd < DV
                o = tl.load(p_head + rd, mask=md, other=0.0, cache_modifier=".cg").to(tl.float32)
                gated_norm_row(o, rd, md, p_head, p_z, norm_w, DV, eps, X_DTYPE)
                tl.store(p_count, 0)  # zero again for the next launch


if HAS_TRITON:
    _conv_silu_one = triton.jit(_conv_silu_one)
    _rolled_window = triton.jit(_rolled_window)
    _store_window = triton.jit(_store_window)
    _gate_inputs = triton.jit(_gate_inputs)
    _gdn_step_kernel = _LazyJit(_gdn_step_kernel, pdl=True)


# ----------------------------------------------------------------------------------------------------------------
# launch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's (request, key head) counters, at least n (all zero between launches). Made on the first launch
    outside a CUDA-graph capture (the warm-up); one made inside a capture belongs to that graph's pool, so it is
    not kept. A larger one replaces a smaller one (graphs captured on the old one keep it alive)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _COUNTERS[device] = counters
    return counters


def step_config(dv: int, rows: int, block_v: int | None = None, num_warps: int | None = None) -> tuple[int, int]:
    """(BV, num_warps) for `rows` = batch x value heads. Measured on the H200 (run 25 of
    benchmarks/results/gpu_rounds_runs.md, batch 1, 32 value heads, dk = dv = 128, 30 layers): BV = 16 with 2 warps
    + the norm launch 237 µs, BV = 32 / 64 + norm 252 / 263, BV = dv in one launch (norm in the kernel) 277 with 4
    warps and 653 / 1033 with 8 / 16, against 343 for the four launches. So narrow tiles while there are few heads,
    as for the recurrent kernel (`default_verifier._recurrent_config`); block_v / num_warps override."""
    if block_v is None:
        block_v = min(16 if rows < 128 else 32, triton.next_power_of_2(dv))
    return block_v, num_warps or (8 if block_v >= 128 else 4 if block_v >= 32 else 2)


def gdn_step(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    num_k_heads: int,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton `gdn_step_reference` (fp32): one launch with BV = dv, two with a smaller block_v (the gated norm
    after it; the default, `step_config`). x [B, 1, C] (the conv input [q ‖ k ‖ v], any strides with the last dim contiguous, e.g. a slice of
    the projection output); conv_state [B, C, K] and state [B, HV, dk, dv] fp32 updated IN PLACE; conv_weight
    [C, K], conv_bias [C] or None; a, b [B, 1, HV] (rows may be strided); A_log, dt_bias [HV]; z [B, 1, HV, dv]
    (the gate, strided rows allowed); norm_weight [dv] in x's dtype. Returns y [B, 1, HV, dv] in x's dtype."""
    batch, t, channels = x.shape
    _, num_v_heads, dk, dv = state.shape
    k_taps = conv_state.shape[-1]
    if (t != 1 or conv_state.shape[:2] != (batch, channels) or conv_weight.shape != (channels, k_taps)
            or channels != 2 * num_k_heads * dk + num_v_heads * dv or num_v_heads % num_k_heads
            or state.shape[0] != batch or state.dtype != torch.float32 or state.stride(-1) != 1
            or a.shape != (batch, 1, num_v_heads) or b.shape != a.shape or z.shape != (batch, 1, num_v_heads, dv)
            or norm_weight.shape != (dv,) or norm_weight.dtype != x.dtype):
        raise ValueError(
            f"gdn_step takes one token: x [B, 1, 2·H·dk + HV·dv], conv_state [B, C, K], conv_weight [C, K], "
            f"state [B, HV, dk, dv] float32 (last dim contiguous), a, b [B, 1, HV], z [B, 1, HV, dv] and a norm "
            f"weight [dv] in x's dtype, with H = {num_k_heads} key heads; got x {tuple(x.shape)}, conv_state "
            f"{tuple(conv_state.shape)}, conv_weight {tuple(conv_weight.shape)}, state {tuple(state.shape)} "
            f"{state.dtype}, a {tuple(a.shape)}, b {tuple(b.shape)}, z {tuple(z.shape)}, norm weight "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    x, a, b, z = (_last_dim_contiguous(v) for v in (x, a, b, z))
    block_v, warps = step_config(dv, batch * num_v_heads, block_v, num_warps)
    norm = block_v >= dv
    tiles = triton.cdiv(dv, block_v)
    group = num_v_heads // num_k_heads
    fold = FOLD_NORM and not norm
    out = torch.empty(batch, 1, num_v_heads, dv, dtype=x.dtype, device=x.device)
    # counters: (request, key head) for the q/k window, then (request, value head) for the folded norm
    key_counters = batch * num_k_heads
    uses_counters = group * tiles > 1 or fold
    counters = _counters(x.device, key_counters + (batch * num_v_heads if fold else 0)) if uses_counters else out
    _gdn_step_kernel[(tiles, num_v_heads, batch)](
        x, conv_state, conv_weight, conv_bias if conv_bias is not None else conv_weight, a, b, A_log, dt_bias,
        state, z, norm_weight, out, counters,
        x.stride(0), *conv_state.stride(), *conv_weight.stride(), a.stride(0), b.stride(0), *state.stride()[:3],
        z.stride(0), z.stride(2),
        num_v_heads, group, dk, dv, dk**-0.5, SOFTPLUS_THRESHOLD, norm_eps, key_counters,
        K=k_taps, BK=triton.next_power_of_2(dk), BV=block_v, BW=triton.next_power_of_2(k_taps),
        BD=triton.next_power_of_2(dv), ARRIVALS=group * tiles, TILES=tiles, HAS_BIAS=conv_bias is not None,
        NORM=norm, FOLD_NORM=fold, EARLY=pdl.EARLY_READS, LOADS_FIRST=LOADS_FIRST, X_DTYPE=tl_dtype(x.dtype),
        W_DTYPE=tl_dtype(conv_weight.dtype), BETA_DTYPE=tl_dtype(b.dtype), num_warps=warps,
    )
    return out if norm or fold else gated_rms_norm(out, z, norm_weight, norm_eps)
