"""Acceptance profiles: what the drafter says and what the target accepts, per round, replayed in timing mode.

A benchmark at full size with random weights has no real acceptance (a random drafter's τ is 1). Timing mode
replays a versioned profile instead: each speculative round takes the next profile row's draft signals
(top-1 probability, margin, entropy of the B-1 draft positions: what the selector reads) and its accepted count with
the whole block verified (a_full); the round then accepts min(a_full, w - 1) drafts of the w it verified. Verification
and commit run for real on the real shapes; the text is not the model's (no equality claim in timing mode).

Profiles are the trace files of `generation.traces` (schema hybridspec-trace/1: the real tiny pair) or synthetic ones
from `synthetic_profile` (fixed seed, declared parameters), saved with `save_profile` in `benchmarks/profiles/`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SIGNALS = ("top1", "margin", "entropy")


@dataclass
class AcceptanceProfile:
    """Rows of (draft signals [R, B-1] fp32 each, accepted [R] long with the full block verified).

    start_row: the row a generate() call's first speculative round replays (timing mode; row b of a batch starts
    b·R/N rows further). A benchmark moves it between calls so that its calls replay different stretches of text
    (the rows are in trace order: one start would time every call on the same few dozen rounds)."""

    top1: torch.Tensor
    margin: torch.Tensor
    entropy: torch.Tensor
    accepted: torch.Tensor
    name: str = "profile"
    start_row: int = 0

    def __post_init__(self) -> None:
        rows, positions = self.top1.shape
        for field in (self.margin, self.entropy):
            if field.shape != (rows, positions):
                raise ValueError(f"profile signals must all be [rows, B-1] = {(rows, positions)}; got {tuple(field.shape)}.")
        if self.accepted.shape != (rows,) or int(self.accepted.min()) < 0 or int(self.accepted.max()) > positions:
            raise ValueError(f"profile accepted counts must be [rows] in [0, B-1 = {positions}].")
        if not isinstance(self.start_row, int) or self.start_row < 0:
            raise ValueError(f"start_row must be an int >= 0 (taken modulo the {rows} rows), got {self.start_row!r}.")

    @property
    def block_size(self) -> int:
        return self.top1.shape[1] + 1

    @property
    def mean_accepted_length(self) -> float:
        """τ with the whole block verified: mean a_full + 1."""
        return float(self.accepted.float().mean()) + 1.0

    def rows(self, index: slice) -> "AcceptanceProfile":
        """The profile restricted to rows[index] (e.g. a replay half and a disjoint half to fit an estimator on)."""
        return AcceptanceProfile(*(getattr(self, k)[index] for k in (*SIGNALS, "accepted")), name=self.name)

    def signals(self) -> dict:
        """The rows as a traces dict (signals and accepted counts): what `AcceptanceEstimator.fit` takes."""
        return {k: getattr(self, k) for k in (*SIGNALS, "accepted")}

    def to(self, device) -> "AcceptanceProfile":
        return AcceptanceProfile(*(getattr(self, k).to(device) for k in (*SIGNALS, "accepted")), name=self.name)


def load_profile(path: str | Path) -> AcceptanceProfile:
    """A profile from a safetensors trace file (generation.traces) or one written by `save_profile`."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"No acceptance profile at {str(path)!r}: pass an AcceptanceProfile or the path of a "
                                "profile or trace file (.safetensors; the declared ones are in benchmarks/profiles/).")
    with safe_open(str(path), "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        meta = json.loads((handle.metadata() or {}).get("json", "{}"))
    verified = tensors.get("verified")
    if verified is not None and bool((verified < verified.max()).any()):
        keep = verified == verified.max()  # rows that verified the whole block: their accepted count is a_full
        tensors = {k: v[keep] for k, v in tensors.items()}
    return AcceptanceProfile(*(tensors[k].float() for k in SIGNALS), tensors["accepted"].long(),
                             name=meta.get("name", Path(path).stem))


def save_profile(profile: AcceptanceProfile, path: str | Path, **meta) -> None:
    from safetensors.torch import save_file

    tensors = {k: getattr(profile, k).contiguous().cpu() for k in (*SIGNALS, "accepted")}
    save_file(tensors, str(path), metadata={"json": json.dumps({"name": profile.name, **meta}, sort_keys=True)})


def synthetic_profile(name: str, mean_accepted_length: float, block_size: int = 16, rows: int = 2048,
                      seed: int = 0) -> AcceptanceProfile:
    """A declared synthetic profile: per-draft acceptance with a constant conditional rate q chosen so that the mean
    accepted length with the full block is `mean_accepted_length`, and signals that carry the information a real
    drafter's do (accepted positions are confident, the first rejected one and later ones less so).

    Each round draws a = number of leading successes of B-1 Bernoulli(q) trials (a geometric truncated at B-1); the
    top-1 probability of position i is drawn from Beta(8, 2) while i < a, Beta(2, 3) at and after the rejection.
    """
    positions = block_size - 1
    q = _rate_for(mean_accepted_length - 1.0, positions)
    with torch.random.fork_rng(devices=[]):  # fixed by the seed, whatever the caller's random state
        torch.manual_seed(seed)
        trials = torch.rand(rows, positions) < q
        high = torch.distributions.Beta(8.0, 2.0).sample((rows, positions))
        low = torch.distributions.Beta(2.0, 3.0).sample((rows, positions))
        share = torch.rand(rows, positions)
    accepted = trials.long().cumprod(1).sum(1)
    confident = torch.arange(positions).view(1, -1) < accepted.view(-1, 1)
    top1 = torch.where(confident, high, low).clamp(1e-4, 1 - 1e-4)
    second = (1 - top1) * share
    entropy = -(top1 * top1.log() + second * second.clamp(min=1e-8).log())
    return AcceptanceProfile(top1, top1 - second, entropy, accepted, name=name)


def _rate_for(mean_accepted: float, positions: int) -> float:
    """q with E[leading successes of `positions` Bernoulli(q)] = Σ_{i=1..n} q^i = mean_accepted (bisection)."""
    if not 0.0 <= mean_accepted < positions:
        raise ValueError(f"mean accepted drafts must be in [0, {positions}), got {mean_accepted}.")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, positions + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------------------------------------- routing profiles
@dataclass
class RoutingProfile:
    """Calibrated routing for timing mode: how much more than chance a verified token reuses experts that earlier
    tokens of its block already chose.

    excess_reuse [B] fp32: e_i, position i's probability of deliberately reusing an already-chosen expert (per pick);
    otherwise the pick is uniform over the experts the token has not picked yet (which may land on a used one by
    chance). Fitted on the real pair's traces (`fit_routing_profile`), where chance reuse is large (16 experts,
    top-4), and applied to any number of experts: the excess, not the raw reuse, is what transfers.
    """

    excess_reuse: torch.Tensor
    name: str = "routing"

    def bank(self, num_layers: int, num_experts: int, top_k: int, rounds: int = 256, seed: int = 0) -> torch.Tensor:
        """Sampled expert ids [rounds, layers, B, k] long (fixed by the seed) that timing-mode rounds replay."""
        block = self.excess_reuse.shape[0]
        rows = rounds * num_layers
        out = torch.empty(rows, block, top_k, dtype=torch.long)
        used = torch.zeros(rows, num_experts, dtype=torch.bool)
        index = torch.arange(rows)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for i in range(block):
                mine = torch.zeros_like(used)
                for j in range(top_k):
                    reuse_pool = used & ~mine
                    deliberate = (torch.rand(rows) < float(self.excess_reuse[i])) & reuse_pool.any(1)
                    pool = torch.where(deliberate.view(-1, 1), reuse_pool, ~mine)
                    choice = torch.rand(rows, num_experts).masked_fill(~pool, -1.0).argmax(1)
                    out[:, i, j] = choice
                    mine[index, choice] = True
                used |= mine
        return out.view(rounds, num_layers, block, top_k)

    def to_dict(self) -> dict:
        return {"name": self.name, "excess_reuse": self.excess_reuse.tolist()}

    @classmethod
    def from_dict(cls, data) -> "RoutingProfile":
        return cls(torch.tensor(data["excess_reuse"], dtype=torch.float32), data.get("name", "routing"))


def fit_routing_profile(router_ids: torch.Tensor, num_experts: int, name: str = "routing") -> RoutingProfile:
    """e_i from traces' router ids [N, L, B, k] (rounds that verified the whole block): per pick, the observed
    reuse r = |picks among earlier tokens' experts| / k against chance c = |earlier experts| / E, both averaged over
    rounds and layers, e = (r - c)/(1 - c) clipped to [0, 1]; position 0 has no earlier token (e_0 = 0)."""
    n, layers, block, k = router_ids.shape
    onehot = torch.zeros(n, layers, block, num_experts, dtype=torch.bool)
    onehot.scatter_(-1, router_ids.clamp(min=0), True)
    earlier = (onehot.long().cumsum(2) - onehot.long()) > 0  # [N, L, B, E]: chosen by a token before this one
    reused = earlier.gather(-1, router_ids.clamp(min=0)).float().mean(-1)  # [N, L, B]
    chance = earlier.float().sum(-1) / num_experts
    reused, chance = reused.mean((0, 1)), chance.mean((0, 1))  # [B]: average first (clipping first would bias up)
    excess = ((reused - chance) / (1 - chance).clamp(min=1e-6)).clamp(0.0, 1.0)
    excess[0] = 0.0
    return RoutingProfile(excess.float(), name)
