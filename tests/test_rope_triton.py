"""Fused RoPE (kernels/rope_triton.py) against transformers' apply_rotary_pos_emb and the drafter's rotation (Triton
interpreter on the CPU). Tolerance: the kernel keeps transformers' rounding steps (each product rounded to the dtype,
then the sum) and has no reduction, so fp32 is bit-identical (checked). In bf16 a GPU, rounding to nearest as torch
does, should be bit-identical too (not checked: no GPU test compares bf16 RoPE); Triton's CPU interpreter truncates
fp32 -> bf16 instead, so each of the three roundings may be one ulp off: bf16 is checked to 3 ulps of the products'
magnitude."""
import pytest
import torch

pytest.importorskip("triton")

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling  # noqa: E402

from hybridspec_hf.drafter import modeling_dflash  # noqa: E402
from hybridspec_hf.kernels.rope_triton import rope, rope_qk, rope_reference, supported  # noqa: E402


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # conftest.py


def _inputs(batch, q_heads, k_heads, tokens, dim, rotary, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # q and k as the attention layers make them: [B, T, H, D] buffers seen through .transpose(1, 2)
    q = (torch.randn(batch, tokens, q_heads, dim, generator=gen) * 2).to(dtype).transpose(1, 2)
    k = (torch.randn(batch, tokens, k_heads, dim, generator=gen) * 2).to(dtype).transpose(1, 2)
    angles = torch.rand(batch, tokens, rotary // 2, generator=gen) * 40
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    return q, k, cos, sin


def _assert_same(got, want, x):
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the interpreter truncates: 3 roundings of values up to |x| (|cos|, |sin| <= 1)
        ulp = 2.0**-7 * x.float().abs().amax(-1, keepdim=True)
        assert bool(((got.float() - want.float()).abs() <= 3 * ulp).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 32, 8), (1, 2, 1, 5, 24, 24), (2, 3, 1, 16, 40, 12)])
def test_rope_qk_equals_transformers(shape, dtype):
    q, k, cos, sin = _inputs(*shape, dtype, seed=sum(shape))
    assert supported(q, k, cos, sin)
    original = getattr(modeling.apply_rotary_pos_emb, "_hybridspec_original", modeling.apply_rotary_pos_emb)
    want_q, want_k = original(q, k, cos, sin)
    got_q, got_k = rope_qk(q, k, cos, sin)
    _assert_same(got_q, want_q, q)
    _assert_same(got_k, want_k, k)
    _assert_same(got_q, rope_reference(q, cos, sin), q)
    assert got_q.is_contiguous() and got_k.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_drafters_rotation(dtype):
    x, _, cos, sin = _inputs(1, 4, 1, 16, 32, 32, dtype, seed=3)
    _assert_same(rope(x, cos, sin), modeling_dflash._rotate(x, cos, sin), x)  # CPU tensors: the torch path


def test_unsupported_inputs_are_refused_or_rejected():
    q, k, cos, sin = _inputs(1, 2, 1, 3, 16, 8, torch.float32, seed=1)
    assert not supported(q, k, cos.double(), sin.double())  # dtype mismatch: the caller runs transformers' code
    assert not supported(q, k, cos[..., :7], sin[..., :7])  # odd rotary dim
    with pytest.raises(ValueError, match="R even"):
        rope_qk(q, k, cos[..., :7], sin[..., :7])


def test_the_patch_routes_only_cuda_tensors_inside_resident_forwards():
    from hybridspec_hf import patches

    patches.install()
    q, k, cos, sin = _inputs(1, 2, 1, 3, 16, 8, torch.float32, seed=2)
    with patches.fused_kernels():  # CPU tensors take transformers' own function even while the flag is on
        got = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    assert modeling.apply_rotary_pos_emb._hybridspec_original is not None
    assert torch.equal(got[0], rope_reference(q, cos, sin))
