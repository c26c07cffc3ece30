"""Per-round telemetry of a HybridSpec generate() call.

After each call, `hybridspec_hf.get_telemetry(target)` (also `target.hybridspec_telemetry`) returns the
`GenerationTelemetry` of the last call: one `RoundRecord` per round plus prefill and total wall time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RoundRecord:
    """One round. w: tokens the target verified (anchor + drafts); accepted: drafts accepted (a);
    emitted: tokens emitted (a + 1 unless cut short by EOS/stop/length); committed: tokens committed into the
    target's state (m); wall_s: wall time of the round in seconds (drafting to commit); drafted: False for a plain
    decoding step (the selector switched speculation off). In a batched call w is shared by the round's rows and the
    counts are summed over them."""

    w: int
    accepted: int
    emitted: int
    committed: int
    wall_s: float
    drafted: bool = True
    w0: int | None = None  # the selector's nominal length (device-side strategies)
    extra_kept: bool | None = None  # routing correction: the extra token d_{w0} was kept
    n_new: int | None = None  # new first-MoE-layer experts of the extra token
    predicted_s: float | None = None  # calibrated latency of this round's choice (C(w), or C_ar for a plain step)
    host_s: float | None = None  # GPU-resident rounds: wall time minus the wait for the hand-off (host work)
    rows: int = 1  # batch rows verified in this round (batched calls: accepted/emitted/committed sum over them)
    lookup: bool | None = None  # context lookup: the round verified the copied proposal, not the drafts


@dataclass
class GenerationTelemetry:
    strategy: str
    block_size: int
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    rounds: list[RoundRecord] = field(default_factory=list)
    path: str = "eager"  # "cuda_graphs" (GPU-resident rounds), "static_eager" (the same rounds, uncaptured) or "eager"
    path_reason: str | None = None  # why cuda_graphs="auto" ran the eager loop, when it did
    capture_s: float = 0.0  # time spent capturing graphs in this call (0 when reused)
    resident_memory_bytes: int = 0  # GPU memory the resident rounds hold (static cache, buffers, graph pools)
    routing_correction: bool = False  # whether this call's rounds ran the routing correction
    routing_correction_off: str | None = None  # why a strategy that has one ("hybridspec") ran without it
    context_lookup: bool = False  # whether this call's rounds could verify context-lookup proposals
    context_lookup_off: str | None = None  # why context lookup was off, where it was

    @property
    def new_tokens(self) -> int:
        """Tokens generated, including the one from the prefill."""
        return sum(r.emitted for r in self.rounds) + self.prefill_tokens

    @property
    def mean_emitted(self) -> float:
        """τ: mean tokens emitted per round."""
        return sum(r.emitted for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def mean_accepted(self) -> float:
        return sum(r.accepted for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def mean_verified(self) -> float:
        return sum(r.w for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "new_tokens": self.new_tokens, "mean_emitted": self.mean_emitted}

    def summary(self) -> str:
        copied = (f", {sum(bool(r.lookup) for r in self.rounds)} verifying a context-lookup copy"
                  if self.context_lookup else "")
        return (
            f"{self.strategy}: {len(self.rounds)} rounds{copied}, {self.new_tokens} new tokens, "
            f"τ = {self.mean_emitted:.2f} tokens/round, mean w = {self.mean_verified:.2f}, "
            f"{self.tokens_per_second:.1f} tokens/s"
        )
