"""A generate() call's set-up: the strategy's identity names the settings by content, and an estimator read from a
path is parsed once but handed out fresh to every call."""
import json
import os

import torch

from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import strategy
from hybridspec_hf.selector import AcceptanceEstimator, LatencyModel


def _latency(scale: float) -> LatencyModel:
    cost = torch.linspace(1.0, 2.0, 8).reshape(1, 8) * scale
    return LatencyModel(cost=cost, cost_ar=torch.tensor([0.5 * scale]), context_lens=torch.tensor([64]))


def test_the_identity_names_a_latency_model_and_an_estimator_by_content():
    one, same, other = _latency(1e-3), _latency(1e-3), _latency(2e-3)
    identity = strategy._settings_identity
    assert identity(HybridSpecConfig(latency_model=one)) == identity(HybridSpecConfig(latency_model=same))
    assert identity(HybridSpecConfig(latency_model=one)) != identity(HybridSpecConfig(latency_model=other))
    a, b = AcceptanceEstimator.default(8), AcceptanceEstimator.default(8)
    assert identity(HybridSpecConfig(acceptance_estimator=a)) == identity(HybridSpecConfig(acceptance_estimator=b))
    b.weight[0, 0] += 1.0
    assert identity(HybridSpecConfig(acceptance_estimator=a)) != identity(HybridSpecConfig(acceptance_estimator=b))
    assert "tensor(" not in identity(HybridSpecConfig(latency_model=one, acceptance_estimator=a))


def test_an_estimator_from_a_path_is_fresh_per_call_and_follows_the_file(tmp_path):
    path = tmp_path / "estimator.json"
    estimator = AcceptanceEstimator.default(8, online_lr=0.1)
    estimator.save(path)
    first, second = strategy._estimator(str(path), 8), strategy._estimator(str(path), 8)
    assert first is not second and torch.equal(first.weight, estimator.weight)
    first.offset.add_(1.0)  # an online update of one call's estimator
    assert not torch.equal(first.offset, second.offset)
    assert torch.equal(strategy._estimator(str(path), 8).offset, second.offset)
    data = json.loads(path.read_text())
    data["weight"][0][0] += 0.5
    path.write_text(json.dumps(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a later write, whatever the clock
    assert strategy._estimator(str(path), 8).weight[0, 0] == estimator.weight[0, 0] + 0.5


def test_a_latency_models_kept_digest_follows_in_place_changes():
    model = _latency(1e-3)
    first = model.digest()
    assert model.digest() == first == _latency(1e-3).digest()
    model.cost_ar.mul_(2)  # in place: a new content
    second = model.digest()
    assert second != first and second == LatencyModel.from_dict(model.to_dict()).digest()
    model.eta = 1e-6  # a field set anew
    assert model.digest() not in (first, second)
