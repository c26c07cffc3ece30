"""Fused RMSNorms of the Qwen hybrids: one launch where transformers' forward runs 6-9 elementwise kernels.

At batch 1 a decode/verify forward is launch-bound (≈ 110 kernels per layer, each a few µs inside a CUDA graph),
and the norms are a fifth of them: two RMSNorms per layer, q/k norms in attention layers, the gated RMSNorm at the
end of every GDN layer. The references are transformers' own modules (same rounding steps, see `rms_norm_reference`
and `gated_rms_norm_reference`); only the order of the fp32 sum of squares differs.

    rms_norm:       y = (x · rsqrt(mean(x²) + eps) · (1 + w)).to(x.dtype)         (Qwen3.5 / Qwen3-Next RMSNorm,
                    with `offset=True`; `offset=False`: · w instead of · (1 + w))
    add_rms_norm:   h = (r + x).to(x.dtype), y = rms_norm(h)   (a decoder layer's residual add and the RMSNorm
                    after it, patches/_decoder.py: one launch instead of two, h read once)
    gated_rms_norm: y = ((w · (x · rsqrt(mean(x²) + eps)).to(dt)) · silu(z)).to(dt)  (the GDN output norm)
All math in fp32, inputs/outputs in the model dtype; one program per row. Rows are read as groups ([..., M, D] ->
[N, M, D], `_row_groups`), so heads split from a column slice of a wider GEMM output (the attention's q, k of the
one q|k|v GEMM, token stride > M·D) are read in place instead of copied.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, fused_kernels, fused_kernels_active, tl, tl_dtype, triton

# the flag's first name, from when it routed only the norms: kept for code written against it


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = True) -> torch.Tensor:
    """transformers' Qwen3.5 RMSNorm: [..., H] -> [..., H] in x's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * ((1.0 + weight.float()) if offset else weight.float())).type_as(x)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' decoder-layer lines `hidden_states = residual + hidden_states` and the RMSNorm after it:
    (h, norm(h)), both [..., H] in x's dtype."""
    h = residual + x
    return h, rms_norm_reference(h, weight, eps, offset)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3.5 RMSNormGated (silu gate): [..., D] -> [..., D] in x's dtype."""
    dtype = x.dtype
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


def _rms_norm_kernel(x, w, y, stride_x_group, stride_x, x_group, stride_y, n, eps, OFFSET: tl.constexpr,
                     BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    p_x = x + (row // x_group) * stride_x_group + (row % x_group) * stride_x  # rows come in groups of x_group
    v = tl.load(p_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    weight = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        weight = weight + 1.0
    tl.store(y + row * stride_y + cols, (v * rstd * weight).to(OUT_DTYPE), mask=mask)


def _add_rms_norm_kernel(x, r, w, h, y, stride_x, stride_r, stride_h, stride_y, n, eps, OFFSET: tl.constexpr,
                         BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    a = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(r + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # torch adds two bf16/fp16 tensors in fp32 and rounds once: so does this (fp32: the same IEEE sum)
    total = (b + a).to(OUT_DTYPE)
    tl.store(h + row * stride_h + cols, total, mask=mask)
    v = total.to(tl.float32)  # transformers normalises the rounded sum
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    weight = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        weight = weight + 1.0
    tl.store(y + row * stride_y + cols, (v * rstd * weight).to(OUT_DTYPE), mask=mask)


def gated_norm_row(v, cols, mask, p_y, p_z, w, n, eps, OUT_DTYPE: tl.constexpr):
    """One row's gated RMSNorm in a kernel: v [BLOCK] fp32 (0 where masked), stored at p_y + cols in OUT_DTYPE:
    y = (w · (v · rsqrt(mean(v²) + eps))) · silu(z), with transformers' roundings (also the GDN step's epilogue)."""
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    normed = (v * rstd).to(OUT_DTYPE).to(tl.float32)  # transformers rounds to the model dtype before the weight
    weight = tl.load(w + cols, mask=mask, other=0.0)
    scaled = (weight.to(tl.float32) * normed).to(OUT_DTYPE).to(tl.float32)  # w · y in the model dtype
    gate = tl.load(p_z + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(p_y + cols, (scaled * silu).to(OUT_DTYPE), mask=mask)


def _gated_rms_norm_kernel(x, z, w, y, stride_x, stride_z_group, stride_z, z_group, stride_y, n, eps,
                           BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    p_z = z + (row // z_group) * stride_z_group + (row % z_group) * stride_z  # gate rows come in groups of z_group
    gated_norm_row(v, cols, mask, y + row * stride_y, p_z, w, n, eps, OUT_DTYPE)

if HAS_TRITON:
    gated_norm_row = triton.jit(gated_norm_row)
    _rms_norm_kernel = _LazyJit(_rms_norm_kernel, pdl=True)
    _add_rms_norm_kernel = _LazyJit(_add_rms_norm_kernel, pdl=True)
    _gated_rms_norm_kernel = _LazyJit(_gated_rms_norm_kernel, pdl=True)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., M, D] as [N, M, D] (a view where strides allow: heads split from a column slice stay in place)."""
    groups = x.reshape(-1, x.shape[-2] if x.dim() > 2 else 1, x.shape[-1])
    return groups if groups.stride(-1) == 1 else groups.contiguous()


def _num_warps(block: int) -> int:
    return 4 if block >= 1024 else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = True) -> torch.Tensor:
    """Triton `rms_norm_reference` (one launch); x [..., H], weight [H]."""
    groups = _row_groups(x)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device).view(-1, n)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(out.shape[0],)](groups, weight, out, groups.stride(0), groups.stride(1), groups.shape[1],
                                      out.stride(0), n, eps, OFFSET=offset, BLOCK=block, OUT_DTYPE=tl_dtype(x.dtype),
                                      num_warps=_num_warps(block))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `add_rms_norm_reference` (one launch): (h = residual + x, rms_norm(h)); x, residual [..., H] of one
    dtype, weight [H]."""
    rows, residual_rows = _rows(x), _rows(residual)
    h = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(h)
    block = triton.next_power_of_2(rows.shape[1])
    _add_rms_norm_kernel[(rows.shape[0],)](rows, residual_rows, weight, h, out, rows.stride(0), residual_rows.stride(0),
                                           h.stride(0), out.stride(0), rows.shape[1], eps, OFFSET=offset,
                                           BLOCK=block, OUT_DTYPE=tl_dtype(x.dtype), num_warps=_num_warps(block))
    return h.view(x.shape), out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton `gated_rms_norm_reference` (one launch); x, gate [..., D], weight [D] in x's dtype.

    The gate is read as groups of rows ([..., M, D] -> [N, M, D]), so a gate sliced from a wider GEMM output and
    split into heads ([B, T, HV, dv] with token stride > HV·dv) is read in place instead of copied."""
    rows = _rows(x)
    gates = _row_groups(gate)  # [N, M, D]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(rows.shape[1])
    _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, rows.stride(0), gates.stride(0),
                                             gates.stride(1), gates.shape[1], out.stride(0), rows.shape[1], eps,
                                             BLOCK=block, OUT_DTYPE=tl_dtype(x.dtype),
                                             num_warps=_num_warps(block))
    return out.view(x.shape)
