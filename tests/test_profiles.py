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


@pytest.mark.parametrize("name, tau", [("dflash_like", 6.8), ("medium", 4.0), ("low", 2.0)])
def test_the_committed_declared_profiles_are_what_make_profiles_writes(name, tau):
    """benchmarks/profiles/{dflash_like,medium,low}.safetensors: the seeded synthetic profiles of their declared
    mean accepted length (make_profiles.py's DECLARED), row for row."""
    committed = load_profile(PROFILES / f"{name}.safetensors")
    made = synthetic_profile(name, tau, block_size=16, rows=8192, seed=0)
    assert torch.equal(committed.accepted, made.accepted) and torch.equal(committed.top1, made.top1)
    assert abs(committed.mean_accepted_length - tau) < 0.1


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
    # under low acceptance the plain-decoding option takes over the rounds; the latency model is given (a
    # round costs 2-3 plain steps, as on a CPU), so the choice does not hang on this host's measured timings
    from hybridspec_hf.selector.latency import LatencyModel
    latency = LatencyModel(cost=8e-3 + 0.5e-3 * torch.arange(1, 9, dtype=torch.float32)[None],
                           cost_ar=torch.tensor([4e-3]), context_lens=torch.tensor([64]))
    target.generate(prompt, max_new_tokens=240, assistant_model=drafter, generation_strategy="hybridspec",
                    hybridspec_config=HybridSpecConfig(acceptance_profile=profile, latency_model=latency))
    rounds = hybridspec_hf.get_telemetry(target).rounds
    plain = sum(not r.drafted for r in rounds)
    assert plain > 4 * (len(rounds) - plain), (plain, len(rounds))  # drafted rounds: the option's probes only
    with pytest.raises(ValueError, match="GPU-resident rounds only"):
        target.generate(prompt, max_new_tokens=8, assistant_model=drafter, generation_strategy="dflash",
                        hybridspec_config=HybridSpecConfig(acceptance_profile=profile, cuda_graphs="off"))
    with pytest.raises(ValueError, match="block size"):
        target.generate(prompt, max_new_tokens=8, assistant_model=drafter, generation_strategy="dflash",
                        hybridspec_config=HybridSpecConfig(acceptance_profile=synthetic_profile("p", 3.0)))


def test_calibrated_routing_profile_fits_the_pair_and_replays_in_rounds():
    import json

    from hybridspec_hf.selector.profiles import RoutingProfile, fit_routing_profile

    routing = RoutingProfile.from_dict(json.loads((PROFILES / "routing_tiny_pair.json").read_text()))
    assert routing.excess_reuse[0] == 0 and bool((routing.excess_reuse[1:] > 0).all())
    # uniform ids have no excess reuse; ids that copy the first token's experts have all of it
    uniform = torch.stack([torch.randperm(64)[:4] for _ in range(400 * 16)]).view(100, 4, 16, 4)
    assert float(fit_routing_profile(uniform, 64).excess_reuse.max()) < 0.05
    copied = uniform[:, :, :1].expand(-1, -1, 16, -1).contiguous()
    assert float(fit_routing_profile(copied, 64).excess_reuse[1:].min()) > 0.99
    bank = routing.bank(num_layers=3, num_experts=64, top_k=4, rounds=8)
    assert bank.shape == (8, 3, 16, 4) and int(bank.max()) < 64
    assert all(len(set(row.tolist())) == 4 for row in bank.reshape(-1, 4))  # no expert twice for one token

    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = make_drafter(target, 8).float()
    settings = HybridSpecConfig(acceptance_profile=synthetic_profile("p", 4.0, block_size=8, rows=64),
                                routing_profile=RoutingProfile(routing.excess_reuse[:8], "r"))
    seen = []
    handle = target.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone()))
    try:
        target.generate(torch.randint(0, VOCAB, (1, 9)), max_new_tokens=40, assistant_model=drafter,
                        generation_strategy="dflash", hybridspec_config=settings)
    finally:
        handle.remove()
    rounds = target.__dict__["_hybridspec_resident"]
    replayed = [ids for ids in seen if ids.shape[0] == 8]
    assert replayed and any(torch.equal(ids, rounds.routing.bank[r, 0].to(ids.dtype)) for ids in replayed
                            for r in range(rounds.routing.bank.shape[0]))
    with pytest.raises(ValueError, match="timing mode only"):
        target.generate(torch.randint(0, VOCAB, (1, 9)), max_new_tokens=4, assistant_model=drafter,
                        generation_strategy="dflash", hybridspec_config=HybridSpecConfig(routing_profile=routing))
