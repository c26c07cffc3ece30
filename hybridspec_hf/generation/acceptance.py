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
