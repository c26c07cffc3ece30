"""Length selection, routing correction, latency model and strategies: formulas vs brute force, no host sync."""
import dataclasses
import json

import pytest
import torch

from hybridspec_hf.selector import (
    AcceptanceEstimator,
    ConfidencePrefix,
    FullBlock,
    HybridSpec,
    LatencyModel,
    PerRoundRatio,
    StaticLength,
    calibrate,
    count_new_experts,
    distinct_expert_counts,
    draft_signals,
    fit_cost_curve,
    fit_eta,
    fit_expert_model,
    keep_extra_token,
    make_cache_key,
    make_selector,
    predicted_delta_latency,
    ratio_length,
    select_length,
)

B = 8


def random_survival(g, batch, positions=B - 1):
    return torch.rand(batch, positions, generator=g).cumprod(-1)


def random_cost(g, *shape):
    return (torch.rand(*shape, B, generator=g) * 2e-3).cumsum(-1) + 5e-3  # increasing, seconds


def synthetic_model(n_buckets=2, eta=0.0, experts=None):
    g = torch.Generator().manual_seed(0)
    return LatencyModel(cost=random_cost(g, n_buckets), cost_ar=torch.full((n_buckets,), 4e-3),
                        context_lens=torch.tensor([512, 8192][:n_buckets]),
                        sunk=torch.rand(n_buckets, B - 1, generator=g) * 2e-4, eta=eta, experts=experts)


# ---------------------------------------------------------------------------------------------- length selection
def brute_force(objective_rows, w_max_rows):
    """First maximiser (smallest w) of each row's list, w = 1..len, w <= w_max."""
    best = []
    for values, w_max in zip(objective_rows, w_max_rows):
        candidates = [(v, -w) for w, v in enumerate(values, start=1) if w <= max(w_max, 1)]
        best.append(-max(candidates)[1])
    return best


def test_select_length_equals_brute_force_maximisation():
    g = torch.Generator().manual_seed(0)
    for case in range(200):
        batch = 1 + case % 5
        survival = random_survival(g, batch).double()
        cost = random_cost(g, batch).double() if case % 2 else random_cost(g).double()
        rho = torch.rand(batch, generator=g).double() * 600
        w_max = torch.randint(0, B + 3, (batch,), generator=g)
        gain = torch.cat([torch.ones(batch, 1, dtype=torch.float64), 1 + survival.cumsum(-1)], -1)
        objective = (gain - rho[:, None] * cost.expand(batch, B)).float().tolist()  # what the fp32 code sees
        expected = brute_force(objective, w_max.tolist())
        assert select_length(survival, cost, rho, w_max).tolist() == expected, case
        ratio = (gain.float() / cost.float().expand(batch, B)).tolist()
        assert ratio_length(survival, cost, w_max).tolist() == brute_force(ratio, w_max.tolist()), case


def test_select_length_breaks_ties_toward_the_smaller_length():
    survival = torch.tensor([[0.5, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0]])
    cost = torch.arange(1, B + 1, dtype=torch.float32)  # each extra token costs 1 s: gain 0.5 at rate 1 is a tie
    assert select_length(survival, cost, 0.5).tolist() == [1]
    assert select_length(survival, cost, 0.4).tolist() == [3]
    assert select_length(survival, cost, torch.tensor([0.5, 0.4]), w_max=torch.tensor([8, 2])).tolist() == [1, 2]
    with pytest.raises(ValueError, match="w = 1..B"):
        select_length(survival, cost[:-1], 0.5)


# ---------------------------------------------------------------------------------------------- routing correction
def test_count_new_experts_matches_sets():
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(4 * 6)]).view(4, 6, 3)  # [batch, T, k]
    w0 = torch.tensor([5, 1, 3, 0])
    expected = [len(set(ids[b, w0[b]].tolist()) - set(ids[b, : w0[b]].flatten().tolist())) for b in range(4)]
    assert count_new_experts(ids, w0).tolist() == expected
    assert count_new_experts(ids).tolist() == [len(set(ids[b, 5].tolist()) - set(ids[b, :5].flatten().tolist()))
                                               for b in range(4)]


def test_keep_extra_token_follows_the_formula():
    g = torch.Generator().manual_seed(2)
    p, delta, rho = torch.rand(64, generator=g), torch.randn(64, generator=g) * 1e-3, torch.rand(64, generator=g) * 900
    keep = keep_extra_token(p, rho, delta)
    assert keep.tolist() == [pi > ri * di for pi, ri, di in zip(p.tolist(), rho.tolist(), delta.tolist())]
    assert not keep_extra_token(torch.ones(1), 1.0, torch.tensor([float("inf")])).any()


def test_predicted_delta_latency_formula():
    experts = fit_expert_model([routing_observation(torch.Generator().manual_seed(s)) for s in range(30)], 32)
    model = synthetic_model(eta=3e-5, experts=experts)
    w0, n_new, ctx = torch.tensor([1, 3, 7, 8]), torch.tensor([0, 2, 4, 1]), torch.tensor([100, 9000, 600, 600])
    delta = predicted_delta_latency(model, w0, n_new, ctx)
    for b in range(3):
        k = int(model.bucket(ctx[b]))
        i = int(w0[b]) - 1
        expected = (model.cost[k, i + 1] - model.cost[k, i] - model.sunk[k, i]
                    + model.eta * (experts.extra_given_new[i, n_new[b]] - experts.extra_uncond[i]))
        assert float(delta[b]) == pytest.approx(float(expected), rel=1e-5)
    assert delta[3] == float("inf")  # w0 = B: there is no extra token


def test_the_routing_correction_is_armed_only_where_it_can_keep_a_token():
    """Without an expert term (η = 0) and without sunk stage-0 costs, the correction's test of the extra token is the
    length choice's marginal test of w0 + 1, which the chosen w0 already failed: it never keeps (random survivals,
    costs, ρ and contexts), and HybridSpec runs without it (`correction_can_act`); with η > 0 or sunk > 0 it can
    keep, and stays armed."""
    from hybridspec_hf.generation.strategy import correction_can_act
    from hybridspec_hf.selector.routing import extra_survival

    g = torch.Generator().manual_seed(5)
    plain = synthetic_model()
    plain.sunk.zero_()
    for _ in range(200):
        survival = torch.rand(4, B - 1, generator=g).cumprod(-1)
        rho = torch.rand(4, generator=g) * 900
        ctx = torch.randint(16, 9000, (4,), generator=g)
        w0 = select_length(survival, plain.cost_for(ctx), rho)
        delta = predicted_delta_latency(plain, w0, torch.randint(0, 5, (4,), generator=g), ctx)
        assert not keep_extra_token(extra_survival(survival, w0), rho, delta).any()
    assert not correction_can_act(HybridSpec(plain))
    assert correction_can_act(HybridSpec(synthetic_model()))  # sunk stage-0 costs
    experts = fit_expert_model([routing_observation(torch.Generator().manual_seed(s)) for s in range(30)], 32)
    priced = synthetic_model(eta=3e-5, experts=experts)
    priced.sunk.zero_()
    assert correction_can_act(HybridSpec(priced))


# ---------------------------------------------------------------------------------------------- latency model
def routing_observation(g, layers=3, w=B, top_k=4, num_experts=32):
    """Tokens of a few "topics": a topic fixes its expert set in every layer, so layer 0 predicts later layers."""
    topic_experts = torch.stack([torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(layers)])
                                 for _ in range(4)])  # [topics, layers, k]
    topics = torch.randint(0, 4, (w,), generator=g)
    return topic_experts[topics].transpose(0, 1)  # [layers, w, k]


def test_fit_expert_model_matches_a_direct_count():
    obs = [routing_observation(torch.Generator().manual_seed(s), w=4 + s % 5) for s in range(40)]
    model = fit_expert_model(obs, 32, prior_strength=0.0)
    sums, counts = {}, {}
    for o in obs:
        for t in range(1, o.shape[1]):
            added = [len(set(o[l, t].tolist()) - set(o[l, :t].flatten().tolist())) for l in range(o.shape[0])]
            key = (t, added[0])
            sums[key], counts[key] = sums.get(key, 0) + sum(added), counts.get(key, 0) + 1
    for (t, n_new), total in sums.items():
        assert float(model.extra_given_new[t - 1, n_new]) == pytest.approx(total / counts[t, n_new], rel=1e-5)
        assert float(model.counts[t - 1, n_new]) == counts[t, n_new]
    assert distinct_expert_counts(obs[0], 32)[:, 0].tolist() == [4, 4, 4]
    # with topic routing, a token that is new in layer 0 brings more experts everywhere than an old one
    given, uncond = model.extra_given_new[:3], model.extra_uncond[:3]  # w0 = 1..3: every round contributes
    assert bool((model.counts[:3, [0, 4]] > 0).all())
    assert bool((given[:, 4] > uncond).all()) and bool((given[:, 0] < uncond).all())
    empty = model.counts == 0
    torch.testing.assert_close(model.extra_given_new[empty], model.extra_uncond[:, None].expand_as(empty)[empty])


def test_fit_cost_curve_is_monotone_and_robust():
    true = [10.0 + w + 0.2 * w * w for w in range(1, 9)]
    ws, ts = [], []
    for w in [1, 2, 3, 5, 8]:  # 4, 6, 7 are not measured
        ws += [w] * 5
        ts += [true[w - 1] + d for d in (-0.1, 0.0, 0.1, 0.05, 50.0)]  # one straggler per w
    curve = fit_cost_curve(ws, ts, block_size=9)
    assert curve.shape == (9,)
    assert bool((curve[1:] >= curve[:-1]).all())
    for w in [1, 2, 3, 5, 8]:
        assert float(curve[w - 1]) == pytest.approx(true[w - 1] + 0.05, abs=1e-4)  # median ignores the straggler
    assert float(curve[8]) > float(curve[7])  # extrapolated with the last slope
    assert fit_cost_curve([1, 2, 3], [2.0, 1.0, 3.0]).tolist() == [1.5, 1.5, 3.0]  # isotonic pooling


def test_fit_eta_recovers_the_per_expert_latency():
    g = torch.Generator().manual_seed(3)
    ws = torch.randint(1, 9, (400,), generator=g)
    distinct = ws * 30 + torch.randint(0, 60, (400,), generator=g)  # correlated with w, varies at fixed w
    lat = 5e-3 + 4e-4 * ws + 2e-5 * distinct + torch.randn(400, generator=g) * 1e-5
    assert fit_eta(lat.tolist(), distinct.tolist(), ws.tolist()) == pytest.approx(2e-5, rel=0.05)


def test_calibrate_builds_the_model_from_a_measurement_function():
    calls = []

    def measure(w, context_len):
        calls.append((w, context_len))
        base = 5e-3 + context_len * 1e-7
        return base - 1e-3 if w == 0 else base + w * 2e-4

    model = calibrate(measure, ws=[1, 2, 4, 8], context_buckets=[4096, 256], repeats=2, warmup=1, progress=False,
                      measure_stage0=lambda w, c: 1e-4 * w, key={"k": 1})
    assert len(calls) == 5 * 2 * 3  # (4 ws + AR) x 2 contexts x (1 warm-up + 2 repeats)
    assert model.context_lens.tolist() == [256, 4096] and model.block_size == 8
    torch.testing.assert_close(model.cost[1], 5e-3 + 4096e-7 + 2e-4 * torch.arange(1, 9.0))  # w = 3, 5-7 interpolated
    torch.testing.assert_close(model.cost_ar, torch.tensor([5e-3 + 256e-7, 5e-3 + 4096e-7]) - 1e-3)
    torch.testing.assert_close(model.sunk, torch.full((2, 7), 1e-4))
    assert model.bucket(torch.tensor([10, 1000, 1100, 100000])).tolist() == [0, 0, 1, 1]  # log-space midpoint 1024


def test_one_context_latency_model_reads_row_zero_without_a_bucketize_and_selectors_move_it_at_restart():
    """A model measured at one context reads its only row for every context, on the host and on the device alike
    (no bucketize over an empty edge list: compiled by inductor for CUDA, that fails Triton's passes, H200 run 83);
    a calibrated selector's `restart` makes its device copy before any compiled decision could trace the move."""
    from hybridspec_hf.selector import make_selector

    model = LatencyModel(cost=torch.linspace(1, 2, 8)[None] * 1e-3, cost_ar=torch.tensor([0.8e-3]),
                         context_lens=torch.tensor([64]))
    rows = model.bucket(torch.tensor([1, 64, 10**6]))
    assert rows.dtype == torch.long and rows.tolist() == [0, 0, 0]
    assert model.bucket(10**6).tolist() == [0]
    torch.testing.assert_close(model.cost_for(torch.tensor([5, 7])), model.cost.expand(2, -1))
    for name in ("ratio", "hybridspec"):
        selector = make_selector(name, {"latency_model": model})
        selector._by_device.clear()  # as for a model loaded on the host and rounds on a GPU
        selector.restart(torch.tensor([12]))
        assert list(selector._by_device) == [torch.device("cpu")]


def test_latency_model_json_roundtrip_and_stale_key(tmp_path):
    experts = fit_expert_model([routing_observation(torch.Generator().manual_seed(s)) for s in range(5)], 32)
    key = make_cache_key({"hidden_size": 2048, "num_experts": 256}, torch.bfloat16, "NVIDIA H200", {"transformers": "5.17"})
    model = dataclasses.replace(synthetic_model(eta=2e-5, experts=experts), key=key)
    path = tmp_path / "cal" / "latency.json"
    model.save(path)
    loaded = LatencyModel.load(path, key)
    for field in ("cost", "cost_ar", "context_lens", "sunk"):
        assert torch.equal(getattr(loaded, field), getattr(model, field)), field
    assert torch.equal(loaded.experts.extra_given_new, experts.extra_given_new) and loaded.eta == model.eta
    assert loaded.key == key
    stale = make_cache_key({"hidden_size": 2048, "num_experts": 256}, torch.bfloat16, "NVIDIA H100", {"transformers": "5.17"})
    with pytest.warns(UserWarning, match="stale.*device"):
        assert LatencyModel.load(path, stale) is None
    assert LatencyModel.load(tmp_path / "missing.json", key) is None
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.warns(UserWarning, match="unreadable"):
        assert LatencyModel.load(path, key) is None


# ---------------------------------------------------------------------------------------------- strategies
def test_baseline_strategies():
    survival = torch.tensor([[0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05], [0.3] + [0.1] * 6])
    assert FullBlock().choose(survival, 100).tolist() == [8, 8]
    assert FullBlock().choose(survival, 100, w_max=torch.tensor([3, 9])).tolist() == [3, 8]
    assert StaticLength(7).choose(survival, 100, w_max=5).tolist() == [5, 5]
    assert StaticLength(12).choose(survival, 100).tolist() == [8, 8]
    assert ConfidencePrefix(0.5).choose(survival, 100).tolist() == [4, 1]
    assert ConfidencePrefix(0.5, min_length=2).choose(survival, 100).tolist() == [4, 2]
    model = synthetic_model()
    expected = ratio_length(survival, model.cost_for(100).expand(2, -1))
    assert PerRoundRatio(model).choose(survival, 100).tolist() == expected.tolist()
    assert FullBlock().should_draft(100).tolist() == [True]
    assert not FullBlock().keep_extra(survival, torch.tensor([3, 3]), torch.tensor([1, 1]), 100).any()


def test_make_selector_names_and_errors():
    model = synthetic_model()
    kinds = {name: type(make_selector(name, {"latency_model": model} if name in ("ratio", "nominal", "hybridspec")
                                      else None)) for name in ("dflash", "static", "ratio", "confidence", "nominal",
                                                                "hybridspec")}
    assert kinds == {"dflash": FullBlock, "static": StaticLength, "ratio": PerRoundRatio,
                     "confidence": ConfidencePrefix, "nominal": HybridSpec, "hybridspec": HybridSpec}
    assert not make_selector("nominal", {"latency_model": model}).routing_correction
    assert make_selector("hybridspec", {"latency_model": model}).routing_correction
    assert make_selector("static", {"w": 3}).w == 3
    with pytest.raises(ValueError, match="unknown verification strategy"):
        make_selector("eagle")
    with pytest.raises(ValueError, match="does not take"):
        make_selector("static", {"threshold": 0.5})
    with pytest.raises(TypeError, match="needs a LatencyModel"):
        make_selector("hybridspec", {"latency_model": None})


def test_hybridspec_keeps_the_extra_token_by_the_formula():
    experts = fit_expert_model([routing_observation(torch.Generator().manual_seed(s)) for s in range(30)], 32)
    model = synthetic_model(eta=5e-5, experts=experts)
    selector = HybridSpec(model)
    g = torch.Generator().manual_seed(4)
    survival, ctx = random_survival(g, 6), torch.tensor([100, 100, 9000, 9000, 100, 100])
    w0 = selector.choose(survival, ctx)
    n_new = torch.tensor([0, 4, 0, 4, 2, 1])
    keep = selector.keep_extra(survival, w0, n_new, ctx)
    p = torch.cat([survival, torch.zeros(6, 1)], 1).gather(1, (w0 - 1)[:, None]).squeeze(1)
    expected = p > selector.rho * predicted_delta_latency(model, w0, n_new, ctx)
    assert keep.tolist() == expected.tolist()
    assert not selector.keep_extra(survival, w0, n_new, ctx, w_max=w0).any()  # no room for an extra token
    assert not make_selector("nominal", {"latency_model": model}).keep_extra(survival, w0, n_new, ctx).any()


# ---------------------------------------------------------------------------------------------- no host sync
@pytest.fixture
def no_host_sync(monkeypatch):
    """Any device->host read (item, bool, tolist, nonzero, int/float conversion) raises while the test body runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation on the selection path")

    for name in ("item", "__bool__", "tolist", "nonzero", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    yield
    # monkeypatch restores every attribute at teardown


def round_path(experts, device):
    """Inputs on device and a function playing rounds of every per-round call, for every strategy."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, B - 1, 40, generator=g).to(device)
    estimator = AcceptanceEstimator.default(B, online_lr=0.01).to(device)
    model = synthetic_model(eta=1e-5, experts=experts)  # on the CPU: strategies move it once, at their first round
    selectors = [make_selector(name, {"latency_model": model} if name in ("ratio", "nominal", "hybridspec") else None)
                 for name in ("dflash", "static", "ratio", "confidence", "nominal", "hybridspec")]
    cost, routed = random_cost(g).to(device), torch.randint(0, 16, (3, 5, 2), generator=g).to(device)
    rho, w_cap = torch.tensor([100.0, 200.0, 300.0], device=device), torch.tensor([8, 3, 8], device=device)
    ones, accepted = torch.ones(3, device=device), torch.ones(3, dtype=torch.long, device=device)

    def play(context_len, rounds):
        for _ in range(rounds):
            signals = draft_signals(logits)
            survival = estimator.survival(signals)
            select_length(survival, cost, rho, w_cap)
            keep_extra_token(survival[:, 2], 300.0, cost[:3])
            n_new = count_new_experts(routed, w_cap.clamp(max=4))
            for selector in selectors:
                drafted = selector.should_draft(context_len)
                w0 = selector.choose(survival, context_len, w_max=w_cap)
                w = w0 + selector.keep_extra(survival, w0, n_new, context_len).long()
                selector.observe(w, ones, 9e-3, drafted=drafted)
                selector.observe(w, ones, None, drafted=True)
            estimator.observe(signals, accepted, w - 1)

    return play


def test_round_path_has_no_host_sync(request):
    experts = fit_expert_model([routing_observation(torch.Generator().manual_seed(s)) for s in range(10)], 32)
    play = round_path(experts, "cpu")
    ctx = torch.tensor([100, 5000, 100])
    request.getfixturevalue("no_host_sync")  # from here on any host sync raises
    for sync in (lambda: torch.ones(1).item(), lambda: bool(torch.ones(1)), lambda: torch.ones(2).nonzero()):
        with pytest.raises(AssertionError, match="host synchronisation"):
            sync()
    play(ctx, rounds=2)
    play(700, rounds=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("context_len", [700, "tensor"])
def test_round_path_has_no_cuda_sync(context_len):
    """On the GPU, after a first round (which moves the latency model), rounds run with sync debug mode 'error'."""
    experts = fit_expert_model([routing_observation(torch.Generator().manual_seed(s)) for s in range(10)], 32)
    play = round_path(experts, "cuda")
    ctx = torch.tensor([100, 5000, 100], device="cuda") if context_len == "tensor" else context_len
    play(ctx, rounds=1)  # warm-up: the strategies' one-time move of the latency model to the GPU
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        play(ctx, rounds=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
