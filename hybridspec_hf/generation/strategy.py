"""What a strategy decides in a round, on top of the selector (`hybridspec_hf.selector`).

"dflash" and "static" know w on the host before drafting: the target verifies exactly w tokens. The other strategies
choose w0 on the device from the drafts (no sync): the target verifies min(B, room) tokens and a device-side valid
length says how many count; with the routing correction, stage 0 sees w0 + 1 tokens and the
first-router hook sets valid = w0 + keep.
"""
from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass

import torch

from hybridspec_hf.config import (CALIBRATED_STRATEGIES, HybridSpecConfig, resolved_compile_backend,
                                  resolved_verify_shape)
from hybridspec_hf.generation.calibration import ForcedLength, cached_file, resolve_latency_model
from hybridspec_hf.graphs.capture import distributed, host_syncs
from hybridspec_hf.selector.lookup import LookupEstimator
from hybridspec_hf.selector.profiles import AcceptanceProfile, RoutingProfile, load_profile
from hybridspec_hf.selector import (AcceptanceEstimator, LatencyModel, LengthSelector, copy_signals, count_new_experts,
                                    draft_signals, make_selector)
from hybridspec_hf.selector import length_rules

# the selectors whose decisions `RoundStrategy.compile_decisions` compiles: this package's (pure torch, no host sync);
# of calibration's ForcedLength only its shadow's (ForcedLength.compile_shadow)
_COMPILABLE = (length_rules.FullBlock, length_rules.StaticLength, length_rules.ConfidencePrefix,
               length_rules.PerRoundRatio, length_rules.HybridSpec, ForcedLength)


@dataclass
class Choice:
    """The device-side choice of one round, and the one owner of its valid length.

    Contract (routing correction): `valid` is a single [1] long device tensor, made here and never copied or
    rebound. The verify session (GDN kernels), the experts hook (`VerifyWindow`), acceptance and the hand-off all
    read this very tensor when they run; `correct` rewrites it in place at the first MoE router (the end of stage 0),
    from w0 + 1 to w0 + keep, so stage 1 and acceptance see the corrected length. Tested by
    test_every_reader_sees_the_corrected_valid_length.
    A batch's choice (`choose_rows`: one shared w0, no correction) has valid [N], one count per row.
    """

    w0: torch.Tensor  # [1] long, the nominal length
    valid: torch.Tensor  # [1] long, tokens that count: w0, or w0 + 1 while the extra token is kept ([N]: a batch)
    keep: torch.Tensor  # [1] bool, extra token kept
    n_new: torch.Tensor  # [1] long, new first-layer experts of the extra token
    # (first-layer ids [1, T, k], n_new, keep, valid) -> None, writing the three in place; None: no correction
    correction: Callable[..., None] | None = None
    signals: dict | None = None  # the draft signals w0 was chosen from (the estimator's online update reads them)
    lookup: torch.Tensor | None = None  # [1] bool: verify the context-lookup proposal, not the drafts (None: none)

    @property
    def corrects(self) -> bool:
        return self.correction is not None

    def correct(self, first_layer_ids: torch.Tensor) -> None:
        """The routing correction, from the [T, k] router choices at the first MoE layer; updates in place."""
        ids = first_layer_ids.view(1, -1, first_layer_ids.shape[-1]).to(self.w0.device)  # device_map: may differ
        self.correction(ids, self.n_new, self.keep, self.valid)


def correction_can_act(selector) -> bool:
    """Whether the routing correction can ever keep the extra token under the selector's latency model.

    It keeps d_{w0} iff p̂_{w0} > ρ·ΔL, ΔL = C(w0+1) - C(w0) - s(w0) + η·(n̄_all(w0 | n_new) - n̄_all(w0))
    (selector/routing.py). Without an expert term (η = 0: a calibration that measured no cost per distinct expert,
    as on a CPU, whose experts run densely) and without sunk stage-0 costs (s = 0), that is the length choice's own
    marginal test of w0 + 1 at the same ρ and p̂, which w0, the argmax of G(w) - ρ·C(w), already failed: the extra
    token would be verified through stage 0 and the routing masks of every MoE layer, then always dropped. Such a
    selector runs without the correction (its rounds verify w0 tokens, as "nominal"). Selectors without a latency
    model keep it."""
    model = getattr(selector, "latency_model", None)
    if model is None:
        return True
    return model.prices_routing


class RoundStrategy:
    """How a strategy's rounds choose and verify w. `mode` is the one notion of it:

    - "fixed": w is known on the host before drafting (dflash, static, ar): verify exactly `fixed_length` tokens
      (capped by the room left);
    - "max": w0 is chosen on the device from the drafts; verify min(B, room) tokens with a device-side valid length
      and no host sync inside the round;
    - "exact": w0 is chosen on the device, read on the host, and only those tokens are verified (resident rounds:
      a draft graph, then the verify graph of that length). "auto" picks by device (HybridSpecConfig).
    """

    def __init__(self, name: str, fixed_length: int | None, selector, estimator, corrects: bool,
                 mode: str = "max", kernel_backend: str = "auto", identity: tuple = ()):
        self.name = name
        self.kernel_backend = kernel_backend
        self._identity = identity  # what the decisions depend on: equal identities choose alike (graph reuse)
        self.mode = "fixed" if fixed_length is not None else mode
        self.fixed_length = fixed_length
        self.selector = selector
        self.estimator = estimator
        self.corrects = corrects  # routing correction on (needs a MoE router)
        self.profile = None  # timing mode: a selector.profiles.AcceptanceProfile replayed by resident rounds
        # context lookup (HybridSpecConfig.context_lookup): the survival table of its proposals, None while off;
        # lookup_off says why it is off under "auto", lookup_required that "on" asked for it
        self.lookup: LookupEstimator | None = None
        self.lookup_off: str | None = None
        self.lookup_required = False
        self._lookup_identity: str | None = None  # the table's part of `identity` while lookup is on
        self.gdn_verifier = "block"  # or "per_token_state" (the serving engines' verifier, for benchmarks)
        self.greedy_head = "auto"  # HybridSpecConfig.greedy_head
        self.calibration_file = None  # the cached calibration its latency model came from (calibration.retire_if_busy)
        self.routing = None  # timing mode: a selector.profiles.RoutingProfile replacing the routers' choices
        # the decisions' device work: eager, or compiled by `compile_decisions`; resident rounds compile them with
        # compile_backend (None: eager), _compiled says with which backend they were
        self.compile_backend = self._compiled = None
        self._decide, self._correct = self._choose, self._correction
        self._should_draft, self._plain_run = self._should_draft_eager, self._plain_run_eager
        self._observe_round, self._end_round = self._observe_round_eager, self._end_round_eager

    @classmethod
    def build(cls, name: str, settings: HybridSpecConfig, target, drafter, has_router: bool,
              batch: int = 1) -> "RoundStrategy":
        """The strategy of one generate() call over `batch` prompts (a calibrated strategy reads the latency
        model's tables for that batch size: LatencyModel.for_batch)."""
        strategy = cls._build(name, settings, target, drafter, has_router, batch)
        profile = settings.acceptance_profile
        if profile is not None and not isinstance(profile, AcceptanceProfile):
            profile = load_profile(profile)
        strategy.profile = profile
        routing = settings.routing_profile
        if routing is not None and profile is None:
            raise ValueError("routing_profile= replaces the routers' choices: timing mode only; pass an "
                             "acceptance_profile= too.")
        if routing is not None and not isinstance(routing, RoutingProfile):
            routing = RoutingProfile.from_dict(json.loads(Path(routing).read_text()))
        strategy.routing = routing
        strategy.gdn_verifier = settings.gdn_verifier
        strategy.greedy_head = settings.greedy_head
        strategy.compile_backend = resolved_compile_backend(settings, next(target.parameters()).device)
        strategy.lookup_required = settings.context_lookup == "on"
        # (a batch, or a left-padded prompt, turns it off in the loop: generation/loop.py)
        lookup, off = _context_lookup(settings, strategy, drafter)
        strategy.switch_lookup_off(off)
        if lookup is not None:  # the table is part of what the decisions depend on (graph reuse)
            strategy._lookup_identity = json.dumps(lookup.to_dict())
            strategy._identity = (*strategy._identity, strategy._lookup_identity)
            with host_syncs():  # the call's set-up: a pageable host→device copy counts as a sync
                strategy.lookup = lookup.to(next(target.parameters()).device)  # this call's copy, on the device
        return strategy

    def switch_lookup_off(self, reason: str | None) -> None:
        """Context lookup off for this call, because of `reason` (None: leave it as it is). Raises where
        HybridSpecConfig(context_lookup="on") asked for it."""
        if reason is None:
            return
        if self.lookup_required:
            raise ValueError(f"HybridSpecConfig(context_lookup='on') cannot run in this call: {reason}. Use "
                             "context_lookup='auto' (on only where it can run) or 'off'.")
        self.lookup, self.lookup_off = None, reason
        if self._lookup_identity is not None:  # rounds built without it are another kind (graph reuse)
            self._identity = tuple(part for part in self._identity if part is not self._lookup_identity)
            self._lookup_identity = None

    @classmethod
    def _build(cls, name: str, settings: HybridSpecConfig, target, drafter, has_router: bool,
               batch: int) -> "RoundStrategy":
        identity = (name, _settings_identity(settings), id(settings.selector))
        plain = dict(kernel_backend=settings.kernel_backend, identity=identity)
        if name == "ar":  # plain decoding through the same machinery: the baseline
            return cls(name, 1, None, None, False, **plain)
        block_size = drafter.config.block_size
        if name == "static" and settings.static_length > block_size:
            raise ValueError(
                f"static_length={settings.static_length} exceeds the drafter's block_size={block_size}; "
                f"choose 1 ≤ static_length ≤ {block_size}."
            )
        if settings.selector is not None:
            selector = settings.selector
        elif name == "dflash":
            return cls(name, block_size, None, None, False, **plain)
        elif name == "static":
            return cls(name, settings.static_length, None, None, False, **plain)
        elif name == "confidence":
            selector = make_selector(name, {"threshold": settings.confidence_threshold})
        else:
            assert name in CALIBRATED_STRATEGIES
            resolved = resolve_latency_model(settings, target, drafter)
            latency = resolved.for_batch(batch)
            selector = make_selector(name, {"latency_model": latency})
            # the module-level defaults a selector read (HybridSpec's trust_tokens, carry_rounds, explore): part
            # of its decisions
            throughput = getattr(selector, "throughput", None)
            trust, hopeful, explore, probe = (getattr(throughput, k, None) for k in (
                "trust_tokens", "hopeful_share", "explore", "probe_price"))
            identity = (*identity, latency.digest(), trust, hopeful, explore, probe,
                        *(getattr(selector, k, None) for k in ("carry_rounds", "draft_price")))
        selector.reset()
        carried = settings.acceptance_estimator is None and getattr(drafter, "acceptance_estimator", None) is not None
        estimator = _estimator(drafter.acceptance_estimator if carried else settings.acceptance_estimator, block_size)
        if estimator.block_size != block_size:
            raise ValueError(f"the acceptance estimator was fitted for block_size={estimator.block_size}, the drafter "
                             f"drafts blocks of {block_size}: fit one on this drafter's traces "
                             "(selector.AcceptanceEstimator.fit) or pass acceptance_estimator=None.")
        if carried:  # the drafter's own estimator: part of what the decisions depend on
            identity = (*identity, json.dumps(estimator.to_dict()))
        shape = resolved_verify_shape(settings, next(target.parameters()).device)
        corrects = bool(selector.routing_correction and has_router and correction_can_act(selector))
        strategy = cls(name, None, selector, estimator, corrects, shape, settings.kernel_backend, identity)
        if name in CALIBRATED_STRATEGIES and settings.selector is None:
            strategy.calibration_file = cached_file(settings, resolved)
        return strategy

    def correction_state(self, batched: bool) -> tuple[bool, str | None]:
        """(whether a call's rounds run the routing correction, why not where its selector has one)."""
        if not getattr(self.selector, "routing_correction", False):
            return False, None
        if batched:
            return False, "the batched loop (batch > 1 or a left-padded prompt) verifies without it"
        if not self.corrects:
            model = getattr(self.selector, "latency_model", None)
            if model is not None and not model.prices_routing:
                return False, ("the latency model prices no distinct expert (η = 0, nothing sunk): the correction "
                               "could never keep the extra token")
            return False, "the target has no MoE router"
        return True, None

    def identity(self) -> tuple:
        """Strategies with equal identities take the same decisions from the same device state."""
        return self._identity

    def max_tokens(self, w_max: int) -> int:
        """Tokens a round drafts for (anchor + drafts); "exact" trims to the choice after `choose`."""
        return min(self.fixed_length, w_max) if self.mode == "fixed" else w_max

    def choose(self, draft_logits: torch.Tensor, context_len, w_max, signals: dict | None = None,
               lookup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Choice:
        """w0 from the drafts' survival estimates; arms the routing correction for the extra token.

        context_len, w_max: ints, or [1] long device tensors (GPU-resident rounds). signals: the draft signals to
        use instead of the drafts' own (timing mode replays a profile's, see selector.profiles). lookup: this
        round's context-lookup proposal, (tokens [1, B-1] long, its match length n [1] long (0: none), the drafts
        [1, B-1] long = draft_logits.argmax(-1)); `self.lookup` rates it from n and from the drafter's estimate of
        the copied tokens (`copy_signals`): where its Σ p̂ exceeds the drafts', w0 is chosen from its survival and
        `Choice.lookup` says to verify it instead."""
        estimator = self.estimator.to(draft_logits.device)
        signals = signals if signals is not None else draft_signals(draft_logits)
        copied = None
        if lookup is not None:
            tokens, ngram, drafts = lookup
            rating = (estimator.survival(copy_signals(draft_logits, signals, drafts, tokens))
                      if self.lookup.table_weight < 1.0 else None)  # λ = 1: the table alone
            copied = self.lookup.survival(ngram, rating)
        survival, w0, valid, keep, n_new, use_copy = self._decide(estimator, signals, context_len, w_max, copied)
        if not self.corrects:
            return Choice(w0, valid, keep, n_new, signals=signals, lookup=use_copy)
        correction = functools.partial(self._correct_padded, survival=survival, w0=w0, context_len=context_len,
                                       w_max=w_max)
        return Choice(w0, valid, keep, n_new, correction, signals, use_copy)

    def _correct_padded(self, ids: torch.Tensor, *args, survival: torch.Tensor, **kwargs) -> None:
        """`_correct` on ids padded to the block's B tokens (id -1: no expert) when stage 0 verified fewer
        ("exact" shape: w0 + 1): one shape, so the compiled correction is compiled once, not once per w0."""
        block, tokens = survival.shape[-1] + 1, ids.shape[1]
        extra_at = kwargs["w0"]
        if self._compiled and tokens < block:
            ids = torch.nn.functional.pad(ids, (0, 0, 0, block - tokens), value=-1)
            extra_at = extra_at.clamp(max=tokens - 1)  # as count_new_experts reads the unpadded ids (no extra token)
        self._correct(ids, *args, survival=survival, extra_at=extra_at, **kwargs)

    def _choose(self, estimator: AcceptanceEstimator, signals: dict, context_len, w_max,
                copied: torch.Tensor | None = None) -> tuple:
        """(survival [1, B-1], w0 [1], valid [1], keep [1] False, n_new [1] 0, lookup [1] bool or None) of one row's
        drafts: the device work of `choose` after the signals (one compiled region with `compile_decisions`: the
        zeros the routing correction overwrites come out of its kernels, not two launches of their own). valid = w0,
        + 1 (the extra token in stage 0) when the routing correction is on and there is room for it. copied: the
        survival [1, B-1] of a context-lookup proposal, taken (lookup True) where its Σ p̂ exceeds the drafts'."""
        survival = estimator.survival(signals)  # [1, B-1]
        lookup = None
        if copied is not None:
            lookup = copied.sum(-1) > survival.sum(-1)  # [1]
            survival = torch.where(lookup[:, None], copied, survival)
        # [1] long. Clamped on the device (no sync): a custom selector's w0 = 0 would verify nothing that counts,
        # and w0 > w_max would read past the block.
        w0 = self.selector.choose(survival, context_len, w_max).long().clamp(min=1)
        w0 = torch.minimum(w0, w_max) if isinstance(w_max, torch.Tensor) else w0.clamp(max=w_max)
        keep, n_new = torch.zeros_like(w0, dtype=torch.bool), torch.zeros_like(w0)
        if not self.corrects:
            return survival, w0, w0.clone(), keep, n_new, lookup
        # stage 0 includes the extra token when there is room for it
        return survival, w0, w0 + (w0 < w_max).long(), keep, n_new, lookup

    def _correction(self, ids: torch.Tensor, n_new: torch.Tensor, keep: torch.Tensor, valid: torch.Tensor, *,
                    survival: torch.Tensor, w0: torch.Tensor, context_len, w_max, extra_at: torch.Tensor) -> None:
        """The routing correction's device work (`Choice.correct`): n_new of the token at extra_at (the extra token
        d_{w0}) from the first MoE layer's ids [1, T, k], the keep decision, valid = w0 + keep; written in place."""
        n_new.copy_(count_new_experts(ids, extra_at))
        decided = self.selector.keep_extra(survival, w0, n_new, context_len, w_max) & (w0 < w_max)
        keep.copy_(decided)
        valid.copy_(w0 + decided.long())

    def compile_decisions(self, backend: str = "inductor") -> bool:
        """Compile the device work of the decisions a GPU-resident round makes (the length choice, the routing
        correction, the next round's draft decision, the selector's update, a plain stretch's length) with
        `torch.compile` (whole graphs, static shapes): a few fused kernels instead of ≈ 130 small ones a round
        (≈ 0.3 ms of a 0.8 ms round on the tiny pair on the H200, gpu_rounds_tiny_pair3.md). Only for this
        package's selectors (a custom one may hold host code that a whole-graph compile refuses; of calibration's
        forced length only its shadow's, `ForcedLength.compile_shadow`); their eager code stays the reference, and
        the CPU twin runs it compiled too when asked (tests). The first round of a capture compiles (seconds, cached
        by torch on this machine); returns whether the decisions are compiled."""
        if self._compiled:
            return True
        if self.selector is None or type(self.selector) not in _COMPILABLE:
            return False
        compiled = functools.partial(compiled_region, backend=backend)
        if isinstance(self.selector, ForcedLength):  # calibration: the shadow's work compiled as HybridSpec's is
            self._compiled = backend if self.selector.compile_shadow(compiled) else None
            return self._compiled is not None
        self._decide, self._correct = compiled(self._choose), compiled(self._correction)
        self._should_draft, self._plain_run = compiled(self._should_draft_eager), compiled(self._plain_run_eager)
        self._observe_round = compiled(self._observe_round_eager)
        self._end_round = compiled(self._end_round_eager)
        self._compiled = backend
        return True

    def choose_rows(self, draft_logits: torch.Tensor, context_len, w_max, live: torch.Tensor | None = None,
                    signals: dict | None = None) -> Choice:
        """One w for every row of a batch, on the device (no sync): the strategy's rule applied to the live rows'
        mean survival, without the routing correction. Returns a Choice whose w0 [1] is the shared length and
        whose valid [N] is w0 for live rows and 1 for the others (they verify their anchor only).

        draft_logits [N, B-1, V]; context_len, w_max: ints or [1] long device tensors; live [N] long (None: all
        rows); signals: the draft signals to use instead of the drafts' own (timing mode).

        Why the mean: Σ_b G_b(w) = N·(1 + Σ_{i<w} mean_b p̂_{b,i}), so the pooled objective Σ_b G_b(w) − ρ_N·C_N(w)
        of N rows is N times the selector's objective on the mean survival with ρ = ρ_N / N, the throughput per row,
        which is what the selector learns from `observe(..., emitted=mean tokens per row, seconds=None)`. C is the
        selector's latency model: a batch calibration (LatencyModel with batch sizes) gives C_N(w) at N rows, else
        the batch-1 C, exact whenever C_N(w) = k_N·C(w)."""
        signals = signals if signals is not None else draft_signals(draft_logits)
        survival = self.estimator.to(draft_logits.device).survival(signals)  # [N, B-1]
        if live is None:
            live = torch.ones(survival.shape[0], dtype=torch.long, device=survival.device)
        weight = live.to(survival.dtype).view(-1, 1)
        mean = (survival * weight).sum(0, keepdim=True) / weight.sum().clamp(min=1)  # [1, B-1]
        w0 = self.selector.choose(mean, context_len, w_max).long().view(1).clamp(min=1)
        w0 = torch.minimum(w0, w_max) if isinstance(w_max, torch.Tensor) else w0.clamp(max=w_max)
        valid = torch.where(live > 0, w0, 1)
        nothing = torch.zeros_like(w0)
        return Choice(w0, valid, nothing.bool(), nothing, signals=signals)

    def choose_shared(self, draft_logits: torch.Tensor, context_len: int, w_max: int) -> tuple[int, dict]:
        """`choose_rows` read on the host (the eager batched loop, generation/batched.py): (w, the rows' draft
        signals)."""
        choice = self.choose_rows(draft_logits, context_len, w_max)
        return int(choice.w0), choice.signals

    def observe_acceptance(self, choice: Choice | None, accepted: torch.Tensor) -> None:
        """The acceptance estimator's online update (a no-op unless it was built with online_lr > 0): one step on
        the positions this round verified. On the device, no host sync."""
        # an offline estimator learns nothing: not even the verified count is built (a launch a round on CUDA)
        if choice is not None and self.estimator is not None and self.estimator.online_lr != 0.0:
            verified = choice.valid.view(-1) - 1
            if choice.lookup is not None:  # a round that verified copied tokens says nothing of the drafts
                verified = torch.where(choice.lookup, 0, verified)
            self.estimator.observe(choice.signals, accepted.view(-1), verified)

    def should_draft(self, context_len: int):
        """Whether the next round drafts (decided from the rounds so far; read at the hand-off)."""
        return self._should_draft(context_len)

    def _should_draft_eager(self, context_len):
        if self.selector is None:
            return True
        return self.selector.should_draft(context_len)

    def plain_run(self, context_len) -> torch.Tensor:
        """At a plain step that `should_draft` chose: how many more plain steps come before the next draft ([1] or
        [batch] long, 0 = draft next), decided now for all of them; the selector is advanced past this step and
        those (they teach it nothing: `HybridSpec.plain_run`). The steps in between run no selector work.
        Selectors without a plain-step rule always draft (0; this step still accounted)."""
        return self._plain_run(context_len)

    def _plain_run_eager(self, context_len) -> torch.Tensor:
        run = getattr(self.selector, "plain_run", None)
        if run is not None:
            return run(context_len)
        if self.takes_plain_steps():
            raise TypeError(f"{type(self.selector).__name__} overrides should_draft but has no plain_run(context_len):"
                            " the rounds ask it once per stretch of plain steps how many come before the next draft.")
        device = context_len.device if isinstance(context_len, torch.Tensor) else torch.device("cpu")
        if self.selector is not None:
            one = torch.ones(1, dtype=torch.long, device=device)
            self.selector.observe(one, one, None, False)
        return torch.zeros(1, dtype=torch.long, device=device)

    def observe_round(self, w: torch.Tensor, emitted: torch.Tensor, spread: torch.Tensor | None = None) -> None:
        """A GPU-resident speculative round's update of the selector, on the device: w [1] tokens verified,
        emitted [1] tokens per live row, spread (a batch's rows) or None; priced at the calibrated C(w)."""
        if self.selector is not None:
            self._observe_round(w, emitted, spread)

    def _observe_round_eager(self, w: torch.Tensor, emitted: torch.Tensor, spread: torch.Tensor | None) -> None:
        self.selector.observe(w, emitted, None, True, spread)

    def end_round(self, context_len, w: torch.Tensor, emitted: torch.Tensor,
                  spread: torch.Tensor | None = None):
        """`should_draft(context_len)` and then `observe_round(w, emitted, spread)`, in one call (one compiled region
        with `compile_decisions`): the draft decision reads the selector before this round's update, as the two calls
        apart do. Returns the decision: a bool, or a [1] long tensor where should_draft answers a tensor (cast in
        the region: no launch of its own)."""
        return self._end_round(context_len, w, emitted, spread)

    def _end_round_eager(self, context_len, w: torch.Tensor, emitted: torch.Tensor, spread: torch.Tensor | None):
        draft = self._should_draft_eager(context_len)
        if self.selector is not None:
            self._observe_round_eager(w, emitted, spread)
        return draft.reshape(-1)[:1].long() if isinstance(draft, torch.Tensor) else draft

    def takes_plain_steps(self) -> bool:
        """Whether `should_draft` may answer False: a selector with its own rule (the others draft every round)."""
        return self.selector is not None and type(self.selector).should_draft is not LengthSelector.should_draft

    def handoff(self, accepted, valid, choice: Choice | None, next_draft, tokens: int) -> torch.Tensor:
        """The round's one transfer: [a, w, kept, n_new, draft_next, lookup] as one long tensor."""
        like = accepted.view(-1)[:1]
        w = valid.view(-1)[:1] if valid is not None else torch.full_like(like, tokens)
        kept = choice.keep.view(-1)[:1].long() if choice is not None else torch.zeros_like(like)
        n_new = choice.n_new.view(-1)[:1] if choice is not None else torch.zeros_like(like)
        draft = next_draft.view(-1)[:1].long() if isinstance(next_draft, torch.Tensor) else torch.full_like(like, int(next_draft))
        copied = (choice.lookup.long() if choice is not None and choice.lookup is not None
                  else torch.zeros_like(like))
        return torch.cat([like, w, kept, n_new, draft.to(like.device), copied])

    def predicted_latency(self, w: int, context_len: int, drafted: bool) -> float | None:
        """C(w) (or C_ar) of the calibration this round was chosen with; None for uncalibrated strategies."""
        model = getattr(self.selector, "latency_model", None)
        if model is None:
            return None
        if not drafted:
            return float(model.cost_ar_for(context_len).reshape(-1)[0])  # the CPU copy: no device sync
        return float(model.cost_for(context_len).reshape(-1)[w - 1])

    def observe(self, w: int, emitted: float, seconds: float, drafted: bool, like: torch.Tensor,
                spread: float | None = None) -> None:
        """Feed the selector (emitted: tokens per row; spread: a batch round's spread between its rows,
        LengthSelector.observe). Under tensor parallelism the measured seconds differ between ranks, so ρ uses the
        calibrated C(w) instead (ranks must take identical decisions)."""
        if self.selector is None:
            return
        device = like.device
        if distributed():
            seconds = None
        self.selector.observe(torch.tensor([w], device=device), torch.tensor([emitted], device=device), seconds, drafted,
                              None if spread is None else torch.tensor([spread], device=device))

    def batch_state(self, rows: int, left: int, like: torch.Tensor) -> None:
        """The batch the next decisions are for (LengthSelector.batch_state): live rows, tokens its roomiest row
        still needs."""
        if self.selector is not None:
            device = like.device
            self.selector.batch_state(torch.tensor([float(rows)], device=device),
                                      torch.tensor([float(left)], device=device))


def compiled_region(fn: Callable, backend: str) -> "_CompiledDecision":
    """fn compiled with `torch.compile` as one whole graph at static shapes (the resident rounds' device work), its
    eager code the fallback (`_CompiledDecision`)."""
    return _CompiledDecision(fn, torch.compile(fn, fullgraph=True, dynamic=False, backend=backend))


class _CompiledDecision:
    """A decision's compiled form, with its eager code as the fallback: where torch.compile cannot take it (a
    trace it refuses, a backend that fails, too many recompiles) the decision runs eagerly from then on, with one
    warning. Those failures happen while compiling, before the compiled code runs, so no state was touched."""

    def __init__(self, eager: Callable, fast: Callable):
        import torch._dynamo.exc as dynamo_errors  # once here, not on every round's call

        self.eager, self.fast = eager, fast
        self.refusals = (dynamo_errors.TorchDynamoException, dynamo_errors.FailOnRecompileLimitHit)

    def __call__(self, *args, **kwargs):
        if self.fast is None:
            return self.eager(*args, **kwargs)
        try:
            return self.fast(*args, **kwargs)
        except self.refusals as error:
            self.fast = None
            warnings.warn(f"HybridSpec: torch.compile could not take {self.eager.__name__} ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); it runs eagerly (same decisions, "
                          "more kernels). HybridSpecConfig(compile_decisions='off') silences this.", stacklevel=2)
            return self.eager(*args, **kwargs)


def _context_lookup(settings: HybridSpecConfig, strategy: "RoundStrategy",
                    drafter) -> tuple[LookupEstimator | None, str | None]:
    """(the survival table context lookup runs with, or None; why it is off, or None)."""
    if settings.context_lookup == "off":
        return None, "context_lookup='off'"
    value = settings.lookup_estimator
    if value is None:
        value = getattr(drafter, "lookup_estimator", None)
    if strategy.mode == "fixed":
        return None, (f"strategy {strategy.name!r} verifies a fixed length; context lookup serves the strategies "
                      "that choose w from estimates (hybridspec, nominal, ratio, confidence)")
    if strategy.profile is not None:
        return None, "timing mode (acceptance_profile=) replays the drafts' acceptance, not the lookup's"
    if value is None:
        return None, ("no survival table for lookup proposals: pass HybridSpecConfig(lookup_estimator=...) or set "
                      "drafter.lookup_estimator (fit one with selector.lookup.LookupEstimator.fit on traces of "
                      "training-split text, e.g. benchmarks/context_lookup_tau.py --split train --fit-lookup FILE)")
    estimator = value if isinstance(value, LookupEstimator) else LookupEstimator.load(value)
    if estimator.block_size != drafter.config.block_size:
        raise ValueError(f"the lookup estimator was fitted for block_size={estimator.block_size}, the drafter drafts "
                         f"blocks of {drafter.config.block_size}: fit one for this block size or pass "
                         "context_lookup='off'.")
    return estimator, None


def _estimator(value, block_size: int) -> AcceptanceEstimator:
    if value is None:
        return AcceptanceEstimator.default(block_size)
    if isinstance(value, AcceptanceEstimator):
        return value
    return AcceptanceEstimator.from_dict(_read_json(Path(value)))  # a new one per call (online updates: in place)


# JSON files read by a call's set-up, by path: (mtime_ns, size, parsed). A call that finds the file unchanged parses
# nothing (as calibration._load_file does for latency models)
_JSON: dict[str, tuple[int, int, dict]] = {}


def _read_json(path: Path) -> dict:
    stat = path.stat()
    hit = _JSON.get(str(path))
    if hit is None or hit[:2] != (stat.st_mtime_ns, stat.st_size):
        hit = _JSON[str(path)] = (stat.st_mtime_ns, stat.st_size, json.loads(path.read_text()))
    return hit[2]


def _settings_identity(settings: HybridSpecConfig) -> str:
    """The settings as a string for the strategy's identity, model objects by their content (a latency model's
    digest, an estimator's dict) instead of the repr of their tensors (≈ 1.4 ms of a CPU call's set-up)."""
    data = settings.to_dict()
    for name, value in data.items():
        if isinstance(value, LatencyModel):
            data[name] = f"LatencyModel({value.digest()})"
        elif isinstance(value, (AcceptanceEstimator, LookupEstimator)):
            data[name] = f"{type(value).__name__}({json.dumps(value.to_dict())})"
    return repr(data)
