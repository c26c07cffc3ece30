"""The drafter's per-position signals (top-1 probability, top-1 minus top-2 probability, entropy) and its drafts (the
argmax) in two launches.

`selector.survival.draft_signals` is the truth: log_softmax over the vocabulary in fp32, topk(2), exp, entr and a
sum — on CUDA about 30 kernels per round at a 248k vocabulary (radix top-k alone takes four), ≈ 0.15 ms of the
draft graph on the H200 (benchmarks/results/breakdown_attributed.md). Here each draft position's row streams
its logits once with an online softmax: the running max m, s = Σ e^(x-m), t = Σ e^(x-m)·(x-m) and the two largest
values (a repeated maximum counts twice, as topk's values do), split over programs by vocabulary chunk (one program
per 248k-logit row took 138 µs on the H200, run 21) and merged per row by a second launch. Then

    top1 = 1 / s,   top2 = e^(x2 - m) / s,   entropy = log s - t / s     (−Σ p log p with p = e^(x-m) / s)

The argmax comes with the stream (the index of the first occurrence of the largest value, as torch.argmax: the
first split holding the row's max, its first column), so the drafts cost no launch and no read of their own (torch's
argmax over [15, V] took two launches; the drafter's logits need no fp32 copy either: the kernel reads bf16 and
computes in fp32). Logits of -inf contribute nothing (entr(0) = 0); NaN logits are not ranked as torch ranks them (a
drafter that returns NaN breaks its signals anyway; its drafts are only proposals: the target's verification keeps
the output exact). fp32 throughout; against the reference the sums run in another
order: agreement to ~1e-5 relative (entropy to ~1e-5 absolute). Kernels bind to `triton.jit` at launch (`_LazyJit`),
so `TRITON_INTERPRET=1` runs them on the CPU (tests).
"""
from __future__ import annotations

import torch

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, triton

BLOCK_V = 2048  # logits per step of the stream
CHUNK_V = 4 * BLOCK_V  # logits per program: a 248k vocabulary spreads over 31 programs per position


def _signals_partial_kernel(logits, part, index, stride_row, V, S: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, split): m, the second largest value, s and t (module docstring) over its CHUNK of the row, and
    the column of m's first occurrence."""
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    base = logits + row * stride_row + split * CHUNK
    m = tl.full([], float("-inf"), tl.float32)  # running max (= x1, the largest value)
    x2 = tl.full([], float("-inf"), tl.float32)  # second largest value
    s = tl.zeros([], tl.float32)  # Σ e^(x - m)
    t = tl.zeros([], tl.float32)  # Σ e^(x - m) · (x - m)
    at = split * CHUNK  # the column of m's first occurrence (an all -inf chunk: its first column, as torch.argmax)
    for start in range(0, CHUNK, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=split * CHUNK + idx < V, other=float("-inf")).to(tl.float32)
        b1 = tl.max(x, axis=0)
        first = tl.min(tl.where(x == b1, cols, BLOCK), axis=0)  # one occurrence of the block max ...
        b2 = tl.max(tl.where(cols == first, float("-inf"), x), axis=0)  # ... out: a repeat stays a candidate
        x2 = tl.maximum(tl.maximum(x2, b2), tl.minimum(m, b1))
        at = tl.where(b1 > m, split * CHUNK + start + first, at)  # a tie with an earlier block keeps the earlier
        new_m = tl.maximum(m, b1)
        ref = tl.where(new_m > float("-inf"), new_m, 0.0)  # all -inf so far: nothing to add, keep s = t = 0
        seen = m > float("-inf")
        shift = tl.where(seen, m - ref, 0.0)
        t = tl.where(seen, tl.exp(shift) * (t + shift * s), 0.0)
        s = tl.where(seen, tl.exp(shift) * s, 0.0)
        live = x > float("-inf")
        d = tl.where(live, x - ref, 0.0)
        e = tl.where(live, tl.exp(d), 0.0)
        s += tl.sum(e, axis=0)
        t += tl.sum(e * d, axis=0)
        m = new_m
    out = part + (row * S + split) * 4
    tl.store(out + 0, m)
    tl.store(out + 1, x2)
    tl.store(out + 2, s)
    tl.store(out + 3, t)
    tl.store(index + row * S + split, at)


def _signals_combine_kernel(part, index, out, tokens, S: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the S partials merged (each rescaled to the row's max), then top1, margin, entropy, and
    the argmax (the first split holding the max: its first occurrence)."""
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, SP)
    ok = i < S
    base = part + (row * S + i) * 4
    m_i = tl.load(base + 0, mask=ok, other=float("-inf"))
    x2_i = tl.load(base + 1, mask=ok, other=float("-inf"))
    s_i = tl.load(base + 2, mask=ok, other=0.0)
    t_i = tl.load(base + 3, mask=ok, other=0.0)
    m = tl.max(m_i, axis=0)
    first = tl.min(tl.where(m_i == m, i, SP), axis=0)  # the largest value once; a repeat elsewhere is the second
    x2 = tl.maximum(tl.max(x2_i, axis=0), tl.max(tl.where(i == first, float("-inf"), m_i), axis=0))
    live = m_i > float("-inf")
    shift = tl.where(live, m_i - m, 0.0)
    scale = tl.where(live, tl.exp(shift), 0.0)
    s = tl.sum(scale * s_i, axis=0)
    t = tl.sum(scale * (t_i + shift * s_i), axis=0)
    top1 = 1.0 / s
    top2 = tl.where(x2 > float("-inf"), tl.exp(x2 - m), 0.0) / s
    tl.store(out + row * 3 + 0, top1)
    tl.store(out + row * 3 + 1, top1 - top2)
    tl.store(out + row * 3 + 2, tl.log(s) - t / s)
    tl.store(tokens + row, tl.load(index + row * S + first).to(tl.int64))


if HAS_TRITON:
    _signals_partial_kernel = _LazyJit(_signals_partial_kernel, pdl=True)
    _signals_combine_kernel = _LazyJit(_signals_combine_kernel, pdl=True)


def draft_signals_fused(draft_logits: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Triton `draft_signals` and argmax: draft_logits [batch, B-1, V] (any float dtype) -> ({"top1", "margin",
    "entropy"} fp32 [batch, B-1], the drafts [batch, B-1] long, = draft_logits.argmax(-1))."""
    batch, positions, vocab = draft_logits.shape
    logits = draft_logits.reshape(batch * positions, vocab)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, splits = logits.shape[0], triton.cdiv(vocab, CHUNK_V)
    out = torch.empty(rows, 3, dtype=torch.float32, device=draft_logits.device)
    tokens = torch.empty(rows, dtype=torch.long, device=draft_logits.device)
    if rows:
        part = torch.empty(rows, splits, 4, dtype=torch.float32, device=draft_logits.device)
        index = torch.empty(rows, splits, dtype=torch.int32, device=draft_logits.device)
        _signals_partial_kernel[(rows, splits)](logits, part, index, logits.stride(0), vocab, S=splits,
                                                CHUNK=CHUNK_V, BLOCK=BLOCK_V, num_warps=8)
        _signals_combine_kernel[(rows,)](part, index, out, tokens, S=splits, SP=triton.next_power_of_2(splits),
                                         num_warps=1)
    out = out.view(batch, positions, 3)
    signals = {"top1": out[..., 0], "margin": out[..., 1], "entropy": out[..., 2]}
    return signals, tokens.view(batch, positions)
