"""Attention of a few queries over a static KV cache whose length lives on the device (flash-decoding).

What the resident forwards attend: a verification (T ≤ 16 new tokens), the AR step (T = 1) and the DFlash drafter's
block (T = block size) read keys from a static buffer of S slots (the target's StaticCache, the drafter's
StaticDraftContext) in which only the first length + T slots are live. SDPA with a mask over all S slots costs
≈ 110 µs per layer on the H200 at the Qwen3.5-35B-A3B shape (16 query heads, 2 KV heads, head_dim 256, T = 16, S ≈
2,000: cuDNN's 64x128x256 tile over the whole capacity), for ≈ 2 MB of live keys and values (≈ 1 µs of bytes), and
it grows with S, not with the length. Here:

    out[b, i, h] = Σ_j softmax_j(scaling · q[b, h, i] · k[b, h // G, j]) v[b, h // G, j]  over the visible slots j

visible: the T new tokens sit at slots length .. length+T-1 (already written), query i at slot length + i, and
    causal:      j < length + i + 1            (the target's verification and AR step)
    non-causal:  j < length + T                (the drafter's block: its whole block and the context)
    window W:    also |length + i - j| < W     (sliding-window drafter layers)
`length` is a [1] or [B] long device tensor read inside the kernel: no host sync, capturable in a CUDA graph.

Layout: one program per (key split, KV head × row block, batch row). GQA-native: the G query heads × T tokens of a
KV head are the rows of one tile (row r = g·T + t), so each key block is read once for all of them, with no
repeat_kv copy. The keys [first, length + T) are cut into `num_splits` equal ranges of whole BLOCK_N blocks, sized
on the device from the length (first = 0, or the window's first slot), so a short context spreads over the splits
too; splits whose range starts past the live keys exit at once (the grid is fixed at capture, from S). Each split
keeps an online softmax in fp32 (running max, sum and output) and writes them at contiguous rows; a second small
kernel, one program per output row, merges the splits (log-sum-exp) and writes the row where transformers wants it
(storing the [64, 256] tile to rows scattered over heads and tokens spilled registers). The number of splits depends
on S (the length bound known on the host) and aims at ~one program per SM at full length: `plan`.

Precision: scores, softmax and accumulation in fp32; the probabilities are rounded to the value dtype for the P·V
dot (bf16/fp16), as flash attention does; fp32 inputs take exact fp32 dots (`input_precision="ieee"`). Under the
Triton interpreter (CPU tests) every dot takes fp32 operands (the same values: it would multiply bf16 bit patterns
as integers) and fp32 -> bf16 casts truncate where the GPU rounds to nearest. `attention_reference` beside it is the
truth (the same maths with an explicit mask, in fp32). Kernels bind to `triton.jit` at launch (`_LazyJit`);
Triton compiles each shape on its first launch (the warm-up before CUDA-graph capture).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, _processors, fused_kernels_active, tl, triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634
_ON_CPU = False  # tests only: the resident forwards take the kernel on CPU tensors too (with the Triton interpreter)


# ----------------------------------------------------------------------------------------------------------------
# reference


def visible_keys(length: torch.Tensor, tokens: int, slots: int, causal: bool = True,
                 window: int | None = None) -> torch.Tensor:
    """bool [B|1, 1, T, S]: whether key slot j is visible to query i (at slot length + i); length [1] or [B] long."""
    device = length.device
    start = length.view(-1, 1, 1)  # [B, 1, 1]
    query = start + torch.arange(tokens, device=device).view(1, -1, 1)  # [B, T, 1]
    keys = torch.arange(slots, device=device).view(1, 1, -1)  # [1, 1, S]
    visible = keys <= query if causal else keys < start + tokens
    if window is not None:
        visible = visible & (query - keys < window) & (keys - query < window)
    return visible[:, None]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, scaling: float,
                        causal: bool = True, window: int | None = None) -> torch.Tensor:
    """`static_attention` in fp32 torch (float64 for float64 q) with an explicit mask: q [B, Hq, T, D], k/v
    [B, Hk, S, D] -> [B, T, Hq, D] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    keys = k.to(work).repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    values = v.to(work).repeat_interleave(group, dim=1)
    scores = (q.to(work) @ keys.transpose(-1, -2)) * scaling  # [B, Hq, T, S]
    mask = visible_keys(length, q.shape[2], k.shape[2], causal, window)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ values).transpose(1, 2).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# kernels


def _key_range(length, i_b, stride_len, T, S, num_splits, window, HAS_WINDOW: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(length, first live key, end of the live keys, keys per split) of batch row i_b: the splits cut
    [first, end) into equal runs of whole BLOCK_N blocks (at most ITERS blocks each, by construction of `plan`)."""
    n = tl.load(length + i_b * stride_len).to(tl.int32)
    end = tl.minimum(n + T, S)  # a length past the buffer (a broken precondition) reads no slot outside it
    first = n * 0
    if HAS_WINDOW:
        first = tl.maximum(n - window + 1, 0)
    chunk = tl.maximum(tl.cdiv(end - first, num_splits * BLOCK_N), 1) * BLOCK_N
    return n, first, end, chunk


def _attention_kernel(
    q, k, v, length, part_o, part_stats,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_len, stride_stats, row_blocks,
    T, G, S, num_splits, window, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ITERS: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_s = tl.program_id(0)
    i_p = tl.program_id(1)  # KV head × row block
    i_b = tl.program_id(2).to(tl.int64)
    i_kv = i_p // row_blocks
    n, first, end, chunk = _key_range(length, i_b, stride_len, T, S, num_splits, window, HAS_WINDOW, BLOCK_N)
    start = first + i_s * chunk
    if start < end:  # else: every key of this split is past the live ones
        stop = tl.minimum(start + chunk, end)
        rows = (i_p % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)  # r = g·T + t
        row_ok = rows < G * T
        t = rows % T
        head = i_kv * G + rows // T
        position = n + t  # each query's own slot
        if CAUSAL:
            hi = position + 1
        else:
            hi = tl.zeros([BLOCK_M], dtype=tl.int32) + n + T
            if HAS_WINDOW:
                hi = tl.minimum(hi, position + window)
        lo = position * 0
        if HAS_WINDOW:
            lo = position - window + 1
        d = tl.arange(0, D)
        b_q = tl.load(q + i_b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                      mask=row_ok[:, None], other=0.0)
        if DOT_FP32:
            b_q = b_q.to(tl.float32)
        p_k = k + i_b * stride_kb + i_kv * stride_kh + d[None, :]
        p_v = v + i_b * stride_vb + i_kv * stride_vh + d[None, :]
        # a finite floor instead of -inf: a row with no visible key in this split keeps m = -1e30, l = 0, acc = 0
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for it in range(ITERS):
            cols = start + it * BLOCK_N + tl.arange(0, BLOCK_N)
            if start + it * BLOCK_N < stop:
                live = cols < stop  # slots past the live keys are never loaded (garbage, or another layer's)
                b_k = tl.load(p_k + cols[:, None] * stride_ks, mask=live[:, None], other=0.0)
                b_v = tl.load(p_v + cols[:, None] * stride_vs, mask=live[:, None], other=0.0)
                if DOT_FP32:
                    b_k = b_k.to(tl.float32)
                s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee" if DOT_FP32 else "tf32") * qk_scale
                seen = live[None, :] & (cols[None, :] < hi[:, None]) & (cols[None, :] >= lo[:, None])
                s = tl.where(seen, s, float("-inf"))  # [BLOCK_M, BLOCK_N] log2-scaled scores
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                p = p.to(b_v.dtype)  # flash attention's rounding of P to the value dtype (none in fp32)
                if DOT_FP32:
                    p, b_v = p.to(tl.float32), b_v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, b_v, input_precision="ieee" if DOT_FP32 else "tf32")
                m_i = m_new
        # partial results at contiguous rows (the output's rows are scattered over heads and tokens: storing
        # [64, 256] there spilled registers at head_dim 256, so the combine, one row per program, writes them)
        slot = (i_b * tl.num_programs(1) + i_p) * num_splits + i_s  # [B, P, splits] of BLOCK_M rows
        r = tl.arange(0, BLOCK_M)
        tl.store(part_o + (slot * BLOCK_M + r)[:, None] * D + d[None, :], acc)
        tl.store(part_stats + slot * BLOCK_M + r, m_i)
        tl.store(part_stats + stride_stats + slot * BLOCK_M + r, l_i)


def _combine_kernel(
    length, out, part_o, part_stats, gate,
    stride_ob, stride_ot, stride_oh, stride_gb, stride_gt, stride_gh,
    stride_len, stride_stats, row_blocks,
    T, G, S, num_splits, window,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr, ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_r = tl.program_id(0)  # ROWS rows of a row block
    i_p = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    n, first, end, chunk = _key_range(length, i_b, stride_len, T, S, num_splits, window, HAS_WINDOW, BLOCK_N)
    r = i_r * ROWS + tl.arange(0, ROWS)
    row = (i_p % row_blocks) * BLOCK_M + r
    d = tl.arange(0, D)
    # a running log-sum-exp merge over blocks of BLOCK_S splits, per (split lane, row); lanes are folded at the end
    m_all = tl.full([BLOCK_S, ROWS], -1.0e30, dtype=tl.float32)
    l_all = tl.zeros([BLOCK_S, ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, ROWS, D], dtype=tl.float32)
    base = (i_b * tl.num_programs(1) + i_p) * num_splits
    for j in range(SPLIT_BLOCKS):  # a compile-time count: the interpreter cannot loop to a runtime bound
        split = j * BLOCK_S + tl.arange(0, BLOCK_S)
        ran = ((split < num_splits) & (first + split * chunk < end))[:, None]  # splits that wrote their rows
        index = (base + split)[:, None] * BLOCK_M + r[None, :]  # [BLOCK_S, ROWS]
        m_s = tl.load(part_stats + index, mask=ran, other=-1.0e30)
        l_s = tl.load(part_stats + stride_stats + index, mask=ran, other=0.0)
        o_s = tl.load(part_o + index[:, :, None] * D + d[None, None, :], mask=ran[:, :, None], other=0.0)
        m_new = tl.maximum(m_all, m_s)
        scale_old = tl.exp2(m_all - m_new)
        scale_new = tl.exp2(m_s - m_new)
        l_all = l_all * scale_old + l_s * scale_new
        acc = acc * scale_old[:, :, None] + o_s * scale_new[:, :, None]
        m_all = m_new
    w = tl.exp2(m_all - tl.max(m_all, 0)[None, :])  # [BLOCK_S, ROWS]
    total = tl.sum(acc * w[:, :, None], 0) / tl.sum(l_all * w, 0)[:, None]  # [ROWS, D]
    t = row % T
    head = (i_p // row_blocks) * G + row // T
    p_out = out + i_b * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    result = total.to(out.dtype.element_ty)
    if HAS_GATE:  # Qwen's output gate, rounded as transformers does: (o · sigmoid(gate).to(dt)).to(dt)
        p_gate = gate + i_b * stride_gb + t[:, None] * stride_gt + head[:, None] * stride_gh + d[None, :]
        g = tl.load(p_gate, mask=(row < G * T)[:, None], other=0.0).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
        result = (result.to(tl.float32) * sig).to(out.dtype.element_ty)
    tl.store(p_out, result, mask=(row < G * T)[:, None])


if HAS_TRITON:
    _key_range = triton.jit(_key_range)
    _attention_kernel = _LazyJit(_attention_kernel, pdl=True)
    _combine_kernel = _LazyJit(_combine_kernel, pdl=True)


# ----------------------------------------------------------------------------------------------------------------
# launch


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `static_attention` takes these tensors (else the caller runs SDPA): q [B, Hq, T, D], k/v
    [B, Hk, S, D] of one float dtype with Hq a multiple of Hk, head_dim a power of two in 16 .. 256, unit stride
    along head_dim."""
    if not HAS_TRITON or q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return False
    batch, q_heads, _, dim = q.shape
    return (q.dtype in _DTYPES and q.dtype == k.dtype == v.dtype and k.shape[0] == batch and k.shape[3] == dim
            and q_heads % k.shape[1] == 0 and 16 <= dim <= MAX_HEAD_DIM and dim & (dim - 1) == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and q.device == k.device == v.device)


def routed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a resident forward's attention runs `static_attention`: inside `fused_kernels()`, grad off, on CUDA
    tensors (or CPU ones under the tests' switch, with the interpreter), in shapes the kernel takes."""
    return (fused_kernels_active() and (q.is_cuda or _ON_CPU) and not torch.is_grad_enabled()
            and supported(q, k, v))


class Plan(NamedTuple):
    """A launch: tiles, warps, and the key splits of the grid."""

    block_m: int  # query rows (heads × tokens) per tile
    block_n: int  # keys per tile
    num_warps: int
    row_blocks: int  # tiles of rows per KV head
    splits: int  # programs along the keys
    iters: int  # the most key blocks one split reads (a compile-time loop count)


def plan(q: torch.Tensor, k: torch.Tensor, window: int | None = None, num_splits: int | None = None) -> Plan:
    """The launch of `static_attention` for q [B, Hq, T, D] and k [B, Hk, S, D] (shapes, dtype and device only).

    Tiles: 16 rows is `tl.dot`'s smallest; 64 rows take Hopper's warpgroup MMA (bf16/fp16); fp32 inputs take exact
    (non tensor-core) dots, hence smaller tiles. Every choice compiles for sm_90 without register spills (checked on
    a CPU machine: triton.compile with GPUTarget("cuda", 90, 32), then ptxas -v).
    Splits: fixed by the host-known bound on the live keys (S slots, or a window's W + T - 1) so that at full
    length the programs fill each SM about once: splits × Hk × row_blocks × B ≈ processors, at most MAX_SPLITS
    (`num_splits` overrides: tests and tuning)."""
    batch, q_heads, tokens, dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    rows = q_heads // kv_heads * tokens
    if q.dtype == torch.float32:
        block_m = min(32, max(16, triton.next_power_of_2(rows)))
        block_n, num_warps = (16 if dim >= 128 else 32), (8 if dim >= 64 else 4)
    else:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        block_n, num_warps = (32 if dim >= 256 and block_m >= 32 else 64), (8 if dim >= 128 else 4)
    row_blocks = triton.cdiv(rows, block_m)
    span = slots if window is None else min(slots, window + tokens - 1)
    key_blocks = max(1, triton.cdiv(span, block_n))
    if num_splits is None:
        num_splits = min(key_blocks, _processors(q.device) // (kv_heads * row_blocks * batch), MAX_SPLITS)
    iters = triton.cdiv(key_blocks, max(1, num_splits))
    return Plan(block_m, block_n, num_warps, row_blocks, triton.cdiv(key_blocks, iters), iters)


def static_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, scaling: float,
                     causal: bool = True, window: int | None = None, num_splits: int | None = None,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over the live slots of k/v [B, Hk, S, D] -> [B, T, Hq, D] in q's dtype
    (contiguous: what transformers' attention functions return). `length` [1] or [B] long on q's device: live
    context slots (the T new keys at length .. length+T-1 are written already); visibility as in the module
    docstring. `num_splits` replaces `plan`'s choice of splits (tests, tuning). `gate` [B, T, Hq, D] (any strides
    but the last): Qwen's gated attention output, out · sigmoid(gate) with transformers' roundings, applied as the
    rows are written. Two launches, no host sync."""
    if not supported(q, k, v):
        raise ValueError(
            f"static_attention takes q [B, Hq, T, D] and k/v [B, Hk, S, D] of one float dtype (fp32/bf16/fp16), "
            f"Hq a multiple of Hk, head_dim a power of two in 16..{MAX_HEAD_DIM}, unit stride along head_dim; got "
            f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}.")
    if length.numel() not in (1, q.shape[0]) or length.dtype.is_floating_point:
        raise ValueError(f"length must be an integer tensor of 1 or B={q.shape[0]} elements, got "
                         f"{tuple(length.shape)} {length.dtype}.")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}.")
    batch, q_heads, tokens, dim = q.shape
    if gate is not None and (gate.shape != (batch, tokens, q_heads, dim) or gate.stride(-1) != 1
                             or gate.dtype != q.dtype or gate.device != q.device):
        raise ValueError(f"gate must be [B, T, Hq, D] = {(batch, tokens, q_heads, dim)} in q's dtype and device with "
                         f"unit stride along D; got {tuple(gate.shape)} {gate.dtype} strides {gate.stride()}.")
    kv_heads, slots = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    block_m, block_n, num_warps, row_blocks, splits, iters = plan(q, k, window, num_splits)
    length = length.reshape(-1)
    out = torch.empty(batch, tokens, q_heads, dim, dtype=q.dtype, device=q.device)
    programs = kv_heads * row_blocks
    part_o = torch.empty(batch * programs * splits * block_m, dim, dtype=torch.float32, device=q.device)
    part_stats = torch.empty(2, batch * programs * splits * block_m, dtype=torch.float32, device=q.device)  # m, l
    interpret = bool(triton.knobs.runtime.interpret)
    common = (length.stride(0) if length.numel() > 1 else 0, part_stats.stride(0), row_blocks,
              tokens, group, slots, splits, window or 0)
    _attention_kernel[(splits, programs, batch)](
        q, k, v, length, part_o, part_stats,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *common, scaling * _LOG2E,
        D=dim, BLOCK_M=block_m, BLOCK_N=block_n, ITERS=iters, CAUSAL=causal, HAS_WINDOW=window is not None,
        DOT_FP32=q.dtype == torch.float32 or interpret, num_warps=num_warps, num_stages=1)
    block_s = min(16, triton.next_power_of_2(splits))
    rows = block_m if interpret else 1  # one output row per program on the GPU; few programs for the interpreter
    gate_strides = gate.stride()[:3] if gate is not None else (0, 0, 0)
    _combine_kernel[(block_m // rows, programs, batch)](
        length, out, part_o, part_stats, gate if gate is not None else out, out.stride(0), out.stride(1),
        out.stride(2), *gate_strides, *common,
        D=dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_S=block_s, SPLIT_BLOCKS=triton.cdiv(splits, block_s),
        ROWS=rows, HAS_WINDOW=window is not None, HAS_GATE=gate is not None, num_warps=4 if dim >= 128 else 1)
    return out


__all__ = ["Plan", "attention_reference", "plan", "routed", "static_attention", "supported", "visible_keys"]
