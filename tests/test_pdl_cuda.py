"""Programmatic dependent launch (kernels/pdl.py) on a Hopper GPU: launches that may overlap must not change a bit.
Skipped without CUDA capability ≥ 9; the CPU tests run every kernel with PDL=False (the same code otherwise)."""
import pytest
import torch
from _tiny import VOCAB

from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident
from hybridspec_hf.kernels import gemv_triton, norm_triton, pdl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA device of compute capability >= 9 (Hopper)")


@pytest.fixture
def pdl_switch(monkeypatch):
    def set_to(on: bool):
        monkeypatch.setattr(pdl, "ENABLED", on)
        assert pdl.active(False) == on
    return set_to


def _chain(x, weights, norm_weight):
    """A chain of dependent launches, as a forward's: norm → gemv → gemv (split-K) → add-norm, several times."""
    h = x
    for w_in, w_out in weights:
        y = norm_triton.rms_norm(h, norm_weight, 1e-6)
        y = gemv_triton.gemv(y, w_in, None, gemv_triton.GemvConfig(64, 128, 1, 4, 4, True))
        y = gemv_triton.gemv(y, w_out, None, gemv_triton.GemvConfig(32, 128, 8, 4, 4, True))
        h = h + y
    return h


def test_a_captured_chain_of_overlapping_launches_gives_the_same_bits(pdl_switch):
    torch.manual_seed(0)
    hidden, inter = 2048, 4096
    weights = [(torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5,
                torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5) for _ in range(6)]
    norm_weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        _chain(x, weights, norm_weight)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, weights, norm_weight)
        results = []
        for _ in range(20):
            graph.replay()
            results.append(out.clone())
        eager = _chain(x, weights, norm_weight)
        assert all(torch.equal(r, results[0]) for r in results), "replays differ"
        assert torch.equal(eager, results[0])
        outputs[on] = results[0]
    assert torch.equal(outputs[True], outputs[False])
    assert outputs[True].abs().sum() > 0


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("strategy", ["ar", "hybridspec"])
def test_resident_calls_with_pdl_equal_those_without(strategy, rows, pdl_switch):
    """A whole bf16 call through the resident graphs (our kernels throughout) gives the same tokens with PDL as
    without, at batch 1 and in a bucket of 4."""
    from _tiny import make_drafter, make_target

    target = make_target("qwen3_5_moe", dtype=torch.bfloat16)
    if hasattr(target, "set_experts_implementation"):
        target.set_experts_implementation("batched_mm")
    target.cuda()
    drafter = make_drafter(target, 8, None, error_rate=0.25, seed=0).to(torch.bfloat16).cuda()
    drafter.bind_target(target)
    prompt = torch.randint(1, VOCAB, (rows, 11), generator=torch.Generator().manual_seed(rows)).cuda()
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=40, pad_token_id=0,
                  assistant_model=drafter if strategy != "ar" else None, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        resident.release_resident_rounds(target)  # graphs captured under this setting
        target.generate(prompt, **kwargs)
        outputs[on] = target.generate(prompt, **kwargs)
    resident.release_resident_rounds(target)
    assert torch.equal(outputs[True], outputs[False])
