"""The bookkeeping of a resident plain step after its token, in one launch.

After the LM head a plain decoding step (generation/resident.py, `ResidentRounds._step`) commits m = 1 token per
live row: in torch ≈ 20 launches of a few elements each (≈ 40 µs of the captured AR step on the H200, most of it
launch latency). `step_tail` does the same updates in one program:

    count = live                                          m: 1 per live row
    length += count;  position[r] += count                StaticTarget.advance (every mRoPE row r)
    attention_lengths[:] = length                         one row: the attention layers' cumulative_length
    last_token = token where count > 0                    the next step's anchor
    tokens = [token, 0, ..., 0]                           [N, T]: the hand-off's block layout
    live *= not (EOS among the committed tokens or length + 1 >= limit)      `rows_ended` (device_commit only)
    out = [tokens, a = 0, m = count, live, w = 1, kept = 0, n_new = 0, draft_next]      the hand-off's values

All integer (int64) arithmetic, so `step_tail_reference` and the kernel agree exactly. `rows_ended` is the torch rule
every resident round ends its rows by (ResidentRounds._end_rows). The GDN commit (none after a decoding step) and
the drafter's context append read `count` afterwards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, triton

_ON_CPU = False  # tests only: the kernel on CPU tensors too (with the Triton interpreter)


def rows_ended(tokens: torch.Tensor, emitted: torch.Tensor, eos_ids: torch.Tensor, length: torch.Tensor,
               limit: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rows that end with this commit: an EOS among their committed tokens (tokens [N, T] long,
    emitted [N, T] bool; eos_ids [E] long, -1 unused) or their new length [N] one short of their limit [N]."""
    eos = ((tokens[..., None] == eos_ids.view(1, 1, -1)).any(-1) & emitted).any(-1)
    return eos | (length + 1 >= limit)


def step_tail_reference(token: torch.Tensor, live: torch.Tensor, count: torch.Tensor, length: torch.Tensor,
                        position: torch.Tensor, attention_lengths: torch.Tensor | None, last_token: torch.Tensor,
                        eos_ids: torch.Tensor, limit: torch.Tensor, draft_next: torch.Tensor, out: torch.Tensor,
                        device_commit: bool) -> None:
    """The module docstring's updates in torch. token, live, count, length, limit [N] long; position [R, N, 1];
    attention_lengths [L] (one row; None: not kept); last_token [N, 1]; eos_ids [E]; draft_next [1];
    out [N·T + 3N + 4] long (T from its size). live ends rows only with device_commit."""
    rows = live.numel()
    width = (out.numel() - 4) // rows - 3
    count.copy_(live)
    length.add_(count)
    position.add_(count.view(1, -1, 1))
    if attention_lengths is not None:
        attention_lengths.copy_(length.expand_as(attention_lengths))
    last_token.copy_(torch.where(count.view(-1, 1) > 0, token.view(-1, 1), last_token))
    tokens = F.pad(token.view(-1, 1), (0, width - 1))
    if device_commit:
        emitted = torch.arange(width, device=live.device).view(1, -1) < count.view(-1, 1)
        live.mul_((~rows_ended(tokens, emitted, eos_ids, length, limit)).long())
    fixed = F.pad(torch.ones(1, dtype=torch.long, device=live.device), (0, 2))  # w, kept, n_new (no host copy:
    # the reference also runs inside CUDA-graph captures, FUSED_STEP_TAIL off)
    out.copy_(torch.cat([tokens.reshape(-1), torch.zeros_like(live), count, live, fixed, draft_next.reshape(1)]))


def _step_tail_kernel(token, live, count, length, position, attention_lengths, last_token, eos_ids, limit,
                      draft_next, out, N, L, T, R: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, ATTENTION: tl.constexpr,
                      DEVICE_COMMIT: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    rows = tl.arange(0, BLOCK_N)
    in_rows = rows < N
    was_live = tl.load(live + rows, mask=in_rows, other=0)
    tl.store(count + rows, was_live, mask=in_rows)
    new_length = tl.load(length + rows, mask=in_rows, other=0) + was_live
    tl.store(length + rows, new_length, mask=in_rows)
    for r in tl.static_range(R):  # R (mRoPE rows) and E (EOS ids) are small constants: unrolled
        p = tl.load(position + r * N + rows, mask=in_rows, other=0)
        tl.store(position + r * N + rows, p + was_live, mask=in_rows)
    if ATTENTION:  # one row (N = 1): every attention layer's cumulative_length is its length
        layers = tl.arange(0, BLOCK_L)
        first = tl.sum(tl.where(rows == 0, new_length, 0), axis=0)
        tl.store(attention_lengths + layers, tl.zeros([BLOCK_L], tl.int64) + first, mask=layers < L)
    tok = tl.load(token + rows, mask=in_rows, other=0)
    anchor = tl.load(last_token + rows, mask=in_rows, other=0)
    tl.store(last_token + rows, tl.where(was_live > 0, tok, anchor), mask=in_rows)
    cols = tl.arange(0, BLOCK_T)
    tokens = tl.where(cols[None, :] == 0, tok[:, None], 0)  # [BLOCK_N, BLOCK_T]
    in_block = in_rows[:, None] & (cols[None, :] < T)
    tl.store(out + rows[:, None] * T + cols[None, :], tokens, mask=in_block)
    now_live = was_live
    if DEVICE_COMMIT:
        hit = tokens != tokens  # all False
        for e in tl.static_range(E):
            hit = hit | (tokens == tl.load(eos_ids + e))
        emitted = in_block & (cols[None, :] < was_live[:, None])
        eos = tl.max(tl.where(hit & emitted, 1, 0), axis=1) > 0
        ended = eos | (new_length + 1 >= tl.load(limit + rows, mask=in_rows, other=0))
        now_live = was_live * tl.where(ended, 0, 1).to(tl.int64)
        tl.store(live + rows, now_live, mask=in_rows)
    tl.store(out + N * T + rows, tl.zeros([BLOCK_N], tl.int64), mask=in_rows)  # a
    tl.store(out + N * T + N + rows, was_live, mask=in_rows)  # m
    tl.store(out + N * T + 2 * N + rows, now_live, mask=in_rows)
    last = tl.arange(0, 4)
    fixed = tl.where(last == 0, 1, 0).to(tl.int64)  # w = 1, kept = n_new = 0
    fixed = tl.where(last == 3, tl.load(draft_next), fixed)
    tl.store(out + N * (T + 3) + last, fixed)


if HAS_TRITON:
    _step_tail_kernel = _LazyJit(_step_tail_kernel, pdl=True)


def applies(device: torch.device) -> bool:
    """Whether `step_tail` runs the kernel for tensors on `device` (CUDA with triton; the CPU under the tests'
    switch)."""
    return HAS_TRITON and (device.type == "cuda" or _ON_CPU)


def step_tail(token: torch.Tensor, live: torch.Tensor, count: torch.Tensor, length: torch.Tensor,
              position: torch.Tensor, attention_lengths: torch.Tensor | None, last_token: torch.Tensor,
              eos_ids: torch.Tensor, limit: torch.Tensor, draft_next: torch.Tensor, out: torch.Tensor,
              device_commit: bool) -> None:
    """`step_tail_reference` in ONE launch (same arguments; every tensor contiguous int64 on one device)."""
    tensors = [token, live, count, length, position, last_token, eos_ids, limit, draft_next, out]
    tensors += [] if attention_lengths is None else [attention_lengths]
    rows = live.numel()
    if (not all(t.dtype == torch.long and t.is_contiguous() and t.device == live.device for t in tensors)
            or token.numel() != rows or position.numel() % rows or (out.numel() - 4) % rows
            or (out.numel() - 4) // rows < 4):
        raise ValueError(
            f"step_tail wants contiguous int64 tensors on one device: token, live, count, length, limit [N], "
            f"position [R, N, 1], out [N·T + 3N + 4]; got token {tuple(token.shape)} {token.dtype}, live "
            f"{tuple(live.shape)}, position {tuple(position.shape)}, out {tuple(out.shape)}.")
    width = (out.numel() - 4) // rows - 3
    layers = 0 if attention_lengths is None else attention_lengths.numel()
    _step_tail_kernel[(1,)](
        token, live, count, length, position, live if attention_lengths is None else attention_lengths,
        last_token, eos_ids, limit, draft_next, out, rows, layers, width, R=position.numel() // rows,
        E=eos_ids.numel(), BLOCK_N=triton.next_power_of_2(rows), BLOCK_T=triton.next_power_of_2(width),
        BLOCK_L=triton.next_power_of_2(max(layers, 1)), ATTENTION=attention_lengths is not None,
        DEVICE_COMMIT=device_commit, num_warps=1)
