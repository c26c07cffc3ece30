"""Acceptance profiles and timing mode (selector/profiles.py; replayed by GPU-resident rounds, eagerly on the CPU)."""
from pathlib import Path

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.selector.profiles import load_profile, save_profile, synthetic_profile

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"


@pytest.mark.parametrize("tau", [2.0, 6.5, 7.5])
def test_synthetic_profiles_have_the_declared_acceptance(tau):
    profile = synthetic_profile("p", tau, block_size=16, rows=4096, seed=1)
    assert abs(profile.mean_accepted_length - tau) < 0.15
    accepted, top1 = profile.accepted, profile.top1
    before = top1[torch.arange(15).view(1, -1) < accepted.view(-1, 1)].mean()
    after = top1[torch.arange(15).view(1, -1) >= accepted.view(-1, 1)].mean()
    assert before > after + 0.2, "signals must tell accepted positions from rejected ones"
    assert torch.equal(synthetic_profile("p", tau, seed=1, rows=64).top1, synthetic_profile("p", tau, seed=1, rows=64).top1)


def test_profiles_round_trip_and_the_tiny_pair_traces_load(tmp_path):
    profile = synthetic_profile("dflash_like", 6.5, rows=32)
    save_profile(profile, tmp_path / "p.safetensors", mean_accepted_length=6.5)
    loaded = load_profile(tmp_path / "p.safetensors")
    assert loaded.name == "dflash_like" and torch.equal(loaded.accepted, profile.accepted)
    traces = load_profile(PROFILES / "tiny_pair_heldout.safetensors")
    assert traces.block_size == 16 and 1.0 < traces.mean_accepted_length < 16.0


def test_timing_mode_replays_the_profile():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = make_drafter(target, 8).float()
    prompt = torch.randint(0, VOCAB, (1, 9))
    for tau in (6.5, 2.0):
        profile = synthetic_profile("p", tau, block_size=8, rows=512, seed=2)
        target.generate(prompt, max_new_tokens=240, assistant_model=drafter, generation_strategy="dflash",
                        hybridspec_config=HybridSpecConfig(acceptance_profile=profile))
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.path == "static_eager"
        assert abs(telemetry.mean_emitted - profile.mean_accepted_length) < 0.6
    # under low acceptance the plain-decoding option takes over part of the rounds
    target.generate(prompt, max_new_tokens=240, assistant_model=drafter, generation_strategy="hybridspec",
                    hybridspec_config=HybridSpecConfig(acceptance_profile=profile))
    assert any(not r.drafted for r in hybridspec_hf.get_telemetry(target).rounds)
    with pytest.raises(ValueError, match="GPU-resident rounds only"):
        target.generate(prompt, max_new_tokens=8, assistant_model=drafter, generation_strategy="dflash",
                        hybridspec_config=HybridSpecConfig(acceptance_profile=profile, cuda_graphs="off"))
    with pytest.raises(ValueError, match="block size"):
        target.generate(prompt, max_new_tokens=8, assistant_model=drafter, generation_strategy="dflash",
                        hybridspec_config=HybridSpecConfig(acceptance_profile=synthetic_profile("p", 3.0)))
