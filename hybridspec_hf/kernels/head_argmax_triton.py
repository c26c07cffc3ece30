"""Greedy tokens from the LM head with half its bytes: an int8 copy's logits bound every row's logit, and only the
rows that the bound leaves within reach of the maximum are multiplied by the head itself.

The target's LM head is the largest single read of a decoding step (a 248 320 x 2 048 bf16 head: 1.02 GB, ≈ 335 µs
of an H100's 3.0-ms AR step at the bandwidth, benchmarks/results/kernel_costs_run150.md), and greedy decoding needs
only its argmax. With the head's int8 copy (`gemv_triton.quantize_rows`: q_i = round(w_i / scale_i)), for a hidden
state h and row i:

    s_i  = w_i · h                       the head's logit (exact products, fp32 sum), r_i = s_i in the head's dtype
    ŝ_i  = scale_i · (q_i · h)           the int8 GEMV's logit (`gemv_triton.gemv(..., scale=)`), in h's dtype
    |s_i − ŝ_i| ≤ ε_i = BOUND · scale_i · ‖h‖₁ + |ŝ_i| / 128

BOUND = 0.5 (|w_ik − scale_i q_ik| ≤ scale_i / 2, + 4e-6: quantize_rows) + the two fp32 sums' worst cases (each
≤ K · 2^-24 · 127.5 · scale_i · ‖h‖₁) + 0.01; |ŝ_i| / 128 covers ŝ's rounding to h's dtype (2^-8 for bf16 to
nearest, 2^-7 truncated as the interpreter does). generate() takes the first maximum of r; r_j can equal the
largest r only where s_j > s_max − |s_max| / 128 (one bf16 step), and s_max ≥ L = max_i (ŝ_i − ε_i), so no row with
ŝ_j + ε_j < L − |L| / 128 can be the argmax, and every other row is a candidate. Each candidate's r_j is computed
from the head (fp32 sum of exact products, rounded to the head's dtype to nearest even), and the token is the first
of the largest: the head's own argmax, up to the order of the fp32 sum (which may round a logit that sits on the
edge of a bf16 step the other way than cuBLAS does: a near-tie, as between our GEMVs and cuBLAS anywhere else).

Kernels (`greedy_tokens`), after the int8 GEMV: one program per (BLOCK_V rows of the head, token). With TWO_PASS a
first launch stores each block's largest lower bound, and the second judges every block's rows against the token's
L; without it one launch, each block against its own lower bound (≤ L: a superset of candidates, no pass before).
A program gathers CANDIDATES of its candidates at a time and multiplies their rows of the head by h, then stores its
best (value, row) as one int64 key; the token's last program to arrive (a counter, as gemv_triton's split-K) takes
the largest key and writes the token. With random 35B-shaped weights ≈ 0.15-0.3 % of the head's rows are candidates
against the token's L (≈ 2.5 % against a 1 024-row block's own); a flat row of logits makes more, and every one of
them is multiplied (correct at any count, slower).

`greedy_tokens_reference` is the same rule in torch (the CPU path); `greedy_tokens_plain` is the truth: the head's
logits rounded to its dtype, then their first argmax.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, triton
from .gemv_triton import MAX_ROWS, QuantizedRows, linear_int8, split_counters

# head rows per program: 1 024 up to 4 tokens (a 248 320-row head: 243 programs a token), BLOCK_V_WIDE past them.
# Run 166 (H100, the head alone, `benchmarks/greedy_head.py`, two passes): 2 048 rows a program (fewer programs for a
# 16-token verification) cost 273.6 / 358.3 µs at 8 / 16 tokens, 1 024 239.6 / 299.6 (the int8 GEMV alone 180 / 185,
# the bf16 head + argmax 352 / 360; both walking every candidates' step, before BOUNDED_CANDIDATES). Kept apart from
# BLOCK_V to time other widths (`greedy_head.py --block-v-wide`): 512 lost in run 173 (16 tokens 1.30x over the bf16
# head against 1 024's 1.52x in run 167, greedy_head_run173_w512.md)
BLOCK_V = 1024
BLOCK_V_WIDE = 1024
CANDIDATES = 8  # candidate rows multiplied at once: [8, K] of the head in one load
MAX_BLOCK_K = 2048  # hidden values per load of the candidates' rows (K whole at the 35B-A3B shape)
NUM_WARPS = 8
# True: a first launch takes each block's largest lower bound, so every block's candidates are judged against the
# token's maximum (random 35B-shaped weights: ≈ 0.15-0.3 % of the head's rows, against ≈ 2.5 % of a 1 024-row block
# judged alone); False: one launch, each block against its own (a superset: ≈ 24 MB more of the head read a token at
# 248 320 x 2 048). Run 163 (H100, the AR step in situ): two passes 2.911-2.920 ms, one pass 2.973 (A/B:
# `greedy-two-pass`, off as "-greedy-two-pass").
TWO_PASS = True
# True: each program's loop over its candidates runs as many steps as the block has (a runtime bound); False: every
# C-row step of the block, each skipped past the count by a branch (BLOCK_V / C = 128 steps). Run 167 (H100, the head
# alone, `benchmarks/greedy_head.py`): 190 / 207 / 250 µs at 1 / 4 / 16 tokens against 195 / 223 / 307 walking every
# step; in situ HybridSpec +0.6 / +1.0 % (batch_b1_run169.md; A/B switch `bounded-candidates`)
BOUNDED_CANDIDATES = True
MAX_HIDDEN = 16384
_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
NO_KEY = tl.constexpr(-(2**63)) if tl is not None else -(2**63)  # below every key: a program without candidates


def error_bound(k: int) -> float:
    """BOUND of the module docstring for a hidden size k: the int8 rounding's half step, two fp32 sums' worst-case
    errors and a margin."""
    return 0.5 + 4e-6 + 2 * k * 127.5 * 2.0**-24 + 0.01


def greedy_tokens_plain(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The truth: the first argmax of the head's logits hidden [R, K] @ weight [V, K]ᵀ (fp32 sum, float64 for
    float64) rounded to the head's dtype -> [R] long."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    logits = F.linear(hidden.to(dtype), weight.to(dtype)).to(weight.dtype)
    return logits.argmax(-1)


def _candidates(hidden: torch.Tensor, approx: torch.Tensor, scale: torch.Tensor,
                block: int | None = None) -> torch.Tensor:
    """[R, V] bool: the rows each token's bound leaves within reach of its maximum (module docstring); with `block`,
    each block of that many rows judged by its own lower bound, as the kernel's programs do (a superset)."""
    h1 = hidden.double().abs().sum(-1, keepdim=True)  # [R, 1]
    approx = approx.double()
    eps = error_bound(hidden.shape[-1]) * scale.double()[None, :] * h1 + approx.abs() / 128
    lower = approx - eps
    if block is None:
        lower = lower.amax(-1, keepdim=True)
    else:
        pad = -lower.shape[-1] % block
        blocks = F.pad(lower, (0, pad), value=float("-inf")).view(lower.shape[0], -1, block)
        lower = blocks.amax(-1, keepdim=True).expand(blocks.shape).reshape(lower.shape[0], -1)[:, :lower.shape[-1]]
    return approx + eps >= lower - lower.abs() / 128


def greedy_tokens_reference(hidden: torch.Tensor, weight: torch.Tensor, quantized: QuantizedRows) -> torch.Tensor:
    """The kernel's rule in torch: the int8 copy's logits, each token's candidates over the whole head, their logits
    from the head (rounded to its dtype), the first of the largest -> [R] long. hidden [R, K], weight [V, K]."""
    approx = linear_int8(hidden, quantized)  # [R, V] in hidden's dtype, as the kernel path's
    candidates = _candidates(hidden, approx, quantized.scale)
    dtype = torch.promote_types(weight.dtype, torch.float32)
    tokens = []
    for row in range(hidden.shape[0]):
        rows = candidates[row].nonzero().view(-1)
        if rows.numel() == 0:  # no candidate (NaN logits): token 0, as the kernel
            tokens.append(torch.zeros((), dtype=torch.long, device=hidden.device))
            continue
        exact = F.linear(hidden[row].to(dtype), weight[rows].to(dtype)).to(weight.dtype).to(dtype)
        best = exact.max()
        tokens.append(rows[(exact == best).nonzero()[0, 0]])
    return torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=hidden.device)


def _key(value, index, V):
    """An int64 that orders (value, -index) as generate()'s first argmax does: the value's fp32 bits made monotonic
    (-0.0 taken as +0.0), then V - 1 - index below them."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (V - 1 - index).to(tl.int64)


def _round_to(acc, KIND: tl.constexpr):
    """fp32 acc rounded to the head's dtype (to nearest even), back in fp32: bf16 by integer arithmetic on the
    bits (the same on a GPU and in the interpreter, whose casts truncate), fp16 by a cast, fp32 as it is."""
    if KIND == 0:
        bits = acc.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    elif KIND == 1:
        return acc.to(tl.float16).to(tl.float32)
    else:
        return acc


def _bounds(h, approx, scale, row, rv, mv, bound, stride_h, stride_a, K: tl.constexpr, KP: tl.constexpr):
    """A block's int8 logits ŝ, their bounds ε (module docstring) and its largest lower bound max(ŝ - ε)."""
    rk = tl.arange(0, KP)
    h1 = tl.sum(tl.abs(tl.load(h + row * stride_h + rk, mask=rk < K, other=0.0).to(tl.float32)), 0)
    b_scale = tl.load(scale + rv, mask=mv, other=0.0)
    b_a = tl.load(approx + row * stride_a + rv, mask=mv, other=0.0).to(tl.float32)
    eps = bound * b_scale * h1 + tl.abs(b_a) / 128
    return b_a, eps, tl.max(tl.where(mv, b_a - eps, float("-inf")), 0)


def _lower_kernel(h, approx, scale, lowers, V, bound, stride_h, stride_a, stride_l, K: tl.constexpr,
                  BLOCK_V: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    """TWO_PASS's first pass: each block's largest lower bound, for `_greedy_kernel` to take the token's maximum."""
    pdl.enter(PDL)
    i_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    rv = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    _, _, lower = _bounds(h, approx, scale, row, rv, rv < V, bound, stride_h, stride_a, K, KP)
    tl.store(lowers + row * stride_l + i_v, lower)


def _candidate_step(h, w, row, rv, cand, rank, base, mine, V, stride_h, stride_w, K: tl.constexpr, C: tl.constexpr,
                    BLOCK_K: tl.constexpr, KP: tl.constexpr, KIND: tl.constexpr):
    """The block's candidates base + 1 .. base + C (by rank): their exact logits from the head's rows, rounded to
    its dtype, folded into `mine` as keys (the largest per slot)."""
    slots = tl.arange(0, C)
    hit = cand[None, :] & (rank[None, :] == base + 1 + slots[:, None])  # [C, BLOCK_V]: slot c's row
    taken = tl.sum(hit.to(tl.int32), 1) > 0
    index = tl.sum(tl.where(hit, rv[None, :], 0), 1)  # [C]
    acc = tl.zeros([C], dtype=tl.float32)
    for k0 in tl.static_range(0, KP, BLOCK_K):  # K whole at the head's hidden sizes: one round trip
        ck = k0 + tl.arange(0, BLOCK_K)
        mk = ck < K
        b_w = tl.load(w + index.to(tl.int64)[:, None] * stride_w + ck[None, :],
                      mask=taken[:, None] & mk[None, :], other=0.0).to(tl.float32)
        b_h = tl.load(h + row * stride_h + ck, mask=mk, other=0.0).to(tl.float32)
        acc += tl.sum(b_w * b_h[None, :], 1)
    keys = _key(_round_to(acc, KIND), index, V)
    return tl.maximum(mine, tl.where(taken, keys, mine))


def _greedy_kernel(h, approx, scale, w, lowers, best, counters, tokens, V, bound, stride_h, stride_a, stride_w,
                   stride_l, stride_b, K: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
                   BLOCK_K: tl.constexpr, KP: tl.constexpr, BLOCK_P: tl.constexpr, KIND: tl.constexpr,
                   TWO_PASS: tl.constexpr, BOUNDED: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    i_v = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    rv = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = rv < V
    b_a, eps, lower = _bounds(h, approx, scale, row, rv, mv, bound, stride_h, stride_a, K, KP)
    if TWO_PASS:  # the token's largest lower bound over every block (the first pass's), not this block's alone
        rp = tl.arange(0, BLOCK_P)
        lower = tl.max(tl.load(lowers + row * stride_l + rp, mask=rp < tl.num_programs(0), other=float("-inf")), 0)
    cand = mv & (b_a + eps >= lower - tl.abs(lower) / 128)
    rank = tl.cumsum(cand.to(tl.int32), 0)  # 1, 2, ... at the candidates
    count = tl.sum(cand.to(tl.int32), 0)
    mine = tl.full([C], NO_KEY, tl.int64)
    if BOUNDED:  # C candidates at a time, as many steps as this block has candidates (a runtime bound)
        base = count * 0  # an int32 scalar like count (the loop-carried type)
        while base < count:
            mine = _candidate_step(h, w, row, rv, cand, rank, base, mine, V, stride_h, stride_w, K, C, BLOCK_K, KP,
                                   KIND)
            base += C
    else:  # every step of the block, skipped past its candidates (A/B)
        for base in range(0, BLOCK_V, C):
            if base < count:
                mine = _candidate_step(h, w, row, rv, cand, rank, base, mine, V, stride_h, stride_w, K, C,
                                       BLOCK_K, KP, KIND)
    tl.store(best + row * stride_b + i_v, tl.max(mine, 0))
    # the token's last program to arrive takes the largest key (a barrier, then an acq_rel atomic: gemv's split-K)
    tl.debug_barrier()
    p_count = counters + row
    arrived = tl.atomic_add(p_count, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        rp = tl.arange(0, BLOCK_P)
        keys = tl.load(best + row * stride_b + rp, mask=rp < tl.num_programs(0),
                       other=NO_KEY, cache_modifier=".cg")
        top = tl.max(keys, 0)
        token = V - 1 - (top - ((top >> 32) << 32))  # the low 32 bits: V - 1 - row
        tl.store(tokens + row, tl.where(top == NO_KEY, 0, token))  # no candidate anywhere (NaN logits): token 0
        tl.store(p_count, 0)  # zero again for the next launch


if HAS_TRITON:
    _key = triton.jit(_key)
    _round_to = triton.jit(_round_to)
    _bounds = triton.jit(_bounds)
    _candidate_step = triton.jit(_candidate_step)
    _lower_kernel = _LazyJit(_lower_kernel, pdl=True)
    _greedy_kernel = _LazyJit(_greedy_kernel, pdl=True)


def applies(hidden: torch.Tensor, weight: torch.Tensor, quantized: QuantizedRows | None) -> bool:
    """Whether `greedy_tokens` runs the kernel for these: Triton present, CUDA tensors (or the interpreter on CPU
    ones), at most MAX_ROWS tokens, a float head [V, K] with K contiguous whose int8 copy is `quantized`."""
    rows = hidden.numel() // max(1, hidden.shape[-1])
    runs = hidden.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return (HAS_TRITON and runs and quantized is not None and 0 < rows <= MAX_ROWS
            and weight.dtype in _KINDS and hidden.dtype in _KINDS and weight.stride(-1) == 1
            and hidden.shape[-1] == weight.shape[1] <= MAX_HIDDEN and quantized.weight.shape == weight.shape
            and weight.device == hidden.device)


def greedy_tokens(hidden: torch.Tensor, weight: torch.Tensor, quantized: QuantizedRows) -> torch.Tensor:
    """Greedy tokens of hidden states [..., K] under the LM head `weight` [V, K] -> [...] long, reading the head's
    int8 copy `quantized` and only the candidate rows of the head itself (module docstring): the kernel where
    `applies`, else `greedy_tokens_reference`. Equal to `greedy_tokens_plain` (the first argmax of the head's logits
    in its dtype) up to the order of the fp32 sums."""
    if quantized is None or quantized.weight.shape != weight.shape or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"greedy_tokens takes hidden [..., K], a head [V, K] and its int8 copy of the same shape; got "
                         f"hidden {tuple(hidden.shape)}, head {tuple(weight.shape)}, copy "
                         f"{None if quantized is None else tuple(quantized.weight.shape)}")
    lead = hidden.shape[:-1]
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not applies(rows, weight, quantized):
        return greedy_tokens_reference(rows, weight, quantized).view(lead)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    approx = linear_int8(rows, quantized)  # [R, V]
    v, k = weight.shape
    block_v = BLOCK_V if rows.shape[0] <= 4 else BLOCK_V_WIDE
    programs = triton.cdiv(v, block_v)
    lowers = torch.empty(rows.shape[0], programs, dtype=torch.float32, device=rows.device)
    best = torch.empty(rows.shape[0], programs, dtype=torch.long, device=rows.device)
    tokens = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
    kp = triton.next_power_of_2(k)
    if TWO_PASS:
        _lower_kernel[(programs, rows.shape[0])](
            rows, approx, quantized.scale, lowers, v, error_bound(k), rows.stride(0), approx.stride(0),
            lowers.stride(0), K=k, BLOCK_V=block_v, KP=kp, num_warps=4)
    _greedy_kernel[(programs, rows.shape[0])](
        rows, approx, quantized.scale, weight, lowers, best, split_counters(rows.device), tokens, v, error_bound(k),
        rows.stride(0), approx.stride(0), weight.stride(0), lowers.stride(0), best.stride(0), K=k,
        BLOCK_V=block_v, C=CANDIDATES, BLOCK_K=min(MAX_BLOCK_K, kp), KP=kp, BLOCK_P=triton.next_power_of_2(programs),
        KIND=_KINDS[weight.dtype], TWO_PASS=TWO_PASS, BOUNDED=BOUNDED_CANDIDATES, num_warps=NUM_WARPS)
    return tokens.view(lead)
