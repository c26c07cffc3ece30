"""Fused rotary position embedding: one launch for the query and key of an attention layer.

transformers' `apply_rotary_pos_emb` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: partial rotary, half-split rotation) runs
six small kernels per tensor (slice, neg, cat, two muls, add, cat with the pass-through part): twelve per attention
layer, a few µs each inside a batch-1 CUDA graph. `rope_qk` does both tensors in one launch with the same rounding
steps (each product rounded to the model dtype, then the sum) and no reduction, so it equals `rope_reference` bit
for bit wherever fp32 -> dtype rounds to nearest as torch does (tests/test_rope_triton.py).

    out[..., :R] = (x_rot · cos).to(dt) + (rotate_half(x_rot) · sin).to(dt)     R = cos.shape[-1] (even)
    out[..., R:] = x[..., R:]
x: [B, heads, T, D] (any strides, last dim contiguous), cos/sin: [B, T, R] in x's dtype. One program per
(batch, head, token) row of q or k.
"""
from __future__ import annotations

import torch

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, tl_dtype, triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' partial-rotary RoPE of one tensor: x [B, H, T, D], cos/sin [B, T, R] -> [B, H, T, D]."""
    rotary = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat([(x_rot * cos) + (rotate_half(x_rot) * sin), x_pass], dim=-1)


def _rope_kernel(q, k, cos, sin, q_out, k_out,
                 q_sb, q_sh, q_st, k_sb, k_sh, k_st, c_sb, c_st,
                 q_rows, q_heads, k_heads, tokens, dim, rotary,
                 BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0)  # rows (b, head, t) in row-major order: q's B·Hq·T first, then k's B·Hk·T
    if row < q_rows:
        x_ptr, out_ptr, r, heads, sb, sh, st = q, q_out, row, q_heads, q_sb, q_sh, q_st
    else:
        x_ptr, out_ptr, r, heads, sb, sh, st = k, k_out, row - q_rows, k_heads, k_sb, k_sh, k_st
    b = r // (heads * tokens)
    h = (r // tokens) % heads
    t = r % tokens
    src = x_ptr + b * sb + h * sh + t * st
    cols = tl.arange(0, BLOCK)
    in_dim = cols < dim
    in_rot = cols < rotary
    half = rotary // 2
    x = tl.load(src + cols, mask=in_dim, other=0.0)
    # rotate_half inside the rotary part: column c takes -x[c + R/2] (first half) or x[c - R/2] (second half)
    partner = tl.where(cols < half, cols + half, cols - half)
    other = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
    other = tl.where(cols < half, -other, other)
    c = tl.load(cos + b * c_sb + t * c_st + cols, mask=in_rot, other=0.0).to(tl.float32)
    s = tl.load(sin + b * c_sb + t * c_st + cols, mask=in_rot, other=0.0).to(tl.float32)
    first = (x.to(tl.float32) * c).to(OUT_DTYPE).to(tl.float32)  # transformers rounds each product to the dtype
    second = (other * s).to(OUT_DTYPE).to(tl.float32)
    rotated = (first + second).to(OUT_DTYPE)
    tl.store(out_ptr + r * dim + cols, tl.where(in_rot, rotated, x.to(OUT_DTYPE)), mask=in_dim)


if HAS_TRITON:
    _rope_kernel = _LazyJit(_rope_kernel, pdl=True)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.shape[-1] % 2 or cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"rope wants x [B, H, T, D] and cos/sin [B, T, R] with R even and ≤ D; got "
                         f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}.")


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope_qk` takes these tensors as they come (else the caller runs the reference)."""
    return (q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.shape[-1] == k.shape[-1]
            and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[-1]
            and cos.shape[0] == q.shape[0] == k.shape[0] and cos.shape[1] == q.shape[2] == k.shape[2]
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and cos.stride() == sin.stride())


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rope_reference` of q [B, Hq, T, D] and k [B, Hk, T, D] in ONE launch -> (q_embed, k_embed), contiguous."""
    _check(q, cos, sin)
    _check(k, cos, sin)
    batch, q_heads, tokens, dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty((batch, q_heads, tokens, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((batch, k_heads, tokens, dim), dtype=k.dtype, device=k.device)
    q_rows, k_rows = batch * q_heads * tokens, batch * k_heads * tokens
    if q_rows + k_rows == 0:
        return q_out, k_out
    block = triton.next_power_of_2(dim)
    _rope_kernel[(q_rows + k_rows,)](
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), q_rows, q_heads, k_heads, tokens, dim, cos.shape[-1],
        BLOCK=block, OUT_DTYPE=tl_dtype(q.dtype), num_warps=1 if block <= 256 else 2)
    return q_out, k_out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope_reference` of one tensor x [B, H, T, D] in one launch (the same kernel, no key rows)."""
    empty = x.new_empty((x.shape[0], 0, x.shape[2], x.shape[3]))
    return rope_qk(x, empty, cos, sin)[0]
