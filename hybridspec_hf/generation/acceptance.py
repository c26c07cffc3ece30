"""Acceptance rules: which drafts the target keeps."""
from __future__ import annotations

import torch


def greedy_accept(drafts: torch.Tensor, target_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Drafts accepted per request: the longest prefix where draft == target argmax, within the valid tokens.

    drafts: [B, T-1] the verified drafts d_1..d_{T-1}; target_tokens: [B, T] target argmax after each verified
    token; valid: optional [B] long, tokens of the verification that count (anchor included), so at most
    valid - 1 drafts can be accepted. Returns a [B] long. The emitted tokens are target_tokens[:, :a+1].
    """
    matches = drafts == target_tokens[:, : drafts.shape[1]]
    if valid is not None:
        positions = torch.arange(drafts.shape[1], device=drafts.device)
        matches &= positions.unsqueeze(0) < (valid.view(-1, 1) - 1)
    return matches.long().cumprod(dim=1).sum(dim=1)


def speculative_sample(
    drafts: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor | None = None, generator: torch.Generator | None = None,
    coins: torch.Tensor | None = None, races: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless acceptance when sampling, for drafts proposed deterministically (target-only verification).

    Draft d_i is accepted with probability p_i(d_i); at the first rejection the emitted token is sampled from p_i
    with d_i's mass removed (renormalised), and after the last verified draft from p. Each emitted token then has
    exactly the target's distribution: P(y) = p(x)[y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y ≠ x] = p(y). The
    verification length must be chosen from draft-side information only (it is), never from the target's outputs.

    drafts: [B, T-1]; probs: [B, T, V] target probabilities after logits processors/warpers at each verified
    position; valid: [B] tokens that count. coins [B, T-1] uniform and races [B, V] Exp(1): the random numbers, drawn
    here if not given (what the function would draw, in the same order). Returns (a [B] drafts accepted, token [B]
    the token emitted after them).
    """
    batch, tokens, vocab = probs.shape
    p_draft = probs[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    if coins is None:
        coins = torch.rand(p_draft.shape, device=probs.device, generator=generator)
    accept = coins < p_draft
    limit = torch.full((batch,), tokens, device=probs.device) if valid is None else valid.view(-1)
    positions = torch.arange(tokens - 1, device=probs.device)
    accept &= positions.unsqueeze(0) < (limit.view(-1, 1) - 1)
    a = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    row = probs.gather(1, a.view(-1, 1, 1).expand(-1, 1, vocab)).squeeze(1)  # [B, V] p at position a
    rejected = a < limit - 1  # a draft was verified at position a and rejected
    rejected_token = drafts.gather(1, a.clamp(max=max(tokens - 2, 0)).view(-1, 1)) if tokens > 1 else None
    if rejected_token is not None:
        removed = torch.zeros_like(row).scatter_(1, rejected_token, 1.0) * rejected.view(-1, 1)
        row = row * (1 - removed)
    return a, sample_tokens(row, generator, races)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None,
                  races: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of probs [..., V] (any non-negative weights), without a host sync.

    argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i / Σ p (E_i / p_i are exponential races with
    rates p_i) — `torch.multinomial` reads the row sums on the host, which a CUDA graph cannot capture. `races`:
    the E_i (probs' shape, fp32), drawn here if not given.
    """
    if races is None:
        races = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / races).argmax(dim=-1)


def score_positions(logits_processor, prefix: torch.Tensor, tokens: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Logits processors applied to each verified position with the prefix AR would have seen there.

    prefix: [B, L] ending with the anchor; tokens: [B, T] the verified tokens (anchor first); raw: [B, T, V] fp32.
    """
    if len(logits_processor) == 0:
        return raw
    scores = torch.empty_like(raw)
    for i in range(raw.shape[1]):
        scores[:, i] = logits_processor(torch.cat([prefix, tokens[:, 1 : i + 1]], dim=1), raw[:, i])
    return scores
