"""The skinny GEMM with int8 weight rows (`gemv_triton.linear_int8`, the drafter's int8 LM head) on the GPU: against
the float32 reference at a large head's shape, eager and replayed in a CUDA graph. Skipped without CUDA; the CPU
twin (the interpreter) is tests/test_head_quantization.py."""
import pytest
import torch

from hybridspec_hf.kernels import gemv_triton
from hybridspec_hf.kernels.gemv_triton import linear_int8, linear_int8_reference, quantize_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _eager_and_captured(x, quantized):
    """linear_int8 of x eagerly and replayed from a CUDA graph captured around it."""
    with torch.no_grad():
        eager = linear_int8(x, quantized)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = linear_int8(x, quantized)
        graph.replay()
    torch.cuda.synchronize()
    return eager, captured


@pytest.mark.parametrize("rows", [1, 15, 16])
def test_int8_rows_match_the_reference_eager_and_captured(rows):
    generator = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(60_000, 2048, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    quantized = quantize_rows(weight)
    x = torch.randn(rows, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    expected = linear_int8_reference(x, quantized).float()
    eager, captured = _eager_and_captured(x, quantized)
    scale = expected.abs().max()
    # one bf16 rounding of the output (2^-8 relative) and fp32 sums in another order
    assert ((eager.float() - expected).abs().max() / scale).item() < 2.0**-7
    assert torch.equal(eager, captured)
    # the int8 copy is close to the bf16 head it came from (≈ 0.4 % of a row's largest weight per element)
    full = torch.nn.functional.linear(x.float(), weight.float())
    assert ((eager.float() - full).abs().max() / full.abs().max()).item() < 0.02
    assert eager.dtype == torch.bfloat16 and gemv_triton.INT8_CONFIG.dot


@pytest.mark.parametrize("n,k", [(2048, 6144), (5120, 2048), (12288, 2048)])
def test_int8_drafter_projections_at_int8_config_eager_and_captured(n, k):
    """A drafter layer's projections in int8 at 16 rows (one request's block), at `int8_config`'s tiles (split K for
    N = 2048): the float32 reference within one bf16 rounding; eager = captured."""
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    quantized = quantize_rows((torch.randn(n, k, device="cuda", generator=generator) * 0.02).to(torch.bfloat16))
    x = torch.randn(16, k, device="cuda", generator=generator).to(torch.bfloat16)
    expected = linear_int8_reference(x, quantized).float()
    eager, captured = _eager_and_captured(x, quantized)
    assert ((eager.float() - expected).abs().max() / expected.abs().max()).item() < 2.0**-7
    assert torch.equal(eager, captured)
