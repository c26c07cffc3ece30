"""benchmarks/context_lookup_tau.py: the lookup finds the latest, longest earlier match; a short run on the shipped
tiny pair writes every row with τ in [1, B] and the drafter's row equal to `acceptance_lengths`' τ."""
import pytest


@pytest.fixture
def lookup_tau(benchmarks):
    import context_lookup_tau

    return context_lookup_tau


def test_the_lookup_takes_the_longest_latest_match(lookup_tau):
    ids = [1, 2, 3, 9, 1, 2, 4, 7, 8, 1, 2]
    assert lookup_tau.lookup(ids, 10, 4, 4) == (2, [4, 7, 8])  # "1 2" last seen at 4-5, then 4 7 8
    assert lookup_tau.lookup(ids, 10, 4, 1) == (1, [4, 7, 8])  # "2" alone: the same, latest occurrence
    assert lookup_tau.lookup([5, 6, 7], 2, 4, 3) == (0, [])
    assert lookup_tau.lookup([5, 5, 5], 2, 3, 2) == (2, [5])  # the proposal stops at the anchor's end of text
    assert lookup_tau.accepted([1, 2, 3], [1, 2, 4]) == 2 and lookup_tau.accepted([], [1]) == 0


def test_full_block_rounds_start_where_the_last_one_ended(lookup_tau):
    rows = [{"sample": s, "anchor": a} for s, first in ((0, 5), (1, 3)) for a in range(first, first + 6)]
    taus = [2, 1, 3, 1, 1, 1] + [6, 1, 1, 1, 1, 1]  # sample 0: anchors 5 -> 7 -> 10 -> 11 (none); 1: 3 -> 9 (none)
    assert lookup_tau.rounds_tau(rows, taus) == pytest.approx((2 + 3 + 1 + 6) / 4)


def test_a_short_run_reports_every_rule(lookup_tau, tmp_path):
    from hybridspec_hf.drafter.training import acceptance_lengths, regenerate_responses
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    payload = lookup_tau.main(["--prompts", "3", "--max-new-tokens", "40", "--block-size", "8",
                               "--name", str(tmp_path / "lk")])
    lines = payload["summary"]
    assert len(lines) == 2 + len(lookup_tau.MIN_NGRAMS) * len(lookup_tau.THRESHOLDS) + 1
    for line in lines:
        assert 1 <= line["tau"] <= 8 and 1 <= line["tau_rounds"] <= 8 and 0 <= line["lookup_share"] <= 1
    assert lines[0]["lookup_share"] == 0
    oracle = lines[-1]["tau"]
    assert all(line["tau"] <= oracle + 1e-9 for line in lines)  # the per-anchor maximum bounds every rule
    target, drafter, tokenizer = load_tiny_pair()
    target.float()
    drafter.float()
    samples = regenerate_responses(target, tokenizer, heldout_prompts(3), tmp_path / "regen", max_new_tokens=40,
                                   batch_size=16)
    reference = acceptance_lengths(target, drafter, samples, (8,))["block_sizes"]["8"]["tau"]
    assert lines[0]["tau"] == pytest.approx(reference, abs=1e-6)
    assert "| the larger of the two (oracle) |" in (tmp_path / "lk.md").read_text()
