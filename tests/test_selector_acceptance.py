"""Acceptance estimator: draft signals, calibration on synthetic traces from a known logistic model, online update."""
import pytest
import torch

from hybridspec_hf.selector import (
    AcceptanceEstimator,
    accepted_from_matched,
    draft_signals,
    expected_calibration_error,
    survival_outcomes,
)

P = 15  # B - 1 draft positions (B = 16)


def synthetic_traces(n: int, seed: int, true_weight=(0.5, 0.0, 0.0, -0.5), verified=None):
    """Traces whose conditional acceptance follows a known logistic model of the signals (an overconfident drafter).

    Returns (traces dict in the recorder's format, true conditional acceptance c [n, P]).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, P, 32, generator=g) * (torch.rand(n, P, 1, generator=g) * 8 + 1)
    signals = draft_signals(logits)
    top1 = signals["top1"].clamp(1e-6, 1 - 1e-6)
    w = true_weight
    z = w[0] * torch.log(top1 / (1 - top1)) + w[1] * signals["margin"] + w[2] * signals["entropy"] + w[3]
    c = torch.sigmoid(z - 0.03 * torch.arange(1, P + 1))  # acceptance also decays with the position
    matched = torch.rand(n, P, generator=g) < c
    traces = {**signals, "matched": matched, "accepted": accepted_from_matched(matched)}
    if verified is not None:
        traces["verified"] = verified
        traces["accepted"] = torch.minimum(traces["accepted"], verified)
    return traces, c


def survival_ece(estimator, traces):
    outcome, observed = survival_outcomes(traces["accepted"], P, P)
    return float(expected_calibration_error(estimator.survival(traces), outcome, observed))


def test_draft_signals_match_a_direct_computation():
    logits = torch.randn(3, P, 50, generator=torch.Generator().manual_seed(0)) * 3
    s = draft_signals(logits.to(torch.bfloat16).float())
    probs = logits.to(torch.bfloat16).float().softmax(-1).double()
    top = probs.sort(-1, descending=True).values
    torch.testing.assert_close(s["top1"].double(), top[..., 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(s["margin"].double(), top[..., 0] - top[..., 1], atol=1e-6, rtol=0)
    torch.testing.assert_close(s["entropy"].double(), -(probs * probs.log()).sum(-1), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="batch, B-1, V"):
        draft_signals(logits[0])


def test_default_estimator_is_the_prefix_product_of_top1():
    traces, _ = synthetic_traces(64, seed=1)
    survival = AcceptanceEstimator.default(P + 1).survival(traces)
    torch.testing.assert_close(survival, traces["top1"].cumprod(-1), atol=1e-5, rtol=1e-4)


def test_fit_recovers_calibration_on_held_out_traces():
    """Fitted on 6k synthetic rounds, survival ECE on 6k held-out rounds < 0.01 and < 1/4 of the default's."""
    train, _ = synthetic_traces(6000, seed=2)
    test, true_c = synthetic_traces(6000, seed=3)
    fitted = AcceptanceEstimator.fit(train)
    default = AcceptanceEstimator.default(P + 1)
    ece_fit, ece_default = survival_ece(fitted, test), survival_ece(default, test)
    assert ece_fit < 0.01, ece_fit
    assert ece_fit < ece_default / 4, (ece_fit, ece_default)
    # the conditional model itself is close to the generating one (and much closer than top-1)
    assert (fitted.conditional(test) - true_c).abs().mean() < 0.05
    assert (default.conditional(test) - true_c).abs().mean() > 0.15
    survival = fitted.survival(test)
    assert bool((survival[:, 1:] <= survival[:, :-1]).all()) and bool(((survival >= 0) & (survival <= 1)).all())


def test_fit_from_truncated_rounds_stays_calibrated():
    """Traces of adaptive-length rounds are censored past w-1: the fit uses only verified positions."""
    g = torch.Generator().manual_seed(4)
    train, _ = synthetic_traces(6000, seed=4, verified=torch.randint(0, P + 1, (6000,), generator=g))
    test, _ = synthetic_traces(6000, seed=5)
    assert survival_ece(AcceptanceEstimator.fit(train), test) < 0.012


def test_per_position_matches_and_accepted_counts_give_the_same_fit():
    traces, _ = synthetic_traces(2000, seed=6)
    by_count = AcceptanceEstimator.fit(traces, traces["accepted"])
    by_match = AcceptanceEstimator.fit(traces, traces["matched"])
    torch.testing.assert_close(by_count.weight, by_match.weight)


def test_online_update_corrects_a_biased_estimator():
    """The default estimator on an overconfident drafter: the per-position offset learnt online halves the ECE."""
    test, _ = synthetic_traces(4000, seed=7)
    online = AcceptanceEstimator.default(P + 1, online_lr=0.02)
    before = survival_ece(online, test)
    stream, _ = synthetic_traces(3000, seed=8)
    for start in range(0, 3000, 10):  # rounds of 10 streams
        rows = slice(start, start + 10)
        online.observe({k: v[rows] for k, v in stream.items()}, stream["accepted"][rows], P)
    after = survival_ece(online, test)
    assert after < before / 2, (before, after)
    assert bool((online.offset[:5] < 0).all())  # it learnt that top-1 overstates acceptance (where rounds reach)


def test_json_roundtrip_and_block_size_check(tmp_path):
    traces, _ = synthetic_traces(500, seed=9)
    fitted = AcceptanceEstimator.fit(traces)
    fitted.save(tmp_path / "acc.json")
    loaded = AcceptanceEstimator.load(tmp_path / "acc.json")
    torch.testing.assert_close(loaded.survival(traces), fitted.survival(traces))
    short = {k: v[:, :7] for k, v in traces.items() if v.dim() == 2}
    with pytest.raises(ValueError, match="block size"):
        fitted.survival(short)
