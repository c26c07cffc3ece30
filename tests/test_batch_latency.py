"""The batch-aware latency model: C_N(w) calibrated over (batch size, w), and the shared w of a batch chosen with
the tables of its batch size (pooled objective Σ_b G_b(w) − ρ_N·C_N(w))."""
import collections
import dataclasses

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_properties import latency_model

from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation.calibration import calibrate_latency
from hybridspec_hf.generation.strategy import RoundStrategy
from hybridspec_hf.selector import LatencyModel, draft_signals, expected_tokens

BLOCK = 8


def batched(slopes: dict[int, float]) -> LatencyModel:
    """Synthetic tables: C_N(w) = N-dependent slopes (a batch pays more per verified token)."""
    return LatencyModel.with_batches({n: latency_model(BLOCK, slope) for n, slope in slopes.items()})


def test_for_batch_reads_the_tables_of_the_batch_bucket():
    model = batched({1: 0.1, 2: 0.3, 4: 0.6, 8: 1.2})
    assert model.for_batch(1) is model
    for batch, slope in ((2, 0.3), (3, 0.6), (4, 0.6), (5, 1.2), (8, 1.2), (16, 1.2)):
        chosen = model.for_batch(batch)
        assert torch.equal(chosen.cost, latency_model(BLOCK, slope).cost), batch
        assert torch.equal(chosen.cost_ar, latency_model(BLOCK, slope).cost_ar)
        assert chosen.batch_sizes is None and chosen.digest() != model.digest()
    plain = latency_model(BLOCK, 0.1)
    assert plain.for_batch(4) is plain  # without batch tables: the batch-1 C
    again = LatencyModel.from_dict(model.to_dict())  # the tables survive the JSON cache
    assert torch.equal(again.batch_cost, model.batch_cost) and again.batch_sizes.tolist() == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="batch-1 calibration"):
        LatencyModel.with_batches({2: plain})
    with pytest.raises(ValueError, match="ascending from 1"):
        dataclasses.replace(model, batch_sizes=torch.tensor([2, 1, 4, 8]))


@pytest.mark.parametrize("batch", [2, 3])
def test_the_shared_length_maximises_the_pooled_objective_at_its_batch_size(batch):
    """w = argmax_w Σ_b G_b(w) − ρ·N·C_N(w) with C_N the batch tables (steep here), not the batch-1 C (flat): the
    two give different choices, and the strategy built for N rows takes C_N's."""
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = make_drafter(target, BLOCK).float()
    model = batched({1: 0.02, 2: 2.0, 4: 2.0})
    strategy = RoundStrategy.build("nominal", HybridSpecConfig(latency_model=model), target, drafter,
                                   has_router=True, batch=batch)
    flat = RoundStrategy.build("nominal", HybridSpecConfig(latency_model=model), target, drafter, has_router=True)
    cost = model.for_batch(batch).cost_for(64)[0]
    generator = torch.Generator().manual_seed(batch)
    differ = 0
    for case in range(12):
        logits = torch.randn(batch, BLOCK - 1, VOCAB, generator=generator) * 20  # confident drafts: long w pays
        w, _ = strategy.choose_shared(logits, 64, BLOCK)
        gain = expected_tokens(strategy.estimator.survival(draft_signals(logits))).sum(0)  # Σ_b G_b(w)
        rho = strategy.selector.throughput.rho  # per row
        assert w == int((gain - batch * rho * cost).argmax()) + 1, case
        differ += w != flat.choose_shared(logits, 64, BLOCK)[0]
    assert differ > 0, "C_N should change the choice here"


def test_calibration_over_batch_sizes_times_batched_rounds():
    """calibrate_latency(batch_sizes=(1, 2)): C_2(w) and C_ar,2 from rounds over 2 prompts (the eager batched loop
    on the CPU), beside batch 1's tables; for_batch(2) gives them."""
    target = make_target("qwen3_5_moe", seed=4, dtype=torch.float32)
    drafter = make_drafter(target, BLOCK).float()
    model = calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False, batch_sizes=(1, 2))
    assert model.batch_sizes.tolist() == [1, 2] and model.batch_cost.shape == (2, 1, BLOCK)
    assert torch.equal(model.batch_cost[0], model.cost) and bool((model.batch_cost > 0).all())
    assert bool((model.batch_cost[1, :, 1:] >= model.batch_cost[1, :, :-1]).all()), "C_2(w) is fitted monotone"
    assert torch.equal(model.for_batch(2).cost, model.batch_cost[1])
    assert torch.equal(model.for_batch(2).cost_ar, model.batch_cost_ar[1])


def test_batch_calibration_times_rounds_that_verified_the_forced_length(monkeypatch):
    """Every forced w of the batch calibration is timed on rounds that verified w tokens: the calls leave room for
    the whole block (a round never verifies past max_length; short calls made C_N(w) flat above w ≈ 4)."""
    target = make_target("qwen3_5_moe", seed=4, dtype=torch.float32)
    drafter = make_drafter(target, BLOCK).float()
    verified = collections.defaultdict(set)  # forced w -> w the batch's drafted rounds verified
    generate = target.generate

    def recording(*args, **kwargs):
        out = generate(*args, **kwargs)
        forced = kwargs["hybridspec_config"].selector.w
        if out.shape[0] == 2:
            verified[forced] |= {r.w for r in target.hybridspec_telemetry.rounds if r.drafted and r.rows == 2}
        return out

    monkeypatch.setattr(target, "generate", recording)
    calibrate_latency(target, drafter, context_lens=(16,), repeats=1, progress=False, batch_sizes=(1, 2))
    lengths = [w for w in verified if w > 0]
    assert BLOCK in lengths and len(lengths) >= 4
    for w in lengths:
        assert w in verified[w], (w, verified[w])
