"""Triton GDN verification and all-layer commit; `gdn_torch` beside it is the reference.

Verify (one launch per layer, one program per (request, value head, dv tile)): from the committed state S_0,
    G = cumsum(g), γ_i = e^{G_i}, Γ_ij = e^{G_i - G_j} (j <= i, masked before exp)
    A = strictly_lower(diag(β) (K Kᵀ ∘ Γ)),  X = (I + A)⁻¹
    Z = X · diag(β) (V - diag(γ) K S_0),     O = diag(γ) Q S_0 + ((Q Kᵀ) ∘ Γ) Z
The window (w <= 16 tokens) is padded to 16 rows, the smallest inner dimension `tl.dot` takes, so the w x w products
are dots too. No state is written. Each program takes the products with the state over dk in slices (fp32 dots),
applies the l2 normalisation afterwards as row and column scales, and solves for X by forward substitution. The
same Z comes out of the recurrence token by token, z_t = β_t (v_t - e^{g_t} S_{t-1}ᵀ k_t) with S_t kept in registers
and never stored (kernel "recurrent", `_recurrent_program`): its cost follows the valid tokens, the block form's is
that of 16. Kernel "auto" (the default) runs windows of up to RECURRENT_UPTO = 8 valid
tokens token by token and longer ones in the block form, per request on the device when valid_len is given (one
launch).

Commit (ONE launch for every layer): per request m from a device tensor,
    S_m = γ_m S_0 + K_{1:m}ᵀ diag(e^{G_m - G_j}) Z_{1:m}   (in place; m = 0 leaves S_0)
and the conv-state roll, in the same launch (extra programs), so a round's whole commit is one graph node. It is
bandwidth-bound (S read and written): each program updates its [dk, 64] state tile in [32, 64] slices.

A plain decoding step (w = 1, its token committed) does not need either: `default_verifier.gdn_decode_step` updates
the state in place in one recurrent step (S read and written once, no commit launch).

Precision: q/k are l2-normalised in fp32 (eps 1e-6 inside the rsqrt, like `gdn_torch.l2norm`; applied as row and
column scales of the raw products), gates, Z and the state are fp32, and every product is an fp32-grade `tl.dot`:
"ieee" (fp32 FMA, the default), "tf32x3" or "bf16x6", chosen per call. Plain TF32 is not offered: a CPU prototype
measured TF32 drift of 2e-5 (K S_0) to 3e-4 (the commit's Kᵀ(d⊙Z)). Measured on an H200 against float64
(benchmarks/results/gdn_kernels.json): ieee Z 6e-8, every S_m 4e-7 and 2e-7 after 200 rounds.
The solve never forms powers of A (the product form (I-A)(I+A²)(I+A⁴)(I+A⁸) does: with aligned keys and β ≈ 1
they grow like binomial coefficients (|A⁸| reached 2.7e3) and cancel in fp32, 7e-5 relative error in X against 9e-8
for substitution). Test: test_aligned_keys_need_a_stable_solve.

Status: exact to fp32 and no per-token state (7.6 MiB of Z + G against 960 MiB at w = 16). On the H200 at batch 1,
30 layers (benchmarks/results/gdn_kernels.md, gdn_kernels_gpu_runs.md runs 4-8): verify + commit 1.00x the
per-token-state verifier at w = 2-4, 1.04x at w = 8, 1.37x at w = 16 (issue 12's 2x / 4x not met: every verify is
latency-bound at 4-11 µs a layer; the state writes the default verifier adds cost it nothing measurable); in the
16-token graphs of the resident rounds the verify alone takes 132 / 187 / 296 / 321 µs at w = 2 / 4 / 8 / 16
against the block form's 316-321 at every w. Tried and measured slower: the whole state tile per program (FMA dots
over dk = 128 spill: 3-10x), the dk loop unrolled (spills), a block-doubling solve (no gain at w = 4; refused by the
compiler at w = 16), a program per commit slice (83-164 µs against 60), the commit folded into the next verify (+33
µs a round); those options were removed (git b2058db has the fold, 0f252d9 the others). A "tile" variant
(tensor-core products with a three-part bf16 split of the state, block doubling, a whole-tile commit) equalled the
block form at batch 1 and was 1.5x slower at batch 8 (run 24, benchmarks/results/gpu_rounds_runs.md); it was
removed after git 57c02b5.

Kernels are bound to `triton.jit` at launch (`_LazyJit`), so `TRITON_INTERPRET=1` set after import (tests) takes
effect. Launches need no host sync; the commit's per-layer pointer tables are cached by address, so call once
before CUDA-graph capture (the warm-up that Triton's JIT needs anyway). Under the interpreter fp32 -> bf16 casts
truncate where the GPU rounds to nearest (bf16 outputs differ in their last bit).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict

import torch

from . import pdl
from .gdn_torch import GDNVerifyResult, PendingGDNLayer, commit_gdn_states, gdn_verify

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton keep the torch path
    triton = None
    tl = None

HAS_TRITON = triton is not None
MAX_WINDOW = 16  # tokens per verification; also the padded dot size
VERIFY_KERNELS = ("auto", "block", "recurrent")
# The verify's kernel: "recurrent" (token by token: default_verifier's kernel without its per-token states, writing
# the block form's Z and G; with valid_len its loop stops at the valid tokens, so its cost follows them), "block"
# (the block form: the cost of T tokens), "auto": windows of at most RECURRENT_UPTO valid tokens token by token, the
# rest in the block form (with valid_len: one launch that branches per request on the device); with RECURRENT_SHORT
# off "auto" is "block". A/B: benchmarks/gdn_kernels.py; switch `gdn-recurrent` of the round benchmarks.
VERIFY_KERNEL = "auto"
RECURRENT_SHORT = True
RECURRENT_UPTO = 8
BACKENDS = ("auto", "triton", "torch")
_L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------
# plumbing shared with default_verifier.py, norm_triton.py and gdn_prologue_triton.py

_fused_active = False


@contextlib.contextmanager
def fused_kernels():
    """While active, patched modules route their tensors to our fused kernels: RMSNorms and RoPE (CUDA tensors),
    the GDN layer's input projection, conv and gates (`patches._gdn`), the MoE router and shared expert
    (`patches._moe`), and the decoder layers' projections to the skinny GEMM where its table names the shape
    (`patches._linear`). Entered around GPU-resident forwards only, so
    plain generate(), training and the eager loop run transformers' own code. HYBRIDSPEC_FUSED_KERNELS=0 in the
    environment keeps transformers' own modules there too (read when a resident forward starts, so graphs captured
    afterwards follow it; for A/B timings and for ruling our kernels out)."""
    global _fused_active
    previous, _fused_active = _fused_active, fused_kernels_allowed()
    try:
        yield
    finally:
        _fused_active = previous


def fused_kernels_active() -> bool:
    return _fused_active


def fused_kernels_allowed() -> bool:
    """Whether `fused_kernels()` turns them on: triton is installed and HYBRIDSPEC_FUSED_KERNELS is not "0"."""
    return HAS_TRITON and os.environ.get("HYBRIDSPEC_FUSED_KERNELS", "1") != "0"


class _LazyJit:
    """`triton.jit(fn, **options)`, bound when first launched in the current TRITON_INTERPRET mode (read at launch,
    not import). `pdl=True`: the kernel takes a `PDL: tl.constexpr` argument and follows `pdl`'s rule (before
    `pdl.enter(PDL)` it reads only weights, or with EARLY_READS what kernels two back wrote, and writes nothing);
    each launch passes PDL and the launch option as `pdl.active` says."""

    def __init__(self, fn, pdl: bool = False, **options):
        self.fn = fn
        self.pdl = pdl
        self.options = options
        self._bound = {}

    def __getitem__(self, grid):
        interpret = bool(triton.knobs.runtime.interpret)
        if interpret not in self._bound:
            self._bound[interpret] = triton.jit(self.fn, **self.options)
        launcher = self._bound[interpret][grid]
        if not self.pdl:
            return launcher
        if pdl.active(interpret):
            return functools.partial(launcher, PDL=True, launch_pdl=True)
        return functools.partial(launcher, PDL=False)


def select_backend(kernel_backend: str, *tensors: torch.Tensor) -> str:
    """"triton" or "torch". "auto": Triton on CUDA tensors, or anywhere when TRITON_INTERPRET=1; else torch."""
    if kernel_backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {kernel_backend!r}")
    if kernel_backend == "auto":
        on_cuda = all(t.is_cuda for t in tensors)
        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        return "triton" if HAS_TRITON and (on_cuda or interpret) else "torch"
    if kernel_backend == "triton" and not HAS_TRITON:
        raise RuntimeError('kernel_backend="triton" needs the triton package; install it or use kernel_backend="torch"')
    return kernel_backend


def tl_dtype(dtype: torch.dtype):
    """The triton element type of a torch float dtype (used for pointers cast from int64 tables)."""
    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if dtype not in table:
        raise TypeError(f"GDN Triton kernels take float32/bfloat16/float16 tensors, got {dtype}")
    return table[dtype]


_POINTER_TABLES: OrderedDict = OrderedDict()
_MAX_TABLES = 256


def pointer_table(rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """[len(rows), L] int64 device tensor of data_ptrs, cached by address so graph replays/captures allocate nothing.

    Content is a function of the key (the addresses themselves), so a cache hit is always right.
    """
    device = rows[0][0].device
    key = (str(device), tuple(tuple(t.data_ptr() for t in row) for row in rows))
    table = _POINTER_TABLES.get(key)
    if table is None:
        host = torch.tensor(key[1], dtype=torch.int64)
        if device.type == "cuda":  # a pinned source may be copied inside a CUDA graph capture (and stays alive)
            host = host.pin_memory()
            table = host.to(device, non_blocking=True)
            table._pinned_source = host
        else:
            table = host.to(device)
        _POINTER_TABLES[key] = table
        if len(_POINTER_TABLES) > _MAX_TABLES:
            _POINTER_TABLES.popitem(last=False)
    else:
        _POINTER_TABLES.move_to_end(key)
    return table


def same_layout(tensors: list[torch.Tensor], name: str) -> None:
    """One launch serves all layers with layer 0's strides: every layer must agree in shape, strides and dtype."""
    def strides(t):  # a size-1 dimension is only ever indexed at 0: its stride does not matter
        return tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride()))

    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if t.shape != first.shape or strides(t) != strides(first) or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"layer {i}'s {name} has shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype} on {t.device}; "
                f"layer 0's has {tuple(first.shape)}, {first.stride()}, {first.dtype} on {first.device}. "
                "All layers of one commit must share one layout."
            )


def _padded(d: int) -> int:
    """Register-tile size of a head dimension: a power of two, at least 16 (the smallest inner dim of `tl.dot`)."""
    return max(16, triton.next_power_of_2(d))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _mask_invalid(x: torch.Tensor, valid_len: torch.Tensor) -> torch.Tensor:
    """Zero tokens at positions >= valid_len[b] of a [B, T, ...] tensor (torch path of `valid_len`)."""
    positions = torch.arange(x.shape[1], device=x.device).view(1, -1, *([1] * (x.dim() - 2)))
    keep = positions < valid_len.to(x.device).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))  # not x * keep: NaN * 0 = NaN


# ----------------------------------------------------------------------------------------------------------------
# verify


def _token(t, b_s, b_q, b_k, b_v, b_g, b_beta, b_G, p_q, p_k, p_v, p_g, p_beta, p_out, p_states, z, g_cum, n, i_b,
           i_h, rv, mk, mv, mask_kv, stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_pt, HV, DV, scale,
           T: tl.constexpr, Z_OUT: tl.constexpr):
    """Token t of the recurrence (its inputs loaded one step ahead: token t+1's are loaded here, index clamped to
    the window): the output, then z_t and G_t (Z_OUT) or S_t; returns the state and token t+1's inputs."""
    t_next = tl.minimum(t + 1, T - 1)
    n_q = tl.load(p_q + t_next * stride_qt, mask=mk, other=0.0)
    n_k = tl.load(p_k + t_next * stride_kt, mask=mk, other=0.0)
    n_v = tl.load(p_v + t_next * stride_vt, mask=mv, other=0.0)
    n_g = tl.load(p_g + t_next * stride_gt)
    n_beta = tl.load(p_beta + t_next * stride_bt)

    f_q = b_q.to(tl.float32)
    f_k = b_k.to(tl.float32)
    f_q = f_q * (tl.rsqrt(tl.sum(f_q * f_q, 0) + 1e-6) * scale)
    f_k = f_k * tl.rsqrt(tl.sum(f_k * f_k, 0) + 1e-6)
    b_s = b_s * tl.exp(b_g.to(tl.float32))
    b_sk = tl.sum(b_s * f_k[:, None], 0)  # [BV] e^{g} S_{t-1}ᵀ k
    b_sq = tl.sum(b_s * f_q[:, None], 0)  # [BV] e^{g} S_{t-1}ᵀ q, independent of the update
    b_z = b_beta.to(tl.float32) * (b_v.to(tl.float32) - b_sk)
    b_s = b_s + f_k[:, None] * b_z[None, :]
    b_o = b_sq + tl.sum(f_q * f_k, 0) * b_z  # S_tᵀ q
    valid = t < n  # ignored tokens of a max-shape graph: zero output, no state stored
    tl.store(p_out + t * HV * DV, tl.where(valid, b_o, 0.0).to(p_out.dtype.element_ty), mask=mv)
    if Z_OUT:  # what the block commit rebuilds S_m from: z_t and G_t, no state per token
        b_G += tl.where(valid, b_g.to(tl.float32), 0.0)
        p_row = (i_b * HV + i_h) * T + t
        tl.store(z + p_row * DV + rv, tl.where(valid, b_z, 0.0), mask=mv)
        tl.store(g_cum + p_row + 0 * rv, b_G + 0.0 * b_z, mask=rv == 0)  # once per head: dv tile 0
    else:
        tl.store(p_states + t * stride_pt, b_s.to(p_states.dtype.element_ty), mask=mask_kv & valid)
    return b_s, n_q, n_k, n_v, n_g, n_beta, b_G


def _recurrent_program(q, k, v, g, beta, state, out, states, z, g_cum, n, i_v, i_h, i_b, i_hk,
                       stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                       stride_vh, stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh, stride_sb,
                       stride_sh, stride_sk, stride_pb, stride_pt, stride_ph, stride_pk, HV, DK, DV, scale,
                       T: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, Z_OUT: tl.constexpr,
                       DYNAMIC: tl.constexpr):
    """One program of the token-by-token verify (default_verifier's kernel, and `_verify_kernel`'s branch for short
    windows): the [dk, BV] state tile in registers through the n valid tokens of the window, each token's output,
    then z_t and G_t (Z_OUT) or S_t into `states`. DYNAMIC (compiled only): the loop stops at n and the ignored rows
    are zero-filled after it; else every token of the window, masked past n (the interpreter's loops take constant
    bounds)."""
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    mask_kv = mk[:, None] & mv[None, :]
    p_q = q + i_b * stride_qb + i_hk * stride_qh + rk
    p_k = k + i_b * stride_kb + i_hk * stride_kh + rk
    p_v = v + i_b * stride_vb + i_h * stride_vh + rv
    p_g = g + i_b * stride_gb + i_h * stride_gh
    p_beta = beta + i_b * stride_bb + i_h * stride_bh
    p_out = out + (i_b * T * HV + i_h) * DV + rv
    p_states = states + i_b * stride_pb + i_h * stride_ph + rk[:, None] * stride_pk + rv[None, :]
    b_s = tl.load(state + i_b * stride_sb + i_h * stride_sh + rk[:, None] * stride_sk + rv[None, :],
                  mask=mask_kv, other=0.0).to(tl.float32)  # [BK, BV]
    # token 0's inputs, then token t+1's while token t is computed (index clamped to the window)
    b_q = tl.load(p_q, mask=mk, other=0.0)
    b_k = tl.load(p_k, mask=mk, other=0.0)
    b_v = tl.load(p_v, mask=mv, other=0.0)
    b_g = tl.load(p_g)
    b_beta = tl.load(p_beta)
    b_G = b_g.to(tl.float32) * 0.0  # Z_OUT: G_t = Σ_{j<=t} g_j over the valid tokens (the block verify's cumsum)
    if DYNAMIC:  # compiled with valid_len: the loop stops at the valid tokens (its cost follows n, not T)
        for t in range(0, n):
            b_s, b_q, b_k, b_v, b_g, b_beta, b_G = _token(
                t, b_s, b_q, b_k, b_v, b_g, b_beta, b_G, p_q, p_k, p_v, p_g, p_beta, p_out, p_states, z, g_cum, n, i_b,
                i_h, rv, mk, mv, mask_kv, stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_pt, HV, DV,
                scale, T, Z_OUT)
        for t in range(n, T):  # ignored tokens: zero output (and Z; G stays G_n), no state stored
            tl.store(p_out + t * HV * DV, tl.zeros([BV], dtype=out.dtype.element_ty), mask=mv)
            if Z_OUT:
                p_row = (i_b * HV + i_h) * T + t
                tl.store(z + p_row * DV + rv, tl.zeros([BV], dtype=tl.float32), mask=mv)
                tl.store(g_cum + p_row + 0 * rv, b_G + tl.zeros([BV], dtype=tl.float32), mask=rv == 0)
    else:  # every token of the window (the interpreter's loops take constant bounds): masked past n
        for t in range(0, T):
            b_s, b_q, b_k, b_v, b_g, b_beta, b_G = _token(
                t, b_s, b_q, b_k, b_v, b_g, b_beta, b_G, p_q, p_k, p_v, p_g, p_beta, p_out, p_states, z, g_cum, n, i_b,
                i_h, rv, mk, mv, mask_kv, stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_pt, HV, DV,
                scale, T, Z_OUT)


def _verify_kernel(
    q, k, v, g, beta, state, out, z, g_cum, valid_len,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_bb, stride_bt, stride_bh,
    stride_sb, stride_sh, stride_sk,
    HV, GROUP, DK, DV, scale,
    T: tl.constexpr, HAS_VALID: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
    BV: tl.constexpr, PRECISION: tl.constexpr, RECURRENT_UPTO: tl.constexpr, DYNAMIC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (dv tile, value head, request). RECURRENT_UPTO > 0 (with valid_len): a request whose window holds
    at most that many valid tokens is verified token by token instead (`_recurrent_program`, the same Z and G; its cost
    follows the valid tokens where the block form's is that of T)."""
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // GROUP  # grouped value heads read key head h // (HV / H)
    n = T
    if HAS_VALID:
        n = tl.load(valid_len + i_b).to(tl.int32)
    short = False
    if RECURRENT_UPTO > 0:
        short = n <= RECURRENT_UPTO
    if short:
        _recurrent_program(q, k, v, g, beta, state, out, state, z, g_cum, tl.minimum(n, T), i_v, i_h, i_b, i_hk,
                           stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                           stride_vh, stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh, stride_sb,
                           stride_sh, stride_sk, 0, 0, 0, 0, HV, DK, DV, scale, T, BK, BV, True, DYNAMIC)
    else:  # the block form
        rt = tl.arange(0, BT)
        rv = i_v * BV + tl.arange(0, BV)
        mt = rt < n  # rows >= n load as zero and so give zero Z and O rows
        mv = rv < DV
        p_q = q + i_b * stride_qb + rt[:, None] * stride_qt + i_hk * stride_qh
        p_k = k + i_b * stride_kb + rt[:, None] * stride_kt + i_hk * stride_kh
        p_s = state + i_b * stride_sb + i_h * stride_sh + rv[None, :]

        # Raw products over dk in BKC-wide slices (an fp32 FMA dot holds its whole inner slice in registers), then the
        # l2 normalisation as row/column scales: (D_q Q)(D_k K)ᵀ = D_q (Q Kᵀ) D_k, (D_k K) S_0 = D_k (K S_0).
        b_ks = tl.zeros([BT, BV], dtype=tl.float32)  # K S_0
        b_qs = tl.zeros([BT, BV], dtype=tl.float32)  # Q S_0
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)  # K Kᵀ
        b_qk = tl.zeros([BT, BT], dtype=tl.float32)  # Q Kᵀ
        b_k2 = tl.zeros([BT], dtype=tl.float32)  # |k_i|²
        b_q2 = tl.zeros([BT], dtype=tl.float32)  # |q_i|²
        for c in range(0, BK, BKC):
            rk = c + tl.arange(0, BKC)
            mk = rk < DK
            b_q = tl.load(p_q + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
            b_k = tl.load(p_k + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
            b_s = tl.load(p_s + rk[:, None] * stride_sk, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
            b_ks += tl.dot(b_k, b_s, input_precision=PRECISION)
            b_qs += tl.dot(b_q, b_s, input_precision=PRECISION)
            b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
            b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
            b_k2 += tl.sum(b_k * b_k, 1)
            b_q2 += tl.sum(b_q * b_q, 1)
        b_rk = tl.rsqrt(b_k2 + 1e-6)  # l2norm: x / sqrt(|x|² + eps), eps inside
        b_rq = tl.rsqrt(b_q2 + 1e-6) * scale
        b_ks = b_ks * b_rk[:, None]
        b_qs = b_qs * b_rq[:, None]
        b_kk = b_kk * b_rk[:, None] * b_rk[None, :]
        b_qk = b_qk * b_rq[:, None] * b_rk[None, :]

        b_v = tl.load(v + i_b * stride_vb + rt[:, None] * stride_vt + i_h * stride_vh + rv[None, :],
                      mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        b_g = tl.load(g + i_b * stride_gb + rt * stride_gt + i_h * stride_gh, mask=mt, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + i_b * stride_bb + rt * stride_bt + i_h * stride_bh, mask=mt, other=0.0).to(tl.float32)
        b_G = tl.cumsum(b_g, 0)  # [BT] fp32
        lower = rt[:, None] >= rt[None, :]
        b_decay = tl.exp(tl.where(lower, b_G[:, None] - b_G[None, :], float("-inf")))  # Γ, masked before exp
        b_a = tl.where(rt[:, None] > rt[None, :], b_beta[:, None] * b_kk * b_decay, 0.0)
        # X = (I + A)^-1 by forward substitution on its rows: x_i = -a_i - Σ_{j<i} A_ij x_j (x = X - I, rows 0, 1
        # closed). Rows >= n have a_i = 0, so their steps are no-ops; the bound stays the compile-time T.
        b_x = -b_a
        for i in range(2, T):
            row_i = rt[:, None] == i
            b_row = tl.sum(tl.where(row_i, b_x, 0.0), 0)
            b_row = b_row + tl.sum(b_row[:, None] * b_x, 0)
            b_x = tl.where(row_i, b_row[None, :], b_x)
        b_x = b_x + tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)

        b_gamma = tl.exp(b_G)
        b_r = b_beta[:, None] * (b_v - b_gamma[:, None] * b_ks)  # [BT, BV]
        b_z = tl.dot(b_x, b_r, input_precision=PRECISION)  # [BT, BV] Z
        b_o = b_gamma[:, None] * b_qs + tl.dot(b_qk * b_decay, b_z, input_precision=PRECISION)

        rows = rt < T
        mask_tv = rows[:, None] & mv[None, :]
        tl.store(out + ((i_b * T + rt[:, None]) * HV + i_h) * DV + rv[None, :], b_o.to(out.dtype.element_ty),
                 mask=mask_tv)
        tl.store(z + ((i_b * HV + i_h) * T + rt[:, None]) * DV + rv[None, :], b_z, mask=mask_tv)
        tl.store(g_cum + (i_b * HV + i_h) * T + rt, b_G, mask=rows & (i_v == 0))


if HAS_TRITON:
    _token = triton.jit(_token)
    _recurrent_program = triton.jit(_recurrent_program)
    _verify_kernel = _LazyJit(_verify_kernel, pdl=True)


# fp32-grade `tl.dot` precisions for fp32 operands (not "tf32", nor Triton's two-part "bf16x3": ~1e-5 and worse)
_FP32_DOT_PRECISIONS = ("ieee", "tf32x3", "bf16x6")
_INTERPRETER_PRECISIONS = ("ieee", "tf32x3")  # the interpreter's subset (it computes every dot in fp32 anyway)


# The plain decoding step (w = 1, m = 1): `default_verifier.gdn_decode_step` updates the state in place (read and
# written once, no commit launch). Run 24: 111 µs per step over 30 layers at batch 1, against 291 µs for the
# verify(1) + commit and 157 µs for the per-token-state verifier + commit; 348 vs 622 / 1044 µs at batch 8.
DECODE_STEP = True


def _verify_config(batch: int, num_v_heads: int, dv: int) -> tuple[int, int, int]:
    """(BV, BKC, num_warps) of the verify kernel, the fastest measured on an H200 (benchmarks/results/
    gdn_kernels.json, sweep): 32-column dv tiles while there are few heads, 64 from 128 heads."""
    if batch * num_v_heads < 128:
        return min(32, triton.next_power_of_2(dv)), 32, 4
    return min(64, triton.next_power_of_2(dv)), 16, 4


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a stand-in of 8 elsewhere (the interpreter runs programs one by
    one, so the CPU tests keep grids small)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _recurrent_upto(programs: int, device: torch.device) -> int:
    """The most valid tokens "auto" verifies token by token (0: none): RECURRENT_UPTO while the block kernel's
    `programs` each have an SM of their own (batch 1 at the 35B-A3B shape: 128 programs on 132 SMs). With more,
    the block form's programs share SMs and the merged kernel's registers cost them occupancy: at batch 8 (1024
    programs) its block form took 966 µs against 759 alone at w = 16, and the recurrence lost from w = 8
    (gdn_kernels_run9.md)."""
    if not RECURRENT_SHORT:
        return 0
    if device.type == "cuda" and programs > _processors(device):  # elsewhere (the interpreter): the branch is tested
        return 0
    return RECURRENT_UPTO


def _dot_precision(precision: str) -> str:
    if precision not in _FP32_DOT_PRECISIONS:
        raise ValueError(f"precision must be one of {_FP32_DOT_PRECISIONS}, got {precision!r}")
    if triton.knobs.runtime.interpret and precision not in _INTERPRETER_PRECISIONS:
        return "ieee"  # same fp32 values: the interpreter's dots are numpy matmuls in the operands' dtype
    return precision


def gdn_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    valid_len: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    precision: str | None = None,
    kernel: str | None = None,
    outputs: GDNVerifyResult | None = None,
) -> GDNVerifyResult:
    """Triton `gdn_torch.gdn_verify`: outputs of T <= 16 tokens and the Z to commit any prefix; `state` is not written.

    q, k: [B, T, H, dk] raw; v: [B, T, HV, dv]; g, beta: [B, T, HV]; state: [B, HV, dk, dv] (fp32).
    valid_len: optional [B] int device tensor; tokens at positions >= valid_len[b] are ignored (their out/Z rows
    are zero), so one max-shape CUDA graph serves every length. Returns out [B, T, HV, dv] in v's dtype,
    z [B, HV, T, dv] fp32, g_cum [B, HV, T] fp32 — written into `outputs` when given (static buffers for graphs).

    block_v / block_k / num_warps: dv tile, dk slice and warps per program (defaults per batch: `_verify_config`).
    precision: every dot's `tl.dot` precision, "ieee" (default), "tf32x3" or "bf16x6". kernel: "block" (the block form
    above) or "recurrent" (the same contract token by token: `default_verifier.recurrent_verify_triton`, whose
    block_v / num_warps defaults are its own) or "auto" (`VERIFY_KERNEL`, the default: windows of at most
    `RECURRENT_UPTO` valid tokens token by token, per request on the device with valid_len).
    """
    batch, t, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    _check_verify_shapes(q, k, v, g, beta, state)
    kernel = kernel or VERIFY_KERNEL
    precision = _dot_precision(precision or "ieee")  # checked whichever kernel runs
    if kernel not in VERIFY_KERNELS:
        raise ValueError(f"kernel must be one of {VERIFY_KERNELS}, got {kernel!r}")
    q, k, v, state = (_last_dim_contiguous(x) for x in (q, k, v, state))
    scale = dk**-0.5 if scale is None else scale
    expected = _empty_verify_result(batch, t, num_v_heads, dv, v.dtype, "meta")
    if outputs is None:
        outputs = _empty_verify_result(batch, t, num_v_heads, dv, v.dtype, v.device)
    elif any(a.shape != e.shape or a.dtype != e.dtype or not a.is_contiguous()
             for a, e in zip((outputs.out, outputs.z, outputs.g_cum), (expected.out, expected.z, expected.g_cum))):
        raise ValueError(
            f"outputs must be contiguous out {tuple(expected.out.shape)} {v.dtype}, z {tuple(expected.z.shape)} and "
            f"g_cum {tuple(expected.g_cum.shape)} float32; got {tuple(outputs.out.shape)}, {tuple(outputs.z.shape)}, "
            f"{tuple(outputs.g_cum.shape)}"
        )
    default_bv, default_bk, default_warps = _verify_config(batch, num_v_heads, dv)
    block_programs = triton.cdiv(dv, block_v or default_bv) * num_v_heads * batch
    upto = _recurrent_upto(block_programs, v.device) if kernel == "auto" else 0
    if kernel == "auto" and valid_len is None:  # the window's length is known here: one kernel or the other
        kernel = "recurrent" if t <= upto else "block"
    if kernel == "recurrent":
        from .default_verifier import recurrent_verify_triton  # it imports this module

        return recurrent_verify_triton(q, k, v, g, beta, state, scale, valid_len, block_v=block_v,
                                       num_warps=num_warps, outputs=outputs)
    out, z, g_cum = outputs.out, outputs.z, outputs.g_cum
    block_v = block_v or default_bv
    block_k = min(block_k or default_bk, _padded(dk))
    grid = (triton.cdiv(dv, block_v), num_v_heads, batch)
    _verify_kernel[grid](
        q, k, v, g, beta, state, out, z, g_cum, valid_len if valid_len is not None else g,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *state.stride()[:3],
        num_v_heads, num_v_heads // num_k_heads, dk, dv, scale,
        T=t, HAS_VALID=valid_len is not None, BT=MAX_WINDOW, BK=_padded(dk), BKC=block_k, BV=block_v,
        PRECISION=precision, RECURRENT_UPTO=upto if kernel == "auto" and valid_len is not None else 0,
        DYNAMIC=not triton.knobs.runtime.interpret, num_warps=num_warps or default_warps,
    )
    return outputs


def _empty_verify_result(batch, t, num_v_heads, dv, dtype, device) -> GDNVerifyResult:
    return GDNVerifyResult(
        out=torch.empty(batch, t, num_v_heads, dv, dtype=dtype, device=device),
        z=torch.empty(batch, num_v_heads, t, dv, dtype=torch.float32, device=device),
        g_cum=torch.empty(batch, num_v_heads, t, dtype=torch.float32, device=device),
    )


def _check_verify_shapes(q, k, v, g, beta, state) -> None:
    batch, t, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    if t > MAX_WINDOW or t < 1:
        raise ValueError(f"the Triton verify takes 1..{MAX_WINDOW} tokens per request, got T={t}; split longer inputs")
    if k.shape != q.shape or v.shape[:2] != (batch, t) or num_v_heads % num_k_heads:
        raise ValueError(
            f"expected q, k [B, T, H, dk] and v [B, T, HV, dv] with HV a multiple of H; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if g.shape != (batch, t, num_v_heads) or beta.shape != g.shape or state.shape != (batch, num_v_heads, dk, dv):
        raise ValueError(
            f"expected g, beta {(batch, t, num_v_heads)} and state {(batch, num_v_heads, dk, dv)}; "
            f"got g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}"
        )


# ----------------------------------------------------------------------------------------------------------------
# commit (all layers, one launch); FOLD=False is the default verifier's copy of a stored per-token state


def _commit_kernel(
    table, n_layers, num_committed,
    B, T, HV, GROUP, DK, DV, C, KC,
    stride_sb, stride_sh, stride_sk,
    stride_ab, stride_at, stride_ah, stride_ak,
    stride_zb, stride_zh, stride_zt,
    stride_gb, stride_gh, stride_gt,
    stride_cb, stride_cc, stride_ck,
    stride_xb, stride_xc, stride_xt,
    n_state_programs,
    FOLD: tl.constexpr, STATE_DTYPE: tl.constexpr, SRC_DTYPE: tl.constexpr, CONV_DTYPE: tl.constexpr,
    CONV_IN_DTYPE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    # table rows: 0 state [B,HV,dk,dv]; 1 FOLD: raw k [B,T,H,dk], else per-token states [B,T,HV,dk,dv];
    #             2 z [B,HV,T,dv] fp32; 3 g_cum [B,HV,T] fp32; 4 conv_state [B,C,KC]; 5 conv_input [B,C,T]
    pid = tl.program_id(0)
    if pid < n_state_programs:
        i_v = pid % NV
        rest = pid // NV
        i_h = rest % HV
        rest = rest // HV
        i_b = (rest % B).to(tl.int64)
        i_l = rest // B
        m = tl.minimum(tl.load(num_committed + i_b).to(tl.int32), T)
        if m > 0:
            rv = i_v * BV + tl.arange(0, BV)
            mv = rv < DV
            p_state = tl.load(table + i_l).to(tl.pointer_type(STATE_DTYPE))
            p_state = p_state + i_b * stride_sb + i_h * stride_sh + rv[None, :]
            p_src = tl.load(table + n_layers + i_l).to(tl.pointer_type(SRC_DTYPE))
            if FOLD:
                p_z = tl.load(table + 2 * n_layers + i_l).to(tl.pointer_type(tl.float32))
                p_g = tl.load(table + 3 * n_layers + i_l).to(tl.pointer_type(tl.float32))
                rt = tl.arange(0, BT)
                mt = rt < m
                p_g = p_g + i_b * stride_gb + i_h * stride_gh
                p_k = p_src + i_b * stride_ab + rt[:, None] * stride_at + (i_h // GROUP) * stride_ah
                p_z = p_z + i_b * stride_zb + i_h * stride_zh + rt[:, None] * stride_zt + rv[None, :]
                b_G = tl.load(p_g + rt * stride_gt, mask=mt, other=0.0)
                b_gm = tl.load(p_g + (m - 1) * stride_gt)
                b_d = tl.exp(tl.where(mt, b_gm - b_G, float("-inf")))  # e^{G_m - G_j}, j < m only
                b_dz = b_d[:, None] * tl.load(p_z, mask=mt[:, None] & mv[None, :], other=0.0)  # [BT, BV]
                b_k2 = tl.zeros([BT], dtype=tl.float32)
                for c in range(0, BK, BKC):
                    rk = c + tl.arange(0, BKC)
                    b_k = tl.load(p_k + rk[None, :], mask=mt[:, None] & (rk < DK)[None, :], other=0.0)
                    b_k = b_k.to(tl.float32)
                    b_k2 += tl.sum(b_k * b_k, 1)
                b_rk = tl.rsqrt(b_k2 + 1e-6)  # the verify's fp32 l2norm of k, recomputed from raw k
                b_gamma = tl.exp(b_gm)
                for c in range(0, BK, BKC):  # S_m rows c .. c+BKC
                    rk = c + tl.arange(0, BKC)
                    mk = rk < DK
                    b_k = tl.load(p_k + rk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
                    b_k = b_k * b_rk[:, None]
                    mask = mk[:, None] & mv[None, :]
                    b_s = tl.load(p_state + rk[:, None] * stride_sk, mask=mask, other=0.0).to(tl.float32)
                    b_s = b_gamma * b_s + tl.dot(tl.trans(b_k), b_dz, input_precision=PRECISION)
                    tl.store(p_state + rk[:, None] * stride_sk, b_s.to(STATE_DTYPE), mask=mask)
            else:
                p_src = p_src + i_b * stride_ab + (m - 1) * stride_at + i_h * stride_ah + rv[None, :]
                for c in range(0, BK, BKC):
                    rk = c + tl.arange(0, BKC)
                    mask = (rk < DK)[:, None] & mv[None, :]
                    b_s = tl.load(p_src + rk[:, None] * stride_ak, mask=mask, other=0.0)
                    tl.store(p_state + rk[:, None] * stride_sk, b_s.to(STATE_DTYPE), mask=mask)
    else:
        # conv roll: new window = columns m .. m+KC-1 of cat(conv_state, conv_input), per channel block
        nc = tl.cdiv(C, BC)
        cid = pid - n_state_programs
        i_c = cid % nc
        rest = cid // nc
        i_b = (rest % B).to(tl.int64)
        i_l = rest // B
        m = tl.minimum(tl.load(num_committed + i_b).to(tl.int32), T)
        if m > 0:
            p_conv = tl.load(table + 4 * n_layers + i_l).to(tl.pointer_type(CONV_DTYPE)) + i_b * stride_cb
            p_x = tl.load(table + 5 * n_layers + i_l).to(tl.pointer_type(CONV_IN_DTYPE)) + i_b * stride_xb
            rc = i_c * BC + tl.arange(0, BC)
            rj = tl.arange(0, BW)
            col = m + rj  # source column in cat(conv_state, conv_input)
            mask = (rc < C)[:, None] & (rj < KC)[None, :]
            from_state = (col < KC)[None, :]
            b_old = tl.load(p_conv + rc[:, None] * stride_cc + col[None, :] * stride_ck, mask=mask & from_state, other=0.0)
            b_new = tl.load(p_x + rc[:, None] * stride_xc + (col - KC)[None, :] * stride_xt, mask=mask & ~from_state,
                            other=0.0)
            b_win = tl.where(from_state, b_old, b_new.to(CONV_DTYPE))
            tl.debug_barrier()  # every thread has read its columns before any is overwritten
            tl.store(p_conv + rc[:, None] * stride_cc + rj[None, :] * stride_ck, b_win, mask=mask)


if HAS_TRITON:
    _commit_kernel = _LazyJit(_commit_kernel, pdl=True)


def launch_commit(
    states: list[torch.Tensor],
    sources: list[torch.Tensor],
    conv_states: list[torch.Tensor],
    conv_inputs: list[torch.Tensor],
    num_committed: torch.Tensor,
    num_key_heads: int,
    z: list[torch.Tensor] | None = None,
    g_cum: list[torch.Tensor] | None = None,
    *,
    block_v: int | None = None,
    block_k: int = 32,
    block_c: int = 256,
    num_warps: int = 4,
    precision: str = "ieee",
) -> None:
    """One launch over all layers: S_m into `states` (fold of k/z/g_cum when z is given, else copy of
    sources[l][b, m-1]) and the conv roll. Layers must share layouts (checked).

    Each program updates a [dk, block_v] state tile (default 64 columns) in [block_k, block_v] slices; the fold's
    dots take `tl.dot` precision `precision` ("ieee", "tf32x3" or "bf16x6")."""
    fold = z is not None
    for tensors, name in ((states, "state"), (sources, "k" if fold else "per-token states"),
                          (conv_states, "conv_state"), (conv_inputs, "conv_input")):
        same_layout(tensors, name)
    if fold:
        same_layout(z, "z")
        same_layout(g_cum, "g_cum")
    batch, num_v_heads, dk, dv = states[0].shape
    channels, kc = conv_states[0].shape[1:]
    t = conv_inputs[0].shape[-1]
    if states[0].stride(-1) != 1 or sources[0].stride(-1) != 1 or (fold and z[0].stride(-1) != 1):
        raise ValueError("the commit needs state, k/per-token states and z contiguous in their last dimension")
    n_layers = len(states)
    table = pointer_table([states, sources, z or sources, g_cum or sources, conv_states, conv_inputs])
    src = sources[0]
    block_k = min(block_k, _padded(dk))
    block_v = block_v or min(64, triton.next_power_of_2(dv))
    nv = triton.cdiv(dv, block_v)
    n_state_programs = n_layers * batch * num_v_heads * nv
    n_conv_programs = n_layers * batch * triton.cdiv(channels, block_c)
    src_strides = (*src.stride()[:3], 0) if fold else (*src.stride()[:3], src.stride(3))
    z_strides = z[0].stride()[:3] if fold else (0, 0, 0)
    g_strides = g_cum[0].stride() if fold else (0, 0, 0)
    _commit_kernel[(n_state_programs + n_conv_programs,)](
        table, n_layers, num_committed,
        batch, t, num_v_heads, num_v_heads // num_key_heads, dk, dv, channels, kc,
        *states[0].stride()[:3], *src_strides, *z_strides, *g_strides,
        *conv_states[0].stride(), *conv_inputs[0].stride(),
        n_state_programs,
        FOLD=fold, STATE_DTYPE=tl_dtype(states[0].dtype), SRC_DTYPE=tl_dtype(src.dtype),
        CONV_DTYPE=tl_dtype(conv_states[0].dtype), CONV_IN_DTYPE=tl_dtype(conv_inputs[0].dtype),
        BT=MAX_WINDOW, BK=_padded(dk), BKC=block_k, BV=block_v, NV=nv, BC=block_c,
        BW=triton.next_power_of_2(kc), PRECISION=_dot_precision(precision), num_warps=num_warps,
    )


def commit_gdn_states_triton(
    layers: list[PendingGDNLayer],
    num_committed: torch.Tensor,
    *,
    block_v: int | None = None,
    block_k: int = 32,
    num_warps: int = 4,
    precision: str = "ieee",
) -> None:
    """Triton `gdn_torch.commit_gdn_states`: S_m and the conv roll of every layer in ONE launch, no host sync.

    num_committed: [B] int device tensor m (0 leaves state and conv state untouched; m is clamped to T).
    block_v / block_k / num_warps / precision: see `launch_commit`.
    The conv roll runs in the same launch as extra programs (a second launch would cost a graph node and ~2 µs
    of launch gap for 64 KiB of conv state per layer and request); each program stages its channels' window in
    registers and syncs its threads before overwriting the columns it read.
    """
    if not layers:
        return
    launch_commit(
        [layer.state for layer in layers],
        [_last_dim_contiguous(layer.k) for layer in layers],
        [layer.conv_state for layer in layers],
        [layer.conv_input for layer in layers],
        num_committed,
        layers[0].k.shape[2],
        z=[layer.verified.z for layer in layers],
        g_cum=[layer.verified.g_cum for layer in layers],
        block_v=block_v,
        block_k=block_k,
        num_warps=num_warps,
        precision=precision,
    )


# ----------------------------------------------------------------------------------------------------------------
# dispatch


def gdn_verify_auto(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    valid_len: torch.Tensor | None = None,
    kernel_backend: str = "auto",
) -> GDNVerifyResult:
    """`gdn_verify_triton` on CUDA (or under TRITON_INTERPRET=1), `gdn_torch.gdn_verify` otherwise."""
    if select_backend(kernel_backend, q, state) == "triton":
        return gdn_verify_triton(q, k, v, g, beta, state, scale, valid_len)
    if valid_len is not None:
        q, k, v, g, beta = (_mask_invalid(x, valid_len) for x in (q, k, v, g, beta))
    return gdn_verify(q, k, v, g, beta, state, scale)


def commit_gdn_states_auto(
    layers: list[PendingGDNLayer], num_committed: torch.Tensor | int, kernel_backend: str = "auto"
) -> None:
    """`commit_gdn_states_triton` on CUDA (or under TRITON_INTERPRET=1; m a [B] int tensor), `gdn_torch.
    commit_gdn_states` otherwise (m a tensor or one int)."""
    if not layers:
        return
    if select_backend(kernel_backend, layers[0].state) == "triton":
        commit_gdn_states_triton(layers, num_committed)
    else:
        commit_gdn_states(layers, num_committed)
