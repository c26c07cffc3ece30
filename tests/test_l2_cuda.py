"""The L2 prefetch of weights (kernels/l2.py) on a Hopper GPU: asking for lines early must not change a bit, eagerly
or captured. Skipped without CUDA capability ≥ 9; under TRITON_INTERPRET=1 (the CPU tests) the kernels run without
the prefetch (`l2.active` is False there), the same code otherwise."""
import pytest
import torch

from hybridspec_hf.kernels import gemv_triton, l2, moe_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA device of compute capability >= 9 (Hopper)")


@pytest.fixture
def prefetch(monkeypatch):
    def set_to(on: bool):
        for name in ("WEIGHTS", "EXPERTS", "DOWN"):
            monkeypatch.setattr(l2, name, on)
    return set_to


def _both(prefetch, run):
    """run() eagerly and as a captured graph's replay, with the prefetch off then on: the four results."""
    results = []
    for on in (False, True):
        prefetch(on)
        eager = run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        results += [eager, out.clone()]
    return results


@pytest.mark.parametrize("shape", [(12352, 2048, 1), (2048, 4096, 1), (2048, 4096, 4), (1000, 520, 3)])
def test_gemv_with_the_prefetch_gives_the_same_bits(shape, prefetch):
    n, k, m = shape
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    config = gemv_triton.TABLE.get((n, k, m), gemv_triton.GemvConfig(32, 128, 4, 4, 4, True))
    results = _both(prefetch, lambda: gemv_triton.gemv(x, weight, None, config))
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0].float(), gemv_triton.linear_reference(x, weight).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_decode_experts_with_the_prefetch_give_the_same_bits(tokens, shared, prefetch):
    torch.manual_seed(tokens)
    experts, hidden, inter, top_k = 256, 2048, 512, 8
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), -1).to(torch.bfloat16)
    extra = {}
    if shared:
        shared_gate_up = torch.randn(2 * inter + 8, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
        shared_down = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
        extra = dict(shared=(shared_gate_up, shared_down))

    def run():
        out = torch.empty_like(x)
        return moe_triton._launch_decode(x, ids, weights, gate_up, down, out, None, None, extra.get("shared"), None)

    results = _both(prefetch, run)
    assert all(torch.equal(r, results[0]) for r in results)
    expected = moe_triton.fused_experts_reference(x, ids, weights, gate_up, down)
    if not shared:
        assert torch.allclose(results[0].float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert results[0].abs().sum() > 0
