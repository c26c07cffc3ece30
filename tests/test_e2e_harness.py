"""The end-to-end benchmark harness (benchmarks/e2e.py, `hybridspec bench`) runs through on a tiny model (CPU)."""
import json

from hybridspec_hf.cli import main
from hybridspec_hf.selector.length_rules import INFORMED_ROUNDS


def test_bench_runs_every_method_under_a_profile_and_writes_results(tmp_path, cpu_only):
    stem = tmp_path / "e2e_tiny"
    code = main(["bench", "--model", "tiny", "--tokens", "12", "--context", "8", "--profiles", "low",
                 "--methods", "hf_eager,ar,dflash,static7,hybridspec", "--routing", "uniform,calibrated",
                 "--name", str(stem)])
    assert code == 0
    report = json.loads(stem.with_suffix(".json").read_text())
    assert set(report["profiles"]) == {"low / uniform routing", "low / calibrated routing"}
    rows = report["profiles"]["low / calibrated routing"]["methods"]
    assert set(rows) == {"hf_eager", "ar", "dflash", "static7", "hybridspec"}
    assert rows["dflash"]["path"] == "static_eager" and rows["dflash"]["tau"] > 1.0
    assert "hf_static_compile" in report["not_run"]
    assert stem.with_suffix(".md").exists() and stem.with_suffix(".png").exists()


def test_a_failing_method_is_written_down_before_the_run_stops(benchmarks, tmp_path, monkeypatch):
    import pytest

    import e2e

    measured = e2e.run_method

    def run_method(target, drafter, prompt, method, *args, **kwargs):
        if method == "dflash":
            raise RuntimeError("CUDA error: invalid argument")
        return measured(target, drafter, prompt, method, *args, **kwargs)

    monkeypatch.setattr(e2e, "run_method", run_method)
    stem = tmp_path / "e2e_fail"
    with pytest.raises(RuntimeError, match="invalid argument"):
        e2e.main(["--model", "tiny", "--tokens", "8", "--context", "8", "--profiles", "low", "--methods",
                  "ar,dflash,static7", "--routing", "uniform", "--name", str(stem)])
    rows = json.loads(stem.with_suffix(".json").read_text())["profiles"]["low / uniform routing"]["methods"]
    assert rows["dflash"] == {"error": "RuntimeError: CUDA error: invalid argument"} and "ar" in rows
    assert "failed: RuntimeError" in stem.with_suffix(".md").read_text()


def test_length_choice_bound_is_the_oracle_over_whole_block_rounds(benchmarks):
    import torch

    import e2e

    cost = torch.arange(1, 17, dtype=torch.float32)  # C(w) = w
    # every round accepts the whole block: the oracle verifies 16 tokens too, no gain
    assert e2e.length_choice_bound(cost, 0.5, torch.full((8,), 15)) == 1.0
    # a = 3 and a = 0: the oracle pays C(4) = 4 and C_ar = 0.5 where DFlash pays 16 twice
    assert abs(e2e.length_choice_bound(cost, 0.5, torch.tensor([3, 0])) - 32 / 4.5) < 1e-9
    # a flat C(w) with plain steps no cheaper: choosing the length cannot pay
    assert e2e.length_choice_bound(torch.ones(16), 1.0, torch.tensor([0, 5, 9, 15])) == 1.0


def test_selector_simulation_replays_a_profile_and_prices_plain_steps(benchmarks):
    """benchmarks/selector_sim.py: every round takes the next profile row; a plain step costs C_ar and emits one
    token; "never plain" never steps plain; DFlash always verifies the whole block."""
    import torch

    import selector_sim
    from e2e import profile_halves

    from hybridspec_hf.selector.latency import LatencyModel

    latency = LatencyModel(cost=torch.linspace(5.8e-3, 7.8e-3, 16)[None], cost_ar=torch.tensor([4.4e-3]),
                           context_lens=torch.tensor([64]))
    _, replay, _, estimator = profile_halves("low")
    dflash = selector_sim.simulate("dflash", {}, latency, replay, estimator, 40)
    expected = sum(min(int(a), 15) + 1 for a in replay.accepted[:40]) / (40 * 7.8e-3)
    assert abs(dflash["tokens_per_s"] - expected) < 1e-6 * expected and dflash["plain_steps"] == 0
    never = selector_sim.simulate("nominal", {"allow_ar": False}, latency, replay, estimator, 40)
    assert never["plain_steps"] == 0 and never["tokens_per_s"] > 0


def test_call_simulation_prices_a_whole_call_and_its_rows(benchmarks):
    """selector_sim.simulate_call: a profile whose every round accepts the whole block, a flat C(w), never plain:
    each round costs C and yields its w tokens per row, so × AR = (tokens - 1)·C_ar / (rounds·C), for one row and
    for a batch's rows; a profile that accepts nothing at a round cost far above C_ar: the call steps plain after its
    first round and probes little (× AR a little below 1)."""
    import torch

    import selector_sim
    from e2e import profile_halves

    from hybridspec_hf.selector.latency import LatencyModel
    from hybridspec_hf.selector.length_rules import make_selector

    # a flat C(w): the whole block is the best length whatever the survival
    latency = LatencyModel(cost=torch.full((1, 16), 7.8e-3), cost_ar=torch.tensor([4.4e-3]),
                           context_lens=torch.tensor([64]))
    _, replay, _, estimator = profile_halves("low")
    everything = replay.rows(slice(0, 40))
    everything.accepted = torch.full_like(everything.accepted, 15)
    for rows in (1, 4):
        selector = make_selector("nominal", {"latency_model": latency, "allow_ar": False})
        selector.reset()
        speedup, spec = selector_sim.simulate_call(selector, latency, everything, estimator, 0, 129, rows)
        assert spec >= 8 and abs(speedup - 128 * 4.4e-3 / (spec * 7.8e-3)) < 1e-6, (rows, speedup, spec)
    nothing = replay.rows(slice(0, 40))
    nothing.accepted = torch.zeros_like(nothing.accepted)
    dear = LatencyModel(cost=torch.full((1, 16), 20e-3), cost_ar=torch.tensor([4.4e-3]),
                        context_lens=torch.tensor([64]))
    selector = make_selector("nominal", {"latency_model": dear})
    selector.reset()
    speedup, spec = selector_sim.simulate_call(selector, dear, nothing, estimator, 0, 129)
    assert spec <= INFORMED_ROUNDS + 1 and 0.85 < speedup < 1.0, (speedup, spec)  # the first rounds, a probe


def _position_sim():
    """benchmarks/position_sim.py (the caller asks for the `benchmarks` fixture), and a recorded text of 128 tokens
    whose every position accepts the whole block of 16 with confident drafts, and a flat C(w) = 8 ms against
    C_ar = 4 ms."""
    import torch

    import position_sim

    from hybridspec_hf.selector.latency import LatencyModel

    n, block = 128, 16
    signals = {k: torch.full((n - 1, block - 1), v) for k, v in (("top1", 0.9), ("margin", 0.8), ("entropy", 0.3))}
    text = {"n": n, "prompt_len": 20, "signals": signals, "a": torch.full((n - 1,), block - 1)}
    flat = LatencyModel(cost=torch.full((1, block), 8e-3), cost_ar=torch.tensor([4e-3]),
                        context_lens=torch.tensor([64]))
    return position_sim, text, flat


def test_position_simulation_walks_the_text_as_the_rounds_do(benchmarks):
    """benchmarks/position_sim.py's walk: a text whose every position accepts the whole block, a flat C(w): DFlash
    makes 127 tokens in ceil(127 / 16) rounds of C; a text that accepts nothing at a round cost far above C_ar:
    HybridSpec drafts its first rounds, steps plain after them and stays within a probe of AR."""
    import torch

    from hybridspec_hf.selector import AcceptanceEstimator
    from hybridspec_hf.selector.latency import LatencyModel

    position_sim, text, flat = _position_sim()
    n, block = text["n"], flat.block_size
    estimator = AcceptanceEstimator.default(block)
    run = position_sim.walk("dflash", {}, flat, estimator, text)
    assert run["rounds"] == run["drafted"] == 8 and abs(run["seconds"] / (8 * 8e-3) - 1) < 1e-6  # C in fp32
    assert abs(run["ar_seconds"] / (127 * 4e-3) - 1) < 1e-6
    nothing = dict(text, a=torch.zeros(n - 1, dtype=torch.long))
    dear = LatencyModel(cost=torch.full((1, block), 20e-3), cost_ar=torch.tensor([4e-3]),
                        context_lens=torch.tensor([64]))
    run = position_sim.walk("nominal", {}, dear, estimator, nothing)
    # the first rounds (one more decided before the last of them is observed), then a probe after 100 plain steps
    assert INFORMED_ROUNDS <= run["drafted"] <= INFORMED_ROUNDS + 2 and run["rounds"] == 127  # one token a round
    assert 0.8 < run["ar_seconds"] / run["seconds"] < 1.0


def test_position_simulation_runs_calls_in_sequence_as_the_resident_rounds_do(benchmarks):
    """position_sim.py --sequence's call: the first call of a selector drafts at once (no evidence); a later call
    holding the evidence of enough rounds opens with a deciding plain step, which drafts next where drafting paid
    (every position accepts the whole block: 1 plain step, then 127 - 1 tokens in 8 rounds)."""
    from hybridspec_hf.selector import AcceptanceEstimator, make_selector

    position_sim, text, flat = _position_sim()
    block = flat.block_size
    selector = make_selector("nominal", {"latency_model": flat})
    clock = [8e-3] * block
    first = position_sim._call(selector, flat, AcceptanceEstimator.default(block), text, clock, 4e-3)
    assert first["drafted"] == 8 and abs(first["seconds"] / (8 * 8e-3) - 1) < 1e-6
    second = position_sim._call(selector, flat, AcceptanceEstimator.default(block), text, clock, 4e-3)
    assert bool(selector.informed()[0]) and second["drafted"] == 8
    assert abs(second["seconds"] / (4e-3 + 8 * 8e-3) - 1) < 1e-6


def test_method_variants_set_one_or_several_switches_and_put_them_back(benchmarks):
    from common import method_variant, variant_switches

    from hybridspec_hf.kernels import gdn_step_triton, pdl

    before = (pdl.EARLY_READS, gdn_step_triton.FOLD_NORM, pdl.ENABLED)
    with method_variant("ar-early-reads-gdn-norm-fold") as base:
        assert base == "ar" and (pdl.EARLY_READS, gdn_step_triton.FOLD_NORM) == (False, False)
        assert pdl.ENABLED == before[2]
    assert (pdl.EARLY_READS, gdn_step_triton.FOLD_NORM, pdl.ENABLED) == before
    with method_variant("hybridspec+pdl") as base:
        assert base == "hybridspec" and pdl.ENABLED
    with method_variant("dflash") as base:
        assert base == "dflash"
    settings = variant_switches("ar-early-reads")
    assert settings["EARLY_READS"] is False and settings["FOLD_NORM"] == before[1]
    assert (pdl.EARLY_READS, gdn_step_triton.FOLD_NORM, pdl.ENABLED) == before


def test_a_drafter_switch_sets_the_drafters_config_and_puts_it_back(benchmarks):
    """"+int8-head" (common.DRAFTER_SWITCHES) sets the drafter's config.head_quantization inside the variant only;
    it needs the drafter; variant_switches and variant_base read it without one."""
    import types

    import pytest
    from common import method_variant, variant_base, variant_switches

    drafter = types.SimpleNamespace(config=types.SimpleNamespace(head_quantization=None))
    with method_variant("hybridspec+int8-head", drafter=drafter) as base:
        assert base == "hybridspec" and drafter.config.head_quantization == "int8"
    assert drafter.config.head_quantization is None
    drafter.config.head_quantization = "int8"
    with method_variant("dflash-int8-head+pdl", drafter=drafter) as base:
        assert base == "dflash" and drafter.config.head_quantization is None
    drafter.config.layers_quantization = None
    with method_variant("hybridspec+int8-layers+int8-head", drafter=drafter) as base:
        assert base == "hybridspec" and (drafter.config.layers_quantization, drafter.config.head_quantization) == (
            "int8", "int8")
    assert drafter.config.layers_quantization is None
    assert drafter.config.head_quantization == "int8"
    with pytest.raises(ValueError, match="needs the drafter"):
        with method_variant("ar+int8-head"):
            pass
    assert variant_base("base+int8-head-commit-beside") == "base"
    assert variant_switches("hybridspec+int8-head")["head_quantization"] == "int8"
    assert variant_switches("hybridspec")["head_quantization"] is None


def test_a_warm_up_replays_another_stretch_of_the_profile(benchmarks):
    """common.profile_elsewhere: inside, the profile starts half its rows past the timed call's start row (the
    evidence HybridSpec carries into the timed call must not be its own rows); after, even on an error, it is back;
    None (no profile) passes through."""
    import pytest

    from common import profile_elsewhere
    from e2e import profile_halves

    _, replay, _, _ = profile_halves("low")
    replay.start_row = 37
    with profile_elsewhere(replay):
        assert replay.start_row == 37 + replay.accepted.shape[0] // 2
    assert replay.start_row == 37
    with pytest.raises(RuntimeError), profile_elsewhere(replay):
        raise RuntimeError("a failed warm-up")
    assert replay.start_row == 37
    with profile_elsewhere(None):
        pass
