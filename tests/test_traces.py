"""The trace recorder's schema, consistency with telemetry, and the expert-reuse statistic."""
import torch
from _tiny import VOCAB, make_drafter, make_target

from hybridspec_hf.generation.traces import expert_reuse, load_traces, record_traces, save_traces
from hybridspec_hf.selector import AcceptanceEstimator


def test_expert_reuse_counts_experts_of_earlier_tokens():
    ids = torch.tensor([[[1, 2], [2, 3], [4, 5], [1, 5]]])  # one layer, 4 tokens, top-2
    assert expert_reuse(ids).tolist() == [[0.0, 0.5, 0.0, 1.0]]


def test_record_save_load_and_fit(tmp_path):
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (4, 9, 13)]
    reference = target.generate(prompts[0], do_sample=False, max_new_tokens=30)
    drafter = make_drafter(target, 8, reference, error_rate=0.3).float()
    traces = record_traces(target, drafter, prompts, max_new_tokens=30)
    n = traces["accepted"].shape[0]
    assert traces["top1"].shape == traces["matched"].shape == (n, 7)
    assert bool((traces["matched"].sum(1) == traces["accepted"]).all())
    assert traces["router_ids"].shape[:3] == (n, 4, 8) and traces["expert_reuse"].shape == (n, 4, 8)
    assert bool((traces["accepted"] <= traces["verified"]).all()) and set(traces["prompt_index"].tolist()) == {0, 1, 2}
    save_traces(traces, tmp_path / "t.safetensors", {"model": "tiny"})
    loaded, meta = load_traces(tmp_path / "t.safetensors")
    assert meta["model"] == "tiny" and torch.equal(loaded["accepted"], traces["accepted"])
    estimator = AcceptanceEstimator.default(8).fit(loaded)
    survival = estimator.survival({k: loaded[k] for k in ("top1", "margin", "entropy")})
    assert survival.shape == (n, 7) and bool((survival[:, 1:] <= survival[:, :-1] + 1e-6).all())
