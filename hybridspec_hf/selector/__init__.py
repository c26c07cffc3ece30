"""Verification-length selection for one round. Torch only: no model code here.

- acceptance: drafter signals -> calibrated survival p̂_i = P(d_1..d_i all accepted).
- length: w0 = argmax_w [G(w) - ρ·C(w)] with ρ the pooled (Dinkelbach) throughput; the draft / AR decision.
- latency: C(w) by context bucket, C_ar, expert-count model, η, s(w); calibration and its JSON cache.
- routing: keep the extra token iff p̂_{w0} > ρ·ΔL after seeing its first-layer experts.
- strategies: HybridSpec and the baselines behind one interface (make_selector).
"""
from .survival import (
    AcceptanceEstimator,
    accepted_from_matched,
    copy_signals,
    draft_signals,
    expected_calibration_error,
    survival_outcomes,
)
from .latency import (
    ExpertModel,
    LatencyModel,
    calibrate,
    distinct_expert_counts,
    fit_cost_curve,
    fit_eta,
    fit_expert_model,
    make_cache_key,
)
from .length import DinkelbachThroughput, expected_tokens, ratio_length, select_length, should_draft
from .routing import count_new_experts, extra_survival, keep_extra_token, predicted_delta_latency
from .length_rules import (
    ConfidencePrefix,
    FullBlock,
    HybridSpec,
    LengthSelector,
    PerRoundRatio,
    StaticLength,
    make_selector,
)

__all__ = [
    "AcceptanceEstimator",
    "ConfidencePrefix",
    "DinkelbachThroughput",
    "ExpertModel",
    "FullBlock",
    "HybridSpec",
    "LatencyModel",
    "LengthSelector",
    "PerRoundRatio",
    "StaticLength",
    "accepted_from_matched",
    "calibrate",
    "copy_signals",
    "count_new_experts",
    "distinct_expert_counts",
    "draft_signals",
    "expected_calibration_error",
    "expected_tokens",
    "extra_survival",
    "fit_cost_curve",
    "fit_eta",
    "fit_expert_model",
    "keep_extra_token",
    "make_cache_key",
    "make_selector",
    "predicted_delta_latency",
    "ratio_length",
    "select_length",
    "should_draft",
    "survival_outcomes",
]
