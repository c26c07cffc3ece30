"""Draft-side acceptance estimates: per-position drafter signals -> calibrated survival p̂_i.

p̂_i = P(d_1..d_i all accepted), i = 1..B-1, is what the length selector needs (G(w) = 1 + Σ_{i<w} p̂_i).

Estimator: a per-position logistic regression for the CONDITIONAL acceptance
    c_i = P(d_i accepted | d_1..d_{i-1} accepted) = sigmoid(θ_i · [logit(top1_i), margin_i, entropy_i, 1])
and survival p̂_i = c_1·…·c_i (a cumulative product, so p̂ is non-increasing in i by construction).
Why this estimator:
- The DFlash drafter predicts all B-1 positions in one forward, each conditioned on the real prefix and masks, never
  on the other drafts (notes/dflash.md §1.1); its top-1 probability is a marginal, typically miscalibrated, and the
  miscalibration depends on the position. Conditioning on "earlier drafts accepted" is exactly what a logistic model
  on the rows that reached position i learns, and the product of conditionals is the survival with no further
  independence assumption than "c_i depends on position i's own signals".
- Logistic regression on logit(top1) nests the uncalibrated D-Cut rule (θ = [1, 0, 0, 0] gives c_i = top1_i), so the
  fit can only move away from it where the traces say so. It is convex with 4·(B-1) parameters, so damped Newton
  with the exact Hessian (float64) reaches the optimum in ~10 steps, and a few thousand trace rounds suffice.
- Deep positions are reached rarely, so each position's weights are θ_i = θ_shared + δ_i with an L2 penalty on δ_i
  (partial pooling): positions with little data fall back to the shared model instead of over-fitting.
The runtime cost is a [batch, B-1, 4] dot product and a cumprod: pure torch, no host sync, works on CUDA tensors.

Online update (optional, off by default: `online_lr=0`): a per-position logit offset b_i, moved after every round by
one SGD step on the log loss of the positions that round actually verified (b_i += lr·(y_i - c_i)). It tracks drift
between the trace domain and the live prompt (e.g. code vs chat) without refitting; positions past the verified
length are censored and not updated. The offset is runtime state and is not saved.

Traces format (what the trace recorder writes; the same dict works as `signals` for `fit`):
    {"top1": [N, B-1] fp32, "margin": [N, B-1] fp32, "entropy": [N, B-1] fp32,
     "accepted": [N] long (drafts accepted a),
     "matched": [N, B-1] bool (optional; draft i equals the target's token i given the prefix),
     "verified": [N] long (optional; drafts the round verified = w-1, default B-1 i.e. full block)}
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from hybridspec_hf.kernels.gdn_triton import fused_kernels_active
from hybridspec_hf.kernels.signals_triton import draft_signals_fused

FEATURES = ("logit_top1", "margin", "entropy")  # + a per-position intercept
_EPS = 1e-6
_FORMAT = "hybridspec.acceptance/1"


def draft_signals(draft_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position drafter signals from the draft logits of positions 1..B-1.

    draft_logits: [batch, B-1, V] (any float dtype; pass the logits after the same processing that drafting uses,
    e.g. temperature, when sampling). Returns fp32 tensors [batch, B-1]: "top1" (top-1 probability), "margin"
    (top-1 minus top-2 probability) and "entropy" (nats).
    """
    if _one_stream(draft_logits):  # inside resident rounds: two launches, not ≈ 30
        return draft_signals_fused(draft_logits)[0]
    logp = draft_logits.float().log_softmax(-1)  # [batch, B-1, V] fp32
    probs = logp.exp()
    # -Σ p·log p with masked (-inf) logits counted as 0·(finite) = 0, not 0·(-inf) = NaN. Not special.entr, and
    # the runner-up as the maximum once the top entry is set aside, not topk(2): on a CPU (2 threads, V = 4096,
    # 15 positions) those two took 170 of the signals' 190 µs (these ops: 90 µs)
    entropy = -(probs * logp.clamp(min=-1e30)).sum(-1)  # [batch, B-1]
    top1, index = probs.max(-1, keepdim=True)
    second = probs.scatter(-1, index, -1.0).amax(-1)  # a tie with the maximum elsewhere: margin 0
    top1 = top1.squeeze(-1)
    return {"top1": top1, "margin": top1 - second, "entropy": entropy}


def copy_signals(draft_logits: torch.Tensor, signals: Mapping[str, torch.Tensor], drafts: torch.Tensor,
                 tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The drafter's signals of other tokens than its drafts (a context-lookup copy, selector/lookup.py), read from
    the same draft logits: "top1" the probability it gives each token, "margin" that minus its top-1 probability
    (the drafts' own margin where the token is the draft), "entropy" the position's. draft_logits [batch, B-1, V],
    signals (`draft_signals` of them), drafts = draft_logits.argmax(-1), tokens [batch, B-1] long. Two gathers, no
    pass over the vocabulary: p(token) = top1 · exp(logit[token] - logit[draft])."""
    picked = draft_logits.gather(-1, torch.stack([tokens, drafts], -1)).float()  # [batch, B-1, 2]
    top1 = signals["top1"] * torch.exp(picked[..., 0] - picked[..., 1])
    margin = torch.where(tokens == drafts, signals["margin"], top1 - signals["top1"])
    return {"top1": top1, "margin": margin, "entropy": signals["entropy"]}


def draft_tokens_and_signals(draft_logits: torch.Tensor, signals: bool = True
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """The drafts (draft_logits.argmax(-1) [batch, B-1] long) and, when `signals`, their `draft_signals`. Inside
    resident rounds on CUDA both come out of one stream over the logits (kernels/signals_triton.py: two launches,
    the logits read once, in their own dtype), signals asked or not: they cost nothing more than the argmax there.
    Elsewhere the argmax, and the torch signals when asked."""
    if _one_stream(draft_logits):
        found, drafts = draft_signals_fused(draft_logits)
        return drafts, found if signals else None
    return draft_logits.argmax(-1), draft_signals(draft_logits) if signals else None


def _one_stream(draft_logits: torch.Tensor) -> bool:
    """Checks draft_logits' shape (a clear error); True where the Triton stream computes the signals and drafts
    (CUDA tensors inside resident rounds' fused kernels), False where torch does."""
    if draft_logits.dim() != 3 or draft_logits.shape[-1] < 2:
        raise ValueError(
            f"draft_signals expects draft logits [batch, B-1, V] with V >= 2, got shape {tuple(draft_logits.shape)}; "
            "pass the logits of block positions 1..B-1 (not the anchor)."
        )
    return draft_logits.is_cuda and fused_kernels_active()


def signal_features(signals: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Stack the estimator's features [logit(top1), margin, entropy, 1] -> [..., B-1, 4] fp32."""
    missing = [k for k in ("top1", "margin", "entropy") if k not in signals]
    if missing:
        raise KeyError(f"signals lack {missing}; build them with draft_signals(draft_logits). Got keys {list(signals)}.")
    top1 = signals["top1"].float().clamp(_EPS, 1.0 - _EPS)
    logit = torch.log(top1) - torch.log1p(-top1)
    return torch.stack([logit, signals["margin"].float(), signals["entropy"].float(), torch.ones_like(top1)], -1)


def survival_outcomes(accepted: torch.Tensor, verified: torch.Tensor | int, positions: int):
    """What a round says about the survival of each position.

    accepted: [N] long (a), verified: [N] long or int (w-1). Returns (outcome [N, P] fp32 = 1[a >= i],
    observed [N, P] bool = 1[i <= verified]) for i = 1..P: past the verified length survival is censored.
    """
    i = torch.arange(1, positions + 1, device=accepted.device)  # [P]
    verified = torch.as_tensor(verified, device=accepted.device).reshape(-1, 1)  # [N, 1] or [1, 1]
    outcome = (accepted.unsqueeze(-1) >= i).float()
    return outcome, (i <= verified).expand_as(outcome)


def conditional_outcomes(accepted: torch.Tensor, verified: torch.Tensor | int, positions: int):
    """Training rows for the conditional model: position i is observed iff d_<i were accepted and i was verified.

    Returns (outcome [N, P] fp32 = 1[d_i accepted], observed [N, P] bool).
    """
    outcome, verified_mask = survival_outcomes(accepted, verified, positions)
    i = torch.arange(1, positions + 1, device=accepted.device)
    return outcome, verified_mask & (accepted.unsqueeze(-1) >= i - 1)


def accepted_from_matched(matched: torch.Tensor) -> torch.Tensor:
    """a = length of the leading run of matched drafts. matched: [N, B-1] bool -> [N] long."""
    return matched.long().cumprod(-1).sum(-1)


def expected_calibration_error(pred: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor | None = None,
                               n_bins: int = 15) -> torch.Tensor:
    """Binned expected calibration error: Σ_bins (n_b/N)·|mean pred_b - mean outcome_b|, 0-dim fp32 tensor.

    pred, outcome: same shape, pred in [0, 1]; mask (optional, bool, same shape) selects the entries that count
    (e.g. the `observed` mask of `survival_outcomes`). Equal-width bins on [0, 1]. Pure torch.
    """
    pred, outcome = pred.float().reshape(-1), outcome.float().reshape(-1)
    weight = torch.ones_like(pred) if mask is None else mask.reshape(-1).float()
    bins = (pred.clamp(0, 1) * n_bins).long().clamp(max=n_bins - 1)  # [M]
    count = torch.zeros(n_bins, device=pred.device).index_add_(0, bins, weight)
    sum_pred = torch.zeros(n_bins, device=pred.device).index_add_(0, bins, weight * pred)
    sum_out = torch.zeros(n_bins, device=pred.device).index_add_(0, bins, weight * outcome)
    return (sum_pred - sum_out).abs().sum() / count.sum().clamp(min=1.0)


class AcceptanceEstimator:
    """Calibrated survival p̂ [batch, B-1] from drafter signals (see the module docstring for the model).

    `AcceptanceEstimator.default(B)` needs no fit: c_i = top1_i, survival = prefix product of top-1 probabilities
    (the D-Cut rule; uncalibrated). `AcceptanceEstimator.fit(traces)` fits the logistic model.
    """

    def __init__(self, weight: torch.Tensor, online_lr: float = 0.0):
        if weight.dim() != 2 or weight.shape[1] != len(FEATURES) + 1:
            raise ValueError(f"weight must be [B-1, {len(FEATURES) + 1}] (features {FEATURES} + intercept), "
                             f"got {tuple(weight.shape)}.")
        self.weight = weight.float()  # [B-1, 4]
        self.online_lr = float(online_lr)
        self.offset = torch.zeros(weight.shape[0], device=weight.device)  # [B-1] online logit correction

    @property
    def block_size(self) -> int:
        return self.weight.shape[0] + 1

    @classmethod
    def default(cls, block_size: int, online_lr: float = 0.0) -> "AcceptanceEstimator":
        """Uncalibrated D-Cut rule: c_i = top1_i (weight 1 on logit(top1), nothing else)."""
        weight = torch.zeros(block_size - 1, len(FEATURES) + 1)
        weight[:, 0] = 1.0
        return cls(weight, online_lr)

    def to(self, device: torch.device | str) -> "AcceptanceEstimator":
        self.weight, self.offset = self.weight.to(device), self.offset.to(device)
        return self

    def _check(self, features: torch.Tensor) -> None:
        if features.shape[-2] != self.weight.shape[0]:
            raise ValueError(f"signals have {features.shape[-2]} draft positions, the estimator was built for "
                             f"B-1 = {self.weight.shape[0]}; fit or build one for this drafter's block size.")
        if features.device != self.weight.device:
            self.to(features.device)  # first call on a new device only

    def conditional(self, signals: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """c_i = P(d_i accepted | d_<i accepted) -> [batch, B-1] fp32."""
        x = signal_features(signals)  # [batch, B-1, 4]
        self._check(x)
        return torch.sigmoid((x * self.weight).sum(-1) + self.offset)

    def survival(self, signals: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """p̂_i = c_1·…·c_i -> [batch, B-1] fp32, non-increasing in i. Pure torch, no host sync."""
        return self.conditional(signals).cumprod(-1)

    def observe(self, signals: Mapping[str, torch.Tensor], accepted: torch.Tensor,
                verified: torch.Tensor | int) -> None:
        """Online update after a round (no-op when online_lr == 0): one SGD step on the per-position offset.

        signals: that round's signals [batch, B-1]; accepted: [batch] long; verified: [batch] long or int (w-1).
        """
        if self.online_lr == 0.0:
            return
        c = self.conditional(signals)  # [batch, B-1]
        y, observed = conditional_outcomes(accepted, verified, c.shape[-1])
        self.offset.add_(self.online_lr * ((y - c) * observed).sum(0))

    @classmethod
    def fit(cls, signals: Mapping[str, torch.Tensor], outcomes: torch.Tensor | None = None,
            verified: torch.Tensor | int | None = None, pooling: float = 10.0, max_iter: int = 50,
            online_lr: float = 0.0) -> "AcceptanceEstimator":
        """Fit the per-position logistic model on traces (offline, CPU or GPU, float64 damped Newton).

        signals: dict with "top1", "margin", "entropy" [N, B-1] (a traces dict works as is).
        outcomes: [N] long accepted counts a, or [N, B-1] bool per-position matches; default signals["accepted"]
        (else signals["matched"]). verified: [N] long or int drafts verified (w-1); default signals["verified"] or
        B-1. pooling: L2 weight (in pseudo-observations) pulling each position's weights to the shared ones.
        """
        x = signal_features(signals).double()  # [N, P, 4]
        accepted = _accepted_counts(signals, outcomes)
        if verified is None:
            verified = signals.get("verified", x.shape[1])
        y, observed = conditional_outcomes(accepted.to(x.device), verified, x.shape[1])
        if not bool(observed.any()):
            raise ValueError("the traces contain no verified draft position; nothing to fit.")
        return cls(_fit_pooled_logistic(x, y.double(), observed, pooling, max_iter).float(), online_lr)

    def to_dict(self) -> dict:
        return {"format": _FORMAT, "features": list(FEATURES) + ["intercept"], "weight": self.weight.cpu().tolist(),
                "online_lr": self.online_lr}

    @classmethod
    def from_dict(cls, data: Mapping) -> "AcceptanceEstimator":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not an acceptance-estimator dict: format {data.get('format')!r}, expected {_FORMAT!r}.")
        return cls(torch.tensor(data["weight"], dtype=torch.float32), data.get("online_lr", 0.0))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceEstimator":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _accepted_counts(signals: Mapping[str, torch.Tensor], outcomes: torch.Tensor | None) -> torch.Tensor:
    if outcomes is None:
        outcomes = signals.get("accepted", signals.get("matched"))
        if outcomes is None:
            raise KeyError("no outcomes: pass accepted counts [N] or matches [N, B-1], or put 'accepted' in the traces.")
    if outcomes.dim() == 2:
        return accepted_from_matched(outcomes.bool())
    return outcomes.long()


def _fit_pooled_logistic(x: torch.Tensor, y: torch.Tensor, observed: torch.Tensor, pooling: float,
                         max_iter: int) -> torch.Tensor:
    """Minimise Σ_obs BCE + pooling·Σ_i |δ_i|² over θ_i = θ_shared + δ_i by damped Newton; returns θ [P, F].

    x: [N, P, F] float64 (last column = 1), y: [N, P], observed: [N, P] bool. Only observed entries enter. Features
    are standardised for conditioning (not the intercept column) and the weights folded back to raw units after.
    The problem has F·(P+1) <= a few hundred parameters, so the exact Hessian is cheap and Newton converges in ~10
    steps (each halved until the loss decreases, so it cannot diverge).
    """
    if pooling <= 0:
        raise ValueError(f"pooling must be > 0 (it makes per-position weights identifiable), got {pooling}.")
    rows, pos = observed.nonzero(as_tuple=True)  # offline fit: host syncs are fine here
    xo, yo = x[rows, pos], y[rows, pos]  # [M, F], [M]
    mean, std = xo.mean(0), xo.std(0).clamp(min=1e-6)
    mean[-1], std[-1] = 0.0, 1.0
    xs = (xo - mean) / std
    P, F = x.shape[1], x.shape[2]
    # θ stacked as [P+1, F]: row 0 shared, rows 1..P the deviations; A maps it to per-position weights [P·F].
    A = torch.cat([torch.eye(F, dtype=x.dtype).repeat(P, 1), torch.eye(P * F, dtype=x.dtype)], 1).to(x.device)
    ridge = torch.full((P + 1, F), float(pooling), dtype=x.dtype, device=x.device)
    ridge[0] = 1e-4
    ridge[0, -1] = 0.0
    theta = torch.zeros(P + 1, F, dtype=x.dtype, device=x.device)

    def logits(t):
        return (xs * (t[0] + t[1:][pos])).sum(-1)  # [M]

    def loss(t):
        return torch.nn.functional.binary_cross_entropy_with_logits(logits(t), yo, reduction="sum") + (ridge * t * t).sum()

    for _ in range(max_iter):
        sig = torch.sigmoid(logits(theta))
        g_pos = torch.zeros(P, F, dtype=x.dtype, device=x.device).index_add_(0, pos, xs * (sig - yo)[:, None])
        h_pos = torch.zeros(P, F, F, dtype=x.dtype, device=x.device).index_add_(
            0, pos, xs[:, :, None] * xs[:, None, :] * (sig * (1 - sig))[:, None, None])
        grad = A.T @ g_pos.reshape(-1) + 2 * (ridge * theta).reshape(-1)
        hess = A.T @ torch.block_diag(*h_pos) @ A + torch.diag(2 * ridge.reshape(-1))
        step = torch.linalg.solve(hess, grad)
        if grad @ step < 1e-10 * len(yo):  # Newton decrement: the loss is within ~1e-10 per entry of its minimum
            break
        step = step.view(P + 1, F)
        current, scale = loss(theta), 1.0
        while loss(theta - scale * step) > current and scale > 1e-6:
            scale /= 2
        theta = theta - scale * step
    per_position = theta[0] + theta[1:]  # [P, F] in standardised units
    raw = per_position / std
    raw[:, -1] = per_position[:, -1] - (per_position[:, :-1] * mean[:-1] / std[:-1]).sum(-1)
    return raw
