"""Fused RMSNorm kernels against transformers' norm modules (Triton interpreter on the CPU).

Tolerance: the kernels keep transformers' rounding steps; only the fp32 sum of squares is reduced in another
order, so fp32 outputs agree to 1e-6 relative; in bf16 a flipped rounding of the normalised value can pass through
the gated norm's two further bf16 roundings: one ulp (2^-7 relative) for the RMSNorm, four (2^-5) for the gated one.
"""
import pytest
import torch

pytest.importorskip("triton")

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling  # noqa: E402

from hybridspec_hf.kernels.norm_triton import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    rms_norm,
)


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(JITFunction, "__call__", lambda self, *args, **kwargs: InterpretedFunction(self.fn)(*args, **kwargs))
        yield


TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 5, 96), (1, 16, 20)])
def test_rms_norm_equals_the_module(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    module = modeling.Qwen3_5MoeRMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(shape[-1], generator=gen) * 0.3)
    module = module.to(dtype)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    forward = getattr(type(module), "_hybridspec_original_forward", type(module).forward)  # transformers' own
    torch.testing.assert_close(rms_norm(x, module.weight, module.eps), forward(module, x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 4, 8), (1, 16, 6, 10), (2, 3, 32, 128)])
def test_gated_rms_norm_equals_the_module(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    module = modeling.Qwen3_5MoeRMSNormGated(shape[-1], eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(1 + torch.randn(shape[-1], generator=gen) * 0.2)
    module = module.to(dtype)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).reshape(-1, shape[-1])
    z = (torch.randn(shape, generator=gen) * 2).to(dtype).reshape(-1, shape[-1])
    forward = getattr(type(module), "_hybridspec_original_forward", type(module).forward)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2**-5, atol=2**-5)
    torch.testing.assert_close(gated_rms_norm(x, z, module.weight, module.variance_epsilon), forward(module, x, z), **tol)


def test_fused_kernels_switch_off_with_the_environment(monkeypatch):
    from hybridspec_hf.kernels import fused_kernels, fused_kernels_active

    with fused_kernels():
        assert fused_kernels_active()
    monkeypatch.setenv("HYBRIDSPEC_FUSED_KERNELS", "0")
    with fused_kernels():
        assert not fused_kernels_active()
    assert not fused_kernels_active()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_reads_a_gate_sliced_from_a_wider_projection(dtype):
    """The GDN layer's z as a column slice of the concatenated projection GEMM, split into heads: [B, T, HV, dv]
    with a token stride wider than HV·dv, read in place."""
    gen = torch.Generator().manual_seed(7)
    batch, t, heads, dv = 2, 5, 3, 16
    module = modeling.Qwen3_5MoeRMSNormGated(dv, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(1 + torch.randn(dv, generator=gen) * 0.2)
    module = module.to(dtype)
    wide = (torch.randn(batch, t, heads * dv + 40, generator=gen) * 2).to(dtype)
    z = wide[..., 24 : 24 + heads * dv].reshape(batch, t, heads, dv)
    x = (torch.randn(batch, t, heads, dv, generator=gen) * 2).to(dtype)
    forward = getattr(type(module), "_hybridspec_original_forward", type(module).forward)
    expected = forward(module, x.reshape(-1, dv), z.reshape(-1, dv)).view(x.shape)
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2**-5, atol=2**-5)
    torch.testing.assert_close(gated_rms_norm(x, z, module.weight, module.variance_epsilon), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_heads_sliced_from_a_wider_projection(dtype):
    """The attention's k as a column slice of the one q|k|v GEMM, split into heads: [B, T, heads, D] with a token
    stride wider than heads·D, read in place (no copy) and normalised as the contiguous tensor is."""
    gen = torch.Generator().manual_seed(11)
    batch, t, heads, dim = 2, 5, 3, 12
    module = modeling.Qwen3_5MoeRMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(dim, generator=gen) * 0.3)
    module = module.to(dtype)
    wide = (torch.randn(batch, t, heads * dim + 20, generator=gen) * 2).to(dtype)
    k = wide[..., 8 : 8 + heads * dim].view(batch, t, heads, dim)
    assert k.reshape(-1, heads, dim).data_ptr() == k.data_ptr()  # the kernel's rows: a view, not a copy
    forward = getattr(type(module), "_hybridspec_original_forward", type(module).forward)
    expected = forward(module, k.contiguous())
    torch.testing.assert_close(rms_norm(k, module.weight, module.eps), expected, **TOL[dtype])


def bf16_truncated(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits: what the Triton interpreter's cast does (the GPU rounds to
    nearest, as torch does)."""
    return (values.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 48), (2, 5, 96), (1, 16, 20), (1, 3, 2047)])
def test_add_rms_norm_equals_the_residual_add_and_the_module(shape, dtype):
    """h = residual + x as transformers' decoder layer rounds it (fp32: bit for bit; bf16: the one fp32 sum, cast
    once: bit for bit with the interpreter's truncating cast, within one rounding of torch's), and the module's
    norm of that h (fp32 1e-6; bf16 one ulp, as `rms_norm`). The residual is a strided view (rows of a wider
    tensor), as a layer's input can be."""
    gen = torch.Generator().manual_seed(sum(shape) + 2)
    hidden = shape[-1]
    module = modeling.Qwen3_5MoeRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden, generator=gen) * 0.3)
    module = module.to(dtype)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    residual = (torch.randn(*shape[:-1], hidden + 5, generator=gen) * 5).to(dtype)[..., 3 : 3 + hidden]
    h, y = add_rms_norm(x, residual, module.weight, module.eps)
    forward = getattr(type(module), "_hybridspec_original_forward", type(module).forward)
    expected_h = residual + x
    assert h.shape == y.shape == x.shape and h.dtype == y.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(h, expected_h)
    else:
        assert torch.equal(h, bf16_truncated(residual.float() + x.float()))
        torch.testing.assert_close(h, expected_h, rtol=2**-7, atol=0.0)
    torch.testing.assert_close(y, forward(module, h), **TOL[dtype])  # the norm of the h it wrote
    torch.testing.assert_close(y, forward(module, expected_h), rtol=2**-6, atol=2**-6)
    ref_h, ref_y = add_rms_norm_reference(x, residual, module.weight, module.eps)
    assert torch.equal(ref_h, expected_h) and torch.equal(ref_y, forward(module, expected_h))
