"""Greedy tokens from the LM head's int8 copy on CUDA (kernels/head_argmax_triton.py, resident.INT8_GREEDY_HEAD): at
the 35B-A3B head's shape (248 320 x 2 048, random bf16 weights, random hidden states) the kernel's tokens are the
head's first argmax (fp32 sums rounded to bf16, and cuBLAS's bf16 logits as the AR step takes them) except where the
two differ by at most one bf16 step at the chosen rows (a near-tie: the fp32 sums' order), the same inside a CUDA
graph replayed with new hidden states, the counters zero after it; and whole resident greedy calls (captured, every
strategy, fp32) with the switch on equal AR's tokens. Skipped without CUDA; the CPU twins are test_head_argmax.py and
test_int8_greedy_head.py."""
import pytest
import torch
import torch.nn.functional as F
from _tiny import VOCAB, make_drafter, make_target

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident
from hybridspec_hf.kernels import head_argmax_triton as ha
from hybridspec_hf.kernels.gemv_triton import quantize_rows, split_counters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V, K = 248320, 2048


@pytest.fixture(scope="module")
def big_head():
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(V, K, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    return weight, quantize_rows(weight)


def _hidden(rows, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, K, device="cuda", generator=generator).to(torch.bfloat16)


def _near(weight, h, ours, truth):
    """Rows where ours and truth differ are within one bf16 step of each other (fp32 logits of the head)."""
    logits = F.linear(h.float(), weight.float())
    differ = (ours != truth).nonzero().view(-1).tolist()
    for r in differ:
        a, b = logits[r, ours[r]], logits[r, truth[r]]
        assert (a - b).abs() <= b.abs() / 128, (r, float(a), float(b))
    return len(differ)


@pytest.mark.parametrize("two_pass", [True, False])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_tokens_are_the_heads_argmax_at_the_35b_shape(big_head, rows, two_pass, monkeypatch):
    monkeypatch.setattr(ha, "TWO_PASS", two_pass)
    weight, quantized = big_head
    near = 0
    for seed in range(8):
        h = _hidden(rows, seed)
        ours = ha.greedy_tokens(h, weight, quantized)
        plain = ha.greedy_tokens_plain(h, weight)
        cublas = F.linear(h, weight).argmax(-1)  # the AR step's own: cuBLAS's bf16 logits
        near += _near(weight, h, ours, plain) + _near(weight, h, ours, cublas)
        _near(weight, h, ours, ha.greedy_tokens_reference(h, weight, quantized))
    assert near <= rows  # near-ties are rare: at most one a seed's row on average
    assert not split_counters(weight.device).any()


def test_a_captured_launch_replays_with_new_hidden_states(big_head):
    weight, quantized = big_head
    static = _hidden(4, 100)
    ha.greedy_tokens(static, weight, quantized)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = ha.greedy_tokens(static, weight, quantized)
    for seed in (101, 102, 103):
        static.copy_(_hidden(4, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(tokens, ha.greedy_tokens(static, weight, quantized))
    assert not split_counters(weight.device).any()


@pytest.mark.parametrize("strategy", ["ar", "dflash", "hybridspec"])
def test_resident_greedy_calls_with_the_switch_equal_ar(strategy, monkeypatch):
    monkeypatch.setattr(resident, "INT8_GREEDY_HEAD", True)

    def pair(reference=None):  # an fp32 tiny target on CUDA, an oracle drafter steered to `reference` (as
        target = make_target("qwen3_5_moe", dtype=torch.float32)  # test_resident_cuda.py's `_pair`)
        if hasattr(target, "set_experts_implementation"):
            target.set_experts_implementation("batched_mm")
        drafter = make_drafter(target, 8, reference, error_rate=0.25).float()
        target.cuda()
        drafter.cuda().bind_target(target)
        return target, drafter

    target, _ = pair()
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0)).cuda()
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40)
    target, drafter = pair(ar.cpu())
    kwargs = dict(do_sample=False, max_new_tokens=40, assistant_model=drafter, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on", static_length=5))
    for _ in range(2):  # captures, then replays
        out = target.generate(prompt, **kwargs)
        assert target.__dict__["_hybridspec_resident"].greedy_head is not None
        assert hybridspec_hf.get_telemetry(target).path == "cuda_graphs"
        assert torch.equal(out, ar), "fp32 greedy output differs from AR"
    hybridspec_hf.release_graphs(target)
