"""Fused decoder layers and the one q|k|v GEMM on CUDA at Qwen3.5-35B-A3B's widths (hidden 2048, 16 heads of 256,
2 KV heads): compiled Triton kernels, a CUDA graph replay. Skipped without CUDA; the CPU twin (Triton interpreter)
is tests/test_decoder_triton.py. On the GPU the fp32 -> bf16 casts round to nearest, as torch does, so the residual
sum is torch's bit for bit in bf16 too; the norm within one bf16 ulp (2^-7 relative; fp32 1e-6)."""
import contextlib

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

import hybridspec_hf  # noqa: F401  (installs the patches)
from hybridspec_hf import patches
from hybridspec_hf.kernels.norm_triton import add_rms_norm
from hybridspec_hf.patches.experts import fused_experts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WIDTHS = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
              num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=256)


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16])
def test_add_rms_norm_is_the_residual_add_bit_for_bit(tokens, dtype):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    norm = modeling.Qwen3_5MoeRMSNorm(2048, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2048, device="cuda", generator=gen) * 0.3)
    x = torch.randn(1, tokens, 2048, device="cuda", generator=gen).to(dtype)
    residual = (torch.randn(1, tokens, 2048, device="cuda", generator=gen) * 4).to(dtype)
    h, y = add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(h, residual + x)
    expected = modeling.Qwen3_5MoeRMSNorm._hybridspec_original_forward(norm, residual + x)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(y, expected, **tol)


def test_fused_layers_match_and_the_attention_layer_replays_in_a_graph():
    """Both layers (GDN, attention) of a full-width model: the fused forward (q|k|v copy made) against
    transformers' eagerly; the attention layer also as a captured graph replayed on a new input."""
    torch.manual_seed(0)
    model = modeling.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**WIDTHS)).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():  # routers far from ties: at init (std 0.02) a bf16 rounding flipped one token's expert
        for block in patches.moe_blocks(model):  # in run 26 (rel 0.05 with and without every fusion)
            block.gate.weight.mul_(8)
    layers = list(patches.text_model(model).layers)
    attention = patches.attention_layers(model)
    patches.prepare_attention_projections(attention)
    assert all("_hybridspec_qkv" in a.__dict__ for a in attention)
    x = torch.randn(1, 8, 2048, device="cuda", dtype=torch.bfloat16)
    position_ids = torch.arange(8, device="cuda")[None]
    with torch.no_grad():  # the text rotary takes mRoPE ids [3, B, T] (5.17 indexes them so; 5.23+ expands [B, T])
        embeddings = patches.text_model(model).rotary_emb(x, position_ids[None].expand(3, -1, -1))

    def run(chosen, hidden, fused: bool):
        with torch.no_grad(), (patches.fused_kernels() if fused else contextlib.nullcontext()):
            for layer in chosen:
                hidden = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=position_ids)
        return hidden

    with fused_experts_for(patches.moe_blocks(model)):
        assert rel(run(layers, x, True), run(layers, x, False)) < 2e-2
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(layers[1:], x, True)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(layers[1:], x, True)
        x.copy_(torch.randn(1, 8, 2048, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        assert rel(out, run(layers[1:], x, False)) < 2e-2
    patches.release_attention_projections(attention)
