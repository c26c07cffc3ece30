"""The DFlash drafter's small fused kernels for the resident draft graph (`drafter/fused.py` wires them).

At the Qwen3.5-35B-A3B shape the draft graph is launch-bound (187 kernels, 0.96 ms busy, against a 0.38 ms bytes
roofline on the H200: benchmarks/results/breakdown_qwen35_35b_a3b.md). Per drafter layer its eager static path runs
q_norm, k_norm, two RoPEs and two scatters of the block's K/V into the static context (6 launches), and two residual
adds beside two RMSNorms. Here:

    qk_norm_rope_store   per head row of a q|k|v projection output: RMSNorm (q_norm / k_norm weights), RoPE from
                         a cos/sin table at the row's position length[b] + t, q to `q_out`, k and v written into the
                         static context's slot length[b] + t (clamped to the last slot) — one launch, any number of
                         layers (the context append projects every layer's K/V in one GEMM and stores them here)
    add_rms_norm         h = x + delta (the residual add), y = RMSNorm(h) — one launch, both outputs

Rounding: the eager drafter's steps (`DFlashRMSNorm`, `_rotate`, each torch op on bf16/fp16 computing in fp32 and
rounding its output): the normalised row is rounded to the model dtype before the weight multiplies it, the product
rounded; each RoPE product rounded, then their sum; the residual sum rounded before the norm reads it. In fp32 every
rounding is the identity, so fp32 results equal the references up to the order of the fp32 sum of squares. Under the
interpreter (triton 3.6, CPU tests) fp32 -> bf16 casts truncate where the GPU rounds to nearest.

`length` [B] long lives on the device and is read inside the kernel: no host sync, capturable in a CUDA graph.
Kernels bind to `triton.jit` at launch (`_LazyJit`), so `TRITON_INTERPRET=1` runs them on the CPU (tests).
"""
from __future__ import annotations

import torch

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, tl_dtype, triton

# ----------------------------------------------------------------------------------------------------------------
# references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager `DFlashRMSNorm`: x [..., D] -> [..., D] in x's dtype (normalised in ≥ fp32, rounded, then · w)."""
    dtype = x.dtype
    y = x.to(torch.promote_types(dtype, torch.float32))
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The eager `_rotate`: x [..., D] with cos/sin broadcastable to it (half-split rotation, full head_dim)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def qk_norm_rope_store_reference(x, q_heads, kv_heads, q_weight, k_weight, eps, cos, sin, length, keys, values,
                                 q_out=None) -> None:
    """The truth for `qk_norm_rope_store` (same arguments), writing through indexing instead of one launch."""
    batch, tokens = x.shape[:2]
    layers, dim = k_weight.shape
    slots = keys.shape[3]
    rows = x.reshape(batch, tokens, layers, q_heads + 2 * kv_heads, dim)
    positions = length.view(-1, 1) + torch.arange(tokens, device=x.device)  # [B, T]
    slot = positions.clamp(max=slots - 1)
    c, s = cos[slot][:, :, None], sin[slot][:, :, None]  # [B, T, 1, D]
    b = torch.arange(batch, device=x.device)[:, None].expand(batch, tokens)
    for layer in range(layers):
        heads = rows[:, :, layer]  # [B, T, Hq + 2Hk, D]
        if q_heads:
            q_out.copy_(rope_reference(rms_norm_reference(heads[:, :, :q_heads], q_weight[layer], eps), c, s))
        k = rope_reference(rms_norm_reference(heads[:, :, q_heads:q_heads + kv_heads], k_weight[layer], eps), c, s)
        keys[layer].permute(0, 2, 1, 3)[b, slot] = k  # [B, T, Hk, D] into [B, S, Hk, D]
        values[layer].permute(0, 2, 1, 3)[b, slot] = heads[:, :, q_heads + kv_heads:]


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h)) with h = x + delta (x itself when delta is None), as the eager decoder layer computes them."""
    h = x if delta is None else x + delta
    return h, rms_norm_reference(h, weight, eps)


# ----------------------------------------------------------------------------------------------------------------
# kernels


def _qk_norm_rope_store_kernel(
    x, q_w, k_w, cos, sin, length, keys, values, q_out,
    stride_xb, stride_xt, stride_lw, stride_kl, stride_kb, stride_kh, stride_ks, stride_vl, stride_vb, stride_vh,
    stride_vs, stride_qb, stride_qt, stride_qh, stride_len, stride_cos,
    tokens, slots, q_heads, kv_heads, dim, eps,
    BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    bt = tl.program_id(0)  # (batch row, token)
    layer = tl.program_id(1)
    head = tl.program_id(2)  # q heads first, then the KV heads (each writes its k and its v)
    b = bt // tokens
    t = bt % tokens
    position = tl.load(length + b * stride_len) + t
    slot = tl.minimum(position, slots - 1)  # an overflowing write (a broken precondition) stays in the buffers
    cols = tl.arange(0, BLOCK)
    in_dim = cols < dim
    half = dim // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    row = x + b.to(tl.int64) * stride_xb + t * stride_xt + layer * stride_lw + head * dim
    v = tl.load(row + cols, mask=in_dim, other=0.0).to(tl.float32)
    p = tl.load(row + partner, mask=in_dim, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / dim + eps)
    is_q = head < q_heads
    w_row = tl.where(is_q, q_w, k_w) + layer * dim  # norm weights [L, D], one row per layer
    w_v = tl.load(w_row + cols, mask=in_dim, other=0.0).to(tl.float32)
    w_p = tl.load(w_row + partner, mask=in_dim, other=0.0).to(tl.float32)
    y = (w_v * (v * rstd).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)  # DFlashRMSNorm's roundings
    y_p = (w_p * (p * rstd).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
    rotated = tl.where(cols < half, -y_p, y_p)
    c = tl.load(cos + slot.to(tl.int64) * stride_cos + cols, mask=in_dim, other=0.0).to(tl.float32)
    s = tl.load(sin + slot.to(tl.int64) * stride_cos + cols, mask=in_dim, other=0.0).to(tl.float32)
    out = ((y * c).to(OUT_DTYPE).to(tl.float32) + (rotated * s).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE)
    if is_q:
        tl.store(q_out + b.to(tl.int64) * stride_qb + t * stride_qt + head * stride_qh + cols, out, mask=in_dim)
    else:
        h = head - q_heads
        k_dst = keys + layer.to(tl.int64) * stride_kl + b * stride_kb + h * stride_kh + slot * stride_ks
        tl.store(k_dst + cols, out, mask=in_dim)
        value = tl.load(row + kv_heads * dim + cols, mask=in_dim, other=0.0)
        v_dst = values + layer.to(tl.int64) * stride_vl + b * stride_vb + h * stride_vh + slot * stride_vs
        tl.store(v_dst + cols, value, mask=in_dim)


def _add_rms_norm_kernel(x, delta, weight, h_out, y_out, stride_x, stride_d, stride_h, stride_y, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta + row * stride_d + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(OUT_DTYPE)  # the residual sum, in the model dtype
        tl.store(h_out + row * stride_h + cols, h, mask=mask)
    v = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * (v * rstd).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE)
    tl.store(y_out + row * stride_y + cols, y, mask=mask)


if HAS_TRITON:
    _qk_norm_rope_store_kernel = _LazyJit(_qk_norm_rope_store_kernel, pdl=True)
    _add_rms_norm_kernel = _LazyJit(_add_rms_norm_kernel, pdl=True)


# ----------------------------------------------------------------------------------------------------------------
# launch


def qk_norm_rope_store(x: torch.Tensor, q_heads: int, kv_heads: int, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       length: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       q_out: torch.Tensor | None = None) -> None:
    """Norm + RoPE the q and k heads of L layers' projection rows and store q, k and v, in one launch.

    Args:
        x: [B, T, L·(Hq + 2Hk)·D] projection output (per layer: q heads, k heads, v heads), last dim contiguous.
        q_weight, k_weight: [L, D] q_norm / k_norm weights (q_weight None when q_heads = 0).
        cos, sin: [S, D] RoPE tables by position (slot p holds position p), model dtype.
        length: [B] long on the device: token t of row b sits at position and slot length[b] + t.
        keys, values: [L, B, Hk, S, D] static context buffers (last dim contiguous). A position past the last
            slot (a broken precondition of the caller) reads and writes slot S - 1: meaningless, memory-safe.
        q_out: [B, T, Hq, D] (last dim contiguous) for the normed, rotated queries.
    """
    batch, tokens, width = x.shape
    layers, dim = k_weight.shape
    if (width != layers * (q_heads + 2 * kv_heads) * dim or x.stride(-1) != 1 or keys.shape != values.shape
            or keys.shape[:3] != (layers, batch, kv_heads) or keys.shape[4] != dim or keys.stride(-1) != 1
            or values.stride(-1) != 1 or dim % 2 or cos.shape[-1] != dim or cos.stride() != sin.stride()
            or cos.stride(-1) != 1 or length.numel() not in (1, batch)
            or (q_heads and (q_out is None or q_out.shape != (batch, tokens, q_heads, dim) or q_out.stride(-1) != 1
                             or q_weight is None or q_weight.shape != (layers, dim) or layers != 1))):
        raise ValueError(
            f"qk_norm_rope_store takes x [B, T, L·(Hq + 2Hk)·D], norm weights [L, D], cos/sin [P, D], keys/values "
            f"[L, B, Hk, S, D] and q_out [B, T, Hq, D] (queries for one layer only); got x {tuple(x.shape)}, "
            f"Hq={q_heads}, Hk={kv_heads}, k_weight {tuple(k_weight.shape)}, cos {tuple(cos.shape)}, keys "
            f"{tuple(keys.shape)}, q_out {None if q_out is None else tuple(q_out.shape)}.")
    if batch * tokens == 0:
        return
    q_weight = k_weight if q_weight is None else q_weight
    q_out = x if q_out is None else q_out
    block = triton.next_power_of_2(dim)
    _qk_norm_rope_store_kernel[(batch * tokens, layers, q_heads + kv_heads)](
        x, q_weight, k_weight, cos, sin, length, keys, values, q_out,
        x.stride(0), x.stride(1), (q_heads + 2 * kv_heads) * dim, keys.stride(0), keys.stride(1), keys.stride(2),
        keys.stride(3), values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        q_out.stride(0), q_out.stride(1), q_out.stride(2) if q_out.dim() == 4 else 0,
        length.stride(0) if length.numel() > 1 else 0, cos.stride(0),
        tokens, keys.shape[3], q_heads, kv_heads, dim, eps,
        BLOCK=block, OUT_DTYPE=tl_dtype(x.dtype), num_warps=1 if block <= 256 else 2)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `add_rms_norm_reference` in one launch: x, delta [..., H] (delta None: norm only, h is x itself),
    weight [H] -> (h, y) [..., H] in x's dtype."""
    shape, n = x.shape, x.shape[-1]
    rows = x.reshape(-1, n)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    deltas = rows if delta is None else delta.reshape(-1, n)
    deltas = deltas if deltas.stride(-1) == 1 else deltas.contiguous()
    h = x if delta is None else torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    h_rows = rows if delta is None else h
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, deltas, weight, h_rows, y, rows.stride(0), deltas.stride(0), h_rows.stride(0), y.stride(0), n, eps,
            HAS_DELTA=delta is not None, BLOCK=block, OUT_DTYPE=tl_dtype(x.dtype),
            num_warps=4 if block >= 1024 else 1)
    return (h if delta is None else h.view(shape)), y.view(shape)


__all__ = ["add_rms_norm", "add_rms_norm_reference", "qk_norm_rope_store", "qk_norm_rope_store_reference",
           "rms_norm_reference", "rope_reference"]
