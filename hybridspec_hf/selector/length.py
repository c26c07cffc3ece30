"""Verification-length selection: w0 = argmax_w [G(w) - ρ·C(w)] with ρ the pooled throughput (Dinkelbach).

Why pooled throughput and not G/C per round: decoding speed is Σ tokens / Σ seconds over all rounds. By Dinkelbach's
theorem, the policy maximising E[G]/E[C] is the one that maximises E[G - ρ*·C] in every round, with ρ* its own
throughput; so every round is scored with ONE exchange rate ρ between tokens and seconds. Maximising G(w)/C(w) per
round instead (EVICT-like) verifies too little in high-acceptance rounds (their own ratio is above ρ*) and too much in
low-acceptance rounds; `tests/test_selector_dinkelbach.py` shows a case where it loses 8% of throughput.

All functions here are pure torch without host synchronisation (no .item(), .tolist(), bool(tensor), nonzero), so
they can run between the drafter and the target's stage 0 on the GPU.
"""
from __future__ import annotations

import math

import torch


def expected_tokens(survival: torch.Tensor) -> torch.Tensor:
    """G(w) = 1 + Σ_{i<w} p̂_i for w = 1..B. survival: [batch, B-1] -> [batch, B] fp32."""
    ones = torch.ones(survival.shape[:-1] + (1,), dtype=torch.float32, device=survival.device)
    return torch.cat([ones, 1.0 + survival.float().cumsum(-1)], -1)


def on_device(value, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor on device: a Python number becomes a fill kernel (no host-to-device copy), a tensor is moved or cast
    only when needed. dtype None keeps a tensor's dtype and gives a number torch's default for its type."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype or value.dtype)
    return torch.full((), value, dtype=dtype, device=device)


def _as_column(value, device: torch.device) -> torch.Tensor:
    """Scalar, 0-dim or [batch] -> fp32 [batch or 1, 1] on device (broadcasts against [batch, B])."""
    return on_device(value, device, torch.float32).reshape(-1, 1)


def _check_cost(cost: torch.Tensor, block_size: int) -> None:
    if cost.shape[-1] != block_size or cost.dim() > 2:
        raise ValueError(f"cost must be C(w) for w = 1..B = {block_size}, shaped [B] or [batch, B]; got "
                         f"{tuple(cost.shape)}. Use LatencyModel.cost_for(context_len) for per-context costs.")


def _best_length(objective: torch.Tensor, w_max) -> torch.Tensor:
    """argmax over w = 1..B of objective [batch, B], w <= w_max, ties -> smaller w. Returns [batch] long."""
    w = torch.arange(1, objective.shape[-1] + 1, device=objective.device)  # [B]
    if w_max is not None:
        limit = on_device(w_max, objective.device).reshape(-1, 1).clamp(min=1)
        objective = objective.masked_fill(w > limit, float("-inf"))
    return objective.argmax(-1) + 1  # argmax returns the first maximum: ties go to the smaller w


def select_length(survival: torch.Tensor, cost: torch.Tensor, rho, w_max=None) -> torch.Tensor:
    """w0 = argmax_{1 <= w <= w_max} [G(w) - ρ·C(w)], ties -> smaller w.

    survival: [batch, B-1] p̂; cost: [B] or [batch, B] seconds (C(w), w = 1..B); rho: float, 0-dim or [batch]
    tokens/second; w_max: None, int or [batch] long (e.g. room left before max_new_tokens). Returns [batch] long.
    """
    gain = expected_tokens(survival)  # [batch, B]
    _check_cost(cost, gain.shape[-1])
    return _best_length(gain - _as_column(rho, gain.device) * cost.to(gain.device), w_max)


def ratio_length(survival: torch.Tensor, cost: torch.Tensor, w_max=None) -> torch.Tensor:
    """The per-round-ratio rule (EVICT-like): argmax_w G(w)/C(w), ties -> smaller w. Shapes as select_length."""
    gain = expected_tokens(survival)
    _check_cost(cost, gain.shape[-1])
    return _best_length(gain / cost.to(gain.device), w_max)


def should_draft(spec_gain: torch.Tensor, spec_cost: torch.Tensor, rho: torch.Tensor,
                 cost_ar: torch.Tensor) -> torch.Tensor:
    """Draft the next round iff a speculative round is worth more than a plain AR step at price ρ.

    A speculative round is expected to yield spec_gain tokens in spec_cost seconds (running averages of recent
    speculative rounds); an AR step yields 1 token in cost_ar seconds (no drafting). The Dinkelbach value of each is
    tokens - ρ·seconds, so: draft iff spec_gain - ρ·spec_cost > 1 - ρ·cost_ar. At the two fixed points this is the
    intuitive rule (all-speculative: draft iff spec_gain/spec_cost > 1/cost_ar), which is the rule at ρ = 1/cost_ar,
    the price `DinkelbachThroughput` decides at. All [batch] -> [batch] bool.
    """
    return spec_gain - rho * spec_cost > 1.0 - rho * cost_ar


def batch_row_tokens(gained: torch.Tensor, live: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """What a batch's speculative round is worth, in tokens per row: the live rows' mean gain, discounted for the
    spread between rows that the call's end pays for. [1] fp32; gained, live, room [N] (tokens each row committed,
    1/0 live at the round's start, tokens each row could still make before it).

    A batched generate() call ends when its last row does, and a row that ended keeps its place in the rounds. Plain
    steps move every row alike; speculative rounds give each row its own number of tokens (mean μ, spread σ between
    rows), so the rows drift apart and the call waits for the slowest. Continuing speculatively over the T tokens the
    roomiest live row still needs takes about T/μ + c_n·σ·√(T/μ)/μ rounds (c_n = E[max of n standard normals], Blom's
    approximation Φ⁻¹((n − 0.375)/(n + 0.25)), n live rows), i.e. the call advances at μ / (1 + c_n·σ/√(T·μ)) tokens
    per round (`spread_discount`): the mean at one row (c_1 = 0) or with rows that agree, less with rows that spread,
    and less as the end nears (small T), where a plain step, which moves the straggler as fast as the others, wins.
    The mean alone chose speculation at batch 8-16 under a medium acceptance (mean accepted length 4) where the
    straggler made it lose 5-8 % to plain decoding (run 56 of benchmarks/results/gpu_rounds_runs.md; selector_sim.py's
    calls mode with each row's own progress). The selector keeps μ and σ apart (`batch_row_stats`) and discounts at
    the moment it decides, with that moment's n and T: a round's T belongs to its call (a short call's last rounds are
    discounted hard), its μ and σ carry over to the next. Pure torch, no host sync."""
    mean, spread = batch_row_stats(gained, live)
    rows, left = batch_rows_left(live, room)
    return mean * spread_discount(mean, spread, rows, left)


def batch_row_stats(gained: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The live rows' mean gain μ and its spread σ between rows ([1] fp32 each; gained, live [N])."""
    weight = live.float()
    n = weight.sum().clamp(min=1.0)
    gained = gained.float()
    mean = (gained * weight).sum() / n
    spread = (((gained - mean) ** 2 * weight).sum() / n).sqrt()
    return mean.view(1), spread.view(1)


def batch_rows_left(live: torch.Tensor, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The live rows n and the tokens T the roomiest of them still needs ([1] fp32 each; live, room [N])."""
    weight = live.float()
    return weight.sum().view(1), (room.float() * weight).max().view(1)


def spread_discount(mean: torch.Tensor, spread: torch.Tensor, rows: torch.Tensor,
                    left: torch.Tensor) -> torch.Tensor:
    """1 / (1 + c_n·σ/√(T·μ)): the share of the rows' mean gain μ a call of n rows (T tokens left to its roomiest
    row) makes per speculative round when the rows spread by σ (see `batch_row_tokens`). Broadcasts; 1 at n = 1."""
    n = rows.float().clamp(min=1.0)
    c = torch.special.ndtri((n - 0.375) / (n + 0.25)).clamp(min=0.0)
    return 1.0 / (1.0 + c * spread / (left.float().clamp(min=1.0) * mean.clamp(min=1e-6)).sqrt())


class DinkelbachThroughput:
    """Running Dinkelbach price ρ = Σ tokens / Σ seconds over past rounds, plus the draft / don't-draft decision.

    ρ_{t+1} = Σ_s γ^{t-s} tokens_s / Σ_s γ^{t-s} latency_s, over ALL rounds (speculative and AR): it is the throughput
    of the policy actually run, which is Dinkelbach's iterate; choosing w by G - ρ·C with it is the next iteration.
    Forgetting γ = 0.98 (memory ≈ 50 rounds) because ρ* drifts: acceptance changes with the text being generated and
    C(w) grows with the context, so an infinite average is stale; near the optimum the argmax is flat in ρ, so the
    extra noise of a 50-round window costs little; and a prior or early rounds must not weigh forever.
    The state starts from `prior_rounds` pseudo AR rounds (ρ0 = 1/C_ar): speculation must beat plain decoding; a
    stream's first `first_rounds` rounds are drafted unasked (`_early`: one round's yield decides nothing);
    `explore` adds an optimism bonus for what the fading evidence no longer rules out (`_spec_gain`).

    What is fed in (chosen by the caller, see strategies.HybridSpec): "measured" = tokens actually emitted and the
    measured round latency (corrects calibration errors in p̂ and C; the default) or "predicted" = G(w) and C(w)
    (smooth, needs no timing, but inherits any calibration bias).

    Draft decision (made before drafting, so from history only): running means of speculative rounds' tokens and
    latency, with a shorter memory (`draft_forgetting` = 0.95, ≈ 20 rounds: they should reflect the current text,
    but near break-even a 10-round memory (0.9) switched to plain steps on noise: on the low-acceptance profile with the
    H200's C(w) it stepped plain in 35–87 of ≈ 270 rounds and fell 4–8 % behind the per-round-ratio selector, which a
    20-round memory closes in simulation — benchmarks/results/selector_sim.md), compared by
    `should_draft` at the plain step's rate 1/C_ar: speculating beats stepping plain iff its rate does. Not at ρ:
    ρ is the pooled rate of the rounds so far, and where it is above both options' rates (after lucky rounds, or in
    a batch whose speculative rounds are worth less as its end nears) the Dinkelbach comparison picks the shorter
    action, a plain step, though speculation still beats it (simulated with runs 63-64's C_N(w), the high profile:
    batch 8 1.19 → 1.22× AR, batch 16 1.44 → 1.46×, batch 4 medium 1.31 → 1.33×, the rest unchanged; ρ still
    prices the choice of w). While AR is chosen nothing new is learnt about speculation, so after a stretch of consecutive AR
    rounds one round is speculative anyway (a probe); since the speculative averages are discounted every round, a
    probe after a long AR stretch dominates them and can switch drafting back on at once. The stretch is at least
    `probe_every` rounds, and long enough that a probe's extra time (a speculative round's recent cost less the plain
    steps its mean tokens spare, `_stretch`) is at most `probe_share` of the plain steps' time since the last
    speculative round: where drafting is
    dear next to a plain step (a batch's rounds: run 37 measured C_16(1) = 27 ms against C_ar = 5.8–11.6 ms), a probe
    every 16 steps cost a fifth of the time. The default share, 1 %, puts a probe every ≈ 73 plain steps at batch 1 on
    the H200 (5.1 against 2.95 ms) and ≈ 135 at batch 16 (27 against 11.5 ms): at 3 % the probes alone kept
    HybridSpec 3 % behind AR where drafting never pays (run 39, benchmarks/results/batch_qwen35_35b_a3b_run39.md).
    `plain_run` takes every decision of a stretch of plain steps at its first step.

    State tensors are [batch] on the device (one independent stream per row; a batch's shared round latency is
    passed to every row). Updates are in place (capturable, no host sync).
    """

    def __init__(self, forgetting: float = 0.98, draft_forgetting: float = 0.95, probe_every: int = 16,
                 prior_rounds: float = 4.0, probe_share: float = 0.01, trust_tokens: float = 0.0,
                 hopeful_share: float | None = None, first_rounds: int = 1, explore: float = 0.0,
                 probe_price: str = "net"):
        hopeful_share = probe_share if hopeful_share is None else hopeful_share
        if probe_price not in ("net", "gross"):
            raise ValueError(f"probe_price must be 'net' or 'gross', got {probe_price!r}: what a probe costs beyond "
                             "the plain steps its tokens replace ('net') or beyond one plain step ('gross').")
        self.probe_price = probe_price
        for name, value in (("forgetting", forgetting), ("draft_forgetting", draft_forgetting)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}; 1 means no forgetting.")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 round, got {probe_every}.")
        if not 0.0 < probe_share <= 1.0:
            raise ValueError(f"probe_share must be in (0, 1], got {probe_share}: the most of the plain steps' time "
                             "that a probe's extra cost may take (1 = probe every probe_every steps, whatever it costs).")
        if not probe_share <= hopeful_share <= 1.0:
            raise ValueError(f"hopeful_share must be in [probe_share = {probe_share}, 1], got {hopeful_share}: the "
                             "probes' share of time while the drafts' own predictions say that drafting pays.")
        if first_rounds < 1:
            raise ValueError(f"first_rounds must be >= 1 (a stream's first round is always drafted), got "
                             f"{first_rounds}.")
        if trust_tokens < 0:
            raise ValueError(f"trust_tokens must be >= 0 (0: the emitted tokens alone), got {trust_tokens}.")
        if explore < 0:
            raise ValueError(f"explore must be >= 0 (0: the speculative rounds' mean alone), got {explore}.")
        self.forgetting, self.draft_forgetting, self.trust_tokens = forgetting, draft_forgetting, trust_tokens
        self.probe_every, self.prior_rounds, self.probe_share = probe_every, prior_rounds, probe_share
        self.hopeful_share, self.first_rounds, self.explore = hopeful_share, first_rounds, explore
        self.tokens = self.latency = None

    PLAIN_HORIZON = 256  # plain steps `plain_run` scans ahead

    def reset(self, cost_ar: torch.Tensor | float, batch: int, device: torch.device | str) -> None:
        """Start (or restart) every stream from the AR prior: prior_rounds rounds of 1 token in cost_ar seconds."""
        cost_ar = on_device(cost_ar, device, torch.float32).expand(batch)
        self.tokens = torch.full((batch,), float(self.prior_rounds), device=device)
        self.latency = self.prior_rounds * cost_ar.clone()
        self.spec_tokens = torch.zeros(batch, device=device)
        self.spec_expected = torch.zeros(batch, device=device)
        self.spec_latency = torch.zeros(batch, device=device)
        self.spec_weight = torch.zeros(batch, device=device)
        self.ar_streak = torch.zeros(batch, dtype=torch.long, device=device)
        self.spec_rounds = torch.zeros(batch, device=device)  # speculative rounds observed (not discounted)
        self.spec_squares = torch.zeros(batch, device=device)  # their tokens squared (discounted as the sums)
        self.spec_spread = torch.zeros(batch, device=device)  # the rows' spread σ of a batch's rounds (0: one row)
        # the batch at the next decision (`set_batch`): live rows n and the tokens T its roomiest row still needs
        self.live_rows = torch.ones(batch, device=device)
        self.rows_left = torch.ones(batch, device=device)
        self.batched = False  # set_batch called: the decisions price the rows' spread (one row: no kernels for it)
        # a forced draft (the first round of a generation, which the loops draft without asking, or a probe) whose
        # round is not observed yet
        self.forced = torch.ones(batch, dtype=torch.bool, device=device)

    def restart(self, cost_ar: torch.Tensor, carry: float = 0.0, informed_rounds: int = 1) -> None:
        """`reset` in place, keeping every tensor's address (CUDA graphs hold them). cost_ar: [batch].

        carry > 0 keeps what the speculative rounds so far taught (their tokens, G(w) and latency means), weighed
        as at most `carry` rounds, so that the new call's own rounds soon outweigh it, and the count of speculative
        rounds observed: with `informed_rounds` of them the call's first round is decided from that evidence
        (`informed`), else it is a forced draft, as every call's first round without a carry. ρ restarts from the AR
        prior either way. With a carry the plain steps since the last speculative round (the probe's streak) carry
        too: the evidence is as old as they say, and a stretch longer than a call still ends in its probe (a call that
        ended inside a stretch `plain_run` had planned carries the planned steps: its probe may come at the next
        call's first step, a little early). Restarting
        it with every call kept the tiny pair on the H200 plain throughout 16 calls of 128 tokens when its C_ar was
        priced at the 0.29 ms its plain steps take (a trial calibration; drafting then pays by ≈ 15 % only, and a
        warm-up whose first rounds accepted little left a stretch of ≈ 100 steps: gpu_rounds_tiny_pair11.md, 0.93×
        our AR against DFlash's 1.31×)."""
        self.tokens.fill_(float(self.prior_rounds))
        self.latency.copy_(self.prior_rounds * cost_ar.expand_as(self.latency))
        if carry > 0:
            scale = (carry / self.spec_weight.clamp(min=1e-12)).clamp(max=1.0)
            for stat in self._spec_sums():
                stat.mul_(scale)
        else:
            self.ar_streak.zero_()
            for stat in (*self._spec_sums(), self.spec_rounds):
                stat.zero_()
        self.forced.copy_(~self.informed(informed_rounds))

    def _spec_sums(self) -> tuple[torch.Tensor, ...]:
        """The speculative rounds' discounted sums (one decay for all: their means keep their value); the rows'
        spread only for a batch."""
        sums = (self.spec_tokens, self.spec_expected, self.spec_latency, self.spec_weight)
        sums = (*sums, self.spec_squares) if self.explore else sums  # the yields' spread: only exploration reads it
        return (*sums, self.spec_spread) if self.batched else sums

    # The least weight the speculative sums decay to (in rounds): their means keep their value, and one new round
    # outweighs them a million to one. Without it a long plain stretch (≈ 540 steps at draft_forgetting 0.95) took the
    # weight below the divisions' 1e-12 clamp, and the means read from it were the sums' scaled down: the spread
    # discount (not homogeneous in them) then vanished, and a batch call drafted rounds its evidence said lose
    # (selector_sim, batch 16 medium: warm-up and timed calls opened with 2-4 such rounds).
    EVIDENCE_FLOOR = 1e-6

    def _decay_spec(self, factor) -> None:
        """Decay the speculative sums by factor (a number or [batch]), none below EVIDENCE_FLOOR rounds of weight
        (a stream without evidence keeps none: its scale is 1, its sums 0)."""
        least = (self.EVIDENCE_FLOOR / self.spec_weight.clamp(min=1e-30)).clamp(max=1.0)  # the scale to the floor
        scale = torch.maximum(least, factor) if isinstance(factor, torch.Tensor) else least.clamp(min=factor)
        for stat in self._spec_sums():
            stat.mul_(scale)

    def set_batch(self, rows: torch.Tensor, left: torch.Tensor) -> None:
        """The batch the next decisions are for: rows [batch] live rows n, left [batch] the tokens T the roomiest
        of them still needs (in place). A batch's speculative round is worth its rows' mean tokens discounted for
        their spread at this n and T (`spread_discount`); one row (the default) is worth its tokens."""
        self.live_rows.copy_(rows.float().expand_as(self.live_rows))
        self.rows_left.copy_(left.float().expand_as(self.rows_left))
        self.batched = True

    def _worth(self, gain: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """What a speculative round expected to yield `gain` tokens per row is worth to the call: gain times the
        spread_discount at the batch's n and T = left ([batch] or [batch, J]), with the rounds' mean spread; the
        gain itself for one row (no set_batch: no kernels in its captured rounds)."""
        if not self.batched:
            return gain
        spread = self.spec_spread / self.spec_weight.clamp(min=1e-12)
        if gain.dim() == 2:
            spread, rows = spread[:, None], self.live_rows[:, None]
        else:
            rows = self.live_rows
        return gain * spread_discount(gain, spread, rows, left)

    def informed(self, informed_rounds: int) -> torch.Tensor:
        """[batch] bool: the streams hold evidence from at least informed_rounds speculative rounds."""
        return (self.spec_rounds >= informed_rounds) & (self.spec_weight > 0)

    @property
    def rho(self) -> torch.Tensor:
        """Pooled throughput ρ [batch] fp32, tokens/second."""
        return self.tokens / self.latency

    def update(self, tokens: torch.Tensor, latency: torch.Tensor, drafted: torch.Tensor,
               expected: torch.Tensor | None = None, spread: torch.Tensor | None = None,
               priced: torch.Tensor | None = None) -> None:
        """Account one round: tokens emitted (per row), latency seconds, drafted (False = plain AR step), all
        [batch]; expected: a speculative round's G(w), the tokens its drafts' signals predicted (None: the emitted
        ones); spread: a batch round's spread σ of tokens between its rows (None: one row); priced: the seconds the
        speculative means keep, which the draft decision compares with C_ar (None: latency). ρ counts a batch round's
        tokens discounted for the spread at the batch set by `set_batch`; the speculative means keep μ and σ."""
        tokens, latency = tokens.float(), latency.float()
        priced = latency if priced is None else priced.float()
        expected = tokens if expected is None else expected.float()
        spec = drafted.float()  # [batch]
        worth = tokens
        if spread is not None:
            spread = spread.float().expand_as(tokens)
            worth = tokens * spread_discount(tokens, spread, self.live_rows, self.rows_left)
        self.tokens.mul_(self.forgetting).add_(worth)
        self.latency.mul_(self.forgetting).add_(latency)
        if spread is not None:
            self.batched = True
        self._decay_spec(self.draft_forgetting)
        for stat, value in ((self.spec_tokens, tokens), (self.spec_expected, expected), (self.spec_latency, priced),
                            (self.spec_weight, 1.0)):
            stat.add_(spec * value)
        if spread is not None:
            self.spec_spread.add_(spec * spread)
        self.ar_streak.add_(1).mul_((~drafted).long())
        self.spec_rounds.add_(spec)
        if self.explore:
            self.spec_squares.add_(spec * tokens * tokens)
        self.forced.logical_and_(~drafted)  # a forced draft observed is no longer in flight (`_early` counts it)

    def draft_decision(self, cost_ar: torch.Tensor) -> torch.Tensor:
        """Whether each stream drafts the next round: [batch] bool (see the class docstring)."""
        weight = self.spec_weight.clamp(min=1e-12)
        spec_cost = self.spec_latency / weight
        pays = should_draft(self._worth(self._spec_gain(1.0), self.rows_left), spec_cost, 1.0 / cost_ar, cost_ar)
        probe = self.ar_streak >= self._stretch(spec_cost, cost_ar)
        # The rounds decide the next round's drafting before they observe their own (the hand-off carries the
        # decision), so when a forced draft (the first, or a probe) is still in flight its tokens are not counted
        # yet: forcing again would draft twice for one observation (each probe cost two speculative rounds) —
        # except among a stream's first rounds (`_early`), which are all drafted.
        forced = (((self.spec_weight == 0) | probe) & ~self.forced) | self._early(self.forced)
        self.forced.copy_(forced & ~pays)
        return pays | forced

    def _early(self, in_flight: torch.Tensor) -> torch.Tensor:
        """[batch] bool: the stream holds fewer than `first_rounds` speculative rounds, counting a forced one still
        in flight, so its next round is drafted unasked. One round decides nothing: a block accepts 0 or 15 drafts,
        and after a first round that accepted none the speculative mean said "step plain" for the rest of the call
        (the next probe dozens of steps later). On the tiny pair's held-out prompts on a CPU that kept HybridSpec
        near AR on prompts where vanilla DFlash gained 1.3-2.1x (strategies_cpu_tiny_pair.md); HybridSpec drafts
        its first INFORMED_ROUNDS (3) rounds (a stream holding that many from earlier calls decides at once)."""
        return (self.spec_rounds + in_flight.float()) < self.first_rounds

    def _stretch(self, spec_cost: torch.Tensor, cost_ar: torch.Tensor) -> torch.Tensor:
        """Plain steps since the last speculative round before a probe: at least probe_every, and enough that the
        probe's extra time is at most `probe_share` of theirs, or `hopeful_share` while the
        drafts' own predictions (the recent rounds' mean G(w)) say that a speculative round beats a plain step
        (G / spec_cost > 1 / cost_ar: the price the plain steps move ρ to) and the emitted tokens disagree: a round or
        two of bad luck then costs a few probes' worth of plain steps, not the rest of the call (on the H200, batch 1,
        a medium acceptance: calls that stepped plain after a bad first round stayed plain to their end, 1.0× AR
        against 1.6× when drafting, run 56 of benchmarks/results/gpu_rounds_runs.md). [batch].

        A probe's extra time with probe_price "net" (the default) is spec_cost - g·cost_ar, g the speculative
        rounds' mean emitted tokens (at least 1): a probe's tokens spare that many plain steps, so near
        break-even (g·cost_ar just under spec_cost) probes are cheap and come every probe_every steps, and where
        drafting fails (g near 1) they are as rare as with "gross", spec_cost - cost_ar (one plain step spared).
        Simulated (position_sim.py, selector_sim.py): the tiny pair's held-out text on this CPU 1.504 → 1.539× AR,
        the 35B shape's medium profile at batch 1 1.679 → 1.712×, its low profile 0.998 → 0.994×."""
        predicted = self.spec_expected / self.spec_weight.clamp(min=1e-12)
        hopeful = self._worth(predicted, self.rows_left) * cost_ar > spec_cost
        share = torch.where(hopeful, self.hopeful_share, self.probe_share)
        # "net": the tokens a probe is expected to yield (the speculative rounds' mean emitted tokens per row, at
        # least the one a plain step makes) would have taken that many plain steps. The mean of the discounted sums
        # keeps its value through a plain stretch (one decay for all), so `plain_run` prices every step alike
        replaced = 1.0
        if self.probe_price == "net":
            replaced = (self.spec_tokens / self.spec_weight.clamp(min=1e-12)).clamp(min=1.0)
        return ((spec_cost - replaced * cost_ar).clamp(min=0) / (share * cost_ar)).ceil().clamp(min=self.probe_every)

    def _spec_gain(self, scale) -> torch.Tensor:
        """Tokens a speculative round is expected to yield: the recent rounds' mean G(w) times the emitted/G ratio,
        the ratio shrunk towards 1 by trust_tokens of pseudo-evidence: (trust + Σ emitted) / (trust + Σ G).

        One round's acceptance is noisy (a block accepts 0 or 15 tokens), and the call's first round alone decides
        whether the next ones draft; G(w) = E[tokens | the drafts' signals] has less noise when the estimator is
        right. With little evidence the mean G counts, with more the emitted tokens do. trust_tokens = 0 (the
        default) is the emitted tokens alone: trust 4 lifted the DFlash-like profile in simulation (a bad first round
        kept one call in three near AR speed until a probe, benchmarks/results/selector_sim_calls.md) but cost 5 % on
        the tiny pair's held-out prompts, whose estimator is optimistic there (strategies_cpu_tiny_pair.md).
        scale: the sums' common decay (plain_run's d^j; a scalar or a [J] row), which moves the ratio towards the
        prior as the evidence fades.

        explore c > 0 then adds c·σ/√W, an upper confidence bound on the yield: σ the spread of the rounds' emitted
        tokens, W the weight of the evidence (the discounted rounds behind the mean, times scale). A plain stretch
        fades W with every step, so the bound rises until the stream drafts again (`plain_run` finds the step); with
        few rounds of evidence (a call's first, unlucky ones) it is reached in a few dozen steps, with many consistent
        ones (σ small: drafting never pays) not before the probe. Without it one bad patch early in a call kept the
        stream plain until a probe ≈ 75 steps later (the tiny pair's held-out prompts on a CPU:
        benchmarks/results/position_sim_tiny_pair.md). HybridSpec leaves it off (EXPLORE): c = 0.5 made +1 % on the
        CPU (within noise), +2.7 % replayed there, +2 % on the 35B shape's medium profile simulated, but cost the low
        profile, where drafting never pays, 3 %.
        Returns [batch] (scalar scale) or [batch, J]."""
        weight = self.spec_weight.clamp(min=1e-12)
        tokens, expected, squares = self.spec_tokens, self.spec_expected, self.spec_squares
        if isinstance(scale, torch.Tensor):
            tokens, expected, weight, squares = tokens[:, None], expected[:, None], weight[:, None], squares[:, None]
        if self.trust_tokens == 0:  # the emitted tokens alone, whatever the decay
            gain = tokens / weight
        else:
            gain = expected / weight * (self.trust_tokens + scale * tokens) / (self.trust_tokens + scale * expected)
        if self.explore == 0:
            return gain
        mean = tokens / weight
        spread = (squares / weight - mean * mean).clamp(min=0.0)
        held = (weight * scale).clamp(min=1e-12)
        return gain + self.explore * (spread / held).sqrt()

    def plain_run(self, cost_ar: torch.Tensor) -> torch.Tensor:
        """A plain step's decision for every plain step to come at once: the number k of further plain steps before
        the next draft ([batch] long, 0 = draft next), with the state advanced past this step and those k.

        Plain steps teach nothing about speculation, and their update is fixed (one token in cost_ar seconds), so
        the decisions `draft_decision` followed by `update` would take over the coming steps are known now: after
        j more plain steps the speculative means keep their value (every sum scales by the same draft_forgetting^j;
        the emitted/G ratio of `_spec_gain` moves towards its prior, computed per j; a batch's roomiest row is j
        tokens nearer its end) and the streak grows by j. k is the first j at which `draft_decision` of that state
        drafts (it pays, or a probe is due); j is scanned up to PLAIN_HORIZON, beyond which k is the probe's step,
        or PLAIN_HORIZON when drafting pays at the limit. Equal to calling `draft_decision` and `update` once per
        step (test), at one decision per stretch instead of one per step: the steps in between run no selector work
        (the rounds replay AR's plain step). cost_ar: [batch].
        """
        device = self.tokens.device
        f, d = self.forgetting, self.draft_forgetting
        cost_ar = cost_ar.float()
        j = torch.arange(self.PLAIN_HORIZON, device=device, dtype=torch.float32)  # [J]
        weight = self.spec_weight.clamp(min=1e-12)
        spec_cost = self.spec_latency / weight  # [batch]: the same at every j
        spec_gain = self._spec_gain(d ** j)  # [batch, J]: the emitted/G ratio moves towards its prior as sums decay
        # a batch's rows: each plain step brings the roomiest row's end one token nearer
        spec_gain = self._worth(spec_gain, (self.rows_left[:, None] - j - 1).clamp(min=1.0))
        pays = should_draft(spec_gain, spec_cost[:, None], 1.0 / cost_ar[:, None], cost_ar[:, None])  # [batch, J]
        stretch = self._stretch(spec_cost, cost_ar)  # [batch]: the same at every j
        due = (self.ar_streak[:, None] + j.long()) >= stretch[:, None]  # a probe is due at step j
        never = (self.spec_weight == 0)[:, None]
        # a forced draft still in flight (self.forced) blocks forcing at j = 0 only: j > 0 means no decision fired
        free = torch.ones_like(due)
        free[:, 0] = ~self.forced
        early = self._early(torch.zeros_like(self.forced))[:, None].expand_as(due).clone()  # the first rounds
        early[:, 0] = self._early(self.forced)
        fires = pays | ((never | due) & free) | early  # [batch, J]
        # the first j that fires, PLAIN_HORIZON if none: the steps before the first fire, counted. (Not a min over
        # where(fires, j, J): inductor's Triton code for that persistent min of int64 asked iinfo of a float at
        # batch > 1 on the H200 (run 88) and the decision ran eagerly; a count's identity is 0, which it takes.)
        first = (fires.long().cumsum(-1) == 0).sum(-1)  # [batch]
        limit_gain = self._spec_gain(0.0)  # the ratio at its limit, the batch's end PLAIN_HORIZON steps nearer
        limit_gain = self._worth(limit_gain, (self.rows_left - self.PLAIN_HORIZON).clamp(min=1.0))
        beyond_pays = should_draft(limit_gain, spec_cost, 1.0 / cost_ar, cost_ar)
        probe_at = (stretch.long() - self.ar_streak).clamp(min=1)  # the probe's step when none fired in the scan
        beyond = torch.where(beyond_pays, torch.full_like(probe_at, self.PLAIN_HORIZON), probe_at)
        k = torch.where(first < self.PLAIN_HORIZON, first, beyond.clamp(min=self.PLAIN_HORIZON))
        at = first.clamp(max=self.PLAIN_HORIZON - 1).view(-1, 1)
        forced = ((((never | due) & free) | early) & ~pays).gather(1, at).squeeze(1)  # the draft at k is forced
        self.forced.copy_(torch.where(first < self.PLAIN_HORIZON, forced, ~beyond_pays))
        # advance past this step and the k to come: n = k + 1 plain updates
        n = (k + 1).float()
        # f^n and Σ_{i<n} f^i from log f in double precision: with f near 1, f rounded to fp32 put (1 - f^n) / (1 - f)
        # off by 4e-4 (f = 0.99995)
        log_f = math.log(f)
        decay_n = torch.exp(n * log_f)
        partial_n = n if f == 1.0 else -torch.expm1(n * log_f) / (1.0 - f)
        self.tokens.mul_(decay_n).add_(partial_n)
        self.latency.mul_(decay_n).add_(partial_n * cost_ar)
        self._decay_spec(d ** n)
        self.ar_streak.add_(k + 1)
        return k
