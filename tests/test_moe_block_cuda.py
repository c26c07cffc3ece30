"""Fused MoE blocks on CUDA at the Qwen3.5-35B-A3B / Qwen3-Next-80B-A3B widths: compiled Triton kernels, a CUDA
graph replay, and the concatenated weight refreshed in place under a captured graph. Skipped without CUDA; the CPU
twin (Triton interpreter) is tests/test_moe_block_triton.py, whose tolerances these reuse (fp32 block outputs
within 1e-5 relative here: cuBLAS may accumulate the concatenated GEMM in another order)."""
import pytest
import torch
from test_moe_block_triton import assert_routing_matches
from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

import hybridspec_hf  # noqa: F401  (installs the patches)
from hybridspec_hf import patches
from hybridspec_hf.patches.experts import fused_experts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WIDTHS = dict(hidden_size=2048, moe_intermediate_size=512, shared_expert_intermediate_size=512)


def full_width_block(family: str, dtype: torch.dtype) -> torch.nn.Module:
    """One randomly initialised sparse MoE block of the family at full width, on CUDA."""
    if family == "qwen3_5_moe":
        config = Qwen3_5MoeTextConfig(**WIDTHS, num_experts=256, num_experts_per_tok=8)
        block = modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(config)
    else:
        config = Qwen3NextConfig(**WIDTHS, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True)
        block = modeling_qwen3_next.Qwen3NextSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block.to("cuda", dtype)


def fused(block, x):
    with torch.no_grad(), patches.fused_kernels():
        return block(x)


def plain(block, x):
    with torch.no_grad():
        return block(x)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_fused_block_and_router_match_transformers(family):
    block = full_width_block(family, torch.float32)
    patches.prepare_fused_moe([block])
    with fused_experts_for([block]):
        for tokens in (1, 5, 17):
            x = torch.randn(1, tokens, 2048, device="cuda")
            assert rel(fused(block, x), plain(block, x)) < 1e-5
    block = block.to(torch.bfloat16)
    for tokens in (1, 5, 17):
        hidden = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        logits, scores, ids = fused(block.gate, hidden)
        assert_routing_matches(logits.cpu(), scores.cpu(), ids.cpu(), block.gate.top_k, True)
    patches.release_fused_moe([block])


def test_a_captured_block_replays_and_follows_in_place_weight_updates():
    block = full_width_block("qwen3_5_moe", torch.float32)
    patches.prepare_fused_moe([block])
    x = torch.randn(1, 5, 2048, device="cuda")
    with fused_experts_for([block]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fused(block, x)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(block, x)
        x.copy_(torch.randn(1, 5, 2048, device="cuda"))
        graph.replay()
        assert rel(out, plain(block, x)) < 1e-5
        with torch.no_grad():
            block.shared_expert.up_proj.weight.mul_(-1.5)
            block.shared_expert_gate.weight.add_(0.5)
        patches.prepare_fused_moe([block])  # what every generate() call's start does
        graph.replay()
        assert rel(out, plain(block, x)) < 1e-5
    patches.release_fused_moe([block])


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_the_one_pass_block_with_the_residual_matches_transformers_and_replays(family, monkeypatch):
    """The shared expert as one more experts slot (compiled kernels, T <= 16) with the decoder layer's residual folded
    into the sum: transformers' block + residual, eagerly and from a captured graph."""
    from hybridspec_hf.kernels import moe_triton

    calls = []
    launch = moe_triton.moe_block_triton
    monkeypatch.setattr(moe_triton, "moe_block_triton", lambda *args: calls.append(1) or launch(*args))
    block = full_width_block(family, torch.float32)
    patches.prepare_fused_moe([block])
    with fused_experts_for([block]):
        for tokens in (1, 5, 16):
            x, residual = torch.randn(2, 1, tokens, 2048, device="cuda")
            with torch.no_grad(), patches.fused_kernels():
                out = patches.moe_block_add(block, x, residual)
            assert rel(out, residual + plain(block, x)) < 1e-5
        assert len(calls) == 3
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad(), patches.fused_kernels():
            patches.moe_block_add(block, x, residual)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad(), patches.fused_kernels():
            out = patches.moe_block_add(block, x, residual)
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert rel(out, residual + plain(block, x)) < 1e-5
    patches.release_fused_moe([block])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernels_match_the_torch_steps_and_repeat_bit_for_bit(dtype):
    """moe_triton's decode kernels compiled at full width (T = 1..4, default tiles: split-K gate_up, the sum over
    the slots, the gated shared expert and the residual in the down launch): the torch steps' result and the direct
    rows' within the CPU twin's tolerances, and the same bits over repeated calls (fixed-order reductions)."""
    from hybridspec_hf.kernels import moe_triton
    from hybridspec_hf.patches import _moe

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    block = full_width_block("qwen3_5_moe", dtype)
    patches.prepare_fused_moe([block])
    shared = block.__dict__[_moe._CACHE].weight
    for tokens in (1, 2, 3, 4):
        x, residual = torch.randn(2, tokens, 2048, device="cuda", dtype=dtype)
        with torch.no_grad():
            _, weights, ids = block.gate(x)
        args = (x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj, shared,
                block.shared_expert.down_proj.weight, residual)
        out = moe_triton.moe_block_triton(*args, mode="decode")
        assert rel(out, moe_triton.moe_block_reference(*args)) < tol
        assert rel(out, moe_triton.moe_block_triton(*args, mode="direct")) < tol
        for _ in range(20):
            assert torch.equal(moe_triton.moe_block_triton(*args, mode="decode"), out)
    patches.release_fused_moe([block])


def _direct_rows_both_ways(dtype, monkeypatch, switch: str) -> dict:
    """The direct rows at full width (T = 16, a round's block; the tokens past valid lengths 1, 4 and 16 routed as
    stage 1 routes them) with moe_triton.`switch` off and on, eagerly and replayed in a CUDA graph with the router's
    mask launch before them (PDL on where the GPU has it): each replay the eager call's bits, each within the CPU
    twin's tolerance of the torch steps. Returns {(on, valid length): output}."""
    from hybridspec_hf.kernels import moe_triton, router_triton
    from hybridspec_hf.patches import _moe

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    block = full_width_block("qwen3_5_moe", dtype)
    patches.prepare_fused_moe([block])
    shared = block.__dict__[_moe._CACHE].weight
    x, residual = torch.randn(2, 16, 2048, device="cuda", dtype=dtype)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
    valid = torch.ones(1, dtype=torch.long, device="cuda")
    outs = {}

    def step():
        masked_ids, masked_weights = router_triton.mask_invalid_routes(ids, weights, valid)
        return moe_triton.moe_block_triton(x, masked_ids, masked_weights, block.experts.gate_up_proj,
                                           block.experts.down_proj, shared, block.shared_expert.down_proj.weight,
                                           residual, mode="direct")

    for on in (False, True):
        monkeypatch.setattr(moe_triton, switch, on)
        step()  # compiles before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for n in (1, 4, 16):
            valid.fill_(n)
            eager = step()
            graph.replay()
            assert torch.equal(captured, eager), (on, n)
            masked = router_triton.mask_invalid_routes_reference(ids, weights, valid)
            truth = moe_triton.moe_block_reference(x, *masked, block.experts.gate_up_proj, block.experts.down_proj,
                                                   shared, block.shared_expert.down_proj.weight, residual)
            assert rel(eager, truth) < tol, (on, n)
            outs[on, n] = eager.clone()
    patches.release_fused_moe([block])
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_direct_rows_with_the_shared_slot_first_give_the_same_bits_in_a_graph(dtype, monkeypatch):
    """moe_triton.DIRECT_SHARED_FIRST: the shared expert's programs first and dead slots leaving early give the old
    order's bits."""
    outs = _direct_rows_both_ways(dtype, monkeypatch, "DIRECT_SHARED_FIRST")
    assert all(torch.equal(outs[True, n], outs[False, n]) for n in (1, 4, 16))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_the_add_norm_and_router_in_one_launch_match_transformers_and_replay(family):
    """`norm_route_block_add` (the decoder layer's residual add, post_attention_layernorm and router in one compiled
    launch, then the one-pass block) at full width in fp32: h + block(norm(h)) eagerly and from a captured graph
    (PDL on where the GPU has it); in bf16 the router's ids are route_topk's on the launch's own logits."""
    from hybridspec_hf.kernels import router_triton
    from hybridspec_hf.patches import _moe

    block = full_width_block(family, torch.float32)
    norm_cls = (modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm if family == "qwen3_5_moe"
                else modeling_qwen3_next.Qwen3NextRMSNorm)
    norm = norm_cls(2048, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2048, device="cuda") * 0.3)
    patches.prepare_fused_moe([block])

    def expected(x, residual):
        h = residual + x
        return h + plain(block, plain(norm, h))

    with fused_experts_for([block]):
        for tokens in (1, 5, 16):
            x, residual = torch.randn(2, 1, tokens, 2048, device="cuda")
            with torch.no_grad(), patches.fused_kernels():
                out = _moe.norm_route_block_add(block, x, residual, norm)
            assert rel(out, expected(x, residual)) < 1e-5
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad(), patches.fused_kernels():
            _moe.norm_route_block_add(block, x, residual, norm)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad(), patches.fused_kernels():
            out = _moe.norm_route_block_add(block, x, residual, norm)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert rel(out, expected(x, residual)) < 1e-5
    patches.release_fused_moe([block])
    gate = block.gate.bfloat16()
    x, residual = torch.randn(2, 16, 2048, device="cuda").bfloat16()
    normalize = family == "qwen3_next"
    h, normed, logits, scores, ids = router_triton.add_norm_route(x, residual, norm.weight.bfloat16(), 1e-6,
                                                                  gate.weight, gate.top_k, normalize)
    ref_h, ref_normed = patches_norms_reference(x, residual, norm.weight.bfloat16())
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(normed, ref_normed, rtol=2**-7, atol=2**-7)
    own_scores, own_ids = router_triton.route_topk(logits, gate.top_k, normalize)
    assert torch.equal(scores, own_scores) and torch.equal(ids, own_ids)
    assert_routing_matches(logits.cpu(), scores.cpu(), ids.cpu(), gate.top_k, normalize)


def patches_norms_reference(x, residual, weight):
    from hybridspec_hf.kernels.norm_triton import add_rms_norm_reference

    return add_rms_norm_reference(x, residual, weight, 1e-6)
