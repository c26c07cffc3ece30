"""Top-k routing of a softmax MoE router in one launch after the router GEMM (`route_topk`), or with the decoder
layer's residual add, post_attention_layernorm and the router GEMM in the same launch (`add_norm_route`, what the
fused decoder layers run, patches/_moe.py `norm_route_block_add`); the `*_reference` functions are the truth.

transformers' Qwen3.5-MoE / Qwen3-Next routers (`*TopKRouter.forward`, 5.17 and 5.24 alike) run, after
`logits = F.linear(x, W)`, on CUDA: softmax (fp32), topk (+ its sort of the k values), sum, div and the cast back to
the logits' dtype: 5-6 launches of a few µs each at batch 1, inside every MoE layer of a launch-bound forward.

    p = softmax(logits.float())                       [T, E] fp32
    scores, ids = topk(p, k)                          descending; ids [T, k] long
    normalize: scores = scores / scores.sum(-1)       (= a softmax over the k largest logits)
    scores = scores.to(logits.dtype)

One program per token row (E ≤ 4096 in registers): the fp32 max and sum of exp over the row, then k passes that each
take the largest remaining logit. The ranking is on the fp32 logits, which the softmax orders the same way, so the
ids are torch.topk's wherever the probabilities differ. Ties (equal logits) go to the lowest expert id first;
torch.topk leaves the order of equal probabilities unspecified (on the CPU it is not the index order), so at a tie
the two may list different, equally probable experts, and a tie at the k-th place may pick a different expert.
Ties are not rare in bf16: 256 logits with 8 significant bits often hold equal values. Scores follow transformers' rounding steps (p_j = e_j / Σe, then
p_j / Σ_top p in fp32, one cast); the fp32 sums run in another order and Triton's exp is not libm's, so scores agree
to ~1e-6 relative in fp32 and to one rounding of the output dtype otherwise.

Kernels bind to `triton.jit` at launch (`_LazyJit`), so `TRITON_INTERPRET=1` runs them on the CPU (tests). Triton
compiles on the first launch of each (E, k) shape: call once before CUDA-graph capture (the warm-up does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, tl_dtype, triton
from .gemv_triton import COUNTERS, split_counters
from .norm_triton import _rows, add_rms_norm_reference

MAX_EXPERTS = 4096  # one row in registers
# `add_norm_route`'s programs: True: 2 router rows and one warp each (E = 256: 128 programs of 8 KB of weight), so the
# token's last program routes it with warp shuffles only, as `route_topk`; False: 4 rows and 4 warps (64 programs of
# 16 KB; the top-k's 2k + 2 reductions then cross warps through shared memory). Run 70 (H200, 4 rows / 4 warps):
# the one launch took 5.6 µs per MoE layer of the AR step's traced span against ≈ 6.1 for add_rms_norm, the router
# GEMM and route_topk (the step −14 / −27 µs traced / wall). A/B switch `route-one-warp`.
ROUTE_ONE_WARP = True
# At more than 2 tokens (verifications; a max-shape round's 16) 4 router rows and 4 warps a program whatever
# ROUTE_ONE_WARP says: every program adds and norms its token's whole row, 64 values a thread with one warp, and at
# T = 16 the one-warp grid is 2 048 programs (run 130, H100: 9.4 µs a MoE layer in a max-shape round against 5.1 at
# the AR step). Off: on an H100 (run 133, benchmarks/results/round_tiles_run133.md) the max-shape round −3 to −25 µs
# at w <= 4 but +144 / +159 at w = 8 and +361 / +378 at w = 16 with it. True: A/B (`+route-wide-rounds`).
ROUTE_WIDE_ROUNDS = False
MAX_ROUTE_HIDDEN = 8192  # a program holds its router rows [2 or 4, H] in registers


def route_topk_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router after its GEMM: logits [T, E] -> (scores [T, k] in logits' dtype, ids [T, k] long)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(logits.dtype), ids


def _topk_row(x, cols, valid, p_scores, p_ids, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr,
              NORMALIZE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """One token's routing from its fp32 logits x [BLOCK_E] (-inf where not valid): scores and ids stored at p_scores
    / p_ids (k of each)."""
    row_max = tl.max(x, axis=0)
    total = tl.sum(tl.where(valid, tl.exp(x - row_max), 0.0), axis=0)  # softmax denominator
    slots = tl.arange(0, KP)
    top_p = tl.zeros([KP], dtype=tl.float32)
    top_i = tl.zeros([KP], dtype=tl.int64)
    free = valid
    for j in tl.static_range(K):  # k passes: the largest free logit, lowest id among equals
        best = tl.max(tl.where(free, x, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (x == best), cols, BLOCK_E), axis=0)
        free = free & (cols != pick)
        top_p = tl.where(slots == j, tl.exp(best - row_max) / total, top_p)
        top_i = tl.where(slots == j, pick.to(tl.int64), top_i)
    if NORMALIZE:
        top_p = top_p / tl.sum(top_p, axis=0)  # padding slots hold 0
    keep = slots < K
    tl.store(p_scores + slots, top_p.to(OUT_DTYPE), mask=keep)
    tl.store(p_ids + slots, top_i, mask=keep)


def _route_topk_kernel(logits, scores, ids, stride_l, stride_s, stride_i, E, K: tl.constexpr, KP: tl.constexpr,
                       BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits + row * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32)
    _topk_row(x, cols, valid, scores + row * stride_s, ids + row * stride_i, K, KP, BLOCK_E, NORMALIZE, OUT_DTYPE)


def _add_norm_route_kernel(x, r, norm_w, router_w, h, y, logits, scores, ids, counters,
                           stride_x, stride_r, stride_h, stride_y, stride_wr, stride_l, stride_s, stride_i,
                           n, E, eps, OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NORMALIZE: tl.constexpr,
                           OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    i_n = tl.program_id(0)  # BLOCK_N router rows
    row = tl.program_id(1).to(tl.int64)  # a token
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n
    rn = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < E
    # weights before the PDL wait: this program's router rows [BLOCK_N, H] and the norm's weight
    b_w = tl.load(router_w + rn[:, None] * stride_wr + cols[None, :], mask=mn[:, None] & mask[None, :], other=0.0)
    weight = tl.load(norm_w + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        weight = weight + 1.0
    pdl.enter(PDL)
    # the residual add and the RMSNorm, as `_add_rms_norm_kernel` (every program computes them; program 0 stores)
    a = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(r + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    total = (b + a).to(OUT_DTYPE)
    v = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / n + eps)
    normed = (v * rstd * weight).to(OUT_DTYPE)
    if i_n == 0:
        tl.store(h + row * stride_h + cols, total, mask=mask)
        tl.store(y + row * stride_y + cols, normed, mask=mask)
    # the router GEMM's rows (fp32 products and sum, rounded to the model dtype as F.linear's output)
    dots = tl.sum(b_w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
    tl.store(logits + row * stride_l + rn, dots.to(OUT_DTYPE), mask=mn)
    # the last program of the token to arrive routes it (a barrier, then an acq_rel atomic: gemv_triton's split-K)
    tl.debug_barrier()
    p_count = counters + row
    arrived = tl.atomic_add(p_count, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        lg = tl.load(logits + row * stride_l + e, mask=valid, other=float("-inf"), cache_modifier=".cg")
        _topk_row(lg.to(tl.float32), e, valid, scores + row * stride_s, ids + row * stride_i, K, KP, BLOCK_E,
                  NORMALIZE, OUT_DTYPE)
        tl.store(p_count, 0)  # zero again for the next launch


def add_norm_route_reference(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             router_weight: torch.Tensor, top_k: int, normalize: bool, offset: bool = True):
    """The truth for `add_norm_route`: a decoder layer's residual add and post_attention_layernorm, then its MoE
    router on the normed rows, in transformers' steps: (h, normed) [..., H], logits [T, E], scores [T, k],
    ids [T, k]."""
    h, normed = add_rms_norm_reference(x, residual, norm_weight, eps, offset)
    logits = F.linear(normed.reshape(-1, normed.shape[-1]), router_weight)
    scores, ids = route_topk_reference(logits, top_k, normalize)
    return h, normed, logits, scores, ids


def mask_invalid_routes_reference(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor):
    """Stage 1 of a verification (generation/router_hooks.py): tokens at or past `valid` ([1] long, on the device)
    take token 0's experts with weight 0, so they read no expert weights of their own. ids [T, k], weights [T, k].
    A batch of R rows (resident rounds): ids [R·T, k] row-major and valid [R], one count per row."""
    tokens = ids.shape[0] // max(1, valid.numel())
    index = torch.arange(ids.shape[0], device=ids.device)
    invalid = (index % tokens >= valid.reshape(-1).repeat_interleave(tokens)).unsqueeze(1)  # [R·T, 1]
    return torch.where(invalid, ids[:1].expand_as(ids), ids), weights.masked_fill(invalid, 0)


def _mask_routes_kernel(ids, weights, out_ids, out_weights, valid, stride_i, stride_w, stride_oi, stride_ow, tokens,
                        K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    keep = slots < K
    invalid = row % tokens >= tl.load(valid + row // tokens)  # the token's position in its batch row
    source = tl.where(invalid, 0, row)
    expert = tl.load(ids + source * stride_i + slots, mask=keep)
    weight = tl.load(weights + row * stride_w + slots, mask=keep)
    tl.store(out_ids + row * stride_oi + slots, expert, mask=keep)
    tl.store(out_weights + row * stride_ow + slots, tl.where(invalid, tl.zeros_like(weight), weight), mask=keep)


if HAS_TRITON:
    _topk_row = triton.jit(_topk_row)
    _route_topk_kernel = _LazyJit(_route_topk_kernel, pdl=True)
    _add_norm_route_kernel = _LazyJit(_add_norm_route_kernel, pdl=True)
    _mask_routes_kernel = _LazyJit(_mask_routes_kernel, pdl=True)


def mask_invalid_routes(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor):
    """Triton `mask_invalid_routes_reference` in one launch (four torch kernels per MoE layer otherwise): new
    (ids, weights); `valid` is read on the device (no sync, capturable). ids [R·T, k] with valid [R]: per row."""
    if (ids.dim() != 2 or weights.shape != ids.shape or valid.numel() < 1 or ids.shape[0] % valid.numel()
            or not valid.is_contiguous()):
        raise ValueError(f"mask_invalid_routes takes ids and weights [R·T, k] and a contiguous valid [R] (R = 1: one "
                         f"sequence); got {tuple(ids.shape)}, {tuple(weights.shape)}, {tuple(valid.shape)}")
    out_ids, out_weights = torch.empty_like(ids), torch.empty_like(weights)
    if ids.shape[0]:
        k = ids.shape[1]
        _mask_routes_kernel[(ids.shape[0],)](ids, weights, out_ids, out_weights, valid, ids.stride(0),
                                             weights.stride(0), out_ids.stride(0), out_weights.stride(0),
                                             ids.shape[0] // valid.numel(), K=k, KP=triton.next_power_of_2(k),
                                             num_warps=1)
    return out_ids, out_weights


def route_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `route_topk_reference` (one launch): logits [T, E] float32/bfloat16/float16 -> (scores [T, k] in
    logits' dtype, ids [T, k] long). Equal logits go to the lowest expert id first."""
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1] or logits.shape[1] > MAX_EXPERTS:
        raise ValueError(f"route_topk takes logits [T, E] with 0 < top_k <= E <= {MAX_EXPERTS}; got logits "
                         f"{tuple(logits.shape)}, top_k={top_k}")
    num_tokens, num_experts = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    scores = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.long, device=logits.device)
    if num_tokens == 0:
        return scores, ids
    block = triton.next_power_of_2(num_experts)
    # 2k+2 row reductions: one warp (shuffles only, no shared-memory round trips) up to 512 experts
    _route_topk_kernel[(num_tokens,)](logits, scores, ids, logits.stride(0), scores.stride(0), ids.stride(0),
                                      num_experts, K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_E=block,
                                      NORMALIZE=normalize, OUT_DTYPE=tl_dtype(logits.dtype),
                                      num_warps=1 if block <= 512 else 4)
    return scores, ids


def route_program(tokens: int) -> tuple[int, int]:
    """`add_norm_route`'s (router rows, warps) a program for a call of `tokens` rows: ROUTE_ONE_WARP's (2, 1) or
    (4, 4), and (4, 4) past 2 tokens with ROUTE_WIDE_ROUNDS."""
    one_warp = ROUTE_ONE_WARP and not (ROUTE_WIDE_ROUNDS and tokens > 2)
    return (2, 1) if one_warp else (4, 4)


def add_norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   router_weight: torch.Tensor, top_k: int, normalize: bool, offset: bool = True):
    """Triton `add_norm_route_reference` in one launch, where transformers runs the residual add, the RMSNorm, the
    router GEMM, softmax and top-k (our unfused route: add_rms_norm, the GEMM, route_topk). Grid (E / 2 or E / 4
    (`route_program`), T): each program loads its router rows before the PDL wait, then computes the add and the
    norm of its token (every program; the first stores h and the normed row), its rows' logits (fp32 sums, rounded
    to the model dtype as F.linear's output), and the token's last program to arrive (a counter of gemv_triton's
    split-K kind) routes it from the stored logits as `route_topk`. x, residual [..., H] of one dtype; norm_weight
    [H]; router_weight [E, H] (last dim contiguous); returns (h, normed) shaped as x, logits [T, E], scores [T, k],
    ids [T, k] long."""
    hidden = x.shape[-1]
    num_experts = router_weight.shape[0]
    if (residual.shape != x.shape or residual.dtype != x.dtype or norm_weight.shape != (hidden,)
            or router_weight.shape != (num_experts, hidden) or router_weight.dtype != x.dtype
            or router_weight.stride(-1) != 1 or not 0 < top_k <= num_experts <= MAX_EXPERTS
            or hidden > MAX_ROUTE_HIDDEN or x.numel() // max(hidden, 1) > COUNTERS):
        raise ValueError(
            f"add_norm_route takes x and residual [..., H] of one dtype (at most {COUNTERS} rows, H <= "
            f"{MAX_ROUTE_HIDDEN}), a norm weight [H] and a router weight [E, H] in x's dtype, last dim contiguous, "
            f"with 0 < top_k <= E <= {MAX_EXPERTS}; got x {tuple(x.shape)} {x.dtype}, residual "
            f"{tuple(residual.shape)} {residual.dtype}, norm weight {tuple(norm_weight.shape)}, router weight "
            f"{tuple(router_weight.shape)} {router_weight.dtype}, top_k={top_k}")

    rows, residual_rows = _rows(x), _rows(residual)
    tokens = rows.shape[0]
    h, normed = torch.empty_like(rows), torch.empty_like(rows)
    logits = torch.empty(tokens, num_experts, dtype=x.dtype, device=x.device)
    scores = torch.empty(tokens, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=x.device)
    if tokens:
        block_n, warps = route_program(tokens)
        block_n = min(block_n, triton.next_power_of_2(num_experts))
        _add_norm_route_kernel[(triton.cdiv(num_experts, block_n), tokens)](
            rows, residual_rows, norm_weight, router_weight, h, normed, logits, scores, ids,
            split_counters(x.device), rows.stride(0), residual_rows.stride(0), h.stride(0), normed.stride(0),
            router_weight.stride(0), logits.stride(0), scores.stride(0), ids.stride(0), hidden, num_experts, eps,
            OFFSET=offset, BLOCK_H=triton.next_power_of_2(hidden), BLOCK_N=block_n,
            BLOCK_E=triton.next_power_of_2(num_experts), K=top_k, KP=triton.next_power_of_2(top_k),
            NORMALIZE=normalize, OUT_DTYPE=tl_dtype(x.dtype), num_warps=warps)
    return h.view(x.shape), normed.view(x.shape), logits, scores, ids
