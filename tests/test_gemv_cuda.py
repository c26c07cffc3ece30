"""The skinny GEMM on the GPU: with int8 weight rows (`gemv_triton.linear_int8`, the drafter's int8 LM head) against
the float32 reference at a large head's shape, and with the gated norm in its prologue (`GatedNorm`, the GDN
out_proj) against the norm's launch followed by the GEMM at the 35B-A3B out_proj's shape, eager and replayed in a
CUDA graph. Skipped without CUDA; the CPU twins (the interpreter) are tests/test_head_quantization.py and
tests/test_gemv_triton.py."""
import pytest
import torch

from hybridspec_hf.kernels import gemv_triton
from hybridspec_hf.kernels.gemv_triton import linear_int8, linear_int8_reference, quantize_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("rows", [1, 15, 16])
def test_int8_rows_match_the_reference_eager_and_captured(rows):
    generator = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(60_000, 2048, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    quantized = quantize_rows(weight)
    x = torch.randn(rows, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    expected = linear_int8_reference(x, quantized).float()
    with torch.no_grad():
        eager = linear_int8(x, quantized)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = linear_int8(x, quantized)
        graph.replay()
    torch.cuda.synchronize()
    scale = expected.abs().max()
    # one bf16 rounding of the output (2^-8 relative) and fp32 sums in another order
    assert ((eager.float() - expected).abs().max() / scale).item() < 2.0**-7
    assert torch.equal(eager, captured)
    # the int8 copy is close to the bf16 head it came from (≈ 0.4 % of a row's largest weight per element)
    full = torch.nn.functional.linear(x.float(), weight.float())
    assert ((eager.float() - full).abs().max() / full.abs().max()).item() < 0.02
    assert eager.dtype == torch.bfloat16 and gemv_triton.INT8_CONFIG.dot


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_gated_prologue_at_the_out_proj_shape_eager_and_captured(rows):
    """32 heads of 128 channels into 2048 at TABLE's config for the rows: the norm's launch then the GEMM, within one
    bf16 rounding of each normed input (the two kernels may sum a head's squares in another order: a last-bit
    rsqrt difference can move a normed value by one bf16 ulp) and the fp32 sums' order; eager = captured."""
    from hybridspec_hf.kernels.norm_triton import gated_rms_norm

    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=generator).to(torch.bfloat16)
    z = torch.randn(rows, 12352, device="cuda", generator=generator).to(torch.bfloat16)[:, 8192:12288]
    weight = (torch.randn(2048, 4096, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    norm_weight = (1 + 0.2 * torch.randn(128, device="cuda", generator=generator)).to(torch.bfloat16)
    config = gemv_triton.TABLE[(2048, 4096, gemv_triton.m_bucket(rows))]
    gate = gemv_triton.GatedNorm(z, norm_weight, 1e-6)
    with torch.no_grad():
        normed = gated_rms_norm(x.view(rows, 32, 128), z.reshape(rows, 32, 128), norm_weight, 1e-6)
        expected = gemv_triton.gemv(normed.reshape(rows, 4096), weight, None, config).float()
        eager = gemv_triton.gemv(x, weight, None, config, gate=gate)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gemv_triton.gemv(x, weight, None, config, gate=gate)
        graph.replay()
    torch.cuda.synchronize()
    magnitude = normed.float().abs() @ weight.float().abs().T
    limit = 2.0**-8 * magnitude + 2.0**-7 * expected.abs()
    assert bool(((eager.float() - expected).abs() <= limit).all())
    assert torch.equal(eager, captured) and eager.dtype == torch.bfloat16
