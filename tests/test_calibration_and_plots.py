"""Latency calibration through real rounds, its cache, the first-use policy, and the plot helpers."""
import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation.calibration import cache_key, cache_path, calibrate_latency
from hybridspec_hf.selector import LatencyModel


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3_5_moe", seed=4, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    reference = target.generate(prompt, do_sample=False, max_new_tokens=24)
    return target, make_drafter(target, 8, reference, error_rate=0.3).float(), prompt, reference


def test_calibration_measures_every_w_and_fits_the_expert_model(pair):
    target, drafter, _, _ = pair
    model = calibrate_latency(target, drafter, context_lens=(16, 48), repeats=1, progress=False)
    assert model.cost.shape == (2, 8) and bool((model.cost > 0).all())
    assert bool((model.cost[:, 1:] >= model.cost[:, :-1]).all()), "C(w) is fitted non-decreasing"
    assert model.experts is not None and model.experts.num_layers == 4 and model.eta >= 0


def test_calibration_prices_a_calls_steady_rounds_not_its_first(pair, monkeypatch):
    """A call's first round follows its prefill (heavier: the drafter appends the whole prompt); C(w) and C_ar are
    the medians of the rounds after it. Round times are replaced by known ones (a first round 50 ms; then a drafted
    round of w tokens (10 + w) ms with one of 13 ms more, a plain step 4 ms with one of 6 more), so the medians are
    exact: a median that took the first round in sits higher."""
    target, drafter, _, _ = pair
    generate = target.generate

    def timed(*args, **kwargs):
        out = generate(*args, **kwargs)
        for index, r in enumerate(hybridspec_hf.get_telemetry(target).rounds):
            r.wall_s = 50e-3 if index == 0 else ((10 + r.w) * 1e-3 if r.drafted else 4e-3)
            r.wall_s += (13e-3 if r.drafted else 6e-3) if index == 2 else 0.0
        return out

    monkeypatch.setattr(target, "generate", timed)
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    torch.testing.assert_close(model.cost[0], (10.0 + torch.arange(1, 9)) * 1e-3)
    torch.testing.assert_close(model.cost_ar, torch.tensor([4e-3]))


@pytest.mark.parametrize("cuda_graphs", ["off", "uncaptured"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense_experts", "routed_experts"])
def test_calibration_rounds_run_hybridspecs_selector_work_at_the_forced_length(pair, cuda_graphs, dense, monkeypatch):
    """The timed rounds cost what HybridSpec's rounds cost at that w: its choice and throughput update run, and its
    routing correction (stage 0 runs the extra token, which is dropped) where HybridSpec's rounds can correct, on the
    eager loop and the resident rounds' CPU twin, while every drafted round verifies exactly the forced w and the
    output stays AR's. A target that verifies with dense experts (a CPU) never corrects (η = 0: a round costs the
    same whichever experts it routes to), so its calibration runs no correction either; one whose experts are routed
    (a GPU; here the CPU's dense path switched off) runs it."""
    from hybridspec_hf import patches
    from hybridspec_hf.generation.calibration import ForcedLength, dense_verification, shadow_selector

    target, drafter, prompt, reference = pair
    if not dense:
        monkeypatch.setattr(patches, "cpu_verification_blocks", lambda blocks, num_tokens: [])
    assert dense_verification(target, drafter.config.block_size) == dense
    shadow = shadow_selector(target, drafter.config.block_size)
    assert shadow.name == ("nominal" if dense else "hybridspec") and shadow.routing_correction == (not dense)
    calls = {"choose": 0, "keep_extra": 0, "observe": 0}
    for name in calls:
        def counted(*args, _name=name, _method=getattr(shadow, name), **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        setattr(shadow, name, counted)
    forced = ForcedLength(3, shadow)
    out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                          generation_strategy="hybridspec",
                          hybridspec_config=HybridSpecConfig(selector=forced, cuda_graphs=cuda_graphs))
    assert torch.equal(out, reference)
    length, max_length = prompt.shape[1] + 1, prompt.shape[1] + 24  # after the prefill's token
    rounds = []
    for r in hybridspec_hf.get_telemetry(target).rounds:
        if r.drafted:  # the forced w, or the room left before max_length
            assert r.w == min(3, max_length - length) and r.extra_kept is (None if dense else False)
            rounds.append(r)
        length += r.emitted
    assert rounds
    assert calls["choose"] == len(rounds) and calls["observe"] >= len(rounds)
    assert calls["keep_extra"] == (0 if dense else len(rounds))
    assert shadow.throughput.tokens is not None  # its streams learned (and are discarded)


@pytest.mark.parametrize("eta", [0.0, 2e-5])
def test_calibration_retimes_the_rounds_without_a_correction_its_model_never_lets_act(pair, eta, monkeypatch):
    """Routed experts (a GPU; here the CPU's dense path switched off): the timed rounds run the routing correction.
    Where the fitted model then prices no distinct expert (η = 0, nothing sunk), HybridSpec's rounds will not
    correct (strategy.correction_can_act), so C(w) is timed again without it, the expert model and η kept; where it
    prices them, once."""
    from hybridspec_hf import patches
    from hybridspec_hf.generation import calibration

    target, drafter, _, _ = pair
    monkeypatch.setattr(patches, "cpu_verification_blocks", lambda blocks, num_tokens: [])
    monkeypatch.setattr(calibration, "fit_eta", lambda *args, **kwargs: eta)
    timed = []  # whether each timed call's rounds ran the correction
    forced_set = calibration.ForcedLength.set

    def spy(self, w):
        timed.append(self.routing_correction)
        return forced_set(self, w)

    monkeypatch.setattr(calibration.ForcedLength, "set", spy)
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    assert model.eta == eta and model.experts is not None and model.prices_routing == (eta > 0)
    assert timed[0] and sorted(set(timed)) == ([False, True] if eta == 0 else [True])
    if eta == 0:  # the first pass with the correction, the second without, one call per shape each
        first = timed.index(False)
        assert all(timed[:first]) and not any(timed[first:]) and len(timed) == 2 * first


def test_calibration_compiles_the_shadows_decisions_as_resident_rounds_do(pair):
    """With compile_decisions (on CUDA by default) the timed rounds run the shadow's decisions compiled, as a
    compiled HybridSpec round runs them, once for the whole calibration; the forced length's own work stays eager
    and every drafted round still verifies the forced w (here the CPU twin with the whole-graph trace)."""
    import warnings

    from hybridspec_hf.generation.calibration import ForcedLength, shadow_selector

    target, drafter, prompt, reference = pair
    forced = ForcedLength(3, shadow_selector(target, drafter.config.block_size))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*torch.compile could not take")
        for w in (3, 0, 3):
            forced.set(w)
            out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                                  generation_strategy="hybridspec",
                                  hybridspec_config=HybridSpecConfig(selector=forced, cuda_graphs="on",
                                                                     compile_decisions="aot_eager"))
            assert torch.equal(out, reference)
            drafted = [r for r in hybridspec_hf.get_telemetry(target).rounds if r.drafted]
            assert all(r.w <= 3 for r in drafted) and (len(drafted) > 1) == (w > 0)
        survival = torch.full((1, drafter.config.block_size - 1), 0.5)
        for k in range(12):  # eager rounds pass host ints and measured seconds: the shadow's eager code takes them
            forced.observe(torch.tensor([3]), torch.tensor([2.0]), 1e-3 * (1 + k), True)  # (no recompile per value,
            forced.should_draft(20 + k)  # no host bisect traced)
            assert forced.choose(survival, 20 + k, 8).tolist() == [3]
    compiled = {name: vars(forced.shadow).get(name) for name in ForcedLength.SHADOW_DECISIONS}
    assert all(type(c).__name__ == "_CompiledDecision" and c.fast is not None for c in compiled.values())
    assert type(compiled["choose"].eager).__name__ == "method"  # compiled once, not a compiled form's compiled form
    assert "choose" not in vars(forced)  # the forced length's own decisions stay eager


def test_calibration_under_a_routing_profile_fits_the_replayed_routing(pair):
    from hybridspec_hf.selector.profiles import RoutingProfile

    target, drafter, prompt, reference = pair
    top_k = target.config.get_text_config().num_experts_per_tok
    # every token after the first reuses the first token's experts: k distinct experts per layer whatever w
    always_reuse = RoutingProfile(torch.ones(drafter.config.block_size), name="always_reuse")
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False,
                              routing_profile=always_reuse)
    assert model.cost.shape == (1, 8) and bool((model.cost > 0).all())
    assert torch.allclose(model.experts.distinct_per_layer, torch.full_like(model.experts.distinct_per_layer, top_k))
    uniform = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    assert float(uniform.experts.distinct_per_layer[-1]) > top_k  # the model's own router spreads tokens
    # the model is usable afterwards: no replay hook is left on the routers
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=24), reference)


def test_first_use_policy_require_raises_and_auto_caches(pair, tmp_path, monkeypatch):
    target, drafter, prompt, reference = pair
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    kwargs = dict(do_sample=False, max_new_tokens=24, assistant_model=drafter, generation_strategy="hybridspec")
    with pytest.raises(ValueError, match="hybridspec calibrate"):
        target.generate(prompt, hybridspec_config=HybridSpecConfig(calibration="require"), **kwargs)
    assert torch.equal(target.generate(prompt, **kwargs), reference)  # calibrates and caches
    path = cache_path(cache_key(target, drafter, "auto"))
    assert path.exists() and LatencyModel.load(path, cache_key(target, drafter, "auto")) is not None
    assert torch.equal(target.generate(prompt, hybridspec_config=HybridSpecConfig(calibration="require"), **kwargs),
                       reference)
    stale = {**cache_key(target, drafter, "auto"), "dtype": "torch.float16"}
    with pytest.warns(UserWarning, match="stale"):
        assert LatencyModel.load(path, stale) is None


def test_a_calibration_another_process_published_first_is_the_one_used(pair, tmp_path, monkeypatch):
    """Two processes calibrating the same model at once (e.g. parallel workers sharing the cache): the first file
    written stays, and the later process uses it, so its next calls (which read the cache) take the same decisions
    and replay the same rounds."""
    from hybridspec_hf.generation import calibration

    target, drafter, prompt, reference = pair
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    key = cache_key(target, drafter, "auto")
    theirs = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    theirs.key = key
    theirs.cost = theirs.cost * 1.5  # measurably different from what this process will measure
    calibrate = calibration.calibrate_latency

    def slower_than_the_other_process(*args, **kwargs):
        model = calibrate(*args, **kwargs)
        assert theirs.save(cache_path(key), replace=False)  # the other process finishes first
        return model

    monkeypatch.setattr(calibration, "calibrate_latency", slower_than_the_other_process)
    used = calibration.resolve_latency_model(HybridSpecConfig(), target, drafter)
    assert used.digest() == LatencyModel.load(cache_path(key), key).digest()
    assert torch.allclose(used.cost, theirs.cost)
    assert not used.save(cache_path(key), replace=False)  # the published file is not replaced
    used.save(cache_path(key))  # an explicit save (`hybridspec calibrate`) replaces it
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_cached_calibration_is_read_again_only_when_its_file_changed(pair, tmp_path, monkeypatch):
    """Calls that find the same cache file unchanged share the model read from it (no parse per call); a file
    rewritten since (here: `hybridspec calibrate` again, other costs) is read again, and a removed one is gone."""
    import os

    from hybridspec_hf.generation import calibration

    target, drafter, _, _ = pair
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    key = cache_key(target, drafter, "auto")
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    model.key = key
    path = cache_path(key)
    model.save(path)
    first = calibration.resolve_latency_model(HybridSpecConfig(), target, drafter)
    assert calibration.resolve_latency_model(HybridSpecConfig(), target, drafter) is first
    model.cost = model.cost * 2.0
    model.save(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a rewrite within the clock's tick
    second = calibration.resolve_latency_model(HybridSpecConfig(), target, drafter)
    assert second is not first and torch.allclose(second.cost, first.cost * 2.0)
    path.unlink()
    with pytest.raises(ValueError, match="hybridspec calibrate"):
        calibration.resolve_latency_model(HybridSpecConfig(calibration="require"), target, drafter)


def test_plot_helpers_draw(pair, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from hybridspec_hf import plots

    target, drafter, prompt, _ = pair
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                    generation_strategy="hybridspec", hybridspec_config=HybridSpecConfig(latency_model=model))
    telemetry = hybridspec_hf.get_telemetry(target)
    assert all(r.predicted_s is not None and r.predicted_s > 0 for r in telemetry.rounds)
    for axes in (plots.chosen_length_histogram(telemetry), plots.acceptance_vs_length(telemetry),
                 plots.latency_curves(model), plots.predicted_vs_measured(telemetry),
                 plots.reliability(torch.rand(200), torch.rand(200) < 0.5)):
        assert axes.has_data()
    axes.figure.savefig(tmp_path / "plot.png")


def test_resident_calibration_calls_stop_on_max_new_tokens_and_time_whole_w_rounds(pair, monkeypatch):
    """Resident rounds (their CPU twin here, cuda_graphs="uncaptured") are timed on calls that stop on
    max_new_tokens alone, without EOS, as a user's call runs them (m known on the device); a host-side criterion
    makes every round decide m on the host (C_ar 27 % and C(w) up to 11 % high on the H200). Each call has room for
    more whole-w rounds than one call times, and only drafted rounds that verified the whole w are priced (rounds
    cut short by max_new_tokens cost 1 ms here; with this drafter they are few, so the median alone hides them too).
    The eager loop keeps AfterRounds."""
    target, drafter, _, _ = pair
    generate, calls = target.generate, []

    def timed(*args, **kwargs):
        calls.append(kwargs)
        out = generate(*args, **kwargs)
        w = kwargs["hybridspec_config"].selector.w
        for index, r in enumerate(hybridspec_hf.get_telemetry(target).rounds):
            r.wall_s = 50e-3 if index == 0 else ((10 + r.w) * 1e-3 if r.drafted and r.w == w else
                                                  1e-3 if r.drafted else 4e-3)
        return out

    monkeypatch.setattr(target, "generate", timed)
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False,
                              cuda_graphs="uncaptured")
    assert calls and all("stopping_criteria" not in c and c["eos_token_id"] is None for c in calls)
    torch.testing.assert_close(model.cost[0], (10.0 + torch.arange(1, 9)) * 1e-3)
    torch.testing.assert_close(model.cost_ar, torch.tensor([4e-3]))
    calls.clear()
    calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False, cuda_graphs="off")
    assert calls and all("stopping_criteria" in c for c in calls)  # the eager loop: AfterRounds


def _rounds(ratios):
    from hybridspec_hf.generation.telemetry import RoundRecord

    return [RoundRecord(w=4, accepted=1, emitted=2, committed=2, wall_s=ratio * 0.01, predicted_s=0.01)
            for ratio in ratios]


def test_a_calibration_that_priced_the_rounds_far_dearer_is_retired(tmp_path, monkeypatch):
    """retire_if_busy deletes the file when the median measured / calibrated time is below STALE_RATIO over at
    least STALE_ROUNDS rounds, says so, and keeps it otherwise (fewer rounds, a slower call, no file to own)."""
    from hybridspec_hf.generation import calibration

    said = []
    monkeypatch.setattr(calibration.logger, "warning", lambda message, *args: said.append(message % args))
    path = tmp_path / "latency.json"
    n = calibration.STALE_ROUNDS
    below, above = calibration.STALE_RATIO * 0.95, calibration.STALE_RATIO * 1.05
    cases = [(None, [below] * n, False), (path, [below] * (n - 1), False), (path, [above] * n, False),
             (path, [5.0] * n, False), (path, [below] * (n // 2 + 1) + [9.0] * (n // 2 - 1), True)]
    for where, ratios, retired in cases:
        path.write_text("{}")
        assert calibration.retire_if_busy(where, _rounds(ratios)) is retired
        assert path.exists() is not retired
    assert len(said) == 1 and str(path) in said[0] and "calibrates afresh" in said[0]


@pytest.mark.parametrize("scale", [20.0, 0.5])
def test_a_busy_calibration_is_retaken_after_the_call_it_mispriced(pair, scale, tmp_path, monkeypatch):
    """A cached calibration 20x dearer than the rounds (one taken while the machine was busy) is deleted after the
    first call that measures it (output exact), and the next call calibrates afresh; one cheaper than the rounds
    (this call slower) stays."""
    from hybridspec_hf.generation import calibration

    target, drafter, prompt, reference = pair
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "STALE_ROUNDS", 3)
    key = cache_key(target, drafter, "auto")
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False)
    model.key = key
    model.cost, model.cost_ar = model.cost * scale, model.cost_ar * scale
    path = cache_path(key)
    model.save(path)
    kwargs = dict(do_sample=False, max_new_tokens=24, assistant_model=drafter, generation_strategy="hybridspec",
                  hybridspec_config=HybridSpecConfig(cuda_graphs="off"))
    assert torch.equal(target.generate(prompt, **kwargs), reference)
    assert len([r for r in hybridspec_hf.get_telemetry(target).rounds if r.predicted_s]) >= 3
    assert path.exists() is (scale < 1)
    calibrated = []
    monkeypatch.setattr(calibration, "calibrate_latency", lambda *a, **k: calibrated.append(1) or model)
    assert torch.equal(target.generate(prompt, **kwargs), reference)
    assert calibrated == ([] if scale < 1 else [1])
