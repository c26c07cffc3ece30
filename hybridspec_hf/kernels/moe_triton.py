"""Routed experts of a sparse MoE layer: each distinct expert's weights read once per call, no host
sync, static shapes, so the call can be captured in a CUDA graph. `fused_experts_reference` beside it is the truth.

What transformers' MoE blocks call: `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` with
gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and down_proj [E, H, I]:

    out[t] = Σ_j w[t, j] · down_e (SiLU(gate_e x_t) · up_e x_t),   e = top_k_index[t, j]

Three launches, the fused_moe plan (sglang/vLLM) with the align step folded into the kernels at decode sizes:
  1. gate_up: one program per (expert slot, I-block) computes the gate and up columns of its block for every row
     the expert serves and stores SiLU(gate)·up, fp32, into act [S, I] (S = T·k token–expert pairs).
  2. down: one program per (expert slot, H-block) reads act, multiplies by the expert's down block and stores
     w · y into per-pair rows [S, H] fp32.
  3. sum: out[t] = Σ_j rows[t·k + j] in a fixed order (deterministic, no atomics), cast to the hidden dtype.

Two ways to assign rows to programs, both with a grid sized for the worst case and programs that exit at once:
  - "direct" (T <= direct_limit(): 16 tokens, one row's whole block; 32 with WIDE_DIRECT on; the
    kernels take up to DIRECT_MAX_TOKENS = 64 with mode="direct"): slot p is the p-th token–expert pair; the program
    works only if p is the first pair naming its expert (a scan of <= S ids), and then takes ALL tokens as its rows
    (one tile of 16, 32 or 64 rows), masked to those that chose the expert. No sort, no extra launch: at these sizes
    the padding rows cost tensor-core work that is free while the weights stream, and the sort's ≈ 25 torch
    launches per layer are gone.
  - "sorted" (larger T, prefill): fused_moe's moe_align_block_size in torch ops (sort by expert, pad each expert to
    BM rows; blocks past the padded count carry expert -1 and exit), so compute scales with S, not T · experts;
    `align_pairs_triton` does the same in one launch for up to 4,096 pairs (ALIGN_KERNEL, on since run 62).
Either way one program column per distinct expert streams that expert's weights: bytes = distinct experts × 6 MiB
at the Qwen3.5-35B-A3B shape (E=256, H=2048, I=512, bf16), against a copy per pair in transformers' batched_mm.

"decode" (T <= DECODE_MAX_TOKENS, the AR step and 2-token verifications; `DECODE_PATH` switches it off for A/B): two
launches, weights read in their layout through wide loads along the contiguous reduction, products as fp32 FMAs on
the CUDA cores (a 16-row tensor-core tile would be >= 75 % padding), one token row at a time:
  1. gate_up, grid (I / BN, SPLIT, slots): program (i_n, i_k, p) takes BN gate and BN up rows of slot p's expert
     (the direct rows' slots: pair p if it is the first naming its expert, slot S the shared expert) over K slice
     i_k of H, for every token. SPLIT > 1: partials to a workspace; the last of the SPLIT programs to bump the
     (slot, column block) counter sums them in slice order (CUTLASS's split-K semaphore, as kernels/gemv_triton.py:
     integer atomics only, so the bits do not depend on arrival order) and stores SiLU(gate)·up to act [slots, T, I]
     fp32; the shared slot's column block 0 also takes the gate logit.
  2. down, grid (H / BN, slots): program (i_n, p) computes y = down_e act for BN output columns and every token,
     times the token's routing weight of that expert (Σ_j w[t, j] over the pairs naming it, 0 if none; the shared
     expert unweighted), into partials [H / BN, slots, T, BN] (zeros for a slot without work); the last program of
     the column block sums the routed slots in slot order, adds sigmoid(logit) · shared and the residual with the
     sum kernel's roundings, and stores the output. No separate sum launch.

Precision: dots accumulate in fp32; bf16/fp16 weights take dot operands in the weight dtype (act is rounded to it
before the down dot, as transformers does); fp32 weights use exact fp32 dots (`input_precision="ieee"`). The routing
weights and the sum over k stay fp32 until the single cast of the output. Under the interpreter (triton 3.6) every
dot takes fp32 operands (the same values: it would multiply bf16 bit patterns as integers) and fp32 -> bf16 casts
truncate where the GPU rounds to nearest, so bf16 errors there are ~2x the GPU's.
Ids outside [0, E) (expert-parallel sentinels) contribute nothing. Kernels bind to `triton.jit` at launch
(`_LazyJit`), so `TRITON_INTERPRET=1` runs them on the CPU (tests). Call once per shape before CUDA-graph capture:
Triton compiles on the first launch (there is no autotuning).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, select_backend
from .gemv_triton import COUNTERS, split_counters
from .shared_expert_triton import gated_add_reference, shared_expert_reference

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # CPU installs without triton keep the reference
    triton = None
    tl = None

DIRECT_MAX_TOKENS = 64  # "direct" rows = all tokens in one tile of up to 64 rows (mode="direct")
# True: "auto" (and the one-pass MoE block, patches/_moe.py) take the direct rows up to WIDE_DIRECT_TOKENS; False: up
# to NARROW_DIRECT_TOKENS (A/B); above, the sorted blocks (the shared expert in its own launches). Measured on the
# H200, vanilla DFlash rounds of ≈ 15 tokens per row: run 55 (benchmarks/results/ab_early_fold_direct_run55.md, the
# sort in torch ops) batch 2 (32 tokens) 13.79 ms direct against 15.08 sorted, batch 4 (64) 20.57 against 19.52;
# run 62 (ab_align_run62.md, the sort in one launch, ALIGN_KERNEL) batch 2 12.13 ms sorted against 14.51 direct,
# so the direct rows stop at 16 tokens again
WIDE_DIRECT = False
WIDE_DIRECT_TOKENS = 32
NARROW_DIRECT_TOKENS = 16
# "decode" (CUDA-core products) up to 4 tokens: each weight element costs T fp32 FMAs, at T = 4 about a quarter of the
# H200's FMA rate while the weights stream at 4.25 TB/s; more tokens go to the tensor cores (the direct rows)
# Measured on the H200 (run 34, `benchmarks/moe_block.py --decode-sweep`, µs per layer at the 35B-A3B shape, best
# tiles): T = 1 decode 22.8 against direct 38.0; T = 2 43.8 against 54.2; T = 4 110.9 against 82.3 — so "auto" takes
# the decode kernels up to 2 tokens (the kernels themselves accept up to 4: `decode_fits`).
DECODE_MAX_TOKENS = 2
DECODE_KERNEL_MAX_TOKENS = 4  # what the decode kernels accept (mode="decode"; the sweep's T = 4 row)
# True: "auto" takes the decode kernels for T <= DECODE_MAX_TOKENS; False: the direct rows (A/B: our AR step 2.97
# ms/token with them against 3.50 without, run 34).
DECODE_PATH = True
# The decode gate_up kernel's shared-expert programs first in its grid, their first weight tiles loaded before the
# PDL wait (every other expert is known only once the router's ids are): the AR step's gate_up had 15.5 µs a layer
# against 8.9 of bytes, none of them in flight while the router ran (run 71). Off: on the H200 the step's traced span
# was 60-72 µs longer with it (runs 75-76, kernel_costs_run75/76.md: the fused router's share and gate_up's both
# grew; the walls -4 / +20 µs, within those machines' noise). True: A/B (`ar+shared-first`).
SHARED_FIRST = False
# The direct rows' programs (gate_up and down) with the shared expert's slot first in the grid, and a slot whose pair
# names no live expert (a token past the round's valid length: its ids are -1; a repeated expert) leaving before it
# loads the token rows. Inside a max-shape round at w = 1 the shared expert's programs ran after 1 920 early exits
# (run 123 of gpu_rounds_runs.md: the round's MoE 1.4-3.1x its bytes at w <= 4). Measured on an H100 (runs 128-129,
# A/B in one run): the round −200 / −125 / −400 / −385 / −250 µs at w = 1 / 2 / 4 / 8 / 16 (the shared expert's
# dense programs no longer the kernels' last wave), HybridSpec at batch 1 1.63 → 1.69x AR (medium), 2.46 → 2.54x
# (high). False: the shared slot last and every program loads its rows first (A/B: `base-direct-shared-first`).
DIRECT_SHARED_FIRST = True
# The direct rows' tiles at 5-16 tokens (a round's block) with a 256-deep K step in 3 stages instead of 128 in 4
# (gate_up 32 x 256, down 64 x 256). Measured on an H100 (run 131, round_tiles_run131.md / batch_b1_run131.md, A/B
# in one run): the round −25 / −115 / −65 / −12 µs at w = 1 / 2 / 4 / 8, +30 at w = 16 (its spread 32); HybridSpec
# at batch 1 1.70 → 1.71x AR (medium), 2.56 → 2.57x (high). False: 32 x 128 / 64 x 128 in 4 stages (A/B:
# `hybridspec-direct-deep-k`).
DIRECT_DEEP_K = True
MODES = ("auto", "decode", "direct", "sorted")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def direct_limit() -> int:
    """The most tokens "auto" (and the one-pass MoE block) give the direct rows: WIDE_DIRECT_TOKENS, or
    NARROW_DIRECT_TOKENS with WIDE_DIRECT off."""
    return WIDE_DIRECT_TOKENS if WIDE_DIRECT else NARROW_DIRECT_TOKENS


@dataclass(frozen=True)
class Tiles:
    """Tile of one GEMM kernel: block_n output columns (gate_up: per half, so 2·block_n weight rows) by block_k of the
    reduction per step; num_stages: software-pipelined loads in flight; split_k: programs along the reduction (the
    decode gate_up only, reduced in the same launch; every other kernel takes 1)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


def default_tiles(num_tokens: int, mode: str) -> tuple[int, Tiles, Tiles]:
    """(block_m, gate_up tiles, down tiles). Direct rows: narrow column blocks so that the few experts of a call
    still spread over every SM (T = 1 at the 35B-A3B shape: 8 experts x 32 gate_up blocks = 256 programs), like
    vLLM's tuned H200 fused_moe configs for E=128/N=1024 at batch 1-8; benchmarks/moe_experts.py sweeps them.
    "decode" (block_m: the tokens padded to a power of two): many short programs of one load step each (the loads
    of a program all in flight at once; Triton does not pipeline loads that feed no dot), so that enough bytes are
    in flight at one token. The tiles are the best of `benchmarks/moe_block.py --decode-sweep` on the H200 (run 34:
    at T = 1 gate_up 32 columns x 256 of K in 8 slices, 8 warps, and down 16 x 256: 22.8 us per layer against 24.4
    at the reasoned tiles before; at T = 2 gate_up 8 x 256 in 8 slices: 43.8 against 50.1). At 3-4 tokens the
    sweep's best (110.9 us at T = 4) lost to the direct rows (82.3), so "auto" stops at DECODE_MAX_TOKENS = 2."""
    if mode == "decode":  # T = 3-4: the sweep's best at 4, for mode="decode" (A/B) only
        if num_tokens == 1:
            return 1, Tiles(32, 256, 8, 1, split_k=8), Tiles(16, 256, 4, 1)
        if num_tokens == 2:
            return 2, Tiles(8, 256, 4, 1, split_k=8), Tiles(16, 256, 4, 1)
        return 4, Tiles(16, 128, 4, 1, split_k=16), Tiles(16, 256, 4, 1)
    if mode == "direct":
        if num_tokens > 16:  # a 32- or 64-row tile: half the K step keeps 4 stages of x and W in shared memory
            return triton.next_power_of_2(num_tokens), Tiles(32, 64), Tiles(64, 64)
        if num_tokens <= 4:
            return 16, Tiles(16, 128), Tiles(32, 128)
        if DIRECT_DEEP_K:
            return 16, Tiles(32, 256, 4, 3), Tiles(64, 256, 4, 3)
        return 16, Tiles(32, 128), Tiles(64, 128)
    if num_tokens <= 32:  # sorted blocks at verification sizes: 16-row blocks, as the direct rows' narrow tiles
        return 16, Tiles(32, 128), Tiles(64, 128)
    return 64, Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)


# ----------------------------------------------------------------------------------------------------------------
# reference


def fused_experts_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """The truth for `fused_experts`, a plain loop over the experts used, in fp32 (float64 for float64 inputs).

    hidden [T, H]; top_k_index [T, k] int; top_k_weights [T, k]; gate_up_proj [E, 2I, H] (gate rows first);
    down_proj [E, H, I]. Returns [T, H] in hidden's dtype. Ids outside [0, E) are skipped. Host syncs (unique,
    where): a reference and the CPU path, not for graphs.
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    num_experts, inter = down_proj.shape[0], down_proj.shape[-1]
    out = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    for expert in top_k_index.unique().tolist():
        if not 0 <= expert < num_experts:
            continue
        tokens, slots = torch.where(top_k_index == expert)
        x = hidden[tokens].to(dtype)  # [n, H]
        gate, up = (x @ gate_up_proj[expert].to(dtype).T).split(inter, dim=-1)  # [n, I] each
        y = (F.silu(gate) * up) @ down_proj[expert].to(dtype).T  # [n, H]
        out.index_add_(0, tokens, y * top_k_weights[tokens, slots].to(dtype)[:, None])
    return out.to(hidden.dtype)


# The torch path computes every expert for every token (`dense_experts`) while the rows it adds beyond the token–
# expert pairs cost at most this many multiply-adds per expert of the layer: about what one iteration of the
# reference's loop costs in per-op overhead on one CPU core (≈ 10 ops of ≈ 5 µs, the time of ≈ 2 MFLOP at
# ≈ 40 GFLOP/s). The tiny pairs' shapes (E = 16, k = 4, H x I = 256 x 32 or 320 x 40) stay dense past 32 tokens;
# Qwen3.5-35B-A3B's (E = 256, I = 512, H = 2048) never is.
DENSE_EXTRA_MACS_PER_EXPERT = 1 << 20


def dense_fits(num_tokens: int, top_k: int, gate_up_proj: torch.Tensor) -> bool:
    """Whether `fused_experts`' torch path takes `dense_experts` (else the reference loop), from the shapes only."""
    num_experts, two_inter, hidden = gate_up_proj.shape
    extra_rows = num_tokens * max(num_experts - top_k, 0)
    return extra_rows * 3 * (two_inter // 2) * hidden <= DENSE_EXTRA_MACS_PER_EXPERT * num_experts


def dense_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """`fused_experts_reference`'s result in two GEMMs and a few elementwise ops, no host sync: every expert on every
    token (one GEMM over all gate_up rows), each token's activations scaled by its routing weight (0 for the experts
    it did not choose), then one GEMM over all (expert, row) pairs of down, which sums the experts' products. Only the
    summation order differs from the reference's (last-bit differences). For the few tokens of a verification on the
    CPU, where the reference's loop over experts is per-op overhead and a batched GEMM per expert is slower than one.

    Shapes and dtypes as `fused_experts_reference`; ids outside [0, E) contribute nothing."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    tokens, size = hidden.shape
    num_experts, inter = down_proj.shape[0], down_proj.shape[-1]
    x = hidden.to(dtype)
    gate_up = F.linear(x, gate_up_proj.to(dtype).reshape(num_experts * 2 * inter, size))  # [T, E·2I]
    gate, up = gate_up.view(tokens, num_experts, 2 * inter).split(inter, dim=-1)
    live = (top_k_index >= 0) & (top_k_index < num_experts)
    weights = torch.where(live, top_k_weights.to(dtype), 0)  # [T, k]
    dense = x.new_zeros(tokens, num_experts).scatter_add_(1, top_k_index.clamp(0, num_experts - 1), weights)
    act = F.silu(gate) * up * dense.unsqueeze(-1)  # [T, E, I]: 0 for the experts a token did not choose
    return (act.reshape(tokens, num_experts * inter) @ _down_rows(down_proj, dtype)).to(hidden.dtype)


_DOWN_ROWS: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, torch.Tensor]] = {}


def _down_rows(down_proj: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """down_proj [E, H, I] as [E·I, H] in `dtype` (a copy): computed once per weight and version while the weight
    lives (inference); under autograd with a weight that needs gradients, every call."""
    num_experts, size, inter = down_proj.shape
    if torch.is_grad_enabled() and down_proj.requires_grad:
        return down_proj.to(dtype).transpose(1, 2).reshape(num_experts * inter, size)
    key = (id(down_proj), dtype)
    hit = _DOWN_ROWS.get(key)
    if hit is not None and hit[0]() is down_proj and hit[1] == down_proj._version:
        return hit[2]
    rows = down_proj.detach().to(dtype).transpose(1, 2).reshape(num_experts * inter, size).contiguous()
    _DOWN_ROWS[key] = (weakref.ref(down_proj, lambda _, key=key: _DOWN_ROWS.pop(key, None)), down_proj._version, rows)
    return rows


def moe_block_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The truth for `moe_block_triton`: transformers' SparseMoeBlock after its router, in its torch steps,
    routed + sigmoid(shared_expert_gate x) · shared_expert(x), plus `residual` when given (the decoder layer's add).

    Routing and experts as `fused_experts_reference`; shared_gate_up [R >= 2I + 1, H]: the shared expert's gate_proj
    rows, up_proj rows and the shared_expert_gate row (`concat_shared_weights`); shared_down [H, I]. [T, H]."""
    inter = shared_down.shape[-1]
    routed = fused_experts_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    gate, up, gate_row = shared_gate_up[:inter], shared_gate_up[inter : 2 * inter], shared_gate_up[2 * inter :][:1]
    shared, logit = shared_expert_reference(hidden, gate, up, shared_down, gate_row)
    out = gated_add_reference(routed, logit, shared)
    return out if residual is None else residual + out


# ----------------------------------------------------------------------------------------------------------------
# kernels


def _first_use(ids, slot, S, E, SP: tl.constexpr, CACHE: tl.constexpr):
    """(expert int64, live) of pair `slot` of ids [S]: live when the id is a valid expert that no earlier pair names
    (one program per distinct expert; slot S, the shared expert's if any, reads -1). CACHE: the loads' cache
    modifier (".cg" for a read before the PDL wait, pdl.py)."""
    expert = tl.load(ids + slot, mask=slot < S, other=-1, cache_modifier=CACHE).to(tl.int64)
    rs = tl.arange(0, SP)
    earlier = tl.load(ids + rs, mask=rs < slot, other=-1, cache_modifier=CACHE)
    live = (tl.sum((earlier == expert).to(tl.int32), 0) == 0) & (expert >= 0) & (expert < E)
    return expert, live


def _program_slot(pid, S, DIRECT: tl.constexpr, SHARED: tl.constexpr, FIRST: tl.constexpr):
    """The slot grid row `pid` serves: itself, or with the shared expert's slot first (direct rows with the shared
    expert and DIRECT_SHARED_FIRST) slot S at row 0 and pair slot p at row p + 1."""
    if DIRECT and SHARED and FIRST:
        return tl.where(pid == 0, S, pid - 1)
    return pid


def _program_expert(ids, block_expert, slot, S, E, DIRECT: tl.constexpr, SP: tl.constexpr, SHARED: tl.constexpr):
    """(expert int64, live, is_shared) of program `slot`: the expert it serves and whether it has work (direct rows:
    the pair's expert is valid and named by no earlier pair; sorted blocks: a block within the padded count);
    is_shared: slot S of the direct rows with the shared expert, always live."""
    if DIRECT:
        expert, live = _first_use(ids, slot, S, E, SP, "")
    else:
        expert = tl.load(block_expert + slot).to(tl.int64)  # -1: a block past the padded count
        live = expert >= 0
    if SHARED:
        is_shared = slot == S
    else:
        is_shared = slot < 0  # never
    return expert, live | is_shared, is_shared


def _program_rows(ids, block_pairs, slot, expert, is_shared, T, S,
                  DIRECT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr):
    """(pair [BM] int32, row_ok [BM]) of a live program: per row the token–expert pair whose act row it reads or
    writes (the shared expert's program: every token a row, act/rows row S + t)."""
    rm = tl.arange(0, BM)
    if DIRECT:
        rj = tl.arange(0, KP)
        token_ids = tl.load(ids + rm[:, None] * K + rj[None, :], mask=(rm[:, None] < T) & (rj[None, :] < K), other=-1)
        j_first = tl.min(tl.where(token_ids == expert, rj[None, :], KP), 1)  # a token lists an expert once, but
        row_ok = j_first < K  # if twice, the first pair holds the act row and the down kernel weights both
        pair = rm * K + tl.where(row_ok, j_first, 0)
        pair = tl.where(is_shared, S + rm, pair)
        row_ok = tl.where(is_shared, rm < T, row_ok)
    else:
        pair = tl.load(block_pairs + slot * BM + rm)
        row_ok = pair < S  # padding rows hold S
    return pair, row_ok


def _gate_up_kernel(
    hidden, ids, block_expert, block_pairs, w1, act, shared_w1, logit,
    T, S, E,
    stride_ht, stride_hh, stride_we, stride_wn, stride_wk,
    H: tl.constexpr, INTER: tl.constexpr, DIRECT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    SP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
    SHARED: tl.constexpr, SHARED_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_n = tl.program_id(0)
    slot = _program_slot(tl.program_id(1), S, DIRECT, SHARED, SHARED_FIRST)
    expert, live, is_shared = _program_expert(ids, block_expert, slot, S, E, DIRECT, SP, SHARED)
    if live:
        pair, row_ok = _program_rows(ids, block_pairs, slot, expert, is_shared, T, S, DIRECT, K, KP, BM)
        if DIRECT:  # rows are tokens, for the shared slot too
            token = tl.arange(0, BM).to(tl.int64)
        else:
            token = (pair // K).to(tl.int64)
        w_base = w1 + expert * stride_we
        if is_shared:
            w_base = shared_w1  # [gate_proj; up_proj; shared_expert_gate; padding]: the experts' row layout
        rn = i_n * BN + tl.arange(0, BN)
        mn = rn < INTER
        p_x = hidden + token[:, None] * stride_ht
        p_gate = w_base + rn[None, :] * stride_wn  # [BK, BN] tiles of the gate rows ...
        p_up = p_gate + INTER * stride_wn  # ... and of the up rows I later
        acc_gate = tl.zeros([BM, BN], dtype=tl.float32)
        acc_up = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < H
            b_w_gate = tl.load(p_gate + rk[:, None] * stride_wk, mask=mk[:, None] & mn[None, :], other=0.0)
            b_w_up = tl.load(p_up + rk[:, None] * stride_wk, mask=mk[:, None] & mn[None, :], other=0.0)
            b_x = tl.load(p_x + rk[None, :] * stride_hh, mask=row_ok[:, None] & mk[None, :], other=0.0)
            b_x = b_x.to(b_w_gate.dtype)  # fp32 activations under bf16 weights: transformers casts them too
            if DOT_FP32:
                b_x, b_w_gate, b_w_up = b_x.to(tl.float32), b_w_gate.to(tl.float32), b_w_up.to(tl.float32)
            acc_gate += tl.dot(b_x, b_w_gate, input_precision="ieee" if DOT_FP32 else "tf32")
            acc_up += tl.dot(b_x, b_w_up, input_precision="ieee" if DOT_FP32 else "tf32")
        b_act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) · up, fp32
        tl.store(act + pair[:, None].to(tl.int64) * INTER + rn[None, :], b_act, mask=row_ok[:, None] & mn[None, :])
        if SHARED:
            if is_shared & (i_n == 0):  # one program also takes the gate logit, row 2I of the copy (a GEMV)
                p_logit = shared_w1 + 2 * INTER * stride_wn
                acc_logit = tl.zeros([BM], dtype=tl.float32)
                for k0 in range(0, H, BK):
                    rk = k0 + tl.arange(0, BK)
                    mk = rk < H
                    b_w = tl.load(p_logit + rk * stride_wk, mask=mk, other=0.0)
                    b_x = tl.load(p_x + rk[None, :] * stride_hh, mask=row_ok[:, None] & mk[None, :], other=0.0)
                    b_x = b_x.to(b_w.dtype).to(tl.float32)
                    acc_logit += tl.sum(b_x * b_w.to(tl.float32)[None, :], 1)
                tl.store(logit + tl.arange(0, BM), acc_logit, mask=row_ok)


def _down_kernel(
    act, ids, weights, block_expert, block_pairs, w2, rows, shared_w2,
    T, S, E,
    stride_we, stride_wn, stride_wk,
    H: tl.constexpr, INTER: tl.constexpr, DIRECT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    SP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
    SHARED: tl.constexpr, SHARED_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_n = tl.program_id(0)
    slot = _program_slot(tl.program_id(1), S, DIRECT, SHARED, SHARED_FIRST)
    expert, live, is_shared = _program_expert(ids, block_expert, slot, S, E, DIRECT, SP, SHARED)
    if live:
        pair, row_ok = _program_rows(ids, block_pairs, slot, expert, is_shared, T, S, DIRECT, K, KP, BM)
        w_base = w2 + expert * stride_we
        if is_shared:
            w_base = shared_w2  # the shared expert's down_proj [H, I]
        rn = i_n * BN + tl.arange(0, BN)
        mn = rn < H
        p_act = act + pair[:, None].to(tl.int64) * INTER
        p_w = w_base + rn[None, :] * stride_wn  # [BK, BN] tiles of down_e
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < INTER
            b_w = tl.load(p_w + rk[:, None] * stride_wk, mask=mk[:, None] & mn[None, :], other=0.0)
            b_a = tl.load(p_act + rk[None, :], mask=row_ok[:, None] & mk[None, :], other=0.0).to(b_w.dtype)
            if DOT_FP32:
                b_a, b_w = b_a.to(tl.float32), b_w.to(tl.float32)
            acc += tl.dot(b_a, b_w, input_precision="ieee" if DOT_FP32 else "tf32")
        if DIRECT:  # rows are tokens: write w[t, j] · y_t to every pair (t, j) that names this expert
            rm = tl.arange(0, BM)
            for j in tl.static_range(K):
                hit = (tl.load(ids + rm * K + j, mask=rm < T, other=-1) == expert) & (expert >= 0)  # shared: -1
                b_wt = tl.load(weights + rm * K + j, mask=hit, other=0.0).to(tl.float32)
                p_out = rows + (rm * K + j)[:, None].to(tl.int64) * H + rn[None, :]
                tl.store(p_out, acc * b_wt[:, None], mask=hit[:, None] & mn[None, :])
            if SHARED:  # the shared expert's y_t, unweighted, to row S + t
                p_out = rows + pair[:, None].to(tl.int64) * H + rn[None, :]
                tl.store(p_out, acc, mask=(row_ok & is_shared)[:, None] & mn[None, :])
        else:  # rows are pairs
            b_wt = tl.load(weights + pair, mask=row_ok, other=0.0).to(tl.float32)
            p_out = rows + pair[:, None].to(tl.int64) * H + rn[None, :]
            tl.store(p_out, acc * b_wt[:, None], mask=row_ok[:, None] & mn[None, :])


def _add_gated_shared(routed, shared, gate_logit, dtype: tl.constexpr):
    """routed + sigmoid(gate_logit) · shared (fp32 in and out), each step rounded to dtype as transformers' torch ops
    round it (SparseMoeBlock.forward's last lines)."""
    shared = shared.to(dtype).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-gate_logit.to(dtype).to(tl.float32)))).to(dtype).to(tl.float32)
    return (routed.to(dtype).to(tl.float32) + (gate * shared).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


def _sum_kernel(rows, ids, out, logit, residual, E, S, stride_ot, stride_rt, H: tl.constexpr, K: tl.constexpr,
                BN: tl.constexpr, SHARED: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_n = tl.program_id(0)
    i_t = tl.program_id(1).to(tl.int64)
    rn = i_n * BN + tl.arange(0, BN)
    mn = rn < H
    dtype = out.dtype.element_ty
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(K):  # j in order: the same sum whatever the routing
        expert = tl.load(ids + i_t * K + j)
        ok = (expert >= 0) & (expert < E)  # sentinel pairs were never written
        acc += tl.load(rows + (i_t * K + j) * H + rn, mask=mn & ok, other=0.0)
    value = acc.to(dtype).to(tl.float32)  # the experts' output, in the model dtype
    if SHARED:
        shared = tl.load(rows + (S + i_t) * H + rn, mask=mn, other=0.0)
        value = _add_gated_shared(value, shared, tl.load(logit + i_t), dtype)
    if RESIDUAL:  # the decoder layer's residual + block output
        value = tl.load(residual + i_t * stride_rt + rn, mask=mn, other=0.0).to(tl.float32) + value
    tl.store(out + i_t * stride_ot + rn, value.to(dtype), mask=mn)


# ----------------------------------------------------------------------------------------------------------------
# decode kernels (T <= DECODE_MAX_TOKENS): CUDA-core products, split-K gate_up, the combine in the down launch


def _add_row_products(acc, b_w, p_x, stride_x, k_ok, T, TP: tl.constexpr):
    """acc [BN, TP] fp32 plus b_w x_t in column t for each row t < T of x, as fp32 FMAs: b_w [BN, BK] a weight
    tile, x_t [BK] at p_x + t·stride_x (masked by k_ok), rounded to the weights' dtype first as transformers casts
    activations. A row at a time: the weight tile stays the only large operand in registers."""
    rt = tl.arange(0, TP)
    dtype = b_w.dtype
    b_w = b_w.to(tl.float32)
    for t in tl.static_range(TP):
        b_x = tl.load(p_x + t * stride_x, mask=k_ok & (t < T), other=0.0).to(dtype).to(tl.float32)
        acc += tl.where(rt[None, :] == t, tl.sum(b_w * b_x[None, :], axis=1)[:, None], 0.0)
    return acc


def _gate_up_decode_kernel(
    hidden, ids, w1, shared_w1, act, partials, logit_partials, logit, counters,
    T, S, E,
    stride_ht, stride_we, stride_wn,
    H: tl.constexpr, INTER: tl.constexpr, SP: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SHARED: tl.constexpr,
    SHARED_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i_n, i_k, slot): BN gate and BN up rows of the slot's expert over K slice i_k, for every token;
    the last of the SPLIT programs of (slot, i_n) sums their partials in slice order and stores SiLU(gate)·up.
    With SHARED_FIRST the shared expert's programs come first in the grid (z = 0, resident first) and load their
    first tiles before the PDL wait: the only weights known before the router's ids are."""
    i_n = tl.program_id(0)
    i_k = tl.program_id(1)
    slot = tl.program_id(2)
    if SHARED and SHARED_FIRST:
        slot = tl.where(slot == 0, S, slot - 1)
    rb = tl.arange(0, BN)
    rn = i_n * BN + rb
    rk = tl.arange(0, BK)
    k_start = i_k * (STEPS * BK)
    # rows past I read row rn mod I (valid memory: the W loads need no row mask) and are never stored
    rows = (rn % INTER).to(tl.int64)[:, None] * stride_wn + (k_start + rk)[None, :]  # [BN, BK]
    early = SHARED & SHARED_FIRST & (slot == S)  # this program's first gate and up tiles, loaded already
    early_ok = early & ((k_start + rk) < H)[None, :]
    early_gate = tl.load(shared_w1 + rows, mask=early_ok, other=0.0)
    early_up = tl.load(shared_w1 + INTER * stride_wn + rows, mask=early_ok, other=0.0)
    pdl.enter(PDL)  # PDL: nothing but weights read before the kernel before this one completed
    expert, live = _first_use(ids, slot, S, E, SP, "")
    w_base = w1 + expert * stride_we
    if SHARED:
        is_shared = slot == S
        live = live | is_shared
        if is_shared:
            w_base = shared_w1  # [gate_proj; up_proj; shared_expert_gate; padding]
    if live:
        rt = tl.arange(0, TP)
        t_ok = rt < T
        p_gate = w_base + rows
        p_up = p_gate + INTER * stride_wn
        p_x = hidden + k_start + rk  # [BK] of token 0
        acc_gate = tl.zeros([BN, TP], dtype=tl.float32)
        acc_up = tl.zeros([BN, TP], dtype=tl.float32)
        for step in range(STEPS):
            k_ok = (k_start + step * BK + rk) < H
            loaded = early & (step == 0)
            if EVEN_K:
                b_gate = tl.load(p_gate, mask=~loaded, other=0.0)
                b_up = tl.load(p_up, mask=~loaded, other=0.0)
            else:
                b_gate = tl.load(p_gate, mask=k_ok[None, :] & ~loaded, other=0.0)
                b_up = tl.load(p_up, mask=k_ok[None, :] & ~loaded, other=0.0)
            b_gate = tl.where(loaded, early_gate, b_gate)
            b_up = tl.where(loaded, early_up, b_up)
            acc_gate = _add_row_products(acc_gate, b_gate, p_x, stride_ht, k_ok, T, TP)
            acc_up = _add_row_products(acc_up, b_up, p_x, stride_ht, k_ok, T, TP)
            p_gate += BK
            p_up += BK
            p_x += BK
        takes_logit = False
        acc_logit = tl.zeros([1, TP], dtype=tl.float32)
        if SHARED:
            takes_logit = is_shared & (i_n == 0)
            if takes_logit:  # the gate logit, row 2I of the copy, over the same K slice
                p_w = shared_w1 + 2 * INTER * stride_wn + k_start + rk[None, :]  # [1, BK]
                p_x = hidden + k_start + rk
                for step in range(STEPS):
                    k_ok = (k_start + step * BK + rk) < H
                    b_w = tl.load(p_w, mask=k_ok[None, :], other=0.0)
                    acc_logit = _add_row_products(acc_logit, b_w, p_x, stride_ht, k_ok, T, TP)
                    p_w += BK
                    p_x += BK
        p_act = act + (slot * TP + rt)[None, :].to(tl.int64) * INTER + rn[:, None]  # act [slots, TP, I] fp32
        act_ok = (rn < INTER)[:, None] & t_ok[None, :]
        if SPLIT == 1:
            tl.store(p_act, acc_gate * tl.sigmoid(acc_gate) * acc_up, mask=act_ok)
            if takes_logit:
                tl.store(logit + rt[None, :], acc_logit, mask=t_ok[None, :])
        else:  # partials [slots, I / BN, SPLIT, 2, TP, BN]; the last program of (slot, i_n) to arrive sums them
            tile = slot * tl.cdiv(INTER, BN) + i_n
            offsets = rt[None, :] * BN + rb[:, None]
            p_part = partials + (tile * SPLIT).to(tl.int64) * (2 * TP * BN) + offsets
            tl.store(p_part + i_k * (2 * TP * BN), acc_gate)
            tl.store(p_part + i_k * (2 * TP * BN) + TP * BN, acc_up)
            if takes_logit:
                tl.store(logit_partials + i_k * TP + rt[None, :], acc_logit)
            tl.debug_barrier()  # every thread's partial is written before the signal (release below)
            arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:  # in slice order, not arrival order: the same bits every call
                acc_gate = tl.zeros([BN, TP], dtype=tl.float32)
                acc_up = tl.zeros([BN, TP], dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    acc_gate += tl.load(p_part + s * (2 * TP * BN), cache_modifier=".cg")
                    acc_up += tl.load(p_part + s * (2 * TP * BN) + TP * BN, cache_modifier=".cg")
                tl.store(p_act, acc_gate * tl.sigmoid(acc_gate) * acc_up, mask=act_ok)
                if takes_logit:
                    acc_logit = tl.zeros([1, TP], dtype=tl.float32)
                    for s in tl.static_range(SPLIT):
                        acc_logit += tl.load(logit_partials + s * TP + rt[None, :], cache_modifier=".cg")
                    tl.store(logit + rt[None, :], acc_logit, mask=t_ok[None, :])
                tl.store(counters + tile, 0)  # zero again for the next launch


def _down_tile(acc, p_w, p_a, step, rk, T, INTER: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr,
               EVEN_K: tl.constexpr):
    """acc plus the products of weight tile `step` (at p_w, [BN, BK]) with act at p_a, every token."""
    k_ok = (step * BK + rk) < INTER
    if EVEN_K:
        b_w = tl.load(p_w)
    else:
        b_w = tl.load(p_w, mask=k_ok[None, :], other=0.0)
    return _add_row_products(acc, b_w, p_a, INTER, k_ok, T, TP)


def _down_decode_rows(act, ids, weights, w2, shared_w2, slot, rn, rt, t_ok, pair, rj, rk, T, S, E, stride_we,
                      stride_wn, H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, SP: tl.constexpr,
                      TP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr,
                      EVEN_K: tl.constexpr, SHARED: tl.constexpr):
    """acc [BN, TP] fp32 of program (i_n, slot), every read after the PDL wait: y = down_e act for BN output columns
    and every token, times the token's routing weight of that expert."""
    expert, live = _first_use(ids, slot, S, E, SP, "")
    w_base = w2 + expert * stride_we
    is_shared = False
    if SHARED:
        is_shared = slot == S
        live = live | is_shared
        if is_shared:
            w_base = shared_w2  # the shared expert's down_proj [H, I]
    acc = tl.zeros([BN, TP], dtype=tl.float32)
    if live:
        # the token's weight of this expert: Σ_j w[t, j] over the pairs (t, j) naming it (an expert listed twice
        # counts twice); the shared expert's output stays unweighted (its gate comes in the combine). Loaded
        # before the weights, so that both are in flight together
        pair_ok = t_ok[:, None] & (rj[None, :] < K)
        named = (tl.load(ids + pair, mask=pair_ok, other=-1) == expert) & pair_ok & (expert >= 0)
        coef = tl.sum(tl.load(weights + pair, mask=named, other=0.0).to(tl.float32), axis=1)  # [TP]
        p_w = w_base + (rn % H).to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BN, BK]; rows past H: not stored
        p_a = act + (slot * TP).to(tl.int64) * INTER + rk  # [BK] of token 0
        for step in range(STEPS):
            acc = _down_tile(acc, p_w, p_a, step, rk, T, INTER, TP, BK, EVEN_K)
            p_w += BK
            p_a += BK
        acc = acc * tl.where(is_shared, 1.0, coef)[None, :]
    return acc


def _down_decode_early(act, ids, weights, w2, shared_w2, slot, rn, rt, t_ok, pair, rj, rk, T, S, E, stride_we,
                       stride_wn, H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, SP: tl.constexpr,
                       TP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr,
                       EVEN_K: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr):
    """`_down_decode_rows` with the routing (the router's, two kernels back) and the first weight tile read before
    the PDL wait, past L1 (pdl.py), so they stream while gate_up ends; act (gate_up's) after it."""
    expert, live = _first_use(ids, slot, S, E, SP, ".cg")
    w_base = w2 + tl.where(live, expert, 0) * stride_we  # an expert without work reads nothing (masked below)
    is_shared = False
    if SHARED:
        is_shared = slot == S
        live = live | is_shared
        if is_shared:
            w_base = shared_w2
    pair_ok = t_ok[:, None] & (rj[None, :] < K) & live
    named = (tl.load(ids + pair, mask=pair_ok, other=-1, cache_modifier=".cg") == expert) & pair_ok & (expert >= 0)
    coef = tl.sum(tl.load(weights + pair, mask=named, other=0.0, cache_modifier=".cg").to(tl.float32), axis=1)
    p_w = w_base + (rn % H).to(tl.int64)[:, None] * stride_wn + rk[None, :]
    k_ok = rk < INTER
    b_w = tl.load(p_w, mask=live & k_ok[None, :], other=0.0)  # the first tile (live: the slot has work)
    pdl.enter(PDL)  # act (gate_up's) from here on
    acc = tl.zeros([BN, TP], dtype=tl.float32)
    if live:
        p_a = act + (slot * TP).to(tl.int64) * INTER + rk  # [BK] of token 0
        acc = _add_row_products(acc, b_w, p_a, INTER, k_ok, T, TP)
        for step in range(1, STEPS):
            p_w += BK
            p_a += BK
            acc = _down_tile(acc, p_w, p_a, step, rk, T, INTER, TP, BK, EVEN_K)
        acc = acc * tl.where(is_shared, 1.0, coef)[None, :]
    return acc


def _down_decode_kernel(
    act, ids, weights, w2, shared_w2, partials, logit, residual, out, counters,
    T, S, E,
    stride_we, stride_wn, stride_ot, stride_rt,
    H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, TP: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr, EVEN_K: tl.constexpr, SHARED: tl.constexpr,
    RESIDUAL: tl.constexpr, EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (i_n, slot): BN output columns of the slot's expert, y = down_e act for every token, times the
    token's routing weight of that expert (0 if it did not choose it), to partials [H / BN, slots, TP, BN]; the last
    of the column tile's programs sums the slots in slot order, adds the gated shared expert and the residual, and
    stores the output. EARLY (pdl.EARLY_READS): the routing (the router's, two kernels back) and the first weight
    tile are read before the PDL wait, so they stream while gate_up ends; act and logit (gate_up's) after it."""
    i_n = tl.program_id(0)
    slot = tl.program_id(1)
    num_slots = S + 1 if SHARED else S
    rb = tl.arange(0, BN)
    rn = i_n * BN + rb
    rt = tl.arange(0, TP)
    t_ok = rt < T
    rj = tl.arange(0, KP)
    pair = rt[:, None] * K + rj[None, :]
    rk = tl.arange(0, BK)
    if EARLY:
        acc = _down_decode_early(act, ids, weights, w2, shared_w2, slot, rn, rt, t_ok, pair, rj, rk, T, S,
                                 E, stride_we, stride_wn, H, INTER, K, SP, TP, BN, BK, STEPS, EVEN_K, SHARED, PDL)
    else:
        pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
        acc = _down_decode_rows(act, ids, weights, w2, shared_w2, slot, rn, rt, t_ok, pair, rj, rk, T, S,
                                E, stride_we, stride_wn, H, INTER, K, SP, TP, BN, BK, STEPS, EVEN_K, SHARED)
    offsets = rt[None, :] * BN + rb[:, None]
    p_part = partials + (i_n * num_slots).to(tl.int64) * (TP * BN) + offsets
    tl.store(p_part + slot * (TP * BN), acc)  # also the zeros of a slot without work: the sum reads every slot
    tl.debug_barrier()  # every thread's partial is written before the signal (release below)
    arrived = tl.atomic_add(counters + i_n, 1, sem="acq_rel")
    if arrived == num_slots - 1:  # the routed slots in slot order, not arrival order: the same bits every call
        routed = tl.zeros([BN, TP], dtype=tl.float32)
        for s in tl.static_range(SP):  # unrolled (SP >= S): every slot's load in flight at once
            routed += tl.load(p_part + s * (TP * BN), mask=s < S, other=0.0, cache_modifier=".cg")
        dtype = out.dtype.element_ty
        value = routed.to(dtype).to(tl.float32)  # the experts' output, in the model dtype
        if SHARED:
            shared = tl.load(p_part + S * (TP * BN), cache_modifier=".cg")
            gate_logit = tl.load(logit + rt, mask=t_ok, other=0.0)
            value = _add_gated_shared(value, shared, gate_logit[None, :], dtype)
        out_ok = (rn < H)[:, None] & t_ok[None, :]
        if RESIDUAL:  # the decoder layer's residual + block output
            p_res = residual + rt[None, :] * stride_rt + rn[:, None]
            value = tl.load(p_res, mask=out_ok, other=0.0).to(tl.float32) + value
        tl.store(out + rt[None, :] * stride_ot + rn[:, None], value.to(dtype), mask=out_ok)
        tl.store(counters + i_n, 0)  # zero again for the next launch


if HAS_TRITON:
    _first_use = triton.jit(_first_use)
    _program_slot = triton.jit(_program_slot)
    _program_expert = triton.jit(_program_expert)
    _program_rows = triton.jit(_program_rows)
    _add_gated_shared = triton.jit(_add_gated_shared)
    _add_row_products = triton.jit(_add_row_products)
    _down_tile = triton.jit(_down_tile)
    _down_decode_rows = triton.jit(_down_decode_rows)
    _down_decode_early = triton.jit(_down_decode_early)
    _gate_up_kernel = _LazyJit(_gate_up_kernel, pdl=True)
    _down_kernel = _LazyJit(_down_kernel, pdl=True)
    _sum_kernel = _LazyJit(_sum_kernel, pdl=True)
    _gate_up_decode_kernel = _LazyJit(_gate_up_decode_kernel, pdl=True, do_not_specialize=["T"])
    _down_decode_kernel = _LazyJit(_down_decode_kernel, pdl=True, do_not_specialize=["T"])


# ----------------------------------------------------------------------------------------------------------------
# launch


def align_pairs(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe's moe_align_block_size in torch ops, no host sync: pairs sorted by expert, each expert padded to
    whole blocks of block_m rows.

    Returns block_pairs [NB·BM] int32 (pair ids t·k + j; S marks padding) and block_expert [NB] int32 (-1 for blocks
    past the padded count), NB = ceil(S / BM) + min(E, S), the worst case (every used expert pads < BM rows).
    """
    device = top_k_index.device
    ids = top_k_index.reshape(-1)
    pairs = ids.numel()
    num_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # sentinels sort last, in bin E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    expert_blocks = (counts[:num_experts] + block_m - 1) // block_m
    first_block = torch.cumsum(expert_blocks, 0) - expert_blocks  # [E]
    first_row = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position of each expert
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(pairs, device=device) - first_row[sorted_key]  # position within the expert's rows
    spill = num_blocks * block_m  # sentinels go to one spare slot past the end
    dest = torch.where(sorted_key < num_experts, first_block[sorted_key.clamp(max=num_experts - 1)] * block_m + rank,
                       spill)
    block_pairs = torch.full((spill + 1,), pairs, dtype=torch.int32, device=device)
    block_pairs.scatter_(0, dest, order.to(torch.int32))
    block_expert = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=device)
    block_expert.scatter_(0, dest // block_m, sorted_key.to(torch.int32))  # all rows of a block agree
    return block_pairs[:spill], block_expert[:num_blocks]


# One launch instead of align_pairs' ≈ 25 torch launches (per MoE layer of a batch's speculative round: ≈ 1,000 of a
# batch-4 round's 2,500 kernels, run 54), for calls of at most ALIGN_KERNEL_MAX_PAIRS token–expert pairs (one
# program sorts them in registers). Measured on the H200 (run 62, benchmarks/results/ab_align_run62.md, vanilla
# DFlash rounds, the A/B switch "align-kernel"): batch 4 (≈ 60 tokens) 16.97 ms against 20.56, batch 2 with the
# sorted blocks 12.13 against 14.58, batch 8 / 16 unchanged (31.44 / 38.22 against 31.51 / 38.12: there the one
# program's sort of 1-2 k pairs costs what the launches did).
ALIGN_KERNEL = True
ALIGN_KERNEL_MAX_PAIRS = 4096


def _max_combine(a, b):
    return tl.maximum(a, b)


def _align_kernel(ids, block_pairs, block_expert, scratch, S, E, NB, ROWS, BM: tl.constexpr, SPP: tl.constexpr,
                  FILL: tl.constexpr, FILLS: tl.constexpr, PDL: tl.constexpr):
    """align_pairs in one program: a stable sort of the pairs by expert (key · SPP + pair in registers), each
    pair's rank within its expert's run and the run's first block from scans over the sorted order, then the
    scatter. scratch [2 · SPP] int32 carries the sorted keys and the blocks' running sum between the scans."""
    pdl.enter(PDL)
    rs = tl.arange(0, SPP)
    in_call = rs < S
    raw = tl.load(ids + rs, mask=in_call, other=0)
    key = tl.where((raw >= 0) & (raw < E), raw, E).to(tl.int32)  # sentinels in bin E, as align_pairs
    key = tl.where(in_call, key, E + 1)  # lanes past S sort last and are never stored
    ordered = tl.sort(key * SPP + rs)  # stable: ties by pair index
    sorted_key = ordered // SPP
    order = ordered % SPP
    p_keys = scratch + rs
    tl.store(p_keys, sorted_key)
    tl.debug_barrier()
    before = tl.load(p_keys - 1, mask=rs > 0, other=-1)
    after = tl.load(p_keys + 1, mask=rs < SPP - 1, other=-1)
    start = tl.associative_scan(tl.where(sorted_key != before, rs, 0), 0, _max_combine)  # its run's first position
    rank = rs - start
    routed = sorted_key < E
    last = (sorted_key != after) & routed  # the last pair of an expert's run: rank + 1 pairs, so many blocks
    blocks = tl.cumsum(tl.where(last, (rank + BM) // BM, 0), 0)  # inclusive, in expert order
    tl.store(scratch + SPP + rs, blocks)
    tl.debug_barrier()
    first_block = tl.load(scratch + SPP + start - 1, mask=start > 0, other=0)  # the experts' before this one
    dest = tl.where(routed, first_block * BM + rank, ROWS)  # sentinels to the spare slot past the rows
    for i in range(FILLS):  # padding everywhere first (pair id S; expert -1), then the pairs on top
        rf = i * FILL + tl.arange(0, FILL)
        tl.store(block_pairs + rf, tl.full([FILL], 0, tl.int32) + S, mask=rf < ROWS + 1)
        tl.store(block_expert + rf, tl.full([FILL], -1, tl.int32), mask=rf < NB + 1)
    tl.debug_barrier()
    tl.store(block_pairs + dest, order.to(tl.int32), mask=sorted_key <= E)
    tl.store(block_expert + dest // BM, sorted_key, mask=routed)


if HAS_TRITON:
    _max_combine = triton.jit(_max_combine)
    _align_kernel = _LazyJit(_align_kernel, pdl=True)


def align_pairs_triton(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs` in one launch (at most ALIGN_KERNEL_MAX_PAIRS pairs): the same two tensors, bit for bit."""
    ids = top_k_index.reshape(-1).contiguous()
    pairs = ids.numel()
    if not 0 < pairs <= ALIGN_KERNEL_MAX_PAIRS:
        raise ValueError(f"align_pairs_triton takes 1 to {ALIGN_KERNEL_MAX_PAIRS} token–expert pairs, got {pairs}; "
                         "use align_pairs")
    num_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    spp = triton.next_power_of_2(pairs)
    device = ids.device
    block_pairs = torch.empty(num_blocks * block_m + 1, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks + 1, dtype=torch.int32, device=device)
    scratch = torch.empty(2 * spp, dtype=torch.int32, device=device)
    _align_kernel[(1,)](ids, block_pairs, block_expert, scratch, pairs, num_experts, num_blocks,
                        num_blocks * block_m, BM=block_m, SPP=spp, FILL=1024,
                        FILLS=triton.cdiv(num_blocks * block_m + 1, 1024), num_warps=4 if spp <= 1024 else 8)
    return block_pairs[: num_blocks * block_m], block_expert[:num_blocks]


def fused_experts_triton(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    mode: str = "auto",
    block_m: int | None = None,
    gate_up_tiles: Tiles | None = None,
    down_tiles: Tiles | None = None,
) -> torch.Tensor:
    """Triton `fused_experts_reference`: [T, H] in hidden's dtype, three launches (plus torch's align ops in
    "sorted" mode; two in "decode" mode), no host sync. Shapes as the reference; mode "auto" = "decode" for
    T <= DECODE_MAX_TOKENS (while DECODE_PATH), "direct" for T <= direct_limit(), else "sorted".
    Call once before CUDA-graph capture (Triton compiles on the first launch of each shape)."""
    num_tokens = _check_shapes(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)[0]
    mode = _resolve_mode(mode, num_tokens, gate_up_proj, down_proj)
    if mode == "direct" and num_tokens > DIRECT_MAX_TOKENS:
        raise ValueError(f'mode="direct" takes at most {DIRECT_MAX_TOKENS} tokens, got T={num_tokens}; use "sorted"')
    return _launch(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, mode, block_m, gate_up_tiles,
                   down_tiles)


def moe_block_triton(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    mode: str = "auto",
    gate_up_tiles: Tiles | None = None,
    down_tiles: Tiles | None = None,
) -> torch.Tensor:
    """Triton `moe_block_reference` in three launches (T <= DIRECT_MAX_TOKENS, the "direct" rows): the shared expert
    is one more expert slot of the gate_up and down kernels (its weights from the concatenated copy, whose program
    also computes the gate logit) and the sum kernel adds sigmoid(logit) · shared and the residual. No host sync.
    mode "auto" takes the "decode" kernels for T <= DECODE_MAX_TOKENS (while DECODE_PATH): two launches, the sum,
    the gated shared expert and the residual in the down launch's reduction.

    Shapes as `fused_experts_triton`, plus shared_gate_up [R >= 2I + 1, H] (`concat_shared_weights`: gate rows, up
    rows, the shared_expert_gate row), shared_down [H, I] (the shared expert's I must be the routed experts' I; the
    strides of both must be those of one routed expert), residual [T, H] or None; all weights of one dtype."""
    num_tokens, hidden_size, _, inter, _ = _check_shapes(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    resolved = _resolve_mode(mode, num_tokens, gate_up_proj, down_proj)
    # "auto": the direct rows up to their kernels' limit (the block has no sorted path; callers that have one, the
    # one-pass MoE block of patches/_moe.py, stop at direct_limit())
    mode = "direct" if mode == "auto" and resolved == "sorted" and num_tokens <= DIRECT_MAX_TOKENS else resolved
    if num_tokens > DIRECT_MAX_TOKENS or mode == "sorted":
        raise ValueError(f"moe_block_triton takes at most {DIRECT_MAX_TOKENS} tokens (the direct rows), got "
                         f"T={num_tokens}; use fused_experts_triton and the shared expert's own kernels")
    if not shared_slot_fits(gate_up_proj, down_proj, shared_gate_up, shared_down):
        raise ValueError(
            f"the shared expert must have the routed experts' layout: shared_gate_up [>= 2I + 1, H] with strides "
            f"{gate_up_proj.stride()[1:]}, shared_down [H, I] with strides {down_proj.stride()[1:]}, dtype "
            f"{gate_up_proj.dtype} (I = {inter}, H = {hidden_size}); got {tuple(shared_gate_up.shape)} "
            f"{shared_gate_up.stride()} {shared_gate_up.dtype}, {tuple(shared_down.shape)} {shared_down.stride()} "
            f"{shared_down.dtype}. Use fused_experts_triton and the shared expert's own kernels")
    if residual is not None and (residual.shape != hidden.shape or residual.dtype != hidden.dtype):
        raise ValueError(f"residual must be [T, H] {hidden.dtype} like hidden; got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    return _launch(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, mode, None, gate_up_tiles,
                   down_tiles, shared=(shared_gate_up, shared_down), residual=residual)


def decode_fits(num_tokens: int, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether the decode kernels can take the call: at most DECODE_KERNEL_MAX_TOKENS tokens, weights contiguous
    along the reduction (their wide loads). "auto" takes them only up to DECODE_MAX_TOKENS."""
    return num_tokens <= DECODE_KERNEL_MAX_TOKENS and gate_up_proj.stride(-1) == 1 and down_proj.stride(-1) == 1


def _resolve_mode(mode: str, num_tokens: int, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str:
    """The kernels of a call: `mode`, or for "auto" the first of decode, direct, sorted that takes it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "decode" and not decode_fits(num_tokens, gate_up_proj, down_proj):
        raise ValueError(
            f'mode="decode" takes at most {DECODE_KERNEL_MAX_TOKENS} tokens and weights with unit stride along the '
            f"reduction; got T={num_tokens}, gate_up_proj strides {gate_up_proj.stride()}, down_proj strides "
            f'{down_proj.stride()}. Use mode="auto"')
    if mode != "auto":
        return mode
    if DECODE_PATH and num_tokens <= DECODE_MAX_TOKENS and decode_fits(num_tokens, gate_up_proj, down_proj):
        return "decode"
    return "direct" if num_tokens <= direct_limit() else "sorted"


def shared_slot_fits(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, shared_gate_up: torch.Tensor,
                     shared_down: torch.Tensor) -> bool:
    """Whether the shared expert can run as one more slot of the experts kernels: one dtype and device, the routed
    experts' I, and the strides of one routed expert (the kernels read both through the same offsets)."""
    num_experts, hidden_size, inter = down_proj.shape
    return (shared_gate_up.dim() == 2 and shared_gate_up.shape[0] >= 2 * inter + 1
            and shared_gate_up.shape[1] == hidden_size and shared_down.shape == (hidden_size, inter)
            and shared_gate_up.stride() == gate_up_proj.stride()[1:] and shared_down.stride() == down_proj.stride()[1:]
            and len({(t.dtype, t.device) for t in (gate_up_proj, down_proj, shared_gate_up, shared_down)}) == 1)


def _launch(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, mode, block_m, gate_up_tiles, down_tiles,
            shared=None, residual=None) -> torch.Tensor:
    """The three launches; shared = (shared_gate_up, shared_down): one more slot (direct mode), residual: added."""
    num_tokens, hidden_size, num_experts, inter, top_k = _check_shapes(
        hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if mode == "decode":
        return _launch_decode(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, out, gate_up_tiles,
                              down_tiles, shared, residual)
    if (gate_up_tiles and gate_up_tiles.split_k != 1) or (down_tiles and down_tiles.split_k != 1):
        raise ValueError(f'split_k > 1 is for mode="decode" only; got {gate_up_tiles}, {down_tiles} in mode {mode!r}')
    default_m, default_gate_up, default_down = default_tiles(num_tokens, mode)
    block_m = block_m or default_m
    gate_up_tiles = gate_up_tiles or default_gate_up
    down_tiles = down_tiles or default_down
    pairs = num_tokens * top_k
    ids = top_k_index.reshape(-1).contiguous()  # [S], pair t·k + j
    weights = top_k_weights.reshape(-1).contiguous()  # [S]
    if mode == "direct":
        block_m = default_m  # all tokens in one tile
        block_pairs = block_expert = ids  # unused
        num_slots = pairs
    else:
        align = align_pairs_triton if ALIGN_KERNEL and pairs <= ALIGN_KERNEL_MAX_PAIRS else align_pairs
        block_pairs, block_expert = align(top_k_index, num_experts, block_m)
        num_slots = block_expert.numel()
    # act: SiLU(gate)·up per pair; rows: w · down(act) per pair; the shared expert's T rows after the S pairs'
    extra = num_tokens if shared is not None else 0
    act = torch.empty(pairs + extra, inter, dtype=torch.float32, device=hidden.device)
    rows = torch.empty(pairs + extra, hidden_size, dtype=torch.float32, device=hidden.device)
    logit = torch.empty(num_tokens if shared is not None else 1, dtype=torch.float32, device=hidden.device)
    shared_gate_up, shared_down = shared if shared is not None else (gate_up_proj, down_proj)  # unused without
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    common = dict(H=hidden_size, INTER=inter, DIRECT=mode == "direct", K=top_k, KP=triton.next_power_of_2(top_k),
                  SP=triton.next_power_of_2(block_m * top_k) if mode == "direct" else 1, BM=block_m,
                  DOT_FP32=gate_up_proj.dtype == torch.float32 or bool(triton.knobs.runtime.interpret),
                  SHARED=shared is not None, SHARED_FIRST=DIRECT_SHARED_FIRST)
    num_slots += 1 if shared is not None else 0

    tiles = _fit(gate_up_tiles, inter, hidden_size)
    _gate_up_kernel[(triton.cdiv(inter, tiles.block_n), num_slots)](
        hidden, ids, block_expert, block_pairs, gate_up_proj, act, shared_gate_up, logit,
        num_tokens, pairs, num_experts, *hidden.stride(), *gate_up_proj.stride(),
        **common, BN=tiles.block_n, BK=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    tiles = _fit(down_tiles, hidden_size, inter)
    _down_kernel[(triton.cdiv(hidden_size, tiles.block_n), num_slots)](
        act, ids, weights, block_expert, block_pairs, down_proj, rows, shared_down,
        num_tokens, pairs, num_experts, *down_proj.stride(),
        **common, BN=tiles.block_n, BK=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    block_sum = min(1024, triton.next_power_of_2(hidden_size))
    _sum_kernel[(triton.cdiv(hidden_size, block_sum), num_tokens)](
        rows, ids, out, logit, residual if residual is not None else out, num_experts, pairs, out.stride(0),
        residual.stride(0) if residual is not None else 0, H=hidden_size, K=top_k, BN=block_sum,
        SHARED=shared is not None, RESIDUAL=residual is not None, num_warps=4,
    )
    return out


@dataclass(frozen=True)
class Launch:
    """One kernel launch: grid, compile-time constants, warps and stages."""

    grid: tuple[int, ...]
    constexprs: dict
    num_warps: int
    num_stages: int


def decode_launches(num_tokens: int, hidden_size: int, inter: int, top_k: int, *, shared: bool, residual: bool,
                    gate_up_tiles: Tiles | None = None, down_tiles: Tiles | None = None) -> tuple[Launch, Launch]:
    """The decode kernels' gate_up and down launches for a call of this shape (`default_tiles` unless given), fitted
    to it: blocks no larger than the problem, no K slice without columns, column blocks within the split-K
    counters. benchmarks/moe_block.py --compile-check compiles exactly these for sm_90."""
    if down_tiles is not None and down_tiles.split_k != 1:
        raise ValueError(f"the decode down kernel does not split its reduction; got {down_tiles}")
    block_t, default_gate_up, default_down = default_tiles(num_tokens, "decode")
    pairs = num_tokens * top_k
    slots = pairs + (1 if shared else 0)
    common = dict(H=hidden_size, INTER=inter, SP=triton.next_power_of_2(pairs), TP=block_t, SHARED=shared)
    tiles, steps, split = _fit_decode(gate_up_tiles or default_gate_up, inter, hidden_size, slots)
    gate_up = Launch((triton.cdiv(inter, tiles.block_n), split, slots),
                     dict(common, BN=tiles.block_n, BK=tiles.block_k, STEPS=steps, SPLIT=split,
                          EVEN_K=hidden_size % (steps * tiles.block_k) == 0, SHARED_FIRST=SHARED_FIRST),
                     tiles.num_warps, tiles.num_stages)
    tiles, steps, _ = _fit_decode(down_tiles or default_down, hidden_size, inter, 1)
    down = Launch((triton.cdiv(hidden_size, tiles.block_n), slots),
                  dict(common, K=top_k, KP=triton.next_power_of_2(top_k), BN=tiles.block_n, BK=tiles.block_k,
                       STEPS=steps, EVEN_K=inter % tiles.block_k == 0, RESIDUAL=residual, EARLY=pdl.EARLY_READS),
                  tiles.num_warps, tiles.num_stages)
    return gate_up, down


def _launch_decode(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, out, gate_up_tiles, down_tiles,
                   shared, residual) -> torch.Tensor:
    """The decode kernels' two launches into out [T, H] (module docstring)."""
    num_tokens, hidden_size, num_experts, inter, top_k = _check_shapes(
        hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    gate_up, down = decode_launches(num_tokens, hidden_size, inter, top_k, shared=shared is not None,
                                    residual=residual is not None, gate_up_tiles=gate_up_tiles, down_tiles=down_tiles)
    pairs = num_tokens * top_k
    ids = top_k_index.reshape(-1).contiguous()  # [S], pair t·k + j
    weights = top_k_weights.reshape(-1).contiguous()  # [S]
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    shared_gate_up, shared_down = shared if shared is not None else (gate_up_proj, down_proj)  # unused without
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    device = hidden.device
    counters = split_counters(device)
    block_t, split, slots = gate_up.constexprs["TP"], gate_up.constexprs["SPLIT"], gate_up.grid[2]

    def workspace(numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32, device=device)

    act = workspace(slots * block_t * inter)  # [slots, TP, I]: SiLU(gate)·up per slot and token
    row_block = block_t * gate_up.constexprs["BN"]
    partials = workspace(math.prod(gate_up.grid) * 2 * row_block if split > 1 else 1)
    logit_partials, logit = workspace(split * block_t), workspace(block_t)
    _gate_up_decode_kernel[gate_up.grid](
        hidden, ids, gate_up_proj, shared_gate_up, act, partials, logit_partials, logit, counters,
        num_tokens, pairs, num_experts, hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        **gate_up.constexprs, num_warps=gate_up.num_warps, num_stages=gate_up.num_stages,
    )
    partials = workspace(math.prod(down.grid) * block_t * down.constexprs["BN"])
    _down_decode_kernel[down.grid](
        act, ids, weights, down_proj, shared_down, partials, logit, residual if residual is not None else out, out,
        counters, num_tokens, pairs, num_experts, down_proj.stride(0), down_proj.stride(1), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        **down.constexprs, num_warps=down.num_warps, num_stages=down.num_stages,
    )
    return out


def _fit_decode(tiles: Tiles, n: int, k: int, slots: int) -> tuple[Tiles, int, int]:
    """(tiles, steps, split) of a decode launch over n output columns and a reduction of k: blocks no larger than
    the problem, column blocks (x slots, when split) within the split-K counters, no K slice without columns;
    steps: block_k steps per slice."""
    block_n = min(max(tiles.block_n, triton.next_power_of_2(triton.cdiv(n, COUNTERS))), triton.next_power_of_2(n))
    block_k = min(tiles.block_k, triton.next_power_of_2(k))
    split = max(1, min(tiles.split_k, triton.cdiv(k, block_k)))
    if slots * triton.cdiv(n, block_n) > COUNTERS:
        split = 1
    steps = triton.cdiv(triton.cdiv(k, split), block_k)
    split = triton.cdiv(k, steps * block_k)
    return Tiles(block_n, block_k, tiles.num_warps, tiles.num_stages, split), steps, split


def _fit(tiles: Tiles, n: int, k: int) -> Tiles:
    """Tiles no larger than the problem (tiny test shapes), no smaller than `tl.dot`'s 16."""
    def clamp(block, size):
        return max(16, min(block, triton.next_power_of_2(size)))

    return Tiles(clamp(tiles.block_n, n), clamp(tiles.block_k, k), tiles.num_warps, tiles.num_stages)


def _check_shapes(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj) -> tuple[int, int, int, int, int]:
    if hidden.dim() != 2 or top_k_index.dim() != 2 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"expected hidden [T, H], top_k_index [T, k], gate_up_proj [E, 2I, H], down_proj [E, H, I]; got "
            f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}"
        )
    num_tokens, hidden_size = hidden.shape
    num_experts, _, inter = down_proj.shape
    top_k = top_k_index.shape[1]
    if (top_k_index.shape[0] != num_tokens or top_k_weights.shape != top_k_index.shape
            or gate_up_proj.shape != (num_experts, 2 * inter, hidden_size) or down_proj.shape[1] != hidden_size):
        raise ValueError(
            f"expected hidden [T, H], top_k_index and top_k_weights [T, k], gate_up_proj [E, 2I, H] and down_proj "
            f"[E, H, I]; got hidden {tuple(hidden.shape)}, top_k_index {tuple(top_k_index.shape)}, top_k_weights "
            f"{tuple(top_k_weights.shape)}, gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"down_proj {tuple(down_proj.shape)}"
        )
    if top_k_index.dtype.is_floating_point:
        raise TypeError(f"top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    return num_tokens, hidden_size, num_experts, inter, top_k


# ----------------------------------------------------------------------------------------------------------------
# dispatch


def fused_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    kernel_backend: str = "auto",
    **triton_options,
) -> torch.Tensor:
    """The routed experts' output [T, H] (hidden's dtype): `fused_experts_triton` on CUDA (or under
    TRITON_INTERPRET=1) for float32/bfloat16/float16 weights; otherwise `dense_experts` where `dense_fits`, else
    `fused_experts_reference`.

    hidden [T, H]; top_k_index [T, k] int; top_k_weights [T, k]; gate_up_proj [E, 2I, H] (gate rows, then up rows);
    down_proj [E, H, I]. triton_options: mode, block_m, gate_up_tiles, down_tiles of `fused_experts_triton`.
    """
    backend = select_backend(kernel_backend, hidden, gate_up_proj, down_proj)
    if backend == "triton" and (gate_up_proj.dtype not in _DTYPES or down_proj.dtype != gate_up_proj.dtype):
        if kernel_backend == "triton":
            raise TypeError(
                f"the Triton experts take float32/bfloat16/float16 weights of one dtype; got gate_up_proj "
                f"{gate_up_proj.dtype}, down_proj {down_proj.dtype}. Use kernel_backend='torch' (the reference)"
            )
        backend = "torch"  # e.g. float64 test models
    if backend == "triton":
        return fused_experts_triton(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, **triton_options)
    if dense_fits(hidden.shape[0], top_k_index.shape[-1], gate_up_proj):
        return dense_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    return fused_experts_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
