"""The front of a Qwen gated-attention layer in one launch: q/k RMSNorm, RoPE, and the new keys and values written
into the static cache.

transformers' Qwen3.5 / Qwen3.5-MoE / Qwen3-Next attention forward, after its projections, runs per layer: q_norm,
k_norm (our `rms_norm`: 2 launches), RoPE (our `rope_qk`: 1), and `StaticLayer.update` (arange, add, add_ and two
index_copy_: 5), i.e. 8 launches of a few µs each inside a batch-1 CUDA graph for a few KB of data. `qk_prologue`
does all of it in one launch with the same rounding steps:

    q_out = rope(rms_norm(q, q_weight)),  keys[:, :, length + t] = rope(rms_norm(k, k_weight)),
    values[:, :, length + t] = v

rms_norm as transformers' Qwen RMSNorm ((1 + w) offset, fp32 math, one rounding to the dtype), rope as
`rope_triton` (partial rotary, each product rounded to the dtype, then the sum). `length` [1] long lives on the
device (the static target's committed length, which every attention layer's `cumulative_length` equals at the
start of a resident forward), or [B] long, one per batch row (batched resident rounds: each row's tokens from slot
0, its own count): the slots are read inside the kernel, so the launch is capturable. The layer's
`cumulative_length` is not advanced here: the static target resets it to `length` at every commit
(graphs/static_target.py), and nothing in a resident forward reads it after the layer's update.

One program per (batch, head, token) row of q, k or v; rows need unit stride along head_dim (they may be strided
views of one projection output, e.g. q beside its output gate). `qk_prologue_reference` is the truth.
"""
from __future__ import annotations

import torch

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, tl_dtype, triton
from .norm_triton import rms_norm_reference
from .rope_triton import rope_reference


def qk_prologue_reference(q, k, v, q_weight, k_weight, eps, cos, sin, keys, values, length, offset=True):
    """transformers' ops: q, k, v [B, H*, T, D]; cos/sin [B, T, R]; keys/values [B, Hk, S, D] written in place at
    slots length .. length+T-1; offset: the (1 + w) RMSNorm (Qwen3.5, Qwen3-Next), else w. Returns q_out
    [B, Hq, T, D]."""
    q_out = rope_reference(rms_norm_reference(q, q_weight, eps, offset), cos, sin)
    k_out = rope_reference(rms_norm_reference(k, k_weight, eps, offset), cos, sin)
    starts = length.reshape(-1, 1).expand(q.shape[0], 1)  # [B, 1]: one length for all rows, or one per row
    for row, start in enumerate(starts[:, 0].tolist()):
        slots = start + torch.arange(q.shape[2], device=q.device)
        keys[row].index_copy_(1, slots, k_out[row])
        values[row].index_copy_(1, slots, v[row])
    return q_out


def _qk_prologue_kernel(q, k, v, q_w, k_w, cos, sin, q_out, keys, values, length, stride_len,
                        q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st,
                        c_sb, c_st, o_sb, o_sh, o_st, kv_sb, kv_sh, kv_ss,
                        q_heads, kv_heads, tokens, dim, rotary, eps,
                        OFFSET: tl.constexpr, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0)  # rows (b, head, t): q's B·Hq·T, then k's B·Hk·T, then v's B·Hk·T
    b = tl.program_id(1).to(tl.int64)  # batch row
    cols = tl.arange(0, BLOCK)
    in_dim = cols < dim
    q_rows = q_heads * tokens
    k_rows = kv_heads * tokens
    slot0 = tl.load(length + b * stride_len)  # the row's first new slot (stride 0: one length for all rows)
    if row < q_rows + k_rows:
        if row < q_rows:
            h, t = row // tokens, row % tokens
            src = q + b * q_sb + h * q_sh + t * q_st
            w_ptr = q_w
            dst = q_out + b * o_sb + h * o_sh + t * o_st
        else:
            r = row - q_rows
            h, t = r // tokens, r % tokens
            src = k + b * k_sb + h * k_sh + t * k_st
            w_ptr = k_w
            dst = keys + b * kv_sb + h * kv_sh + (slot0 + t) * kv_ss
        x = tl.load(src + cols, mask=in_dim, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        weight = tl.load(w_ptr + cols, mask=in_dim, other=0.0).to(tl.float32)
        if OFFSET:
            weight = weight + 1.0
        normed = (x * rstd * weight).to(OUT_DTYPE)  # the norm's output in the dtype, as transformers hands it on
        # rotate_half of the rotary part: column c takes -x[c + R/2] (first half) or x[c - R/2] (second half); the
        # partner's normed value is recomputed from its own load (a register shuffle Triton does not offer)
        half = rotary // 2
        in_rot = cols < rotary
        partner = tl.where(cols < half, cols + half, cols - half)
        xp = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0).to(tl.float32)
        if OFFSET:
            wp = wp + 1.0
        other = (xp * rstd * wp).to(OUT_DTYPE).to(tl.float32)
        other = tl.where(cols < half, -other, other)
        c = tl.load(cos + b * c_sb + t * c_st + cols, mask=in_rot, other=0.0).to(tl.float32)
        s = tl.load(sin + b * c_sb + t * c_st + cols, mask=in_rot, other=0.0).to(tl.float32)
        first = (normed.to(tl.float32) * c).to(OUT_DTYPE).to(tl.float32)  # each product rounded to the dtype
        second = (other * s).to(OUT_DTYPE).to(tl.float32)
        rotated = (first + second).to(OUT_DTYPE)
        tl.store(dst + cols, tl.where(in_rot, rotated, normed), mask=in_dim)
    else:
        r = row - q_rows - k_rows
        h, t = r // tokens, r % tokens
        value = tl.load(v + b * v_sb + h * v_sh + t * v_st + cols, mask=in_dim, other=0.0)  # (own name: the
        tl.store(values + b * kv_sb + h * kv_sh + (slot0 + t) * kv_ss + cols, value, mask=in_dim)  # branches' types differ)


if HAS_TRITON:
    _qk_prologue_kernel = _LazyJit(_qk_prologue_kernel, pdl=True)


def supported(q, k, v, cos, keys, values) -> bool:
    """Whether `qk_prologue` takes these tensors as they come (else the caller runs transformers' ops)."""
    if not HAS_TRITON or q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or cos.dim() != 3:
        return False
    batch, _, tokens, dim = q.shape
    rotary = cos.shape[-1]
    return (q.dtype == k.dtype == v.dtype == cos.dtype == keys.dtype == values.dtype
            and k.shape[0] == batch and k.shape[2] == tokens and k.shape[3] == dim
            and keys.shape == values.shape and keys.shape[:2] == k.shape[:2] and keys.shape[3] == dim
            and keys.stride() == values.stride() and cos.shape[:2] == (batch, tokens) and rotary % 2 == 0
            and rotary <= dim and all(x.stride(-1) == 1 for x in (q, k, v, cos, keys)))


def qk_prologue(q, k, v, q_weight, k_weight, eps, cos, sin, keys, values, length, offset=True) -> torch.Tensor:
    """`qk_prologue_reference` in ONE launch: q [B, Hq, T, D], k/v [B, Hk, T, D] (strided views allowed, unit stride
    along D), q_weight/k_weight [D] (the RMSNorms' weights, (1 + w) convention), cos/sin [B, T, R] in q's dtype,
    keys/values [B, Hk, S, D] (the static cache, written at slots length .. length+T-1), length [1] or [B] long
    on the device (one per row: the rows of a batch hold different numbers of tokens). Returns q_out [B, Hq, T, D] contiguous."""
    if not supported(q, k, v, cos, keys, values) or cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(
            f"qk_prologue wants q [B, Hq, T, D], k/v [B, Hk, T, D], cos/sin [B, T, R] (R even, ≤ D) and keys/values "
            f"[B, Hk, S, D] of one dtype with unit stride along the last dim; got q {tuple(q.shape)} {q.dtype}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)} {cos.dtype}, keys {tuple(keys.shape)} "
            f"{keys.dtype}.")
    batch, q_heads, tokens, dim = q.shape
    length = length.reshape(-1)
    if length.numel() not in (1, batch) or length.dtype.is_floating_point:
        raise ValueError(f"qk_prologue's length must be an integer tensor of 1 or B={batch} elements, got "
                         f"{tuple(length.shape)} {length.dtype}.")
    kv_heads = k.shape[1]
    q_out = torch.empty((batch, q_heads, tokens, dim), dtype=q.dtype, device=q.device)
    rows = (q_heads + 2 * kv_heads) * tokens
    if rows == 0 or batch == 0:
        return q_out
    block = triton.next_power_of_2(dim)
    _qk_prologue_kernel[(rows, batch)](
        q, k, v, q_weight, k_weight, cos, sin, q_out, keys, values, length, length.stride(0) if length.numel() > 1 else 0,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], cos.stride(0), cos.stride(1),
        *q_out.stride()[:3], *keys.stride()[:3],
        q_heads, kv_heads, tokens, dim, cos.shape[-1], eps,
        OFFSET=offset, BLOCK=block, OUT_DTYPE=tl_dtype(q.dtype), num_warps=1 if block <= 256 else 2)
    return q_out


__all__ = ["qk_prologue", "qk_prologue_reference", "supported"]
