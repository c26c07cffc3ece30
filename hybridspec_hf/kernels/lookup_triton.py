"""Context lookup on the device, over a static token buffer: the proposal of `drafter.lookup.context_lookup` for the
first `length` tokens of each row, inside a captured round (no host work between a hand-off and the next replay).

The GPU-resident rounds keep every row's tokens so far in a buffer [N, C] that only grows where they commit
(generation/resident.py): `context_lookup_static` reads its first length[r] tokens (the anchor last) and returns what
`context_lookup(ids[r:r+1, :length[r]])` returns, with static shapes and no host sync. The torch form (the CPU twin
and the definition the kernel is tested against) masks a scan of the whole buffer, ≈ 8 small launches per match
length; the kernel does it in one launch, one program per row, its scan skipping the blocks past the row's length.
"""
from __future__ import annotations

import torch

from .gdn_triton import HAS_TRITON, _LazyJit, tl, triton

_ON_CPU = False  # tests only: the kernel on CPU tensors too (with the Triton interpreter)
BLOCK_S = 512  # start positions compared per step of the kernel's scan


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


def _context_lookup_kernel(ids, length, proposal, ngram, stride_ids, stride_p, B1,
                           MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
                           ITERS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = ids + row * stride_ids
    total = tl.load(length + row)  # the row's tokens, the anchor last
    best_n = total * 0
    best_start = total * 0
    for n in tl.static_range(MIN_N, MAX_N + 1):  # longer matches overwrite shorter ones
        latest = total * 0 - 1
        for it in range(ITERS):  # start positions s: the window [s, s + n) ends before the last token
            if it * BLOCK_S + n <= total - 1:  # (blocks past the row's length: skipped)
                s = it * BLOCK_S + tl.arange(0, BLOCK_S)
                found = s + n <= total - 1
                for j in tl.static_range(n):
                    token = tl.load(base + total - n + j)  # the row's last n tokens (total > n here)
                    found = found & (tl.load(base + s + j, mask=found, other=-1) == token)
                latest = tl.maximum(latest, tl.max(tl.where(found, s, -1), axis=0))
        hit = latest >= 0
        best_n = tl.where(hit, n, best_n)
        best_start = tl.where(hit, latest, best_start)
    begin = best_start + best_n
    period = tl.maximum(total - begin, 1)
    k = tl.arange(0, BLOCK_B)
    index = tl.where(best_n > 0, begin + k % period, total - 1)
    keep = k < B1
    tl.store(proposal + row * stride_p + k, tl.load(base + index, mask=keep, other=0), mask=keep)
    tl.store(ngram + row, best_n)


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
    if not ids.is_contiguous() or proposal.stride(-1) != 1 or not length.is_contiguous():
        raise ValueError("context_lookup_static wants contiguous ids, length and proposal rows.")
    _context_lookup_kernel[(rows,)](ids, length, proposal, ngram, ids.stride(0), proposal.stride(0), block_size - 1,
                                    MIN_N=min_ngram, MAX_N=max_ngram, BLOCK_B=triton.next_power_of_2(block_size - 1),
                                    BLOCK_S=BLOCK_S, ITERS=triton.cdiv(ids.shape[1], BLOCK_S), num_warps=4)
    return proposal, ngram
