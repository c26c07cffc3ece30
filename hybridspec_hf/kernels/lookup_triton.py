"""Context lookup on the device, over a static token buffer: the proposal of `drafter.lookup.context_lookup` for the
first `length` tokens of each row, inside a captured round (no host work between a hand-off and the next replay).

The GPU-resident rounds keep every row's tokens so far in a buffer [N, C] that only grows where they commit
(generation/resident.py): `context_lookup_static` reads its first length[r] tokens (the anchor last) and returns what
`context_lookup(ids[r:r+1, :length[r]])` returns, with static shapes and no host sync. The torch form (the CPU twin
and the definition the kernel is tested against) masks a scan of the whole buffer, ≈ 8 small launches per match
length; the kernel does it in one launch: a program per BLOCK_S positions of a row compares the windows ending there
for every match length at once, the row's last program to finish picks the longest latest match and copies.
"""
from __future__ import annotations

import torch

from .gdn_triton import HAS_TRITON, _LazyJit, tl, triton
from .gemv_triton import COUNTERS, split_counters

_ON_CPU = False  # tests only: the kernel on CPU tensors too (with the Triton interpreter)
BLOCK_S = 512  # window ends compared per program (a row's programs: its capacity / BLOCK_S)


def context_lookup_static_reference(ids: torch.Tensor, length: torch.Tensor, block_size: int, min_ngram: int,
                                    max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`context_lookup` of ids[r, :length[r]] for every row r, in static shapes (ids [N, C] long, length [N] long,
    1 <= length <= C, read on the device). Returns (proposal [N, block_size - 1] long, n [N] long)."""
    rows, capacity = ids.shape
    length = length.view(-1, 1)  # [N, 1]
    best_n = torch.zeros(rows, 1, dtype=torch.long, device=ids.device)
    best_start = torch.zeros(rows, 1, dtype=torch.long, device=ids.device)
    for n in range(min_ngram, min(max_ngram, capacity - 1) + 1):  # longer matches overwrite shorter ones
        windows = ids[:, : capacity - 1].unfold(1, n, 1)  # [N, C - n, n]: windows starting at s
        tail = ids.gather(1, (length - n + torch.arange(n, device=ids.device)).clamp(min=0))  # [N, n]
        starts = torch.arange(capacity - n, device=ids.device).view(1, -1)
        # a window counts where it ends before the row's last token (s + n <= length - 1)
        found = (windows == tail[:, None, :]).all(-1) & (starts + n <= length - 1)  # [N, C - n]
        latest = torch.where(found, starts, -1).amax(-1, keepdim=True)  # [N, 1], -1: none
        hit = latest >= 0
        best_n = torch.where(hit, n, best_n)
        best_start = torch.where(hit, latest, best_start)
    begin = best_start + best_n  # [N, 1] first copied position (<= length - 1)
    period = (length - begin).clamp(min=1)
    k = torch.arange(block_size - 1, device=ids.device).view(1, -1)
    index = torch.where(best_n > 0, begin + k % period, length - 1)
    return ids.gather(1, index), best_n.view(-1)


def _context_lookup_kernel(ids, length, proposal, ngram, scratch, counters, stride_ids, stride_p, B1,
                           MIN_N: tl.constexpr, MAX_N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
                           BLOCK_S: tl.constexpr, CHUNKS: tl.constexpr, CP: tl.constexpr):
    """Program (row, chunk): the windows of the row that end in the chunk's BLOCK_S positions e (a window of n
    tokens ending at e <= length - 2 matches where ids[e - k] == ids[length - 1 - k] for k < n: one pass over k
    serves every n), the latest matching end per n stored to scratch; the last of the row's programs to arrive takes
    the latest end of the longest n over all chunks and writes the proposal."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = ids + row * stride_ids
    total = tl.load(length + row)  # the row's tokens, the anchor last
    lanes = tl.arange(0, NP)  # lane n: the latest end of a match of n tokens, -1: none
    best = tl.full([NP], -1, tl.int64)
    if chunk * BLOCK_S <= total - 2:  # (chunks past the row's text: nothing to compare)
        e = chunk * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
        run = e <= total - 2  # windows end before the last token
        for k in tl.static_range(MAX_N):
            at = total - 1 - k
            token = tl.load(base + at, mask=at >= 0, other=-2)  # the k-th token back from the row's end
            run = run & (e >= k)
            run = run & (tl.load(base + e - k, mask=run, other=-1) == token)
            if k + 1 >= MIN_N:
                best = tl.maximum(best, tl.where(lanes == k + 1, tl.max(tl.where(run, e, -1), axis=0), -1))
    tl.store(scratch + (row * CHUNKS + chunk) * NP + lanes, best)
    # the last program of the row to arrive proposes (a barrier, then an acq_rel atomic: gemv_triton's split-K)
    tl.debug_barrier()
    p_count = counters + row
    arrived = tl.atomic_add(p_count, 1, sem="acq_rel")
    if arrived == CHUNKS - 1:
        c = tl.arange(0, CP)
        ends = tl.load(scratch + (row * CHUNKS + c[:, None]) * NP + lanes[None, :], mask=(c < CHUNKS)[:, None],
                       other=-1, cache_modifier=".cg")
        latest = tl.max(ends, axis=0)  # [NP]
        found = (latest >= 0) & (lanes >= MIN_N) & (lanes <= MAX_N)
        best_n = tl.max(tl.where(found, lanes, 0), axis=0).to(tl.int64)  # the longest n that matches, 0: none
        begin = tl.max(tl.where(lanes == best_n, latest, -1), axis=0) + 1  # first copied position
        period = tl.maximum(total - begin, 1)
        k = tl.arange(0, BLOCK_B)
        index = tl.where(best_n > 0, begin + k % period, total - 1)
        keep = k < B1
        tl.store(proposal + row * stride_p + k, tl.load(base + index, mask=keep, other=0), mask=keep)
        tl.store(ngram + row, best_n)
        tl.store(p_count, 0)  # zero again for the next launch


if HAS_TRITON:
    _context_lookup_kernel = _LazyJit(_context_lookup_kernel)


def applies(device: torch.device) -> bool:
    """Whether `context_lookup_static` runs the kernel for tensors on `device` (CUDA with triton; the CPU under the
    tests' switch)."""
    return HAS_TRITON and (device.type == "cuda" or _ON_CPU)


def context_lookup_static(ids: torch.Tensor, length: torch.Tensor, block_size: int, min_ngram: int, max_ngram: int,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`context_lookup_static_reference` in one launch where the kernel applies (else the reference). ids [N, C]
    long contiguous, length [N] long (1 <= length <= C, not checked on the device: a capture must not sync);
    out: (proposal [N, block_size - 1], n [N]) long buffers to write, else new ones."""
    if ids.dim() != 2 or ids.dtype != torch.long or length.dtype != torch.long or length.numel() != ids.shape[0]:
        raise ValueError(f"context_lookup_static takes ids [rows, capacity] long and length [rows] long, got "
                         f"{tuple(ids.shape)} {ids.dtype} and {tuple(length.shape)} {length.dtype}.")
    if not 1 <= min_ngram <= max_ngram or block_size < 2:
        raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram and a block of >= 2 tokens, got "
                         f"{min_ngram}, {max_ngram} and {block_size}.")
    if not applies(ids.device):
        found = context_lookup_static_reference(ids, length, block_size, min_ngram, max_ngram)
        if out is None:
            return found
        out[0].copy_(found[0])
        out[1].copy_(found[1])
        return out
    rows = ids.shape[0]
    proposal, ngram = out if out is not None else (
        torch.empty(rows, block_size - 1, dtype=torch.long, device=ids.device),
        torch.empty(rows, dtype=torch.long, device=ids.device))
    if not ids.is_contiguous() or proposal.stride(-1) != 1 or not length.is_contiguous() or rows > COUNTERS:
        raise ValueError(f"context_lookup_static wants contiguous ids, length and proposal rows, at most {COUNTERS} "
                         f"rows; got {rows}.")
    chunks = triton.cdiv(ids.shape[1], BLOCK_S)
    npow = triton.next_power_of_2(max_ngram + 1)
    scratch = torch.empty(rows * chunks * npow, dtype=torch.long, device=ids.device)  # each chunk's latest ends
    _context_lookup_kernel[(rows, chunks)](
        ids, length, proposal, ngram, scratch, split_counters(ids.device), ids.stride(0), proposal.stride(0),
        block_size - 1, MIN_N=min_ngram, MAX_N=max_ngram, NP=npow, BLOCK_B=triton.next_power_of_2(block_size - 1),
        BLOCK_S=BLOCK_S, CHUNKS=chunks, CP=triton.next_power_of_2(chunks), num_warps=4)
    return proposal, ngram
