"""A speculative round's bookkeeping around the target's forward, when the round commits on the device, as pure
torch functions that `torch.compile` turns into a few kernels (resident.FUSED_ROUND_TAIL; eagerly, one launch per op,
they are the round's reference): run 135 of benchmarks/results/gpu_rounds_runs.md counted ≈ 40 small torch launches
a round after the forward (acceptance, the commit count, lengths, the anchor, the rows that end, the hand-off) and ≈ 8
before it (the block, the rows' room, the longest length allowed, the context length), 1-3 µs each on the GPU.

    round_head       before the choice: the block [anchor, drafts], each row's room, w_max, the selector's context
    (the choice of w, the target's forward)
    round_accept     greedy: target tokens → drafts accepted a (greedy_accepted), and m (commit_count)
    commit_count     m = the tokens the round commits per row (a from greedy or speculative sampling)
    (the selector's update, the GDN commit and the drafter's context append run between: kernels of their own)
    round_advance    lengths and positions + m, the new anchor, the rows that end, the hand-off values

One static shape: the block's [N, T] (tests/test_round_tail.py: against the rules row by row, and whole calls).
"""
from __future__ import annotations

import torch

from hybridspec_hf.generation.acceptance import greedy_accept
from hybridspec_hf.graphs.static_target import advance_lengths
from hybridspec_hf.kernels.step_tail_triton import rows_ended


def round_head(last_token: torch.Tensor, drafts: torch.Tensor, length: torch.Tensor, limit: torch.Tensor,
               live: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's values before its choice of w: last_token [N, 1] the anchor, drafts [N, B-1] long, length [N]
    committed tokens, limit [N] the most tokens a row may reach, live [N] 0/1, t the tokens a round may verify.
    Returns (block [N, t] = [anchor, the first t-1 drafts], room [N] = the tokens generate() still allows each row,
    w_max [1] = the roomiest live row's room in [1, t], context_len [1] = the length the selector's latency model is
    read at: the row's, or the longest live row's (one stream: the rows share w))."""
    block = torch.cat([last_token, drafts[:, : t - 1]], dim=1)
    room = limit - (length + 1)
    w_max = (room * live).max().view(1).clamp(min=1, max=t)
    return block, room, w_max, context_length(length, live)


def context_length(length: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[1] long: the context the selector's latency model is read at (length, live [N]): the row's, or the longest
    live row's (one stream: w is shared by the rows)."""
    return length.clone() if length.shape[0] == 1 else (length * live).max().view(1)


def round_accept(target_tokens: torch.Tensor, block: torch.Tensor, valid: torch.Tensor,
                 replayed: torch.Tensor | None, eos_ids: torch.Tensor, length: torch.Tensor, limit: torch.Tensor,
                 live: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a round and its commit count.

    target_tokens [N, T] long: the target's argmax after each verified token (zero past the n verified: their
    positions are at or past `valid`); block [N, T] the verified tokens (anchor first; the drafts after it);
    valid [N] long tokens that count (≤ n); replayed [N] (timing mode: a with the whole block verified) or None;
    eos_ids [E] (-1 unused); length [N] committed tokens; limit [N] the most tokens a row may reach; live [N] 0/1.
    Writes count [N] (`commit_count`). Returns (accepted [N], count as int32 [N], what the GDN commit reads)."""
    accepted = greedy_accepted(target_tokens, block, valid, replayed)
    return accepted, commit_count(target_tokens, accepted, eos_ids, length, limit, live, count)


def greedy_accepted(target_tokens: torch.Tensor, block: torch.Tensor, valid: torch.Tensor,
                    replayed: torch.Tensor | None) -> torch.Tensor:
    """[N] drafts accepted (shapes as `round_accept`'s): the longest prefix of drafts equal to the target's argmax
    within the valid tokens, or in timing mode the profile's count (`replayed`) within them."""
    if replayed is not None:
        return torch.minimum(replayed, valid.view(-1) - 1)
    return greedy_accept(block[:, 1:], target_tokens, valid)


def commit_count(target_tokens: torch.Tensor, accepted: torch.Tensor, eos_ids: torch.Tensor, length: torch.Tensor,
                 limit: torch.Tensor, live: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Writes count [N] = m = min(a + 1, up to the first EOS among the emitted tokens target_tokens[:, :a + 1], the
    row's room before `limit`) · live (shapes as `round_accept`'s). Returns count as int32 (the GDN commit's)."""
    t = target_tokens.shape[1]
    positions = torch.arange(t, device=target_tokens.device)
    emitted = positions.view(1, -1) <= accepted.view(-1, 1)  # [N, T]
    eos = (target_tokens[..., None] == eos_ids.view(1, 1, -1)).any(-1) & emitted
    first_eos = torch.where(eos, positions.view(1, -1), t).min(-1).values  # [N]
    room = (limit - (length + 1)).clamp(min=0)
    m = torch.minimum(torch.minimum(accepted + 1, first_eos + 1), room) * live
    count.copy_(m)
    return m.to(torch.int32)


def new_anchor(target_tokens: torch.Tensor, count: torch.Tensor, last_token: torch.Tensor) -> None:
    """last_token [N, 1] = the last of the count [N] tokens committed from target_tokens [N, T] (kept where count is
    0: a row that ended or had no room)."""
    last = target_tokens.gather(1, (count - 1).clamp(min=0).view(-1, 1))  # [N, 1]
    last_token.copy_(torch.where(count.view(-1, 1) > 0, last, last_token))


def round_advance(target_tokens: torch.Tensor, accepted: torch.Tensor, count: torch.Tensor, length: torch.Tensor,
                  next_position: torch.Tensor, attention_lengths: torch.Tensor | None, last_token: torch.Tensor,
                  live: torch.Tensor, eos_ids: torch.Tensor, limit: torch.Tensor, w: torch.Tensor, keep: torch.Tensor,
                  n_new: torch.Tensor, draft_next: torch.Tensor, handoff_values: torch.Tensor) -> None:
    """After the commit of count [N] tokens of target_tokens [N, T] (in place): length [N] and next_position
    [R, N, 1] + count, attention_lengths [L] (one row; None: not kept) = length, last_token [N, 1] the last committed
    token (unchanged where count is 0), live [N] 0 for rows that end (an EOS committed, or the limit reached), and
    handoff_values = [target_tokens, accepted, count, live, w, keep, n_new, draft_next] (the last four [1])."""
    advance_lengths(count, length, next_position, attention_lengths)
    new_anchor(target_tokens, count, last_token)
    committed = torch.arange(target_tokens.shape[1], device=count.device).view(1, -1) < count.view(-1, 1)
    live.mul_((~rows_ended(target_tokens, committed, eos_ids, length, limit)).long())
    torch.cat([target_tokens.reshape(-1), accepted.reshape(-1), count, live, w.reshape(1), keep.reshape(1).long(),
               n_new.reshape(1), draft_next.reshape(1)], out=handoff_values)
