"""Acceptance rules: which drafts the target keeps."""
from __future__ import annotations

import torch


def greedy_accept(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request: the longest prefix where draft == target argmax.

    drafts: [B, w-1] the verified drafts d_1..d_{w-1}; target_tokens: [B, w] target argmax after each verified
    token. Returns a [B] long, 0 ≤ a ≤ w-1. The emitted tokens are target_tokens[:, :a+1].
    """
    matches = drafts == target_tokens[:, : drafts.shape[1]]
    return matches.long().cumprod(dim=1).sum(dim=1)
