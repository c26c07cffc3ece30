"""Top-k routing of a softmax MoE router in one launch after the router GEMM; `route_topk_reference` is the truth.

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

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, tl_dtype, triton

MAX_EXPERTS = 4096  # one row in registers


def route_topk_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router after its GEMM: logits [T, E] -> (scores [T, k] in logits' dtype, ids [T, k] long)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(logits.dtype), ids


def _route_topk_kernel(logits, scores, ids, stride_l, stride_s, stride_i, E, K: tl.constexpr, KP: tl.constexpr,
                       BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits + row * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32)
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
    tl.store(scores + row * stride_s + slots, top_p.to(OUT_DTYPE), mask=keep)
    tl.store(ids + row * stride_i + slots, top_i, mask=keep)


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
    _route_topk_kernel = _LazyJit(_route_topk_kernel, pdl=True)
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
