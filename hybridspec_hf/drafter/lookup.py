"""Context lookup: a second proposal beside the drafter's block, copied from earlier in the same sequence.

Where the last n tokens (the anchor included) occurred earlier, the tokens that followed that occurrence are a
guess at what follows now (prompt-lookup decoding). Code repeats itself (names, calls, whole lines), and a small
target repeats itself more, which a DFlash drafter conditioned on hidden states does not copy: on the tiny pair's
held-out prompts the better of the two per round is worth ≈ 1.6 tokens a round over the drafter alone
(benchmarks/results/context_lookup_tau_tiny_pair.md). The proposal is verified exactly like the drafter's, so it
changes nothing the target emits.

`context_lookup` is the definition in torch (no host sync, the same launches whatever is found: tests and the
offline benchmark); `ContextIndex` keeps the same search up to date on the host, a few dictionary reads a round
(what the eager loop runs); the GPU-resident rounds run it on the device, over a static buffer of the call's tokens
inside the draft graph (kernels/lookup_triton.py: one launch on CUDA).
"""
from __future__ import annotations

import torch

from hybridspec_hf.kernels.lookup_triton import context_lookup_static_reference


def context_lookup(ids: torch.Tensor, block_size: int, min_ngram: int, max_ngram: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The proposal that context lookup makes after the last token of each row.

    ids: [R, L] long, each row's tokens so far (its last token is the round's anchor). For the largest n in
    [min_ngram, max_ngram] whose last n tokens occur earlier in the row (an occurrence ending before the last
    token), take the latest such occurrence, starting at s; the proposal is the block_size - 1 tokens that followed
    it, ids[s + n + k] for k < P = L - s - n, and past the row's end the same tokens again (ids[s + n + k mod P]):
    the continuation of a text that repeats with period P, what it would be if the repeat went on.
    Returns (proposal [R, block_size - 1] long, n [R] long: the match length, 0 where no n in the range matches;
    the proposal's tokens are then the anchor's, never used).
    """
    if ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(f"context_lookup expects token ids [rows, length] long, got {tuple(ids.shape)} {ids.dtype}.")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}.")
    rows, length = ids.shape
    # every row whole: the static form (kernels/lookup_triton.py, the resident rounds' torch twin) at full length
    return context_lookup_static_reference(ids, torch.full((rows,), length, device=ids.device), block_size,
                                           min_ngram, max_ngram)


class ContextIndex:
    """`context_lookup` on the host, kept up to date token by token: the latest start of every n-gram seen (n in
    [min_ngram, max_ngram]), so a round's proposal costs a few dictionary reads instead of a scan of the sequence.
    What the eager loop uses (the host has each round's tokens); `context_lookup` is its definition in torch, and
    the tests hold the two equal."""

    def __init__(self, tokens: list[int], block_size: int, min_ngram: int, max_ngram: int):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"context lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}.")
        self.block_size, self.min_ngram, self.max_ngram = block_size, min_ngram, max_ngram
        self.tokens: list[int] = []
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; each n-gram that ended at the old last token is now an earlier occurrence."""
        seq, latest = self.tokens, self.latest
        for token in tokens:
            end = len(seq)
            for n, seen in latest.items():
                if end >= n:
                    seen[tuple(seq[end - n:])] = end - n
            seq.append(int(token))

    def propose(self) -> tuple[list[int], int]:
        """(the block_size - 1 proposed tokens, the match length n; 0 and the last token repeated where none)."""
        seq, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self.latest[n].get(tuple(seq[length - n:]))
            if start is not None:
                begin = start + n
                period = length - begin
                return [seq[begin + k % period] for k in range(self.block_size - 1)], n
        return [seq[-1] if seq else 0] * (self.block_size - 1), 0
