"""Survival p̂_i of a context-lookup proposal (drafter/lookup.py), by the length n of the match it came from.

The drafter's signals say nothing about a copied proposal, so its survival comes from a table fitted on traces of
lookup proposals against the target's tokens: for each match length n in [min_ngram, max_ngram] and position i the
conditional acceptance c_{n,i} = P(copy i accepted | copies < i accepted), estimated as a count with a prior that
pulls it to the position's rate over every n (`pooling` pseudo-observations; positions reached rarely by one n lean
on the others), survival p̂_{n,i} = c_{n,1}·…·c_{n,i}. The table knows only n, not what is copied: the drafter's
own estimate of the copied tokens (its acceptance estimator on the signals of the copy's tokens, `copy_signals`)
refines it, p̂ = λ·table + (1 - λ)·rating with λ = `table_weight` (fitted beside the table: `fit_table_weight`).
The strategies compare Σ_i p̂ of the two proposals and verify the one expected to yield more (generation/loop.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridspec_hf.selector.survival import conditional_outcomes

_FORMAT = "hybridspec.lookup_acceptance/1"


class LookupEstimator:
    """p̂ [rows, B-1] of lookup proposals from their match lengths n [rows]: a table [max - min + 1, B-1]."""

    def __init__(self, survival: torch.Tensor, min_ngram: int, max_ngram: int, table_weight: float = 1.0):
        if not 0.0 <= table_weight <= 1.0:
            raise ValueError(f"table_weight is the table's share of a copy's survival, in [0, 1]; got {table_weight}.")
        if survival.dim() != 2 or survival.shape[0] != max_ngram - min_ngram + 1 or min_ngram < 1:
            raise ValueError(f"survival must be [max_ngram - min_ngram + 1, B-1] with min_ngram >= 1, got "
                             f"{tuple(survival.shape)} for n in [{min_ngram}, {max_ngram}].")
        if bool((survival < 0).any() or (survival > 1).any() or (survival[:, 1:] > survival[:, :-1]).any()):
            raise ValueError("survival must be probabilities, non-increasing along each row.")
        self.table = survival.float()  # [n range, B-1]
        self.min_ngram, self.max_ngram = int(min_ngram), int(max_ngram)
        self.table_weight = float(table_weight)  # λ: the table's share; the drafter's rating of the copy has 1 - λ

    @property
    def block_size(self) -> int:
        return self.table.shape[1] + 1

    def to(self, device: torch.device | str) -> "LookupEstimator":
        """A copy with its table on `device` (this one stays where it is: a drafter's or a config's table is
        shared between calls, and reading it back from a GPU would be a sync)."""
        moved = LookupEstimator(self.table, self.min_ngram, self.max_ngram, self.table_weight)
        moved.table = moved.table.to(device)
        return moved

    def survival(self, n: torch.Tensor, rating: torch.Tensor | None = None) -> torch.Tensor:
        """p̂ [rows, B-1] fp32 of proposals from matches of length n [rows] long; 0 where n is outside the table's
        range (no proposal). rating: [rows, B-1], the drafter's survival estimate of the copied tokens (its acceptance
        estimator on `copy_signals`), mixed in with weight 1 - table_weight; None: the table alone. No host sync
        where the table is on n's device (`to`)."""
        table = self.table if self.table.device == n.device else self.table.to(n.device)
        inside = (n >= self.min_ngram) & (n <= self.max_ngram)
        row = (n - self.min_ngram).clamp(0, table.shape[0] - 1)
        survival = table[row]
        if rating is not None:
            survival = self.table_weight * survival + (1.0 - self.table_weight) * rating.float()
        return survival * inside[:, None]

    @classmethod
    def fit(cls, n: torch.Tensor, accepted: torch.Tensor, block_size: int, min_ngram: int, max_ngram: int,
            verified: torch.Tensor | int | None = None, pooling: float = 20.0) -> "LookupEstimator":
        """From traces of lookup proposals: n [N] long match lengths, accepted [N] long copies accepted, verified
        [N] long or int copies verified (w - 1; default block_size - 1). Rows with n outside [min_ngram, max_ngram]
        are ignored."""
        if n.shape != accepted.shape or n.dim() != 1:
            raise ValueError(f"n and accepted are one count per traced proposal ([N] each), got shapes "
                             f"{tuple(n.shape)} and {tuple(accepted.shape)}.")
        keep = (n >= min_ngram) & (n <= max_ngram)
        if not bool(keep.any()):
            raise ValueError(f"no trace has a match length in [{min_ngram}, {max_ngram}]; nothing to fit.")
        positions = block_size - 1
        verified = positions if verified is None else verified
        if isinstance(verified, torch.Tensor) and verified.dim() > 0:
            verified = verified[keep]
        y, observed = conditional_outcomes(accepted[keep].long(), verified, positions)  # [M, P]
        y, observed = y.double() * observed, observed.double()
        row = n[keep].long() - min_ngram
        levels = max_ngram - min_ngram + 1
        hits = torch.zeros(levels, positions, dtype=torch.float64).index_add_(0, row, y)
        seen = torch.zeros(levels, positions, dtype=torch.float64).index_add_(0, row, observed)
        pooled = (hits.sum(0) + 0.5) / (seen.sum(0) + 1.0)  # [P], a Jeffreys-like start where nothing was seen
        conditional = (hits + pooling * pooled) / (seen + pooling)
        return cls(conditional.cumprod(-1).float(), min_ngram, max_ngram)

    @staticmethod
    def fit_table_weight(table_survival: torch.Tensor, rating: torch.Tensor, drafts_expected: torch.Tensor,
                         tau_copy: torch.Tensor, tau_drafts: torch.Tensor, steps: int = 10) -> float:
        """λ in {0, 1/steps, ..., 1} under which the rule "verify the copy where Σ(λ·table + (1 - λ)·rating) >
        drafts_expected" yields the most tokens per anchor over traced anchors: table_survival, rating [N, B-1] (the
        copy's two estimates; a row whose table row is all zero has no proposal and keeps the drafts),
        drafts_expected [N] (the drafts' Σ p̂), tau_copy,
        tau_drafts [N] (1 + accepted of each proposal against the target's tokens). Ties go to the larger λ."""
        best, best_tau = 1.0, None
        for step in range(steps, -1, -1):
            weight = step / steps
            copied = (weight * table_survival + (1.0 - weight) * rating).sum(-1)
            use = (table_survival.sum(-1) > 0) & (copied > drafts_expected)
            tau = torch.where(use, tau_copy, tau_drafts).double().mean().item()
            if best_tau is None or tau > best_tau:
                best, best_tau = weight, tau
        return best

    def to_dict(self) -> dict:
        return {"format": _FORMAT, "min_ngram": self.min_ngram, "max_ngram": self.max_ngram,
                "table_weight": self.table_weight, "survival": self.table.cpu().tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> "LookupEstimator":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a lookup-estimator dict: format {data.get('format')!r}, expected {_FORMAT!r}.")
        return cls(torch.tensor(data["survival"], dtype=torch.float32), data["min_ngram"], data["max_ngram"],
                   data.get("table_weight", 1.0))  # files written before the rating: the table alone

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "LookupEstimator":
        return cls.from_dict(json.loads(Path(path).read_text()))
