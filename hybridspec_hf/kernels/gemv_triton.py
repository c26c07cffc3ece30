"""Skinny GEMM for the projections of a batch-1 resident forward: y [M, N] = x [M, K] @ W [N, K]ᵀ (+ bias), M ≤ 16.

At M = 1..16 tokens a projection reads its whole weight to make a few rows, so it is bound by how fast W streams.
cuBLAS picks latency-bound tiles there: on the H200 the 35B-A3B forward's 272 GEMMs per step take 2.2 ms against
≈ 0.9 ms of weight bytes at 4.25 TB/s (benchmarks/results/breakdown_qwen35_35b_a3b.md); the small ones (router
[256, 2048], k/v [512, 2048], shared expert [1032, 2048] and down [2048, 512]) run on a few of the 132 SMs.

Grid: one program per (BLOCK_N rows of W, one of SPLIT_K slices of K). A program streams its [BLOCK_N, K / SPLIT_K]
block of W once, coalesced along K, in [BLOCK_N, BLOCK_K] tiles (num_stages of them in flight), and multiplies each
by the matching x tile (≤ 16 rows, from L2): `dot=True` on tensor cores (x padded to a 16-row tile: the padding is
free while W streams), `dot=False` as fp32 FMAs over [BLOCK_N, BLOCK_M, BLOCK_K] products (M ≤ 4). SPLIT_K > 1
gives small N enough programs to fill the SMs (N = 256, BLOCK_N = 16: 16 row blocks x 8 slices = 128 programs) and
reduces in the same launch: each program stores its fp32 partial [M, BLOCK_N] to a workspace, then bumps its row
block's counter (a barrier, then an acq_rel atomic: CUTLASS's split-K semaphore); the program that arrives last sums
the SPLIT_K partials in slice order 0, 1, ... and writes the output, so the result does not depend on arrival order
(deterministic: the same bits every call), and resets the counter to 0 for the next launch. The counters are one
int32 buffer per device shared by every launch, which is right while launches on a device do not overlap (the
resident rounds replay their graphs on one stream).

Precision: fp32 accumulation of exact products (bf16/fp16 operands; fp32 with `input_precision="ieee"`, no TF32,
as torch's default), one rounding to x's dtype after the optional bias (added in fp32, as cuBLAS's bias epilogue).
Against torch.matmul only the order of the fp32 sum differs. Under the interpreter (triton 3.6, CPU tests) dots
take fp32 operands (the same values: it would multiply bf16 bit patterns as integers) and fp32 -> bf16 casts
truncate where the GPU rounds to nearest.

`linear(x, weight, bias)` is what the patched modules call inside resident forwards: our kernel where TABLE names a
config for (N, K, M bucket), else F.linear. TABLE is filled from `benchmarks/gemv.py` on an H200 (it prints the dict
to paste); empty, every projection keeps cuBLAS. Kernels bind to `triton.jit` at launch (`_LazyJit`); Triton
compiles on the first launch of each config and shape: call once before CUDA-graph capture (the warm-up does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, select_backend, tl, tl_dtype, triton

MAX_ROWS = 16  # rows of x (tokens) the kernel takes: one 16-row tile
# A program loads its whole slice of W ([BLOCK_N, K / SPLIT_K], one tile: STEPS = 1) before the PDL wait when the
# slice is at most WHOLE_SLICE_BYTES and a power of two wide, instead of its first BLOCK_K tile: its weight then
# streams while the kernel before it ends (GDN out_proj / attention o_proj after the GDN step or attention: 32 KB per
# program at (32, 128, split 8); M = 1 only at the current TABLE). On since run 69 (H200,
# benchmarks/results/kernel_costs_run69.md, the AR step's traced span): the GEMVs' share of the step 855 -> 756 µs,
# the GDN step's 215 -> 272 (the out_proj's reads now share the bandwidth with it), the step -17 µs; with
# PDL_SHAPES -38 / -43 µs (two captures). False: the first BLOCK_K tile only (A/B, `ar-whole-slice`).
WHOLE_SLICE = True
WHOLE_SLICE_BYTES = 32 * 1024
# The decoder layer's input RMSNorm in the prologue of the projection after it (`linear(..., norm=)`): each program
# sums its rows' squares over all of K (x from L2) and scales its x tiles, so the norm needs no launch of its own
# (the GDN input projection's and the attention's q|k|v copies: 40 launches fewer per AR step at 35B-A3B). Off: on
# the H200 (run 75, benchmarks/results/kernel_costs_run75.md) the AR step took 2.853 ms with it against 2.619 without
# (the GEMVs' share of the traced step 1119 against 840 µs: the prologue's [16, 256] masked loads and the per-tile
# scaling cost each program more than the norm's own launch saves). True: A/B (`ar+norm-prologue`).
NORM_PROLOGUE = False
NORM_TILE = 4096  # values of x per load of the prologue's sum of squares ([BLOCK_M, NORM_TILE / BLOCK_M])
COUNTERS = 4096  # row blocks of one split-K launch (N / BLOCK_N); beyond it a launch does not split K
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """A launch of the kernel: BLOCK_N rows of W by BLOCK_K columns per step, K in SPLIT_K slices (one program each);
    `dot`: tensor cores over a 16-row x tile (any M), else fp32 FMAs (M ≤ 4)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True


# (N, K, M bucket) -> config for our kernel; a shape not listed runs F.linear (cuBLAS). M buckets: `m_bucket`.
# Paste the dict that `benchmarks/gemv.py` prints after an H200 run here.
# measured on the H200 by benchmarks/gemv.py (run 20 of benchmarks/results/gpu_rounds_runs.md, 2026-11-30): our
# config where it beat F.linear by >= 3 %, the rest stays F.linear; the 2048 x 4096 rows for M > 1 and the drafter's
# 2048 x 6144 / 2048 x 10240 from run 25 (2026-12-01; there the attention q|k|v copy 9216 x 2048 and the drafter's
# 5120 x 2048 stayed within 3 % of cuBLAS, so they run F.linear). GemvConfig(block_n, block_k, split_k, num_warps,
# num_stages, dot)
TABLE: dict[tuple[int, int, int], GemvConfig] = {
    # M = 1, the GDN out_proj and attention o_proj: 64-row blocks (64 KB slices, past WHOLE_SLICE_BYTES) measured
    # in the AR step (run 74, benchmarks/results/sweep_b_run74.md): wall -20 µs against (32, 128, 8) (7.7 µs alone,
    # F.linear 8.6), whose whole-slice prefetch slowed the GDN step before it
    (2048, 4096, 1): GemvConfig(64, 128, 8, 4, 4, True),
    (2048, 4096, 4): GemvConfig(32, 128, 4, 4, 6, True),  # 8.0 µs (F.linear 8.7)
    (2048, 4096, 8): GemvConfig(32, 128, 4, 4, 6, True),  # 8.0 µs (F.linear 8.6)
    (2048, 4096, 16): GemvConfig(32, 128, 4, 4, 6, True),  # 8.1 µs (F.linear 8.8)
    (2048, 6144, 1): GemvConfig(32, 128, 4, 4, 6, True),  # 9.8 µs (F.linear 11.0)
    (2048, 6144, 4): GemvConfig(32, 128, 4, 4, 6, True),  # 9.9 µs (F.linear 10.7)
    (2048, 6144, 8): GemvConfig(32, 128, 4, 4, 6, True),  # 10.0 µs (F.linear 10.8)
    (2048, 6144, 16): GemvConfig(32, 128, 4, 4, 6, True),  # 10.1 µs (F.linear 11.1)
    (2048, 10240, 1): GemvConfig(32, 128, 4, 4, 6, True),  # 13.6 µs (F.linear 14.9)
    (2048, 10240, 4): GemvConfig(32, 128, 4, 4, 6, True),  # 13.7 µs (F.linear 15.4)
    (2048, 10240, 8): GemvConfig(32, 128, 4, 4, 6, True),  # 13.9 µs (F.linear 14.9)
    (2048, 10240, 16): GemvConfig(32, 128, 4, 4, 6, True),  # 14.3 µs (F.linear 15.3)
    (12352, 2048, 1): GemvConfig(64, 128, 1, 4, 4, True),  # 14.3 µs (F.linear 15.9)
    (12352, 2048, 4): GemvConfig(64, 128, 1, 4, 4, True),  # 14.4 µs (F.linear 16.0)
    (12352, 2048, 8): GemvConfig(64, 128, 1, 4, 4, True),  # 14.5 µs (F.linear 16.1)
    (12352, 2048, 16): GemvConfig(64, 128, 1, 4, 4, True),  # 14.8 µs (F.linear 16.2)
    (1032, 2048, 1): GemvConfig(32, 128, 8, 4, 4, True),  # 5.1 µs (F.linear 13.0)
    (1032, 2048, 4): GemvConfig(32, 128, 8, 4, 4, True),  # 5.1 µs (F.linear 8.3)
    (1032, 2048, 8): GemvConfig(32, 128, 8, 4, 4, True),  # 5.2 µs (F.linear 5.9)
    (1032, 2048, 16): GemvConfig(32, 128, 8, 4, 4, True),  # 5.3 µs (F.linear 5.9)
    (256, 2048, 1): GemvConfig(4, 512, 4, 4, 2, False),  # 3.3 µs (F.linear 5.6)
    (256, 2048, 4): GemvConfig(4, 512, 4, 4, 2, False),  # 3.8 µs (F.linear 5.7)
    (256, 2048, 8): GemvConfig(16, 256, 8, 4, 3, True),  # 4.1 µs (F.linear 5.7)
    (256, 2048, 16): GemvConfig(16, 256, 8, 4, 3, True),  # 4.1 µs (F.linear 5.7)
    (2048, 512, 1): GemvConfig(4, 512, 1, 4, 2, False),  # 2.8 µs (F.linear 3.7)
    (2048, 512, 4): GemvConfig(64, 128, 1, 4, 4, True),  # 3.3 µs (F.linear 3.7)
    (2048, 512, 8): GemvConfig(64, 128, 1, 4, 4, True),  # 3.4 µs (F.linear 3.8)
    (2048, 512, 16): GemvConfig(64, 128, 1, 4, 4, True),  # 3.4 µs (F.linear 3.8)
    (512, 2048, 1): GemvConfig(4, 512, 4, 4, 2, False),  # 3.8 µs (F.linear 5.7)
    (512, 2048, 4): GemvConfig(16, 256, 8, 4, 3, True),  # 4.5 µs (F.linear 5.7)
    (512, 2048, 8): GemvConfig(16, 256, 8, 4, 3, True),  # 4.6 µs (F.linear 5.7)
    (512, 2048, 16): GemvConfig(16, 256, 8, 4, 3, True),  # 4.7 µs (F.linear 5.7)
    (8192, 2048, 1): GemvConfig(64, 128, 1, 4, 4, True),  # 10.3 µs (F.linear 10.7)
    (8192, 2048, 8): GemvConfig(64, 128, 1, 4, 4, True),  # 10.5 µs (F.linear 10.8)
    (12288, 2048, 1): GemvConfig(64, 128, 1, 4, 4, True),  # 14.3 µs (F.linear 15.2)
    (12288, 2048, 4): GemvConfig(64, 128, 1, 4, 4, True),  # 14.4 µs (F.linear 15.3)
    (12288, 2048, 8): GemvConfig(64, 128, 1, 4, 4, True),  # 14.5 µs (F.linear 15.4)
    (12288, 2048, 16): GemvConfig(64, 128, 1, 4, 4, True),  # 14.7 µs (F.linear 15.5)
    (64, 2048, 1): GemvConfig(4, 512, 4, 4, 2, False),  # 3.0 µs (F.linear 5.2)
    (64, 2048, 4): GemvConfig(4, 512, 4, 4, 2, False),  # 3.3 µs (F.linear 5.2)
    (64, 2048, 8): GemvConfig(16, 256, 8, 4, 3, True),  # 3.8 µs (F.linear 5.2)
    (64, 2048, 16): GemvConfig(16, 256, 8, 4, 3, True),  # 3.8 µs (F.linear 5.3)
}

# Shapes where our kernel only ties cuBLAS on its own (within 3 %, benchmarks/results/gemv_run25.md) but takes part in
# PDL (kernels/pdl.py), which a cuBLAS launch does not: the kernel after a cuBLAS GEMM can neither start early nor
# prefetch its weights, and the GEMM cannot start before the kernel ahead of it ends. PDL_SHAPES on: `linear` takes
# them too. The attention's one q|k|v copy at the 35B-A3B shape, 10 per AR step: measured in the step at M = 1 only
# (run 69, kernel_costs_run69.md: the step's traced span -10 µs alone, -38 / -43 µs with WHOLE_SLICE); the M > 1
# buckets stay cuBLAS until measured in a verification. False: cuBLAS (A/B, `ar-pdl-shapes`).
PDL_SHAPES = True
PDL_TABLE: dict[tuple[int, int, int], GemvConfig] = {
    (9216, 2048, 1): GemvConfig(64, 128, 1, 4, 4, True),  # 11.64 µs alone (F.linear 11.75)
}
# The same for the buckets of a verification or a draft (M = 2..16), which still run cuBLAS outside the PDL chain:
# the target attention's q|k|v copy (10 a round at the 35B-A3B shape; run 130's round at w = 4: the 10 cuBLAS
# launches 162 µs on an H100 for ≈ 375 MB, 2.3 TB/s) and the drafter's q|k|v (5 a draft, 53 µs). Configs by analogy
# with TABLE's 12288 x 2048 rows (one 64-row block of W per program, whole K; 32 rows for 5120: 160 programs on 132
# SMs), not swept. On since run 133 (H100, benchmarks/results/round_tiles_run133.md, two A/B rows in one run): the
# max-shape round −1 / −31, −42 / −27, −42 / −39, −57 / −37, −57 / −53 µs at w = 1 / 2 / 4 / 8 / 16; batch 1 (run 134,
# batch_b1_run134.md) HybridSpec 1.69 → 1.70x AR (medium), 2.56 → 2.58x (high). False: cuBLAS (A/B `-pdl-wide`).
PDL_WIDE = True
PDL_WIDE_TABLE: dict[tuple[int, int, int], GemvConfig] = {
    **{(9216, 2048, m): GemvConfig(64, 128, 1, 4, 4, True) for m in (4, 8, 16)},
    **{(5120, 2048, m): GemvConfig(32, 128, 1, 4, 4, True) for m in (4, 8, 16)},
}

@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm of the (1 + w) convention applied to x's rows in the GEMM's prologue: weight [K], eps."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class QuantizedRows:
    """A weight [N, K] as int8 rows and a float32 scale per row: W ≈ weight · scale[:, None] (`quantize_rows`)."""

    weight: torch.Tensor  # [N, K] int8, K contiguous
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads of the copy: its int8 rows and their scales (`int8_rows_bytes`)."""
        return int8_rows_bytes(*self.weight.shape)

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether `quantize_rows(weight, out=self)` can write weight's copy into these tensors (same shape and
        device): a CUDA graph captured with them then reads the new values."""
        return self.weight.shape == weight.shape and self.weight.device == weight.device


def int8_rows_bytes(n: int, k: int) -> int:
    """Bytes of the int8 copy of a weight [N, K] (`QuantizedRows`): N·K int8 values and N float32 scales."""
    return n * k + 4 * n


# The int8 GEMV's config (`linear_int8`): 64 rows by 128 columns of int8 (8 KB) a step in 4 stages, K whole per
# program (a 248k-row LM head: 3 880 programs). The best of six on an H100 (run 146, benchmarks/results/
# draft_head_run146.md: a 248 320 x 2 048 head at 15 rows 184 µs, 2.76 TB/s, against 218 for 64 x 256 and 344 for
# cuBLAS on the bf16 head; 32 x 256 in 3 stages 186).
INT8_CONFIG = GemvConfig(64, 128, 1, 4, 4, True)


def int8_config(n: int, k: int) -> GemvConfig:
    """The int8 GEMV's config for a weight [N, K]: INT8_CONFIG's 64-row blocks where N makes ≥ 128 of them (an LM
    head; the drafter's gate|up, 192 blocks, with K split in 2 so that ≥ 384 programs run); for narrower projections
    (a drafter layer's q|k|v, o and down, N = 2048-5120) 32-row blocks with K split so that ≈ 256 programs run.
    Swept on an H100 (run 153, benchmarks/results/draft_head_run153.md, 16 rows): gate|up 12 288 x 2 048 16.8 µs at
    64 x 128 split 2 against 20.0 unsplit (bf16 25.9); q|k|v, o and down within 0.8 µs of the best of ten configs
    (and of bf16: these three are latency-bound alone, 12-18 µs)."""
    if n >= 128 * INT8_CONFIG.block_n:
        split = max(1, min(8, 512 * INT8_CONFIG.block_n // n, k // 512))
        return INT8_CONFIG if split == 1 else GemvConfig(INT8_CONFIG.block_n, INT8_CONFIG.block_k, split,
                                                         INT8_CONFIG.num_warps, INT8_CONFIG.num_stages, True)
    blocks = -(-n // 32)
    return GemvConfig(32, 128, max(1, min(8, 256 // blocks, k // 512)), 4, 4, True)


_FORCE: GemvConfig | None = None  # tests only: this config (fitted to each shape) for every shape, whatever TABLE says


def m_bucket(rows: int) -> int:
    """The M bucket of TABLE's keys: 1, 4 (2-4 rows), 8 (5-8), 16 (9-16)."""
    return 1 if rows <= 1 else 4 if rows <= 4 else 8 if rows <= 8 else 16


# ----------------------------------------------------------------------------------------------------------------
# reference


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The truth for `gemv`: x [..., K] @ weight [N, K]ᵀ (+ bias [N]) in fp32 (float64 for float64), in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return out.to(x.dtype)


def weight_version(weight: torch.Tensor) -> tuple:
    """What says that a weight's int8 copy is still its copy: its storage, in-place version, shape, dtype and device
    (another tensor or a write into this one changes it)."""
    return weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device


def quantize_rows(weight: torch.Tensor, chunk_rows: int = 32768, out: QuantizedRows | None = None) -> QuantizedRows:
    """Symmetric int8 per row: scale = max |row| / 127 (1 for an all-zero row), q = round(row / scale) (to nearest,
    ties to even), so |W - q · scale| ≤ scale / 2 elementwise (up to float32 rounding of the division: 0.5 + 4e-6
    measured). Computed in float32 on weight's device, `chunk_rows` rows at a time (a 248k x 2048 head needs
    ≈ 0.5 GB for q and ≈ 0.3 GB more while it is made); into `out`'s tensors in place if given (same shape and
    device: a CUDA graph that reads them by address sees the new values)."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize_rows takes a float weight [N, K], got {tuple(weight.shape)} {weight.dtype}")
    if out is not None and not out.fits(weight):
        raise ValueError(f"quantize_rows: out holds {tuple(out.weight.shape)} on {out.weight.device}, the weight is "
                         f"{tuple(weight.shape)} on {weight.device}")
    q = out.weight if out is not None else torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = out.scale if out is not None else torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    with torch.no_grad():
        for start in range(0, weight.shape[0], chunk_rows):
            rows = weight[start: start + chunk_rows].detach().float()
            part = rows.abs().amax(dim=1) / 127.0
            part = torch.where(part > 0, part, torch.ones_like(part))
            q[start: start + chunk_rows] = torch.round(rows / part[:, None]).clamp_(-127, 127).to(torch.int8)
            scale[start: start + chunk_rows] = part
    return QuantizedRows(q, scale)


def linear_int8_reference(x: torch.Tensor, quantized: QuantizedRows, chunk_rows: int = 32768) -> torch.Tensor:
    """The truth for the int8 `gemv`: (x @ qᵀ) · scale in float32 (float64 for float64 x), in x's dtype; q is
    widened `chunk_rows` rows at a time (a CPU's copy of a 248k-row head stays ≈ 256 MB)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    q, scale = quantized.weight, quantized.scale
    parts = [F.linear(x.to(dtype), q[i: i + chunk_rows].to(dtype)) * scale[i: i + chunk_rows].to(dtype)
             for i in range(0, q.shape[0], chunk_rows)]
    return torch.cat(parts, dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# kernel


def _gemv_tile(acc, b_w, b_x, DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + b_w [BLOCK_N, BLOCK_K] · b_xᵀ [BLOCK_K, BLOCK_M] (fp32 accumulation). An int8 W
    (`QuantizedRows`) is cast to x's dtype first: every int8 value is exact in bf16, fp16 and fp32."""
    if DOT:
        if DOT_FP32:
            acc += tl.dot(b_w.to(tl.float32), tl.trans(b_x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(b_w.to(b_x.dtype), tl.trans(b_x))
    else:
        acc += tl.sum(b_w.to(tl.float32)[:, None, :] * b_x.to(tl.float32)[None, :, :], axis=2)
    return acc


def _normed_tile(b_x, rstd, norm_w, cols, k_ok, NORM: tl.constexpr):
    """x tile [BLOCK_M, BLOCK_K] as the RMSNorm (1 + w) before the GEMM returns it (`norm_triton._rms_norm_kernel`'s
    products and rounding): x · rstd · (1 + w), in x's dtype; b_x itself without NORM."""
    if NORM:
        weight = tl.load(norm_w + cols, mask=k_ok, other=0.0).to(tl.float32) + 1.0
        b_x = (b_x.to(tl.float32) * rstd[:, None] * weight[None, :]).to(b_x.dtype)
    return b_x


def _gemv_kernel(
    x, w, bias, y, partials, counters, norm_w, scale,
    M, N, K, stride_xm, stride_wn, stride_ym, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEPS: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, NORM_CHUNK: tl.constexpr, NORM_STEPS: tl.constexpr, SCALED: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * (STEPS * BLOCK_K)  # each program: STEPS tiles of BLOCK_K columns
    # rows past N read row rn mod N (valid memory, so the W loads need no mask) and are never stored
    p_w = w + (rn % N).to(tl.int64)[:, None] * stride_wn + (k_start + rk)[None, :]  # [BLOCK_N, BLOCK_K]
    p_x = x + rm[:, None] * stride_xm + (k_start + rk)[None, :]  # [BLOCK_M, BLOCK_K]
    row_ok = rm < M
    # the first W tile before the PDL wait (weights: no kernel writes them), so it streams while the kernel before
    # this one ends; x (that kernel's output) after it
    k_ok = (k_start + rk) < K
    b_w = tl.load(p_w) if EVEN_K else tl.load(p_w, mask=k_ok[None, :], other=0.0)
    pdl.enter(PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # x is the RMSNorm's input: each program sums its rows' squares over all of K (L2 reads)
        rc = tl.arange(0, NORM_CHUNK)
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in tl.static_range(NORM_STEPS):
            chunk = c * NORM_CHUNK + rc
            v = tl.load(x + rm[:, None] * stride_xm + chunk[None, :], mask=row_ok[:, None] & (chunk < K)[None, :],
                        other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    b_x = tl.load(p_x, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    b_x = _normed_tile(b_x, rstd, norm_w, k_start + rk, k_ok, NORM)
    acc = _gemv_tile(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), b_w, b_x, DOT, DOT_FP32)
    for step in range(1, STEPS):  # y block, transposed: W's rows are the long side
        p_w += BLOCK_K
        p_x += BLOCK_K
        cols = k_start + step * BLOCK_K + rk
        k_ok = cols < K
        if EVEN_K:
            b_w = tl.load(p_w)
            b_x = tl.load(p_x, mask=row_ok[:, None], other=0.0)
        else:
            b_w = tl.load(p_w, mask=k_ok[None, :], other=0.0)
            b_x = tl.load(p_x, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_x = _normed_tile(b_x, rstd, norm_w, cols, k_ok, NORM)
        acc = _gemv_tile(acc, b_w, b_x, DOT, DOT_FP32)

    if SCALED:  # int8 rows: W = q · scale per row (`QuantizedRows`), so y = scale · (q x)
        acc = acc * tl.load(scale + rn % N)[:, None]
    out_ok = (rn < N)[:, None] & row_ok[None, :]
    if SPLIT_K > 1:
        offsets = rm[None, :] * N + rn[:, None]  # partials [SPLIT_K, M, N] fp32
        tl.store(partials + pid_k * M * N + offsets, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is written before the signal (release below)
        arrived = tl.atomic_add(counters + pid_n, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:  # all partials are in: sum them in slice order (not arrival order), past L1
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(partials + s * M * N + offsets, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(counters + pid_n, 0)  # zero again for the next launch
        out_ok = out_ok & last
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y + rm[None, :] * stride_ym + rn[:, None], acc.to(OUT_DTYPE), mask=out_ok)


if HAS_TRITON:
    _gemv_tile = triton.jit(_gemv_tile)
    _normed_tile = triton.jit(_normed_tile)
    _gemv_kernel = _LazyJit(_gemv_kernel, pdl=True, do_not_specialize=["M"])  # one compile for every M of a config


# ----------------------------------------------------------------------------------------------------------------
# launch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (all zero between launches; also moe_triton's decode kernels'). Made on the first launch outside a CUDA-graph
    capture (the warm-up); one made inside a capture belongs to that graph's pool, so it is not kept."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _COUNTERS[device] = counters
    return counters


def fit_config(config: GemvConfig, rows: int, n: int, k: int) -> GemvConfig:
    """`config` for this shape: blocks no larger than the problem (tl.dot takes ≥ 16), no more K slices than BLOCK_K
    steps, no split past COUNTERS row blocks, FMAs only for ≤ 4 rows (else tensor cores)."""
    dot = config.dot or rows > 4
    block_n = min(config.block_n, triton.next_power_of_2(n))
    block_k = min(config.block_k, triton.next_power_of_2(k))
    if dot:
        block_n, block_k = max(16, block_n), max(16, block_k)
    split_k = max(1, min(config.split_k, triton.cdiv(k, block_k)))
    if triton.cdiv(n, block_n) > COUNTERS:
        split_k = 1
    return GemvConfig(block_n, block_k, split_k, config.num_warps, config.num_stages, dot)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
         norm: RowNorm | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton `linear_reference` in one launch: x [..., K] with ≤ MAX_ROWS rows, weight [N, K] (K contiguous),
    bias [N] or None, all of one float dtype -> [..., N] in x's dtype. `config` is fitted to the shape. With `norm`
    the GEMM's input is the RMSNorm (1 + w) of x's rows (`linear_reference(rms_norm_reference(x, ...), ...)`).
    With `scale` [N] float32 the weight is int8 rows of a `QuantizedRows` (W = weight · scale per row):
    `linear_int8_reference`."""
    n, k = weight.shape
    w_dtype = torch.int8 if scale is not None else x.dtype
    if x.shape[-1] != k or weight.stride(-1) != 1 or weight.dtype != w_dtype or x.dtype not in _DTYPES or \
            (scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32 or norm is not None)) or \
            (bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype)) or \
            (norm is not None and (norm.weight.shape != (k,) or norm.weight.dtype != x.dtype)):
        raise ValueError(f"gemv takes x [..., K], weight [N, K] with K contiguous, bias [N] or None and a norm "
                         f"weight [K] or None, all of one dtype (float32/bfloat16/float16), or int8 weight rows "
                         f"with a float32 scale [N] and no norm; got x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype} strides {weight.stride()}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}, norm weight "
                         f"{None if norm is None else (tuple(norm.weight.shape), norm.weight.dtype)}, scale "
                         f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    m = rows.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x, got {m}; use F.linear")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    config = fit_config(config, m, n, k)
    steps = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k)
    k_per_split = steps * config.block_k
    if WHOLE_SLICE and steps > 1 and config.block_n * k_per_split * weight.element_size() <= WHOLE_SLICE_BYTES and \
            k_per_split & (k_per_split - 1) == 0:  # one tile of the slice's width (tl.arange: a power of two)
        config = GemvConfig(config.block_n, k_per_split, config.split_k, config.num_warps, 1, config.dot)
        steps = 1
    split_k = triton.cdiv(k, k_per_split)  # no slice without columns
    partials = counters = out  # unused without a split
    if split_k > 1:
        partials = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    interpret = bool(triton.knobs.runtime.interpret)
    block_m = 16 if config.dot else triton.next_power_of_2(m)
    norm_chunk = min(triton.next_power_of_2(k), max(16, NORM_TILE // block_m))  # [block_m, chunk]: ≤ 4096 values
    _gemv_kernel[(triton.cdiv(n, config.block_n), split_k)](
        rows, weight, bias if bias is not None else weight, out, partials, counters,
        norm.weight if norm is not None else weight, scale if scale is not None else weight,
        m, n, k, rows.stride(0), weight.stride(0), out.stride(0), norm.eps if norm is not None else 0.0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        STEPS=steps, SPLIT_K=split_k, DOT=config.dot, DOT_FP32=x.dtype == torch.float32 or interpret,
        EVEN_K=k % k_per_split == 0, HAS_BIAS=bias is not None, NORM=norm is not None, NORM_CHUNK=norm_chunk,
        NORM_STEPS=triton.cdiv(k, norm_chunk), SCALED=scale is not None, OUT_DTYPE=tl_dtype(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.view(*x.shape[:-1], n)


# ----------------------------------------------------------------------------------------------------------------
# dispatch


def choose_config(rows: int, n: int, k: int) -> GemvConfig | None:
    """TABLE's config for (N, K, M bucket), else PDL_TABLE's (with PDL_SHAPES on), else PDL_WIDE_TABLE's (with
    PDL_WIDE on), or None: F.linear."""
    if _FORCE is not None:
        return _FORCE
    key = (n, k, m_bucket(rows))
    config = TABLE.get(key, PDL_TABLE.get(key) if PDL_SHAPES else None)
    return PDL_WIDE_TABLE.get(key) if config is None and PDL_WIDE else config


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           norm: torch.nn.Module | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by `gemv` where TABLE names a config for the shape and the tensors suit it (≤ 16
    rows, one float dtype, on CUDA or under the interpreter), else by F.linear itself. `norm`: an RMSNorm module of
    the (1 + w) convention (weight [K], `eps` or `variance_epsilon`) to apply to x first: in the GEMM's prologue
    while NORM_PROLOGUE is on and `gemv` takes the call, else by calling the module."""
    if weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and x.numel() > 0:
        rows = x.numel() // x.shape[-1]
        config = choose_config(rows, *weight.shape) if rows <= MAX_ROWS else None
        if config is not None and _suits(x, weight, bias):
            row_norm = None if norm is None else _row_norm(norm, x)
            if norm is None or row_norm is not None:
                return gemv(x, weight, bias, config, row_norm)
    return F.linear(x if norm is None else norm(x), weight, bias)


def linear_int8(x: torch.Tensor, quantized: QuantizedRows) -> torch.Tensor:
    """x [..., K] @ (the quantized weight)ᵀ in x's dtype: `gemv` at `int8_config` where it suits (≤ MAX_ROWS rows of
    a float dtype, on CUDA or under the interpreter), else `linear_int8_reference`."""
    q = quantized.weight
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"linear_int8: x has {x.shape[-1]} features, the quantized weight {q.shape[1]}")
    if 0 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and _suits(x, q, None, weight_dtype=torch.int8):
        return gemv(x, q, None, _FORCE or int8_config(*q.shape), scale=quantized.scale)
    return linear_int8_reference(x, quantized)


def _row_norm(norm: torch.nn.Module, x: torch.Tensor) -> RowNorm | None:
    """The module's weight and epsilon for the GEMM's prologue (NORM_PROLOGUE on, a plain weight [K] in x's dtype),
    else None."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if not NORM_PROLOGUE or type(weight) not in (torch.Tensor, torch.nn.Parameter) or not isinstance(eps, float):
        return None
    return RowNorm(weight, eps) if weight.shape == (x.shape[-1],) and weight.dtype == x.dtype else None


def _suits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           weight_dtype: torch.dtype | None = None) -> bool:
    """Plain tensors (not DTensors or other subclasses: their F.linear does more than a matmul) of one float dtype
    (the weight's `weight_dtype` if given: int8 rows), K contiguous, grad off, where Triton runs."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter)
                and t.dtype == (weight_dtype if t is weight and weight_dtype is not None else x.dtype) for t in tensors)
    return (plain and x.dtype in _DTYPES and weight.stride(-1) == 1 and (bias is None or bias.dim() == 1)
            and not torch.is_grad_enabled() and select_backend("auto", *tensors) == "triton")
