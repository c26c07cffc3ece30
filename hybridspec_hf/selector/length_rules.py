"""Verification-length strategies behind one interface: HybridSpec and the baselines the benchmark compares.

The round loop talks to every strategy the same way (batch rows are independent streams):

    draft = selector.should_draft(context_len)           # [batch] bool, before drafting (from history only)
    ...draft, survival = estimator.survival(signals)...   # [batch, B-1]
    w0 = selector.choose(survival, context_len, w_max)    # [batch] long, 1 <= w0 <= min(B, w_max)
    if selector.routing_correction:                       # stage 0 ran on w0 + 1 tokens
        keep = selector.keep_extra(survival, w0, count_new_experts(first_layer_ids), context_len, w_max)
    ...stage 1, accept, commit...
    selector.observe(w, emitted, latency, drafted)        # w = tokens verified; drafted False = plain AR step

Strategy names (make_selector): "dflash" (FullBlock: w = B), "static" (StaticLength), "ratio" (PerRoundRatio,
EVICT-like: argmax G(w)/C(w) per round), "confidence" (ConfidencePrefix, D-Cut / vLLM-threshold-like), "nominal"
(HybridSpec without routing correction) and "hybridspec" (Dinkelbach length + AR option + routing correction).
Only the HybridSpec strategies can choose a plain AR step (should_draft False); the baselines always draft.
Every method is pure torch without host sync; `context_len` is an int or a [batch] long tensor on survival's device.
- should_draft returns a device tensor, but drafting or not is host control flow: read it with the round's one
  permitted sync (e.g. copied together with the emitted tokens), i.e. decide round t+1 at the end of round t.
- The first round moves the latency model to the device (one-time copies); later rounds copy nothing host-to-device:
  Python numbers become fill kernels. Under CUDA-graph capture pass tensors, since a number would be baked in.
"""
from __future__ import annotations

import abc
import inspect
from typing import Any, Mapping

import torch

from .latency import LatencyModel
from .length import DinkelbachThroughput, expected_tokens, on_device, ratio_length, select_length
from .routing import extra_survival, keep_extra_token, predicted_delta_latency


class LengthSelector(abc.ABC):
    """The interface. Subclasses implement `choose`; stateful ones also `should_draft` and `observe`."""

    name = "base"
    routing_correction = False

    def should_draft(self, context_len) -> torch.Tensor:
        """Whether each row drafts the next round -> [batch] bool. Baselines always draft."""
        return torch.ones_like(torch.as_tensor(context_len).reshape(-1), dtype=torch.bool)

    @abc.abstractmethod
    def choose(self, survival: torch.Tensor, context_len, w_max=None) -> torch.Tensor:
        """Tokens to verify w0 [batch] long from survival p̂ [batch, B-1]; w_max: None, int or [batch] (room left)."""

    def keep_extra(self, survival: torch.Tensor, w0: torch.Tensor, n_new: torch.Tensor, context_len,
                   w_max=None) -> torch.Tensor:
        """Routing correction: keep the extra token d_{w0}? -> [batch] bool. Off (all False) unless overridden."""
        return torch.zeros_like(w0, dtype=torch.bool)

    def observe(self, w: torch.Tensor, emitted: torch.Tensor, latency: torch.Tensor | float | None = None,
                drafted: torch.Tensor | bool = True, spread: torch.Tensor | None = None) -> None:
        """After a round: w [batch] long tokens verified, emitted [batch] tokens (per row: a batch's live rows'
        mean), latency seconds ([batch] or scalar; None = use the calibrated C), drafted ([batch] bool or bool;
        False = a plain AR step, w = 1), spread: a batch round's spread of tokens between its rows ([batch]; None:
        one row; selector.batch_row_stats)."""

    def batch_state(self, rows: torch.Tensor, left: torch.Tensor) -> None:
        """The batch the next decisions are for: live rows and the tokens its roomiest row still needs ([1] or
        [batch] each; selector.batch_rows_left). For selectors that price the rows' spread (HybridSpec); the
        others draft every round whatever the batch."""

    def reset(self) -> None:
        """Forget per-stream state (a new generate call)."""


def _clip(w: torch.Tensor, w_max) -> torch.Tensor:
    if w_max is None:
        return w
    return torch.minimum(w, on_device(w_max, w.device).clamp(min=1))


class FullBlock(LengthSelector):
    """Vanilla DFlash: verify the whole block, w = B (capped by w_max)."""

    name = "dflash"

    def choose(self, survival, context_len, w_max=None):
        full = torch.full(survival.shape[:1], survival.shape[1] + 1, dtype=torch.long, device=survival.device)
        return _clip(full, w_max)


class StaticLength(LengthSelector):
    """A fixed w (capped by B and w_max); the design's static baseline is w = 7."""

    name = "static"

    def __init__(self, w: int = 7):
        if w < 1:
            raise ValueError(f"StaticLength needs w >= 1 (the anchor is always verified), got {w}.")
        self.w = w

    def choose(self, survival, context_len, w_max=None):
        w = min(self.w, survival.shape[1] + 1)
        return _clip(torch.full(survival.shape[:1], w, dtype=torch.long, device=survival.device), w_max)


class ConfidencePrefix(LengthSelector):
    """D-Cut / vLLM-threshold-like: verify the anchor plus the longest draft prefix with survival >= threshold.

    With the default (uncalibrated) estimator survival is the product of top-1 probabilities, i.e. D-Cut's score.
    """

    name = "confidence"

    def __init__(self, threshold: float = 0.5, min_length: int = 1):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is a probability, got {threshold}.")
        self.threshold, self.min_length = threshold, min_length

    def choose(self, survival, context_len, w_max=None):
        prefix = (survival >= self.threshold).long().cumprod(-1).sum(-1)  # [batch] leading run
        return _clip((prefix + 1).clamp(min=min(self.min_length, survival.shape[1] + 1)), w_max)


class _Calibrated(LengthSelector):
    """A strategy that reads the latency model; keeps one copy of it per device (moved once, not per round)."""

    def __init__(self, latency_model: LatencyModel):
        if not isinstance(latency_model, LatencyModel):
            raise TypeError(f"{type(self).__name__} needs a LatencyModel (selector.calibrate or LatencyModel.load), "
                            f"got {type(latency_model).__name__}.")
        self.latency_model = latency_model
        self._by_device = {latency_model.cost.device: latency_model}

    def restart(self, context_len: torch.Tensor) -> None:
        """A new GPU-resident call (`reset`), with the latency model's copy on the rounds' device made now: moving
        it builds a LatencyModel on the host, which a compiled decision cannot trace (RoundStrategy.
        compile_decisions)."""
        self.reset()
        self._model(context_len.device)

    def _model(self, device: torch.device) -> LatencyModel:
        if device not in self._by_device:
            self._by_device[device] = self.latency_model.to(device)
        return self._by_device[device]

    def _costs(self, survival: torch.Tensor, context_len) -> torch.Tensor:
        cost = self._model(survival.device).cost_for(context_len)  # [batch or 1, B]
        if cost.shape[1] != survival.shape[1] + 1:
            raise ValueError(f"the latency model was calibrated for B = {cost.shape[1]}, the drafts give "
                             f"B = {survival.shape[1] + 1}; recalibrate for this drafter's block size.")
        return cost.expand(survival.shape[0], -1)


class PerRoundRatio(_Calibrated):
    """EVICT-like: each round maximise its own G(w)/C(w) (same calibration as HybridSpec)."""

    name = "ratio"

    def choose(self, survival, context_len, w_max=None):
        return ratio_length(survival, self._costs(survival, context_len), w_max)


# HybridSpec's default trust_tokens: 0 (the emitted tokens alone) unless TRUST_DRAFTS (the benchmarks' trust-drafts
# A/B switch) makes it TRUST_TOKENS. Trust won in simulation on the declared profiles, whose estimator is fitted on the
# same text (benchmarks/results/selector_sim_calls.md), but lost on the tiny pair's held-out prompts on a CPU, where
# the pair's estimator is optimistic (0.95x against 1.00x AR, benchmarks/results/strategies_cpu_tiny_pair.md), and
# was even or behind on the H200 (runs 42-43 of benchmarks/results/gpu_rounds_runs.md).
TRUST_TOKENS = 4.0
TRUST_DRAFTS = False
# The probes' share of the plain steps' time while the drafts' predicted G(w) says drafting pays but the emitted tokens
# say it does not (DinkelbachThroughput._stretch); probe_share (1 %) otherwise.
HOPEFUL_SHARE = 0.04
# Rounds' worth of speculative evidence a new generate() call of the same GPU-resident rounds keeps from the calls
# before (HybridSpec.restart): its first round is decided rather than drafted unasked, and one unlucky early round
# weighs less. 0: each call starts from the prior alone.
CARRY_ROUNDS = 8.0
# speculative rounds of evidence before a stream decides whether to draft: a call's first rounds are drafted until it
# holds that many (DinkelbachThroughput.first_rounds), and a call that carries them from the calls before decides its
# first round at once
INFORMED_ROUNDS = 3
CARRY_EVIDENCE = True  # False: carry_rounds defaults to 0 (the benchmarks' carry-evidence A/B switch)
# The draft decision's optimism: a speculative round's yield is taken at its mean + EXPLORE·σ/√W, σ the rounds'
# spread, W their fading weight (DinkelbachThroughput._spec_gain; 0: the mean alone, a probe the only way back).
EXPLORE = 0.0
# The seconds a speculative round is priced at in the draft decision, which compares them with the plain step's
# calibrated C_ar: "calibrated" (its C(w), like for like: a machine running slower or faster than when it was calibrated
# moves both alike) or "measured" (its measured time; ρ takes the measured times either way).
DRAFT_PRICE = "calibrated"
# What a probe (a speculative round after a stretch of plain steps) costs when spacing probes: True ("net"), its
# time less the plain steps its expected tokens replace; False ("gross", before 2026-12-04), its time less one plain
# step (DinkelbachThroughput._stretch; the benchmarks' probe-net A/B switch)
PROBE_NET = True


class HybridSpec(_Calibrated):
    """Dinkelbach length selection with a plain-AR option and (optionally) the routing correction.

    rho_source: "measured" (default; emitted tokens and measured latency feed ρ, predicted C(w) when no latency is
    passed) or "predicted" (G(w) and C(w)). See length.DinkelbachThroughput for forgetting, draft_forgetting,
    probe_every, prior_rounds, probe_share, hopeful_share (at least probe_share) and trust_tokens (how much the draft
    decision trusts the estimator's G(w) before the emitted tokens have confirmed it; 0: the emitted tokens alone);
    carry_rounds: the evidence a new call of the resident rounds keeps (`restart`); explore: the draft decision's
    optimism for what fading evidence no longer rules out (DinkelbachThroughput._spec_gain); draft_price: what a
    speculative round costs in the draft decision ("calibrated": its C(w); "measured": its measured time);
    probe_price: how probes are spaced ("net" or "gross", DinkelbachThroughput._stretch; None: PROBE_NET).
    allow_ar=False always drafts.
    """

    name = "hybridspec"

    def __init__(self, latency_model: LatencyModel, routing_correction: bool = True, rho_source: str = "measured",
                 forgetting: float = 0.98, draft_forgetting: float = 0.95, probe_every: int = 16,
                 prior_rounds: float = 4.0, allow_ar: bool = True, probe_share: float = 0.01,
                 trust_tokens: float | None = None, hopeful_share: float = HOPEFUL_SHARE,
                 carry_rounds: float | None = None, explore: float = EXPLORE,
                 draft_price: str = DRAFT_PRICE, probe_price: str | None = None):
        super().__init__(latency_model)
        if draft_price not in ("calibrated", "measured"):
            raise ValueError(f"draft_price must be 'calibrated' or 'measured', got {draft_price!r}: the seconds a "
                             "speculative round is priced at when deciding whether to draft, next to C_ar.")
        self.draft_price = draft_price
        probe_price = ("net" if PROBE_NET else "gross") if probe_price is None else probe_price
        trust_tokens = (TRUST_TOKENS if TRUST_DRAFTS else 0.0) if trust_tokens is None else trust_tokens
        carry_rounds = (CARRY_ROUNDS if CARRY_EVIDENCE else 0.0) if carry_rounds is None else carry_rounds
        if carry_rounds < 0:
            raise ValueError(f"carry_rounds must be >= 0 (0: every call starts without evidence), got {carry_rounds}.")
        self.carry_rounds = carry_rounds
        if rho_source not in ("measured", "predicted"):
            raise ValueError(f"rho_source must be 'measured' or 'predicted', got {rho_source!r}.")
        self.routing_correction, self.rho_source, self.allow_ar = routing_correction, rho_source, allow_ar
        self.name = "hybridspec" if routing_correction else "nominal"
        self.throughput = DinkelbachThroughput(forgetting, draft_forgetting, probe_every, prior_rounds, probe_share,
                                               trust_tokens, max(hopeful_share, probe_share), INFORMED_ROUNDS,
                                               explore, probe_price)
        self._batch = None  # a batch_state() before the streams exist

    @property
    def rho(self) -> torch.Tensor | None:
        """Current pooled-throughput price ρ [batch] (tokens/second), None before the first round."""
        return None if self.throughput.tokens is None else self.throughput.rho

    def reset(self) -> None:
        self.throughput.tokens = None
        self._batch = None

    def restart(self, context_len: torch.Tensor) -> None:
        """A new generation in place: the streams restart from the prior without new tensors (graph-captured rounds
        hold their addresses), keeping `carry_rounds` rounds' worth of what the previous calls' speculative rounds
        taught (DinkelbachThroughput.restart); the first call allocates them. context_len: [batch] long on the
        rounds' device. `informed` then says whether the call's first round can be decided from evidence."""
        model = self._model(context_len.device)  # before any compiled decision reads it (_Calibrated.restart)
        if self.throughput.tokens is None or self.throughput.tokens.device != context_len.device:
            self.throughput.tokens = None
            self.should_draft(context_len)  # allocates the streams; the call's first round is still to come
            self.throughput.forced.fill_(True)
            return
        self.throughput.restart(model.cost_ar_for(context_len), self.carry_rounds,
                                INFORMED_ROUNDS)

    def informed(self) -> torch.Tensor:
        """[batch] bool: whether the streams hold evidence from at least INFORMED_ROUNDS speculative rounds (after
        `restart`: from earlier calls), so that a plain step's `plain_run` can decide the call's first round; False:
        it is drafted unasked. One or two rounds are not enough: a single unlucky round (a block accepts 0 or 15
        tokens) carried into the next call kept it plain to its end (run 57, high acceptance: the first call of each
        batch size at 1.0-1.2x AR against 1.6-2.4x for the others)."""
        return self.throughput.informed(INFORMED_ROUNDS)

    def _ready(self, batch: int, model: LatencyModel, context_len) -> None:
        """(Re)start the streams when the batch or device changes; remember this round's C_ar."""
        cost_ar = model.cost_ar_for(context_len).expand(batch)  # [batch]
        tokens = self.throughput.tokens
        if tokens is None or tokens.shape[0] != batch or tokens.device != cost_ar.device:
            self.throughput.reset(cost_ar, batch, cost_ar.device)
            self._survival = torch.zeros(batch, model.block_size - 1, device=cost_ar.device)  # last round's p̂
            self._cost = model.cost_for(context_len).expand(batch, -1)  # last round's C(w)
            if self._batch is not None:  # a batch_state() that came before the streams
                self.throughput.set_batch(*(on_device(v, cost_ar.device) for v in self._batch))
                self._batch = None
        self._cost_ar = cost_ar

    def should_draft(self, context_len):
        if isinstance(context_len, torch.Tensor):
            batch, device = context_len.reshape(-1).shape[0], context_len.device
        else:  # an int: the streams' batch and device so far (one CPU stream before the first round)
            tokens = self.throughput.tokens
            batch, device = (1, torch.device("cpu")) if tokens is None else (tokens.shape[0], tokens.device)
        self._ready(batch, self._model(device), context_len)
        if not self.allow_ar:
            return torch.ones(batch, dtype=torch.bool, device=device)
        return self.throughput.draft_decision(self._cost_ar)

    def plain_run(self, context_len) -> torch.Tensor:
        """At a plain step: how many more plain steps come before the next draft ([batch] long, 0 = draft next),
        the streams advanced past this step and those (DinkelbachThroughput.plain_run: the same decisions as
        `should_draft` + `observe` once per plain step, each costing C_ar at this context)."""
        self.should_draft(context_len) if self.throughput.tokens is None else None  # allocates the streams
        batch = self.throughput.tokens.shape[0]
        self._ready(batch, self._model(self.throughput.tokens.device), context_len)
        if not self.allow_ar:
            self.throughput.update(torch.ones_like(self._cost_ar), self._cost_ar,
                                   torch.zeros(batch, dtype=torch.bool, device=self._cost_ar.device))
            return torch.zeros(batch, dtype=torch.long, device=self._cost_ar.device)
        return self.throughput.plain_run(self._cost_ar)

    def choose(self, survival, context_len, w_max=None):
        self._ready(survival.shape[0], self._model(survival.device), context_len)
        self._survival, self._cost = survival, self._costs(survival, context_len)  # kept for observe()
        return select_length(survival, self._cost, self.throughput.rho, w_max)

    def keep_extra(self, survival, w0, n_new, context_len, w_max=None):
        if not self.routing_correction:
            return super().keep_extra(survival, w0, n_new, context_len, w_max)
        delta = predicted_delta_latency(self._model(survival.device), w0, n_new, context_len)
        keep = keep_extra_token(extra_survival(survival, w0), self.throughput.rho, delta)
        return keep if w_max is None else keep & (w0 < on_device(w_max, w0.device))

    def batch_state(self, rows, left):
        if self.throughput.tokens is None:  # held until the first decision makes the streams (`_ready`)
            self._batch = (rows, left)
            return
        self.throughput.set_batch(rows, left)

    def observe(self, w, emitted, latency=None, drafted=True, spread=None):
        if self.throughput.tokens is None:
            raise RuntimeError("observe() before should_draft()/choose(): the selector has no round to account.")
        if emitted.shape != w.shape:
            raise ValueError(f"observe() wants w and emitted both [batch]; got {tuple(w.shape)} and "
                             f"{tuple(emitted.shape)}.")
        idx = (w.long() - 1).clamp(min=0).unsqueeze(1)  # [batch, 1]
        spec = on_device(drafted, w.device, torch.bool).expand(w.shape[0])
        predicted_latency = torch.where(spec, self._cost.gather(1, idx).squeeze(1), self._cost_ar)
        if self.rho_source == "predicted":
            gain = expected_tokens(self._survival).gather(1, idx).squeeze(1)  # G(w) of the last choose()
            self.throughput.update(torch.where(spec, gain, torch.ones_like(gain)), predicted_latency, spec)
            return
        seconds = predicted_latency if latency is None else on_device(latency, w.device, torch.float32).expand(
            w.shape[0])
        # G(w): the drafts' own prediction (trust_tokens weighs it against the emitted tokens; the probes' share
        # grows to hopeful_share while it says drafting pays); a batch's rows' mean, as the emitted tokens
        expected = expected_tokens(self._survival).gather(1, idx).squeeze(1).to(emitted.device)
        priced = predicted_latency if self.draft_price == "calibrated" else None
        self.throughput.update(emitted.float(), seconds, spec, expected=expected, spread=spread, priced=priced)


_STRATEGIES = {
    "dflash": (FullBlock, {}),
    "static": (StaticLength, {}),
    "ratio": (PerRoundRatio, {}),
    "confidence": (ConfidencePrefix, {}),
    "nominal": (HybridSpec, {"routing_correction": False}),
    "hybridspec": (HybridSpec, {"routing_correction": True}),
}


def make_selector(strategy: str, config: Mapping[str, Any] | None = None) -> LengthSelector:
    """A strategy by name with its options, e.g. make_selector("hybridspec", {"latency_model": lm}).

    config: the constructor's keyword arguments (latency_model for "ratio", "nominal" and "hybridspec"; w for
    "static"; threshold for "confidence"; ...). Unknown names or options raise with the accepted ones listed.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"unknown verification strategy {strategy!r}; choose one of {sorted(_STRATEGIES)}.")
    cls, fixed = _STRATEGIES[strategy]
    options = {**dict(config or {}), **fixed}
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"strategy {strategy!r} does not take {unknown}; it accepts {accepted}.")
    return cls(**options)
