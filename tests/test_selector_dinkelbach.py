"""Dinkelbach length selection: converges to the pooled-throughput optimum, beats per-round ratio maximisation,
and switches speculation off (and back on) through the AR option."""
import itertools

import pytest
import torch

from hybridspec_hf.selector import (
    HybridSpec,
    LatencyModel,
    PerRoundRatio,
    expected_tokens,
    select_length,
)
from hybridspec_hf.selector.length_rules import INFORMED_ROUNDS

B = 16
W = torch.arange(B, dtype=torch.float64)  # w - 1
COST = (10.0 + W + 0.1 * W ** 2) * 1e-3  # C(w) seconds: fixed round overhead + convex verification growth
I = torch.arange(1, B, dtype=torch.float64)
SURVIVAL = {"easy": 0.98 ** I, "hard": 0.3 ** I}  # two round types: p̂_i = c^i
FREQ = {"easy": 0.2, "hard": 0.8}


def latency_model(cost=COST, cost_ar=1.0):
    return LatencyModel(cost=cost.float()[None], cost_ar=torch.tensor([cost_ar]), context_lens=torch.tensor([1024]))


def pooled(lengths: dict) -> float:
    """E[G]/E[C] of a policy giving each round type a fixed w."""
    gain = sum(FREQ[k] * float(expected_tokens(SURVIVAL[k][None])[0, lengths[k] - 1]) for k in FREQ)
    cost = sum(FREQ[k] * float(COST[lengths[k] - 1]) for k in FREQ)
    return gain / cost


def brute_force_optimum():
    best = max(itertools.product(range(1, B + 1), repeat=2), key=lambda ws: pooled(dict(zip(FREQ, ws))))
    return dict(zip(FREQ, best))


def ratio_lengths():
    return {k: int((expected_tokens(SURVIVAL[k][None])[0] / COST).argmax()) + 1 for k in FREQ}


def test_pooled_optimum_beats_per_round_ratio_on_the_constructed_case():
    optimum, ratio = brute_force_optimum(), ratio_lengths()
    assert optimum == {"easy": 14, "hard": 2} and ratio == {"easy": 8, "hard": 2}
    assert pooled(ratio) < 0.93 * pooled(optimum)  # the per-round ratio rule loses > 7% of throughput here


def test_exact_dinkelbach_iteration_converges_to_the_brute_force_optimum():
    """ρ <- E[G]/E[C] of the policy argmax_w G - ρC: reaches the optimum in a few iterations from the AR price."""
    rho, optimum = 1 / 10e-3, brute_force_optimum()
    for _ in range(5):
        policy = {k: int(select_length(SURVIVAL[k][None], COST, rho)[0]) for k in FREQ}
        rho = pooled(policy)
    assert policy == optimum
    assert abs(rho - pooled(optimum)) < 1e-9 * rho


def run_rounds(selector, types, uniforms, measured: bool):
    """Simulate rounds; returns (Σ emitted tokens / Σ latency, chosen w per type in the last rounds)."""
    tokens = latency = 0.0
    last = {}
    for kind, u in zip(types, uniforms):
        survival = SURVIVAL[kind][None].float()
        w = selector.choose(survival, 1024)
        c = SURVIVAL[kind][0]  # conditional acceptance, constant per type
        accepted = torch.minimum((u < c).long().cumprod(-1).sum(-1), w - 1)
        emitted = accepted + 1 if measured else expected_tokens(survival)[0, w - 1]
        selector.observe(w, emitted, COST[w - 1].float())
        tokens, latency = tokens + float(emitted[0]), latency + float(COST[w[0] - 1])
        last[kind] = int(w[0])
    return tokens / latency, last


def test_dinkelbach_rounds_converge_to_the_pooled_optimum():
    """Deterministic cycle (1 easy, 4 hard), predicted mode: ρ -> ρ* within 1%, the per-type lengths are optimal."""
    selector = HybridSpec(latency_model(), routing_correction=False, rho_source="predicted", forgetting=0.99)
    types = ["easy", "hard", "hard", "hard", "hard"] * 200
    _, last = run_rounds(selector, types, torch.zeros(len(types), 1, B - 1), measured=False)
    optimum = brute_force_optimum()
    assert last == optimum
    assert abs(float(selector.rho[0]) / pooled(optimum) - 1) < 0.01


def test_dinkelbach_beats_the_ratio_selector_on_sampled_rounds():
    """Random types, sampled acceptance, measured ρ (the default): HybridSpec's realised throughput is within 3% of
    the optimum and ≥ 5% above the per-round-ratio selector on the same rounds (common random numbers)."""
    g = torch.Generator().manual_seed(0)
    n = 3000
    types = ["easy" if x < FREQ["easy"] else "hard" for x in torch.rand(n, generator=g).tolist()]
    uniforms = torch.rand(n, 1, B - 1, generator=g)
    hybrid, _ = run_rounds(HybridSpec(latency_model(), routing_correction=False), types, uniforms, measured=True)
    ratio, _ = run_rounds(PerRoundRatio(latency_model()), types, uniforms, measured=True)
    optimum = pooled(brute_force_optimum())
    assert hybrid > 0.97 * optimum, (hybrid, optimum)
    assert hybrid > 1.05 * ratio, (hybrid, ratio)


def test_speculation_switches_off_when_it_does_not_pay_and_back_on_after_a_probe():
    """Drafting costs 10 ms a round, an AR step 6 ms. Useless drafts -> AR with one probe every 16 AR rounds (the
    probes' share of time not limited: probe_share=1); good drafts again -> drafting resumes at the next probe and
    stays on."""
    selector = HybridSpec(latency_model(cost_ar=6e-3), routing_correction=False, probe_every=16, probe_share=1.0)

    def round_(survival_rate):
        draft = bool(selector.should_draft(1024)[0])
        if draft:
            survival = (survival_rate ** I)[None].float()
            w = selector.choose(survival, 1024)
            emitted = expected_tokens(survival)[0, w - 1].round()
            latency = COST[w - 1].float()
        else:
            w, emitted, latency = torch.ones(1, dtype=torch.long), torch.ones(1), torch.tensor([6e-3])
        selector.observe(w, emitted, latency, drafted=draft)
        return draft

    bad = [round_(0.02) for _ in range(100)]
    assert all(bad[:INFORMED_ROUNDS]) and not all(bad[:5])  # tries speculation first, gives up quickly
    assert 4 <= sum(bad[20:]) <= 6  # 80 rounds: only the probes draft (every 17th round)
    good = [round_(0.97) for _ in range(60)]
    first = good.index(True)
    assert first <= 17 and all(good[first:])


def test_one_unlucky_round_does_not_switch_off_drafting_that_the_drafts_say_pays():
    """Rounds whose drafts the estimator trusts (p̂ = 0.95^i) but that emitted few tokens. The first INFORMED_ROUNDS
    (3) are drafted whatever they emit (one round decides nothing); then, counted by their emitted tokens alone
    (trust_tokens=0), the speculative average says stop (1-2 tokens in C(w) against 1 in C_ar); with trust in the
    drafts' G(w) drafting goes on, and a longer run of such rounds still switches it off (the emitted tokens
    outweigh the trust)."""
    survival = (0.95 ** I)[None].float()

    def drafts_after(trust, emitted_tokens):
        selector = HybridSpec(latency_model(cost_ar=20e-3), routing_correction=False, trust_tokens=trust)
        for emitted in emitted_tokens:
            selector.should_draft(1024)
            w = selector.choose(survival, 1024)
            selector.observe(w, torch.tensor([emitted]), COST[w - 1].float(), drafted=True)
        return bool(selector.should_draft(1024)[0])

    assert drafts_after(0.0, [1.0]) and drafts_after(0.0, [1.0] * 2)  # the stream's first rounds
    assert not drafts_after(0.0, [1.0] * 3) and not drafts_after(0.0, [1.0, 2.0, 2.0])
    assert drafts_after(4.0, [1.0, 2.0, 2.0])
    assert not drafts_after(4.0, [1.0] * 4)
    assert drafts_after(4.0, [6.0] * 4) and drafts_after(0.0, [6.0] * 4)  # drafts that deliver: both draft
    with pytest.raises(ValueError, match="trust_tokens"):
        HybridSpec(latency_model(), trust_tokens=-1.0)


def test_probes_take_at_most_their_share_of_the_plain_steps_time():
    """Where a speculative round costs 5x a plain step (a batch's rounds), useless drafts -> probes far enough apart
    that their extra time stays within probe_share of the plain steps' time; the stretch follows the measured costs
    (draft_price "measured"; 0.03: (30 - 6) / (0.03 * 6) = 134 plain steps between probes), and at most probe_every apart where probes are
    cheap."""
    def plain_rounds(selector, spec_ms, ar_ms, rounds):
        drafted = []
        for _ in range(rounds):
            draft = bool(selector.should_draft(1024)[0])
            if draft:
                survival = (0.02 ** I)[None].float()
                w = selector.choose(survival, 1024)
                emitted, latency = torch.ones(1), torch.tensor([spec_ms * 1e-3])
            else:
                w, emitted, latency = torch.ones(1, dtype=torch.long), torch.ones(1), torch.tensor([ar_ms * 1e-3])
            selector.observe(w, emitted, latency, drafted=draft)
            drafted.append(draft)
        return drafted

    dear = plain_rounds(HybridSpec(latency_model(cost=COST * 3, cost_ar=6e-3), routing_correction=False,
                                   probe_share=0.03, draft_price="measured"), 30.0, 6.0, 600)
    probes = [i for i, d in enumerate(dear) if d][INFORMED_ROUNDS:]  # after the first (always speculative) rounds
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps and all(gap == 134 for gap in gaps), gaps
    extra = len(probes) * (30.0 - 6.0)
    assert extra <= 0.03 * 6.0 * (600 - len(probes)) * 1.05
    cheap = plain_rounds(HybridSpec(latency_model(cost_ar=6e-3), routing_correction=False, draft_price="measured"),
                         6.1, 6.0, 200)
    probes = [i for i, d in enumerate(cheap) if d][INFORMED_ROUNDS:]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps and all(gap == 16 for gap in gaps), gaps


def _plain_steps_one_by_one(throughput, cost_ar, limit=4000):
    """The per-step rule: draft_decision, then a plain update, until it drafts: (plain steps after this one, the
    state after them)."""
    k = 0
    while True:
        draft = throughput.draft_decision(cost_ar)
        throughput.update(torch.ones_like(cost_ar), cost_ar, torch.zeros_like(draft))
        if bool(draft[0]) or k == limit:
            return k
        k += 1


def test_plain_run_takes_the_per_step_decisions_at_once():
    """`plain_run` = `draft_decision` + `update` repeated until drafting: the same count of plain steps and the same
    state after them (ρ's sums, the speculative averages, the streak and the forced flag), for random states
    (speculation that pays, does not, or pays only once ρ has fallen; probes due at once or far off; a forced draft
    in flight; no speculative round yet)."""
    from hybridspec_hf.selector.length import DinkelbachThroughput

    generator = torch.Generator().manual_seed(3)
    checked = 0
    for case in range(300):
        u = torch.rand(9, generator=generator, dtype=torch.float64)
        throughput = DinkelbachThroughput(forgetting=float(0.9 + 0.1 * u[0]), probe_every=int(1 + 30 * u[1]),
                                          probe_share=float(0.005 + 0.2 * u[2]),
                                          trust_tokens=0.0 if u[7] < 0.2 else float(10 * u[7]),
                                          first_rounds=1 + 2 * (case % 2),
                                          explore=0.0 if u[8] < 0.3 else float(u[8]))
        cost_ar = torch.tensor([3e-3 * (0.5 + float(u[3]))])
        throughput.reset(cost_ar, 1, "cpu")
        for _ in range(int(10 * u[4])):  # some history: speculative rounds of random yield and cost
            spec = torch.rand(1, generator=generator) < 0.6
            tokens = 1 + 4 * torch.rand(1, generator=generator) * spec
            # plain steps off their calibrated cost too: ρ = 1/C_ar exactly would put every decision on a tie
            latency = cost_ar * (0.8 + 0.4 * torch.rand(1, generator=generator) + 3 * torch.rand(1, generator=generator) * spec)
            predicted = 1 + 6 * torch.rand(1, generator=generator) * spec  # the drafts' G(w), off the emitted
            throughput.update(tokens, latency, spec, expected=predicted)
        throughput.forced.fill_(bool(u[5] < 0.3))
        if u[6] < 0.1:  # no speculative round seen (the streak and ρ's sums as they were)
            for stat in (throughput.spec_tokens, throughput.spec_expected, throughput.spec_latency,
                         throughput.spec_weight):
                stat.zero_()
        twin = DinkelbachThroughput(throughput.forgetting, throughput.draft_forgetting, throughput.probe_every,
                                    throughput.prior_rounds, throughput.probe_share, throughput.trust_tokens,
                                    first_rounds=throughput.first_rounds, explore=throughput.explore)
        twin.reset(cost_ar, 1, "cpu")
        for name in ("tokens", "latency", "spec_tokens", "spec_expected", "spec_latency", "spec_weight", "ar_streak",
                     "forced", "spec_rounds", "spec_squares"):
            getattr(twin, name).copy_(getattr(throughput, name))
        expected = _plain_steps_one_by_one(twin, cost_ar)
        got = throughput.plain_run(cost_ar)
        if expected >= throughput.PLAIN_HORIZON:  # beyond the scan: the probe's step, or the horizon when it pays
            assert int(got[0]) >= throughput.PLAIN_HORIZON
            continue
        checked += 1
        assert int(got[0]) == expected, case
        for name in ("tokens", "latency", "spec_tokens", "spec_expected", "spec_latency", "spec_weight",
                     "spec_squares"):
            # fp32 sums over ≤ 256 steps
            torch.testing.assert_close(getattr(throughput, name), getattr(twin, name), rtol=1e-4, atol=1e-9,
                                       msg=lambda m, name=name: f"case {case}, {name}: {m}")
        for name in ("ar_streak", "forced"):
            assert torch.equal(getattr(throughput, name), getattr(twin, name)), (case, name)
    assert checked > 200


def test_plain_run_of_the_selector_drafts_again_when_speculation_pays():
    """HybridSpec.plain_run at a plain step: useless drafts -> the next probe's distance; good ones -> draft next."""
    selector = HybridSpec(latency_model(cost_ar=6e-3), routing_correction=False, probe_every=16, probe_share=1.0)
    for _ in range(INFORMED_ROUNDS):  # the stream's first rounds, drafted whatever they yield
        selector.should_draft(1024)
        selector.choose((0.02 ** I)[None].float(), 1024)
        selector.observe(torch.ones(1, dtype=torch.long), torch.ones(1), torch.tensor([10e-3]), drafted=True)
    assert int(selector.plain_run(1024)[0]) == 16  # this step and 16 more, then the probe (every 17th round)
    selector.choose((0.97 ** I)[None].float(), 1024)
    selector.observe(torch.full((1,), 16), torch.full((1,), 14.0), torch.tensor([25e-3]), drafted=True)
    assert int(selector.plain_run(1024)[0]) == 0


def test_a_batch_round_is_worth_its_mean_discounted_for_the_rows_spread():
    """batch_row_tokens: one row, or rows that agree, are worth their mean; rows that spread are worth less, and less
    as the roomiest row's end nears; the discount's c_n is E[max of n standard normals] (Blom), checked by sampling;
    rows that are not live count for nothing."""
    from hybridspec_hf.selector.length import batch_row_stats, batch_row_tokens, batch_rows_left, spread_discount

    one = batch_row_tokens(torch.tensor([5]), torch.tensor([1]), torch.tensor([100]))
    assert torch.allclose(one, torch.tensor([5.0]))
    agree = batch_row_tokens(torch.full((8,), 4), torch.ones(8, dtype=torch.long), torch.full((8,), 100))
    assert torch.allclose(agree, torch.tensor([4.0]))
    gained = torch.tensor([1, 7, 1, 7, 1, 7, 1, 7])
    live = torch.ones(8, dtype=torch.long)
    far = float(batch_row_tokens(gained, live, torch.full((8,), 120)))
    near = float(batch_row_tokens(gained, live, torch.full((8,), 6)))
    n, spread, mean = 8.0, 3.0, 4.0
    c = float(torch.randn(200_000, 8, generator=torch.Generator().manual_seed(0)).max(1).values.mean())
    assert abs(far - mean / (1 + c * spread / (120 * mean) ** 0.5)) < 0.02 * mean  # Blom's c_8 within 2 %
    assert near < far < mean
    # a row that ended (live 0) neither counts in the mean nor in the spread
    ended = batch_row_tokens(torch.tensor([4, 4, 15]), torch.tensor([1, 1, 0]), torch.tensor([50, 50, 50]))
    assert torch.allclose(ended, torch.tensor([4.0]))
    # the same value from its parts, as the selector keeps them: μ and σ of the round, n and T of the decision
    mean_, spread_ = batch_row_stats(gained, live)
    rows, left = batch_rows_left(live, torch.full((8,), 120))
    assert torch.allclose(mean_, torch.tensor([mean])) and torch.allclose(spread_, torch.tensor([spread]))
    assert (float(rows), float(left)) == (8.0, 120.0)
    assert torch.allclose(mean_ * spread_discount(mean_, spread_, rows, left), torch.tensor([far]))


def test_a_new_call_keeps_the_earlier_calls_evidence_and_decides_its_first_round():
    """HybridSpec.restart with carry_rounds: the streams keep the speculative rounds' means (at most carry_rounds of
    weight), so the call's first plain_run decides: drafting that paid before drafts at once (k = 0), drafting that
    did not waits for its probe; carry_rounds=0 starts without evidence (the first round is drafted unasked)."""
    survival = (0.95 ** I)[None].float()
    cost_ar = 6e-3
    context = torch.tensor([1024])

    def after_a_call(emitted, carry):
        selector = HybridSpec(latency_model(cost_ar=cost_ar), routing_correction=False, carry_rounds=carry)
        selector.restart(context)
        assert not bool(selector.informed()[0])  # the first call knows nothing
        for _ in range(30):
            selector.should_draft(context)
            w = selector.choose(survival, context)
            selector.observe(w, torch.tensor([emitted]), COST[w - 1].float(), drafted=True)
        selector.restart(context)
        return selector

    paid = after_a_call(8.0, 8.0)
    assert bool(paid.informed()[0]) and float(paid.throughput.spec_weight[0]) <= 8.0 + 1e-4
    assert int(paid.plain_run(context)[0]) == 0
    lost = after_a_call(1.0, 8.0)
    assert bool(lost.informed()[0]) and int(lost.plain_run(context)[0]) > 0
    fresh = after_a_call(8.0, 0.0)
    assert not bool(fresh.informed()[0]) and bool(fresh.throughput.forced[0])
    with pytest.raises(ValueError, match="carry_rounds"):
        HybridSpec(latency_model(), carry_rounds=-1.0)


def test_a_probe_is_priced_net_of_the_plain_steps_its_tokens_spare():
    """Rounds that emit 2 tokens in 15 ms against plain steps of 6 ms: plain steps (2/15 < 1/6). A probe's extra
    time is 15 - 2 · 6 = 3 ms ("net", the default), so at probe_share 1 % it comes after 3 / 0.06 = 50 plain steps;
    priced as one plain step spared ("gross") after (15 - 6) / 0.06 = 150; where the rounds emit one token the two
    agree (150)."""
    def stretch(emitted, **options):
        selector = HybridSpec(latency_model(cost=COST * 3, cost_ar=6e-3), routing_correction=False,
                              probe_share=0.01, carry_rounds=0.0, draft_price="measured", **options)
        selector.should_draft(1024)
        survival = (0.02 ** I)[None].float()  # drafts that predict little: the plain share, not the hopeful one
        for _ in range(INFORMED_ROUNDS):
            w = selector.choose(survival, 1024)
            selector.observe(w, torch.tensor([float(emitted)]), torch.tensor([15e-3]), drafted=True)
        return int(selector.plain_run(1024)[0])

    assert stretch(2) == 50 and stretch(2, probe_price="gross") == 150
    assert stretch(1) == stretch(1, probe_price="gross") == 150
    with pytest.raises(ValueError, match="probe_price"):
        HybridSpec(latency_model(), probe_price="half")


def test_probes_come_sooner_while_the_drafts_predict_that_drafting_pays():
    """Rounds whose drafts predict more tokens than a plain step would make in their time (p̂ = 0.95^i) but emit one:
    plain steps, with probes every hopeful_share-limited stretch ((15 - 6) / (0.04 * 6) -> 38) instead of the
    probe_share one (150); drafts that predict little (p̂ = 0.02^i) keep the long one."""
    def stretch(survival_rate, hopeful, spread=None):
        selector = HybridSpec(latency_model(cost=COST * 3, cost_ar=6e-3), routing_correction=False,
                              probe_share=0.01, hopeful_share=hopeful, carry_rounds=0.0, draft_price="measured")
        selector.should_draft(1024)
        if spread is not None:  # a batch of 8 rows, 10 tokens left to the roomiest
            selector.batch_state(torch.tensor([8.0]), torch.tensor([10.0]))
        survival = (survival_rate ** I)[None].float()
        w = selector.choose(survival, 1024)
        for _ in range(INFORMED_ROUNDS):  # the stream's first rounds, drafted whatever they yield (w as the first's)
            selector.choose(survival, 1024)
            # G(4) = 3.7 in 15 ms: > 1 in 6
            selector.observe(w, torch.ones(1), torch.tensor([15e-3]), drafted=True,
                             spread=None if spread is None else torch.tensor([spread]))
        return int(selector.plain_run(1024)[0])

    long, hopeful, unhopeful = stretch(0.95, 0.01), stretch(0.95, 0.04), stretch(0.02, 0.04)
    assert (long, hopeful, unhopeful) == (150, 38, 150)
    # a batch's rows that spread: G is discounted as the emitted tokens are (σ = 3: 3.7 · 0.59 in 15 ms < 1 in 6;
    # σ = 0.5: 3.7 · 0.89 > 1 in 6)
    assert stretch(0.95, 0.04, spread=3.0) == 150 and stretch(0.95, 0.04, spread=0.5) == 38
    with pytest.raises(ValueError, match="hopeful_share"):
        HybridSpec(latency_model(), probe_share=0.01, hopeful_share=2.0)


def test_a_probe_stretch_longer_than_a_call_still_ends_in_its_probe():
    """The plain steps since the last speculative round carry into the next call with the evidence (restart with
    carry_rounds): calls shorter than the probe's stretch still probe once the stretch has passed over them, instead
    of restarting it with every call and never drafting again (the tiny pair on the H200, gpu_rounds_tiny_pair11)."""
    survival = (0.95 ** I)[None].float()
    context = torch.tensor([1024])
    selector = HybridSpec(latency_model(cost_ar=6e-3), routing_correction=False, carry_rounds=8.0)
    selector.restart(context)
    for _ in range(30):  # drafting loses: one token a round
        selector.should_draft(context)
        w = selector.choose(survival, context)
        selector.observe(w, torch.tensor([1.0]), COST[w - 1].float(), drafted=True)
    call_length, calls, first = 20, 0, None
    while calls < 50:
        selector.restart(context)
        calls += 1
        k = int(selector.plain_run(context)[0])  # the call's first step is plain, k more come before a draft
        first = k + 1 if first is None else first
        if k + 1 < call_length:  # a draft inside this call
            break
    assert first > call_length  # the stretch outlasts a call
    assert 1 < calls <= first // call_length + 1 and bool(selector.throughput.forced[0])  # its probe, in time


def test_a_batch_discounts_its_rows_spread_at_the_decision_not_at_the_round():
    """Batch rounds' evidence keeps the rows' mean tokens and spread; the discount for the straggler is taken when
    deciding, with that moment's live rows and room: rounds observed at a short call's end (T = 6 tokens left) say
    "draft" to a long call (T = 200), and the same evidence near an end says "plain"; one row is never discounted.
    ρ counts a batch round's tokens discounted at the round's own batch."""
    survival = (0.9 ** I)[None].float()
    cost_ar = 6e-3
    context = torch.tensor([1024])
    selector = HybridSpec(latency_model(cost=COST, cost_ar=cost_ar), routing_correction=False, carry_rounds=8.0)
    selector.restart(context)
    selector.batch_state(torch.tensor([16.0]), torch.tensor([6.0]))
    for _ in range(6):  # 8 tokens per row, spread 4, in C(w) ≈ 29 ms (w 9-12): 8 / 29 > 1 / 6 at its mean
        selector.should_draft(context)
        w = selector.choose(survival, context)
        selector.observe(w, torch.tensor([8.0]), COST[w - 1].float(), drafted=True, spread=torch.tensor([4.0]))
    throughput = selector.throughput
    assert float(throughput.spec_tokens[0] / throughput.spec_weight[0]) == pytest.approx(8.0)  # μ kept whole
    # ρ's tokens discounted at the rounds' batch (16 rows, T = 6: 8 · 0.49)
    assert float(throughput.tokens[0]) < 4.0 + 6 * 8.0 * 0.5
    selector.restart(context)
    assert int(selector.plain_run(context)[0]) > 0  # still near an end: the straggler loses
    selector.restart(context)
    selector.batch_state(torch.tensor([16.0]), torch.tensor([200.0]))
    assert int(selector.plain_run(context)[0]) == 0  # a long call ahead: drafting pays
    selector.restart(context)
    selector.batch_state(torch.tensor([1.0]), torch.tensor([6.0]))
    assert int(selector.plain_run(context)[0]) == 0  # one row: no straggler


@pytest.mark.parametrize("floor", [True, False])
def test_evidence_after_a_long_plain_stretch_keeps_its_means_and_its_decision(floor, monkeypatch):
    """The speculative sums decay over plain steps (draft_forgetting) but not below EVIDENCE_FLOOR rounds of weight:
    their means, and the draft decision read from them, are what they were. Without the floor (the weight under the
    divisions' 1e-12 clamp after ≈ 600 plain steps) the batch's spread discount vanished and a new call drafted
    rounds its evidence said lose (selector_sim, batch 16 medium)."""
    from hybridspec_hf.selector.length import DinkelbachThroughput

    if not floor:
        monkeypatch.setattr(DinkelbachThroughput, "EVIDENCE_FLOOR", 0.0)
    cost_ar, spec_cost = torch.tensor([11.5e-3]), torch.tensor([38.4e-3])
    rows, left = torch.tensor([16.0]), torch.tensor([127.0])
    state = DinkelbachThroughput()
    state.reset(cost_ar, 1, "cpu")
    state.set_batch(rows, left)
    for _ in range(4):  # 3.6 tokens per row, σ = 3: above a plain step's 3.34 undiscounted, below it discounted
        state.update(torch.tensor([3.6]), spec_cost, torch.tensor([True]), spread=torch.tensor([3.0]))
    state.draft_decision(cost_ar)  # (clears the first round's forced flag)
    before = bool(state.draft_decision(cost_ar)[0])
    for _ in range(700):
        state.update(torch.tensor([1.0]), cost_ar, torch.tensor([False]))
    weight = float(state.spec_weight[0])
    state.restart(cost_ar, carry=8.0, informed_rounds=3)  # a new call
    state.set_batch(rows, left)
    assert int(state.ar_streak[0]) == 700  # the probe's streak spans calls with the evidence: a probe is due
    assert int(state.plain_run(cost_ar)[0]) == 0 and bool(state.forced[0]) == floor  # (no floor: it "pays")
    state.ar_streak.zero_()  # the evidence's own decision, with no probe due
    k = int(state.plain_run(cost_ar)[0])
    state.restart(cost_ar, carry=8.0, informed_rounds=3)
    state.set_batch(rows, left)
    state.ar_streak.zero_()
    after = bool(state.draft_decision(cost_ar)[0])
    assert not before
    if floor:
        assert weight == pytest.approx(DinkelbachThroughput.EVIDENCE_FLOOR, rel=1e-3)
        assert float(state.spec_tokens[0] / state.spec_weight[0]) == pytest.approx(3.6, rel=1e-3)
        assert not after and k > 0
    else:  # the bug the floor removes
        assert weight < 1e-12 and after and k == 0


def test_the_draft_decision_can_price_speculative_rounds_at_their_calibrated_cost():
    """A machine running slower than when it was calibrated: drafted rounds measured at 40 ms that C(4) prices at
    13.9 ms, 3 tokens each, against a plain step's calibrated 6 ms. "measured" compares 3 tokens in 40 ms with 1 in 6
    and steps plain; "calibrated" (the default) compares like with like (3 in 13.9 ms) and drafts. ρ takes the measured
    times either way."""
    def after_three_rounds(price):
        selector = HybridSpec(latency_model(cost_ar=6e-3), routing_correction=False, draft_price=price,
                              explore=0.0, carry_rounds=0.0)
        for _ in range(INFORMED_ROUNDS):
            selector.should_draft(1024)
            selector.choose((0.9 ** I)[None].float(), 1024)
            selector.observe(torch.full((1,), 4), torch.full((1,), 3.0), torch.tensor([40e-3]), drafted=True)
        return selector.rho.clone(), int(selector.plain_run(1024)[0])

    (measured, plain), (calibrated, drafts) = after_three_rounds("measured"), after_three_rounds("calibrated")
    assert plain > 0 and drafts == 0
    torch.testing.assert_close(measured, calibrated)
    with pytest.raises(ValueError, match="draft_price"):
        HybridSpec(latency_model(), draft_price="predicted")


def test_exploration_brings_drafting_back_sooner_after_rounds_that_spread():
    """Three early rounds below break-even (1.35 tokens in 15 ms against 1 in 6): without exploration the stream
    steps plain until the probe (115 steps); with it the bound mean + c·σ/√W, W fading with every plain step, drafts again
    well before; rounds that all yield the same (σ = 0) give it nothing to explore."""
    def stretch(yields, explore):
        selector = HybridSpec(latency_model(cost=COST * 3, cost_ar=6e-3), routing_correction=False,
                              probe_share=0.01, hopeful_share=0.01, carry_rounds=0.0, explore=explore,
                              draft_price="measured")
        selector.should_draft(1024)
        for tokens in yields:
            w = selector.choose((0.02 ** I)[None].float(), 1024)
            selector.observe(w, torch.tensor([float(tokens)]), torch.tensor([15e-3]), drafted=True)
        return int(selector.plain_run(1024)[0])

    # the probe priced net of the plain steps its mean 1.35 tokens spare: (15 - 1.35 · 6) / 0.06 -> 115 steps
    assert stretch([1, 1, 2], 0.0) == 115 and stretch([1, 1, 1], 0.5) == 150
    assert 0 < stretch([1, 1, 2], 0.5) < stretch([1, 1, 2], 0.25) < 115
    with pytest.raises(ValueError, match="explore"):
        HybridSpec(latency_model(), explore=-1.0)
