"""Context lookup (HybridSpecConfig.context_lookup): the proposal equals a plain-Python search, its survival table
fits counts, greedy output stays AR's and sampling the target's distribution while copied proposals are verified,
and every case it cannot serve is refused ("on") or reported ("auto")."""
import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_exactness import assert_same_as_ar, reference, run

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.drafter.lookup import context_lookup
from hybridspec_hf.selector import copy_signals, draft_signals
from hybridspec_hf.selector.lookup import LookupEstimator


def python_lookup(ids: list[int], block: int, low: int, high: int) -> tuple[int, list[int] | None]:
    """The definition, read literally: the longest n, its latest earlier occurrence, the tokens after it with the
    period they repeat with past the end."""
    length = len(ids)
    for n in range(min(high, length - 1), low - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if ids[start:start + n] == ids[length - n:]:
                begin = start + n
                return n, [ids[begin + k % (length - begin)] for k in range(block - 1)]
    return 0, None


@pytest.mark.parametrize("symbols", [2, 3, 6])
def test_the_proposal_is_the_latest_longest_match_continued_with_its_period(symbols):
    generator = torch.Generator().manual_seed(symbols)
    for length in (1, 2, 3, 5, 9, 40):
        ids = torch.randint(0, symbols, (16, length), generator=generator)
        proposal, n = context_lookup(ids, 8, 2, 4)
        for row in range(16):
            want_n, want = python_lookup(ids[row].tolist(), 8, 2, 4)
            assert int(n[row]) == want_n, (ids[row].tolist(), int(n[row]), want_n)
            if want is not None:
                assert proposal[row].tolist() == want


def test_a_loop_is_proposed_past_the_end_of_the_text():
    ids = torch.tensor([[7, 1, 2, 3, 1, 2, 3, 1, 2]])  # "3 1 2" last seen at 3-5, then "3 1 2" and around again
    proposal, n = context_lookup(ids, 8, 1, 3)
    assert int(n) == 3 and proposal[0].tolist() == [3, 1, 2, 3, 1, 2, 3]
    proposal, n = context_lookup(torch.tensor([[4, 5, 6]]), 4, 1, 2)
    assert int(n) == 0  # nothing earlier matches
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        context_lookup(ids, 8, 3, 2)
    with pytest.raises(ValueError, match="token ids"):
        context_lookup(ids[0], 8, 1, 2)


def test_the_table_fits_the_counts_and_round_trips(tmp_path):
    # n = 2: 40 proposals, half accept 3 copies, half 0; n = 3: every one accepts all 4 (block 5)
    n = torch.tensor([2] * 40 + [3] * 40 + [1] * 5)
    accepted = torch.tensor([3, 0] * 20 + [4] * 40 + [4] * 5)
    table = LookupEstimator.fit(n, accepted, block_size=5, min_ngram=2, max_ngram=3, pooling=1e-9)
    assert table.table[0].tolist() == pytest.approx([0.5, 0.5, 0.5, 0.0], abs=1e-6)
    assert table.table[1].tolist() == pytest.approx([1.0] * 4, abs=1e-6)
    survival = table.survival(torch.tensor([3, 0, 5, 2]))
    assert survival[1].sum() == 0 and survival[2].sum() == 0 and survival[3].tolist() == table.table[0].tolist()
    pooled = LookupEstimator.fit(n, accepted, block_size=5, min_ngram=2, max_ngram=4)  # n = 4 never seen: pooled
    assert 0 < float(pooled.table[2, 0]) < 1 and bool((pooled.table[:, 1:] <= pooled.table[:, :-1]).all())
    pooled.save(tmp_path / "t.json")
    assert torch.equal(LookupEstimator.load(tmp_path / "t.json").table, pooled.table)
    with pytest.raises(ValueError, match="non-increasing"):
        LookupEstimator(torch.tensor([[0.5, 0.9]]), 1, 1)
    with pytest.raises(ValueError, match="nothing to fit"):
        LookupEstimator.fit(torch.tensor([1]), torch.tensor([2]), 5, 2, 3)
    with pytest.raises(ValueError, match="one count per traced proposal"):
        LookupEstimator.fit(torch.tensor([2, 3]), torch.tensor([2]), 5, 2, 3)


def test_the_drafter_rates_copied_tokens_from_its_own_logits():
    """copy_signals: a token's probability and its gap to the top one, read with two gathers, equal the softmax's;
    where the copy is the draft, the drafts' own signals."""
    logits = torch.randn(2, 7, 50, generator=torch.Generator().manual_seed(0)) * 3
    signals = draft_signals(logits)
    drafts = logits.argmax(-1)
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    tokens[:, ::3] = drafts[:, ::3]  # some copies agree with the drafts
    rated = copy_signals(logits, signals, drafts, tokens)
    probs = logits.softmax(-1)
    want = probs.gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(rated["top1"], want, rtol=1e-5, atol=1e-7)
    same = tokens == drafts
    assert torch.equal(rated["margin"][same], signals["margin"][same])
    assert torch.allclose(rated["margin"][~same], (want - probs.amax(-1))[~same], rtol=1e-5, atol=1e-7)
    assert bool((rated["margin"][~same] <= 0).all()) and torch.equal(rated["entropy"], signals["entropy"])


def test_the_copy_survival_mixes_table_and_rating_and_its_weight_is_fitted(tmp_path):
    table = LookupEstimator(torch.tensor([[0.8, 0.6, 0.4], [0.9, 0.9, 0.8]]), 2, 3, table_weight=0.25)
    rating = torch.tensor([[0.4, 0.2, 0.0], [0.4, 0.2, 0.0], [1.0, 1.0, 1.0]])
    mixed = table.survival(torch.tensor([2, 3, 5]), rating)
    assert mixed[0].tolist() == pytest.approx([0.25 * 0.8 + 0.75 * 0.4, 0.25 * 0.6 + 0.75 * 0.2, 0.25 * 0.4])
    assert mixed[1].tolist() == pytest.approx([0.25 * 0.9 + 0.75 * 0.4, 0.25 * 0.9 + 0.75 * 0.2, 0.25 * 0.8])
    assert mixed[2].sum() == 0  # no proposal: nothing, whatever the rating
    assert torch.equal(table.survival(torch.tensor([3])), table.table[1:])  # no rating: the table alone
    table.save(tmp_path / "t.json")
    assert LookupEstimator.load(tmp_path / "t.json").table_weight == 0.25
    old = table.to_dict()
    del old["table_weight"]  # a file written before the rating existed reads as the table alone
    assert LookupEstimator.from_dict(old).table_weight == 1.0
    with pytest.raises(ValueError, match="table_weight"):
        LookupEstimator(table.table, 2, 3, table_weight=1.5)
    # fit: the table rates every copy alike (Σ 1.5 against the drafts' 1.0); the rating tells the copies that are
    # accepted (τ 4) from those that are not (τ 1, the drafts' τ 2): only a small table share keeps the bad ones out
    table_survival = torch.tensor([[0.5, 0.5, 0.5]]).repeat(8, 1)
    rating = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]).repeat(4, 1)
    tau_copy, tau_drafts = torch.tensor([4, 1] * 4), torch.tensor([2] * 8)
    weight = LookupEstimator.fit_table_weight(table_survival, rating, torch.ones(8), tau_copy, tau_drafts)
    assert weight == pytest.approx(0.6)  # the largest λ with 1.5·λ <= 1 (bad copies out) that keeps good ones in
    # a rating that says nothing: the table alone (ties go to the larger λ)
    flat = torch.full((8, 3), 0.1)
    assert LookupEstimator.fit_table_weight(table_survival, flat, torch.ones(8), tau_copy, tau_drafts) == 1.0


@pytest.mark.parametrize("table_weight", [1.0, 0.3])
def test_the_strategy_verifies_the_copy_where_its_mixed_estimate_wins(table_weight):
    """RoundStrategy.choose: the copy is verified iff Σ(λ·table + (1 - λ)·the drafter's rating of the copied tokens)
    exceeds the drafts' Σ p̂, and w0 is then chosen from the copy's survival."""
    from hybridspec_hf.generation.strategy import RoundStrategy

    target = make_target("qwen3_5_moe")
    drafter = make_drafter(target, 8)
    table = LookupEstimator(torch.linspace(0.9, 0.3, 7)[None].repeat(3, 1), 2, 4, table_weight=table_weight)
    settings = HybridSpecConfig(context_lookup="on", lookup_estimator=table, latency_model=flat_latency())
    strategy = RoundStrategy.build("hybridspec", settings, target, drafter, has_router=True)
    generator = torch.Generator().manual_seed(3)
    seen = set()
    for trial in range(40):
        logits = torch.randn(1, 7, VOCAB, generator=generator) * (0.5 + trial / 8)
        drafts = logits.argmax(-1)
        tokens = torch.where(torch.rand(1, 7, generator=generator) < 0.5, drafts,
                             torch.randint(0, VOCAB, (1, 7), generator=generator))
        ngram = torch.tensor([2 + trial % 4])  # 5: no proposal
        choice = strategy.choose(logits, 64, 8, lookup=(tokens, ngram, drafts))
        signals = draft_signals(logits)
        drafts_sum = strategy.estimator.survival(signals).sum()
        rating = strategy.estimator.survival(copy_signals(logits, signals, drafts, tokens))
        copy_sum = table.survival(ngram, rating if table_weight < 1 else None).sum()
        assert bool(choice.lookup) == bool(copy_sum > drafts_sum), trial
        seen.add(bool(choice.lookup))
    assert seen == {True, False}, "the trials never exercised one of the two outcomes"


def always_copy(block_size: int, low: int = 1, high: int = 4, table_weight: float = 1.0) -> LookupEstimator:
    """A table that rates every copy as certain: a match wins over the drafts (lookup rounds happen; always with
    table_weight 1, mostly with less: the drafter's rating of the copy then has a say)."""
    return LookupEstimator(torch.ones(high - low + 1, block_size - 1), low, high, table_weight)


def flat_latency(block_size: int = 8):
    """Rounds barely dearer than a plain step: a calibrated strategy drafts (whatever calibration other tests left)."""
    from hybridspec_hf.selector import LatencyModel

    return LatencyModel(cost=torch.linspace(1.0, 1.1, block_size)[None], cost_ar=torch.tensor([0.9]),
                        context_lens=torch.tensor([64]))


def repetitive_prompt(seed: int, length: int = 24) -> torch.Tensor:
    pattern = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(seed))
    return pattern.repeat(length // 5 + 1)[:length].view(1, -1)


@pytest.mark.parametrize("name,table_weight", [("qwen3_5_moe", 1.0), ("qwen3_next", 1.0), ("qwen3_5_moe", 0.3)])
@pytest.mark.parametrize("strategy", ["hybridspec", "confidence"])
def test_greedy_output_stays_ar_while_copies_are_verified(name, table_weight, strategy, fp64_gdn):
    target = make_target(name)
    used = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        ar = reference(target, prompt, 30)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.5)
        settings = HybridSpecConfig(context_lookup="on", lookup_estimator=always_copy(8, table_weight=table_weight),
                                    latency_model=flat_latency())
        out = run(target, prompt, drafter, strategy, 30, hybridspec_config=settings)
        assert_same_as_ar(out, ar)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.context_lookup and telemetry.context_lookup_off is None
        used += sum(bool(r.lookup) for r in telemetry.rounds)
        assert f"{sum(bool(r.lookup) for r in telemetry.rounds)} verifying a context-lookup copy" in telemetry.summary()
    assert used > 0, "no round verified a copied proposal"


def exact_last_two(target, prompt, top_k: int) -> dict[tuple[int, int], float]:
    """P(the 2nd and 3rd sampled tokens) under top-k sampling at temperature 1, summed over the 1st: exact."""
    def step(ids):
        with torch.no_grad():
            logits = target(ids).logits[0, -1].double()
        values, index = logits.topk(top_k)
        return index.tolist(), values.softmax(-1).tolist()

    joint = {}
    for t1, p1 in zip(*step(prompt)):
        one = torch.cat([prompt, torch.tensor([[t1]])], 1)
        for t2, p2 in zip(*step(one)):
            for t3, p3 in zip(*step(torch.cat([one, torch.tensor([[t2]])], 1))):
                joint[(t2, t3)] = joint.get((t2, t3), 0.0) + p1 * p2 * p3
    return joint


@pytest.mark.parametrize("shape,strategy,table_weight", [("max", "confidence", 1.0), ("exact", "confidence", 1.0),
                                                         ("max", "hybridspec", 0.3)])
def test_resident_rounds_verify_copies_and_stay_ar(shape, strategy, table_weight):
    """GPU-resident rounds (here on the CPU, uncaptured: the same graphs' code) make each round's proposal on the
    device from their token buffer; greedy output stays AR's, rounds verify copies, and the per-round telemetry says
    which."""
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    used = 0
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        ar = reference(target, prompt, 30)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.5).float()
        settings = HybridSpecConfig(context_lookup="on", lookup_estimator=always_copy(8, table_weight=table_weight),
                                    cuda_graphs="on", verify_shape=shape, latency_model=flat_latency())
        out = run(target, prompt, drafter, strategy, 30, hybridspec_config=settings)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.path == "static_eager" and telemetry.context_lookup
        assert torch.equal(out, ar.sequences)
        assert all(r.lookup is not None for r in telemetry.rounds if r.drafted)
        used += sum(bool(r.lookup) for r in telemetry.rounds)
    assert used > 0, "no resident round verified a copied proposal"


def test_sampling_with_copies_keeps_the_target_distribution():
    """400 sampled continuations against the exact distribution of their last two tokens (a chi-square test on
    the cells expected >= 5 times, the rest pooled: p > 1e-3), while copies are verified."""
    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    prompt = repetitive_prompt(4, 10)
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=12)
    drafter = make_drafter(target, 8, greedy, error_rate=0.5).float()
    settings = HybridSpecConfig(context_lookup="on", lookup_estimator=always_copy(8))
    draws, copied, rounds = 400, 0, 0
    torch.manual_seed(0)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(draws):
        out = target.generate(prompt, assistant_model=drafter, generation_strategy="confidence",
                              hybridspec_config=settings, do_sample=True, temperature=1.0, top_k=4, max_new_tokens=3)
        key = tuple(out[0, -2:].tolist())
        counts[key] = counts.get(key, 0) + 1
        telemetry = hybridspec_hf.get_telemetry(target)
        copied += sum(bool(r.lookup) for r in telemetry.rounds)
        rounds += len(telemetry.rounds)
    assert copied > rounds // 10, f"only {copied} of {rounds} rounds verified a copy"
    exact = exact_last_two(target, prompt, 4)
    assert set(counts) <= set(exact), "a pair outside the top-4 support was sampled"
    big = [k for k, p in exact.items() if p * draws >= 5]
    assert len(big) >= 4
    observed = [counts.get(k, 0) for k in big]
    expected = [exact[k] * draws for k in big]
    rest_observed, rest_expected = draws - sum(observed), draws * (1 - sum(exact[k] for k in big))
    if rest_expected >= 5:  # the small cells pooled into one of their own
        observed, expected = observed + [rest_observed], expected + [rest_expected]
    else:  # too few (or none: every pair is a big cell) to stand alone: into the last big cell
        observed[-1], expected[-1] = observed[-1] + rest_observed, expected[-1] + rest_expected
    observed, expected = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = ((observed - expected) ** 2 / expected).sum()
    pvalue = torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), statistic / 2)
    assert float(pvalue) > 1e-3, (float(statistic), len(big))


def test_what_lookup_cannot_serve_is_refused_under_on_and_reported_under_auto():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompt = repetitive_prompt(1)
    drafter = make_drafter(target, 8).float()
    on = HybridSpecConfig(context_lookup="on", lookup_estimator=always_copy(8))
    with pytest.raises(ValueError, match="fixed length"):
        run(target, prompt, drafter, "dflash", 4, hybridspec_config=on)
    with pytest.raises(ValueError, match="no survival table"):
        run(target, prompt, drafter, "confidence", 4, hybridspec_config=HybridSpecConfig(context_lookup="on"))
    with pytest.raises(ValueError, match="batch"):
        run(target, prompt.repeat(2, 1), drafter, "confidence", 4, hybridspec_config=on)
    with pytest.raises(ValueError, match="block_size=4"):
        run(target, prompt, drafter, "confidence", 4,
            hybridspec_config=HybridSpecConfig(context_lookup="on", lookup_estimator=always_copy(4)))
    with pytest.raises(ValueError, match="context_lookup must be one of"):
        HybridSpecConfig(context_lookup="yes")
    with pytest.raises(TypeError, match="lookup_estimator"):
        HybridSpecConfig(lookup_estimator=3)
    # "auto": off where it cannot run, and why; the model still generates (AR's tokens)
    ar = reference(target, prompt, 6)
    for strategy, settings, reason, rows in (
        ("confidence", HybridSpecConfig(), "no survival table", 1),
        ("dflash", HybridSpecConfig(lookup_estimator=always_copy(8)), "fixed length", 1),
        ("confidence", HybridSpecConfig(lookup_estimator=always_copy(8)), "batch", 2),
    ):
        out = run(target, prompt.repeat(rows, 1), drafter, strategy, 6, hybridspec_config=settings)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert not telemetry.context_lookup and reason in telemetry.context_lookup_off
        assert torch.equal(out, ar.sequences.repeat(rows, 1))


def test_the_drafter_saves_and_reads_its_table(tmp_path):
    from hybridspec_hf import DFlashDrafter

    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = DFlashDrafter.from_target(target, num_layers=1, block_size=8)
    drafter.lookup_estimator = LookupEstimator.fit(torch.tensor([2, 3, 3]), torch.tensor([1, 7, 2]), 8, 2, 3)
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert torch.equal(loaded.lookup_estimator.table, drafter.lookup_estimator.table)


def test_the_host_index_proposes_what_the_definition_does():
    """ContextIndex (what the loops run, extended round by round) against context_lookup on the whole sequence."""
    from hybridspec_hf.drafter.lookup import ContextIndex

    generator = torch.Generator().manual_seed(5)
    for symbols, low, high in ((2, 1, 3), (3, 2, 4), (5, 1, 1), (4, 3, 3)):
        ids = torch.randint(0, symbols, (60,), generator=generator)
        index = ContextIndex(ids[:3].tolist(), 8, low, high)
        end = 3
        while end < 60:
            proposal, n = context_lookup(ids[:end].view(1, -1), 8, low, high)
            mine, my_n = index.propose()
            assert my_n == int(n), (ids[:end].tolist(), my_n, int(n))
            if my_n:
                assert mine == proposal[0].tolist()
            step = int(torch.randint(1, 5, (1,), generator=generator))
            index.extend(ids[end:end + step].tolist())
            end += step


@pytest.mark.parametrize("strategy,cost_ar,kernel", [("hybridspec", 0.9, False), ("confidence", 0.9, False),
                                                     ("hybridspec", 0.45, False), ("hybridspec", 0.9, True)])
def test_resident_rounds_propose_from_the_text_committed_so_far(monkeypatch, request, strategy, cost_ar, kernel):
    """The resident rounds' token buffer holds, at every draft, exactly the call's tokens so far (prompt, every
    committed token, the anchor last) whatever mix of drafted rounds, copies and plain steps wrote it, and the
    device's proposal is `context_lookup` of that text. A plain step priced at 0.9 of a round: drafted rounds that
    verify copies; at 0.45: mostly plain steps (their anchors written by the step), a few drafted rounds. `kernel`:
    the proposal by the device kernel (kernels/lookup_triton.py, here in the Triton interpreter), as on CUDA."""
    from hybridspec_hf.kernels import lookup_triton
    from hybridspec_hf.selector import LatencyModel

    if kernel:
        request.getfixturevalue("triton_interpreter")
        monkeypatch.setattr(lookup_triton, "_ON_CPU", True)

    from hybridspec_hf.generation.resident import ResidentRounds

    seen = []
    original = ResidentRounds._lookup_proposal

    def recorded(self):
        proposal, ngram = original(self)
        length = int(self.target.length[0]) + 1
        seen.append((self.lookup_ids[:, :length].clone(), proposal.clone(), ngram.clone()))
        return proposal, ngram

    monkeypatch.setattr(ResidentRounds, "_lookup_proposal", recorded)
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompt = repetitive_prompt(1)
    ar = reference(target, prompt, 40)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.6).float()
    latency = LatencyModel(cost=torch.linspace(1.0, 1.1, 8)[None], cost_ar=torch.tensor([cost_ar]),
                           context_lens=torch.tensor([64]))
    settings = HybridSpecConfig(context_lookup="on", lookup_estimator=always_copy(8), cuda_graphs="uncaptured",
                                latency_model=latency)
    out = run(target, prompt, drafter, strategy, 40, hybridspec_config=settings)
    assert torch.equal(out, ar.sequences)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "static_eager" and len(seen) == sum(r.drafted for r in telemetry.rounds) > 2
    if cost_ar < 0.5:  # the steps' writes are read by the drafts after them
        assert sum(not r.drafted for r in telemetry.rounds) > 10
    else:  # copies verified: matches found (n > 0) and their proposals compared above
        assert sum(bool(r.lookup) for r in telemetry.rounds) > 2
    for text, proposal, ngram in seen:
        assert torch.equal(text, out[:, : text.shape[1]])  # the call's tokens so far, the anchor last
        want, want_n = context_lookup(text, 8, 1, 4)
        assert torch.equal(ngram, want_n) and (int(want_n) == 0 or torch.equal(proposal, want))


def test_resident_rounds_built_with_lookup_are_not_reused_by_a_call_without_it():
    """A left-padded prompt runs without context lookup ("auto": a batched call); after a call that ran it on the
    resident rounds, the padded call with the same settings builds its own rounds (the table is no part of its
    strategy's identity then) and generates AR's tokens."""
    from test_batched import left_pad

    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompt = repetitive_prompt(2)
    ar = reference(target, prompt, 12)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.5).float()
    settings = HybridSpecConfig(lookup_estimator=always_copy(8), cuda_graphs="uncaptured",
                                latency_model=flat_latency())
    out = run(target, prompt, drafter, "confidence", 12, hybridspec_config=settings)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.context_lookup and telemetry.path == "static_eager" and torch.equal(out, ar.sequences)
    ids, mask = left_pad([torch.cat([prompt[0], prompt[0, :3]]), prompt[0]])
    padded = target.generate(ids[1:], attention_mask=mask[1:], assistant_model=drafter, do_sample=False,
                             generation_strategy="confidence", hybridspec_config=settings, max_new_tokens=12)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert not telemetry.context_lookup and "batch" in telemetry.context_lookup_off
    assert telemetry.path == "static_eager"
    assert torch.equal(padded[0, -12:], ar.sequences[0, -12:])
