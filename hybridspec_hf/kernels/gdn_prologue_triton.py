"""The GDN layer's prologue in verify mode: the glue between its input projections and the verify kernel.

transformers' torch code runs it as ~11 small kernels per layer (cat, depthwise conv1d, silu; casts, add,
softplus, exp, neg, mul, sigmoid), and the [B, C, T] conv output makes q/k/v strided, so the verify kernel copies
them (3 more kernels at T > 1). Here it is one launch for the conv and one for the gates, with a contiguous output
(or both in one launch, `conv_silu_gates`, with CONV_GATES):

    conv_silu: out[t] = silu(bias + Σ_j w[:, j] · full[t + j + 1]),  full = [conv_state (K columns) ‖ x (T columns)]
               (`gdn_torch.conv_verify` with silu: the last T outputs of a valid conv over K + T inputs)
    gdn_gates: g = -exp(A_log) · softplus(a + dt_bias) (fp32),  beta = sigmoid(b) (in b's dtype)

Rounding follows transformers: conv inputs are cast to the conv weight's dtype, the conv accumulates in fp32 and
rounds to the weight dtype (conv1d's output), silu runs in fp32 and rounds again, then to x's dtype; the gates
are computed in fp32 from upcast inputs (softplus with PyTorch's threshold 20) and beta rounds once to b's dtype.
Only the order of the conv's fp32 sum differs (and on CUDA `tl.exp`/`tl.log` are the fast hardware versions).
Kernels bind to `triton.jit` at launch (`_LazyJit`), like the other kernel files.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_torch import conv_verify
from .gdn_triton import HAS_TRITON, _LazyJit, _last_dim_contiguous, tl, tl_dtype, triton

SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default: above it softplus(x) = x
CONV_BLOCK = 128  # channels per program: 64 programs for C = 8192 at batch 1
GATE_ROWS = 16  # tokens per program of the gates
# The verify path's conv and gates in one launch (`conv_silu_gates`: one grid, the gates' programs after the conv's)
# instead of two: 30 launches fewer a verification at the 35B-A3B shape, where run 130 (H100) charged the gates'
# launches 66-73 µs of a round's traced span. Off by the rule set before its measurement (a switch may lose at no w
# beyond the base rows' spread): on an H100 (run 133, round_tiles_run133.md) the max-shape round −32 / −59, −71 / −65,
# −51 / −44, −19 / −12 µs at w = 1 / 2 / 4 / 8 but +28 / +37 at w = 16 (spread 11); at batch 1 with PDL_WIDE (run 134,
# batch_b1_run134.md, one run) HybridSpec 1.70 → 1.72x AR (medium), 2.58 → 2.59x (high), within the run-to-run spread;
# repeated in runs 137-139 (H100): the round −74 / −47 / +48 µs at w = 1 / 4 / 16, batch 1 within the spread again
# (1.73 → 1.74x, 2.62 → 2.62x). True: A/B (`+conv-gates`).
CONV_GATES = False


def conv_silu_reference(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """conv_state [B, C, K], x [B, T, C] (new conv inputs), weight [C, K], bias [C] or None -> [B, T, C] in x's
    dtype: transformers' depthwise causal conv + silu of T inputs after the cached K, cache untouched."""
    return conv_verify(conv_state, x.transpose(1, 2), weight, bias, F.silu).transpose(1, 2)


def gdn_gates_reference(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                        dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' GDN gates: a, b [B, T, HV]; A_log, dt_bias [HV] -> g [B, T, HV] fp32, beta in b's dtype."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # the .float(): an fp16 exp(A_log) may overflow
    return g, beta


def _conv_silu_block(state, x, w, bias, out, i_c, i_b,
                     stride_sb, stride_sc, stride_sk,
                     stride_xb, stride_xt, stride_xc,
                     stride_wc, stride_wk,
                     C, T,
                     K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                     X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, ROLL: tl.constexpr, BW: tl.constexpr):
    """Channels i_c·BC .. of request i_b (int64): their T conv + silu outputs, and with ROLL their new window."""
    rc = i_c * BC + tl.arange(0, BC)
    rt = tl.arange(0, BT)
    mc = rc < C
    mt = rt < T
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + rc, mask=mc, other=0.0).to(tl.float32)[None, :]
    p_state = state + i_b * stride_sb + rc[None, :] * stride_sc
    p_x = x + i_b * stride_xb + rc[None, :] * stride_xc
    for j in tl.static_range(K):
        col = rt + j + 1  # the column of [conv_state ‖ x] that output t reads with tap j
        in_state = col < K
        v_state = tl.load(p_state + col[:, None] * stride_sk, mask=(in_state & mt)[:, None] & mc[None, :], other=0.0)
        v_x = tl.load(p_x + (col - K)[:, None] * stride_xt, mask=(~in_state & mt)[:, None] & mc[None, :], other=0.0)
        # transformers casts the cached inputs to x's dtype, then everything to the weight's
        v = tl.where(in_state[:, None], v_state.to(X_DTYPE).to(W_DTYPE), v_x.to(W_DTYPE)).to(tl.float32)
        w_j = tl.load(w + rc * stride_wc + j * stride_wk, mask=mc, other=0.0).to(tl.float32)
        acc += w_j[None, :] * v
    conv = acc.to(W_DTYPE).to(tl.float32)  # conv1d's output in the weight dtype
    silu = (conv / (1.0 + tl.exp(-conv))).to(W_DTYPE)  # silu in fp32, rounded to its input's dtype
    p_out = out + i_b * T * C + rt[:, None] * C + rc[None, :]
    tl.store(p_out, silu.to(X_DTYPE), mask=mt[:, None] & mc[None, :])
    if ROLL:  # the new window: columns T .. T+K-1 of [conv_state ‖ x], written over the columns read above
        rj = tl.arange(0, BW)
        col = T + rj
        mask = (rj < K)[:, None] & mc[None, :]
        from_state = (col < K)[:, None]
        w_old = tl.load(p_state + col[:, None] * stride_sk, mask=mask & from_state, other=0.0)
        w_new = tl.load(p_x + (col - K)[:, None] * stride_xt, mask=mask & ~from_state, other=0.0)
        window = tl.where(from_state, w_old, w_new.to(w_old.dtype))
        tl.debug_barrier()  # every thread has read its columns before any is overwritten
        tl.store(p_state + rj[:, None] * stride_sk, window, mask=mask)


def _conv_silu_kernel(state, x, w, bias, out,
                      stride_sb, stride_sc, stride_sk,
                      stride_xb, stride_xt, stride_xc,
                      stride_wc, stride_wk,
                      C, T,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                      X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, ROLL: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    _conv_silu_block(state, x, w, bias, out, tl.program_id(0), tl.program_id(1).to(tl.int64),
                     stride_sb, stride_sc, stride_sk, stride_xb, stride_xt, stride_xc, stride_wc, stride_wk, C, T,
                     K, BT, BC, HAS_BIAS, X_DTYPE, W_DTYPE, ROLL, BW)


def _softplus(x, threshold):
    """F.softplus in fp32: log1p(e^x) below the threshold, x above it. log1p(u) = u · log(1 + u) / ((1 + u) - 1)
    keeps its precision for small u (the rounding of 1 + u cancels) where log(1 + u) alone would lose it."""
    u = tl.exp(tl.minimum(x, threshold))
    one_plus = 1.0 + u
    exact = one_plus == 1.0  # u below half an ulp of 1: log1p(u) = u to fp32 precision
    log1p = tl.where(exact, u, tl.log(one_plus) * (u / tl.where(exact, 1.0, one_plus - 1.0)))
    return tl.where(x > threshold, x, log1p)


def _gates_block(a, b, A_log, dt_bias, g, beta, rr, row_ok, stride_a, stride_b, HV, threshold,
                 BH: tl.constexpr, BETA_DTYPE: tl.constexpr):
    """The gates of rows rr (of the flattened [B·T, HV]) where row_ok."""
    rh = tl.arange(0, BH)
    mh = rh < HV
    mask = row_ok[:, None] & mh[None, :]
    x = tl.load(a + rr[:, None] * stride_a + rh[None, :], mask=mask, other=0.0).to(tl.float32)
    x = x + tl.load(dt_bias + rh, mask=mh, other=0.0).to(tl.float32)[None, :]
    softplus = _softplus(x, threshold)
    decay = tl.exp(tl.load(A_log + rh, mask=mh, other=0.0).to(tl.float32))
    offsets = rr[:, None] * HV + rh[None, :]
    tl.store(g + offsets, -decay[None, :] * softplus, mask=mask)
    v = tl.load(b + rr[:, None] * stride_b + rh[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(beta + offsets, (1.0 / (1.0 + tl.exp(-v))).to(BETA_DTYPE), mask=mask)


def _gates_kernel(a, b, A_log, dt_bias, g, beta, stride_a, stride_b, rows, HV, threshold,
                  BR: tl.constexpr, BH: tl.constexpr, BETA_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    _gates_block(a, b, A_log, dt_bias, g, beta, rr, rr < rows, stride_a, stride_b, HV, threshold, BH, BETA_DTYPE)


def _conv_gates_kernel(state, x, w, bias, out, a, b, A_log, dt_bias, g, beta,
                       stride_sb, stride_sc, stride_sk,
                       stride_xb, stride_xt, stride_xc,
                       stride_wc, stride_wk, stride_a, stride_b,
                       C, T, HV, threshold, n_conv,
                       K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr,
                       X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, ROLL: tl.constexpr, BW: tl.constexpr,
                       BR: tl.constexpr, BH: tl.constexpr, BETA_DTYPE: tl.constexpr, PDL: tl.constexpr):
    """`_conv_silu_kernel` and `_gates_kernel` in one grid (n_conv + cdiv(T, BR), B): programs i < n_conv take
    channel blocks, the rest BR tokens' gates of request i_b each."""
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    if i < n_conv:
        _conv_silu_block(state, x, w, bias, out, i, i_b, stride_sb, stride_sc, stride_sk, stride_xb, stride_xt,
                         stride_xc, stride_wc, stride_wk, C, T, K, BT, BC, HAS_BIAS, X_DTYPE, W_DTYPE, ROLL, BW)
    else:
        rt = (i - n_conv) * BR + tl.arange(0, BR)
        _gates_block(a, b, A_log, dt_bias, g, beta, i_b * T + rt, rt < T, stride_a, stride_b, HV, threshold, BH,
                     BETA_DTYPE)


if HAS_TRITON:
    _softplus = triton.jit(_softplus)  # a device function (also called by gdn_step_triton's kernel)
    _conv_silu_block = triton.jit(_conv_silu_block)
    _gates_block = triton.jit(_gates_block)
    _conv_silu_kernel = _LazyJit(_conv_silu_kernel, pdl=True)
    _gates_kernel = _LazyJit(_gates_kernel, pdl=True)
    _conv_gates_kernel = _LazyJit(_conv_gates_kernel, pdl=True)


def conv_silu(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, roll_state: bool = False) -> torch.Tensor:
    """Triton `conv_silu_reference` (one launch): conv_state [B, C, K], x [B, T, C] (any strides, e.g. a slice of
    the projection output), weight [C, K], bias [C] or None -> contiguous [B, T, C] in x's dtype.

    roll_state: also commit all T inputs, in place: conv_state becomes the last K columns of [conv_state ‖ x]
    (`gdn_torch.commit_conv_state` with m = T; a decoding step's conv update, with no commit launch after it)."""
    batch, t, channels = x.shape
    k = conv_state.shape[-1]
    if conv_state.shape[:2] != (batch, channels) or weight.shape != (channels, k):
        raise ValueError(f"conv_silu takes conv_state [B, C, K], x [B, T, C] and weight [C, K]; got "
                         f"{tuple(conv_state.shape)}, {tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty(batch, t, channels, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(channels, CONV_BLOCK), batch)
    _conv_silu_kernel[grid](
        conv_state, x, weight, bias if bias is not None else weight, out,
        *conv_state.stride(), *x.stride(), *weight.stride(), channels, t,
        K=k, BT=max(2, triton.next_power_of_2(t)), BC=CONV_BLOCK, HAS_BIAS=bias is not None,
        X_DTYPE=tl_dtype(x.dtype), W_DTYPE=tl_dtype(weight.dtype), ROLL=roll_state, BW=triton.next_power_of_2(k),
        num_warps=4,
    )
    return out


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `gdn_gates_reference` (one launch): a, b [B, T, HV] (rows may be strided) -> g [B, T, HV] fp32,
    beta [B, T, HV] in b's dtype, both contiguous."""
    heads = a.shape[-1]
    if b.shape != a.shape or A_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"gdn_gates takes a, b [B, T, HV] and A_log, dt_bias [HV]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(A_log.shape)} and {tuple(dt_bias.shape)}")
    a_rows, b_rows = (_last_dim_contiguous(x.reshape(-1, heads)) for x in (a, b))  # views for column slices
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    _gates_kernel[(triton.cdiv(a_rows.shape[0], GATE_ROWS),)](
        a_rows, b_rows, A_log, dt_bias, g, beta, a_rows.stride(0), b_rows.stride(0), a_rows.shape[0], heads,
        SOFTPLUS_THRESHOLD, BR=GATE_ROWS, BH=max(2, triton.next_power_of_2(heads)), BETA_DTYPE=tl_dtype(b.dtype),
        num_warps=1,
    )
    return g, beta


def conv_silu_gates(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    roll_state: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_silu` and `gdn_gates` in one launch, the same code and results: (mixed [B, T, C], g, beta). a, b
    [B, T, HV] of the same B and T as x."""
    batch, t, channels = x.shape
    k = conv_state.shape[-1]
    heads = a.shape[-1]
    if conv_state.shape[:2] != (batch, channels) or weight.shape != (channels, k):
        raise ValueError(f"conv_silu_gates takes conv_state [B, C, K], x [B, T, C] and weight [C, K]; got "
                         f"{tuple(conv_state.shape)}, {tuple(x.shape)} and {tuple(weight.shape)}")
    if a.shape != (batch, t, heads) or b.shape != a.shape or A_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(f"conv_silu_gates takes a, b [B, T, HV] (B, T as x's) and A_log, dt_bias [HV]; got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(A_log.shape)} and {tuple(dt_bias.shape)} "
                         f"with x {tuple(x.shape)}")
    out = torch.empty(batch, t, channels, dtype=x.dtype, device=x.device)
    a_rows, b_rows = (_last_dim_contiguous(v.reshape(-1, heads)) for v in (a, b))
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    n_conv = triton.cdiv(channels, CONV_BLOCK)
    _conv_gates_kernel[(n_conv + triton.cdiv(t, GATE_ROWS), batch)](
        conv_state, x, weight, bias if bias is not None else weight, out, a_rows, b_rows, A_log, dt_bias, g, beta,
        *conv_state.stride(), *x.stride(), *weight.stride(), a_rows.stride(0), b_rows.stride(0),
        channels, t, heads, SOFTPLUS_THRESHOLD, n_conv,
        K=k, BT=max(2, triton.next_power_of_2(t)), BC=CONV_BLOCK, HAS_BIAS=bias is not None,
        X_DTYPE=tl_dtype(x.dtype), W_DTYPE=tl_dtype(weight.dtype), ROLL=roll_state, BW=triton.next_power_of_2(k),
        BR=GATE_ROWS, BH=max(2, triton.next_power_of_2(heads)), BETA_DTYPE=tl_dtype(b.dtype), num_warps=4,
    )
    return out, g, beta

