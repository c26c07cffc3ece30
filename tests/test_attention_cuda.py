"""Static-cache attention on CUDA: the compiled kernels at the Qwen3.5-35B-A3B attention shape (16 query heads, 2 KV
heads, head_dim 256), in a CUDA graph whose length moves between replays, and the resident forwards taking it.
Skipped without CUDA; the CPU twin (Triton interpreter) is tests/test_attention_triton.py, whose inputs and
tolerances these reuse (bf16 2e-2: here the GPU rounds to nearest, so errors are about half the interpreter's)."""
import pytest
import torch
from test_attention_triton import TOL, cache_inputs, sdpa

from hybridspec_hf.kernels.attention_triton import attention_reference, static_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def on_cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,causal", [(1, True), (4, True), (16, True), (16, False)])
@pytest.mark.parametrize("length", [1, 37, 300, 1900])
def test_compiled_kernel_equals_reference_and_sdpa(length, tokens, causal, dtype):
    q, k, v, lengths = on_cuda(*cache_inputs(1, 16, 2, tokens, 256, [length], 2048, dtype, seed=length + tokens))
    out = static_attention(q, k, v, lengths, 256**-0.5, causal=causal)
    torch.testing.assert_close(out, attention_reference(q, k, v, lengths, 256**-0.5, causal), **TOL[dtype])
    torch.testing.assert_close(out, sdpa(q, k, v, lengths, 256**-0.5, causal), **TOL[dtype])


@pytest.mark.parametrize("dim,window", [(64, None), (128, None), (128, 40), (16, 7)])
def test_other_head_dims_windows_and_batch_rows(dim, window):
    q, k, v, lengths = on_cuda(*cache_inputs(3, 8, 2, 8, dim, [5, 400, 1000], 1100, torch.bfloat16, seed=dim))
    for causal in (True, False):
        out = static_attention(q, k, v, lengths, dim**-0.5, causal=causal, window=window)
        reference = attention_reference(q, k, v, lengths, dim**-0.5, causal, window)
        torch.testing.assert_close(out, reference, **TOL[torch.bfloat16])


def test_a_captured_graph_follows_the_length_and_never_reads_past_it():
    """One capture at the static capacity; replays at other lengths (moved in place, as the rounds do) equal the
    reference, and NaN in the slots past length + T never reaches the output."""
    q, k, v, lengths = on_cuda(*cache_inputs(1, 16, 2, 16, 256, [40], 2048, torch.bfloat16, seed=7))
    out = torch.empty(1, 16, 16, 256, dtype=torch.bfloat16, device="cuda")

    def step():
        out.copy_(static_attention(q, k, v, lengths, 256**-0.5))

    step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for length in (40, 1, 700, 2032):
        lengths.fill_(length)
        k[:, :, length + 16:] = float("nan")
        v[:, :, length + 16:] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        reference = attention_reference(q, k.nan_to_num(), v.nan_to_num(), lengths, 256**-0.5)
        torch.testing.assert_close(out, reference, **TOL[torch.bfloat16])
        k.nan_to_num_(0.5)
        v.nan_to_num_(0.5)
