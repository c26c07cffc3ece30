"""benchmarks/context_lookup_tau.py: a short run on the shipped tiny pair writes every row with τ in [1, B] and the
drafter's row equal to `acceptance_lengths`' τ; `--fit-lookup` fits a table on training-split prompts only.
(The lookup itself is tested in test_context_lookup.py.)"""
import pytest


@pytest.fixture
def lookup_tau(benchmarks):
    import context_lookup_tau

    return context_lookup_tau


def test_accepted_counts_the_leading_matches(lookup_tau):
    assert lookup_tau.accepted([1, 2, 3], [1, 2, 4]) == 2 and lookup_tau.accepted([], [1]) == 0


def test_full_block_rounds_start_where_the_last_one_ended(lookup_tau):
    rows = [{"sample": s, "anchor": a} for s, first in ((0, 5), (1, 3)) for a in range(first, first + 6)]
    taus = [2, 1, 3, 1, 1, 1] + [6, 1, 1, 1, 1, 1]  # sample 0: anchors 5 -> 7 -> 10 -> 11 (none); 1: 3 -> 9 (none)
    assert lookup_tau.rounds_tau(rows, taus) == pytest.approx((2 + 3 + 1 + 6) / 4)


def test_a_short_run_reports_every_rule(lookup_tau, tmp_path):
    from hybridspec_hf.drafter.training import acceptance_lengths, regenerate_responses
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    payload = lookup_tau.main(["--prompts", "3", "--max-new-tokens", "48", "--block-size", "16",
                               "--name", str(tmp_path / "lk")])
    lines = payload["summary"]
    # the rules, the estimated-Σ p̂ rule (the shipped pair's table alone, and mixed with the drafter's rating of
    # the copy where its table_weight < 1) and the oracle
    from hybridspec_hf.selector.lookup import LookupEstimator
    from hybridspec_hf.tiny_pair import ASSETS_DIR

    mixed = LookupEstimator.load(ASSETS_DIR / "lookup_estimator.json").table_weight < 1
    assert len(lines) == 2 + len(lookup_tau.MIN_NGRAMS) * len(lookup_tau.THRESHOLDS) + 2 + mixed
    assert sum("what the rounds apply" in line["proposal"] for line in lines) == mixed
    for line in lines:
        assert 1 <= line["tau"] <= 16 and 1 <= line["tau_rounds"] <= 16 and 0 <= line["lookup_share"] <= 1
    assert lines[0]["lookup_share"] == 0
    oracle = lines[-1]["tau"]
    assert all(line["tau"] <= oracle + 1e-9 for line in lines)  # the per-anchor maximum bounds every rule
    target, drafter, tokenizer = load_tiny_pair()
    target.float()
    drafter.float()
    samples = regenerate_responses(target, tokenizer, heldout_prompts(3), tmp_path / "regen", max_new_tokens=48,
                                   batch_size=16)
    reference = acceptance_lengths(target, drafter, samples, (16,))["block_sizes"]["16"]["tau"]
    assert lines[0]["tau"] == pytest.approx(reference, abs=1e-6)
    assert "| the larger of the two (oracle) |" in (tmp_path / "lk.md").read_text()


def test_the_table_is_fitted_on_training_prompts_only(lookup_tau, tmp_path):
    from hybridspec_hf.selector.lookup import LookupEstimator

    with pytest.raises(SystemExit, match="--split train"):
        lookup_tau.main(["--fit-lookup", str(tmp_path / "t.json")])
    lookup_tau.main(["--split", "train", "--prompts", "2", "--max-new-tokens", "40", "--block-size", "8",
                     "--min-ngram", "1", "--fit-lookup", str(tmp_path / "t.json"), "--name", str(tmp_path / "f")])
    table = LookupEstimator.load(tmp_path / "t.json")
    assert table.block_size == 8 and (table.min_ngram, table.max_ngram) == (1, 4)
    assert 0 <= table.table_weight <= 1 and abs(table.table_weight * 10 - round(table.table_weight * 10)) < 1e-9
