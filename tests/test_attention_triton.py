"""Static-cache attention (kernels/attention_triton.py) against its fp32 reference and torch SDPA with the same boolean
mask, and wired into the resident forwards (patches/_attention.py for the target, `draft_static` for the drafter)
on CPU tensors under the Triton interpreter.

Tolerances (outputs are convex combinations of values of magnitude ~1): fp32 1e-4 (measured ~5e-7: only the order
of the fp32 sums differs); bf16 2e-2 (measured ~2e-3): the probabilities are rounded to bf16 before the P·V dot, as
flash attention does, and the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest. Slots past the
live keys hold garbage (large values, NaN) that must not change a single bit of the output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _tiny import VOCAB, make_drafter, make_target  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.drafter import StaticDraftContext, modeling_dflash  # noqa: E402
from hybridspec_hf.kernels import attention_triton  # noqa: E402
from hybridspec_hf.kernels.attention_triton import (  # noqa: E402
    attention_reference,
    static_attention,
    supported,
    visible_keys,
)
from hybridspec_hf.patches import _attention, _attention_layer  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def cache_inputs(batch, q_heads, kv_heads, tokens, dim, lengths, slots, dtype, seed, garbage=1e4):
    """q [B, Hq, T, D] (a transposed [B, T, Hq, D] buffer, as the layers make it), k/v [B, Hk, S, D] live up to
    length + T (per row), `garbage` · randn past it; length [B] long."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, q_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, slots, dim, generator=gen)
    v = torch.randn(batch, kv_heads, slots, dim, generator=gen)
    length = torch.tensor(lengths, dtype=torch.long)
    dead = torch.arange(slots).view(1, 1, -1, 1) >= (length + tokens).view(-1, 1, 1, 1)
    junk = garbage * torch.randn(k.shape, generator=gen)
    return q, k.where(~dead, junk).to(dtype), v.where(~dead, junk.flip(-1)).to(dtype), length


def sdpa(q, k, v, length, scaling, causal=True, window=None):
    mask = visible_keys(length, q.shape[2], k.shape[2], causal, window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("length", [1, 37, 300])
def test_kernel_equals_reference_and_sdpa(length, tokens, group, dtype):
    q, k, v, lengths = cache_inputs(1, 2 * group, 2, tokens, 32, [length], 340, dtype, seed=length + tokens + group)
    scaling = 32**-0.5
    out = static_attention(q, k, v, lengths, scaling)
    assert out.shape == (1, tokens, 2 * group, 32) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, attention_reference(q, k, v, lengths, scaling), **TOL[dtype])
    torch.testing.assert_close(out, sdpa(q, k, v, lengths, scaling), **TOL[dtype])


@pytest.mark.parametrize("dim", [16, 64, 128, 256])
def test_head_dims_and_the_qwen35_shape(dim):
    """Every power-of-two head_dim the kernel takes; at 256 the Qwen3.5-35B-A3B attention (16 query heads, 2 KV
    heads: two row blocks of 64 per KV head at T = 16)."""
    q, k, v, lengths = cache_inputs(1, 16, 2, 16, dim, [300], 330, torch.bfloat16, seed=dim)
    out = static_attention(q, k, v, lengths, dim**-0.5)
    torch.testing.assert_close(out, attention_reference(q, k, v, lengths, dim**-0.5), **TOL[torch.bfloat16])


def test_garbage_past_the_length_never_leaks():
    """Slots past length + T are never read: large values, inf or NaN there leave every bit of the output as is."""
    q, k, v, lengths = cache_inputs(1, 4, 2, 4, 32, [37], 200, torch.float32, seed=1)
    live = 37 + 4
    clean = static_attention(q, k, v, lengths, 0.2, num_splits=3)
    for junk in (float("nan"), float("inf"), -3e38):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, live:] = junk
        v2[:, :, live:] = junk
        assert torch.equal(static_attention(q, k2, v2, lengths, 0.2, num_splits=3), clean)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 64])
def test_any_number_of_splits_gives_the_same_attention(splits):
    """Splits share the live keys in whole blocks; those past them exit and are left out of the merge."""
    q, k, v, lengths = cache_inputs(1, 8, 2, 16, 32, [150], 600, torch.float32, seed=2)
    out = static_attention(q, k, v, lengths, 0.17, num_splits=splits)
    torch.testing.assert_close(out, attention_reference(q, k, v, lengths, 0.17), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(False, None), (True, 5), (False, 5), (True, 40), (False, 300)])
def test_block_attention_and_sliding_windows(causal, window):
    """The drafter's rules: a non-causal block sees the context and its whole block; a window W keeps |i - j| < W."""
    q, k, v, lengths = cache_inputs(2, 4, 2, 8, 16, [37, 90], 120, torch.float32, seed=3)
    out = static_attention(q, k, v, lengths, 0.25, causal=causal, window=window, num_splits=4)
    reference = attention_reference(q, k, v, lengths, 0.25, causal=causal, window=window)
    torch.testing.assert_close(out, reference, **TOL[torch.float32])
    torch.testing.assert_close(out, sdpa(q, k, v, lengths, 0.25, causal, window), **TOL[torch.float32])


def test_rows_of_a_batch_use_their_own_lengths():
    q, k, v, lengths = cache_inputs(3, 4, 1, 4, 16, [1, 60, 17], 80, torch.float32, seed=4)
    out = static_attention(q, k, v, lengths, 0.25)
    for row in range(3):
        alone = static_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], lengths[row:row + 1], 0.25)
        torch.testing.assert_close(out[row:row + 1], alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, attention_reference(q, k, v, lengths, 0.25), **TOL[torch.float32])


def test_unsupported_shapes_are_refused():
    q, k, v, lengths = cache_inputs(1, 2, 1, 2, 12, [5], 16, torch.float32, seed=5)
    assert not supported(q, k, v)  # head_dim 12: the callers keep SDPA
    with pytest.raises(ValueError, match="head_dim a power of two"):
        static_attention(q, k, v, lengths, 0.3)
    q, k, v, lengths = cache_inputs(1, 3, 2, 2, 16, [5], 16, torch.float32, seed=5)
    assert not supported(q, k, v)  # 3 query heads over 2 KV heads
    q, k, v, lengths = cache_inputs(1, 2, 1, 2, 16, [5], 16, torch.float32, seed=5)
    assert supported(q, k, v) and not supported(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="length must be an integer"):
        static_attention(q, k, v, lengths.float(), 0.3)


def test_plan_fills_the_processors_and_bounds_the_splits(monkeypatch):
    monkeypatch.setattr(attention_triton, "_processors", lambda device: 132)  # the H200

    def shapes(q_heads, kv_heads, tokens, slots, dim=256, dtype=torch.bfloat16):
        return (torch.empty(1, q_heads, tokens, dim, dtype=dtype, device="meta"),
                torch.empty(1, kv_heads, slots, dim, dtype=dtype, device="meta"))

    # the Qwen3.5-35B-A3B verify: 2 KV heads x 2 row blocks of 64; 2,048 slots in 64 blocks of 32 keys
    assert attention_triton.plan(*shapes(16, 2, 16, 2048)) == (64, 32, 8, 2, 32, 2)
    assert attention_triton.plan(*shapes(16, 2, 1, 2048)) == (16, 64, 8, 1, 32, 1)  # the AR step: 8 rows
    assert attention_triton.plan(*shapes(16, 2, 16, 4096), window=64).splits == 3  # only W + T - 1 keys
    assert attention_triton.plan(*shapes(2, 1, 1, 100)).splits == 2  # never more splits than key blocks
    huge = attention_triton.plan(*shapes(1, 1, 1, 10**6, dim=64))
    assert huge.splits == attention_triton.MAX_SPLITS and huge.splits * huge.iters * huge.block_n >= 10**6
    assert attention_triton.plan(*shapes(16, 2, 16, 2048), num_splits=5).splits == 5


# --------------------------------------------------------------------------------------------------- wiring


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel route allowed on CPU tensors (the tests' switch), counting calls by the target and the drafter."""
    calls = {"target": 0, "drafter": 0}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return static_attention(*args, **kwargs)

        return call

    monkeypatch.setattr(attention_triton, "_ON_CPU", True)
    monkeypatch.setattr(_attention, "static_attention", counting("target"))
    monkeypatch.setattr(_attention_layer, "static_attention", counting("target"))  # the fused attention layer
    monkeypatch.setattr(modeling_dflash, "static_attention", counting("drafter"))
    return calls


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "qwen3_5_dense"])
def test_resident_generate_with_the_kernel_equals_ar(name, kernel_calls):
    """A whole resident generate() with the kernel in every target attention layer and in the drafter (float32,
    greedy): the same tokens as AR decoding, which runs transformers' SDPA throughout."""
    from test_exactness import run

    target = make_target(name, seed=9, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ar = target.generate(prompt, do_sample=False, max_new_tokens=12)
    assert kernel_calls == {"target": 0, "drafter": 0}  # plain generate() never takes the kernel
    drafter = make_drafter(target, 4, ar, error_rate=0.3).to(torch.float32)
    settings = hybridspec_hf.HybridSpecConfig(cuda_graphs="on")
    out = run(target, prompt, drafter, "dflash", 12, hybridspec_config=settings)
    assert torch.equal(out, ar)
    assert kernel_calls["target"] > 0 and kernel_calls["drafter"] > 0
    hybridspec_hf.release_graphs(target)


def test_the_route_is_inert_outside_resident_forwards(kernel_calls, monkeypatch):
    """Without the static target's length (prefill, plain forwards), without the flag, or with grad on, the
    attention layers run transformers' function; inside, they run the kernel and ignore the mask."""
    target = make_target("qwen3_5_moe", seed=10, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad(), patches.fused_kernels():
        target(ids)
    with torch.no_grad(), patches.static_cache_length(torch.tensor([0])):
        target(ids)
    with patches.fused_kernels(), patches.static_cache_length(torch.tensor([0])):
        target(ids)  # grad on
    assert kernel_calls["target"] == 0
    from hybridspec_hf.graphs.static_target import StaticTarget

    static = StaticTarget(target, 32, [])
    saved = [t.clone() for layer in static.cache.layers if patches.is_linear_cache_layer(layer)
             for t in (layer.conv_states[0], layer.recurrent_states[0])]

    def forward():  # 5 new tokens at slots 0..4, from the same GDN states each time
        static.reset()
        states = [t for layer in static.cache.layers if patches.is_linear_cache_layer(layer)
                  for t in (layer.conv_states[0], layer.recurrent_states[0])]
        for state, copy in zip(states, saved):
            state.copy_(copy)
        with torch.no_grad():
            return static.forward(ids)[0]

    fast = forward()
    assert kernel_calls["target"] == 1  # the tiny model's one attention layer
    monkeypatch.setattr(attention_triton, "_ON_CPU", False)
    masked = forward()
    assert kernel_calls["target"] == 1
    torch.testing.assert_close(fast, masked, rtol=1e-5, atol=1e-5)


def test_the_family_interface_keeps_transformers_functions_and_registrations():
    """A family module's interface is transformers' own plus our route in front of "sdpa" and "eager"."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    patches.install()
    functions = modeling.ALL_ATTENTION_FUNCTIONS
    assert isinstance(functions, AttentionInterface) and type(functions) is not AttentionInterface
    assert functions.get_interface("sdpa", None).__wrapped__ is sdpa_attention_forward
    eager = functions.get_interface("eager", modeling.eager_attention_forward)
    assert eager.__wrapped__ is modeling.eager_attention_forward
    mine = lambda *args, **kwargs: None  # noqa: E731
    AttentionInterface.register("hybridspec_test_attention", mine)
    try:
        assert functions.get_interface("hybridspec_test_attention", None) is mine  # registered after the patch
    finally:
        del AttentionInterface._global_mapping["hybridspec_test_attention"]


def test_draft_static_with_the_kernel_equals_the_masked_path(kernel_calls):
    """The drafter's static path with sliding-window and causal layers: the kernel (reading the live slots) against
    SDPA over the whole static context with the layers' masks."""
    target = make_target("qwen3_5_moe", seed=11, dtype=torch.float32)
    drafter = modeling_dflash.DFlashDrafter.from_target(
        target, num_layers=3, block_size=8, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        sliding_window=6, use_sliding_window=True, max_window_layers=1).to(torch.float32).eval()
    drafter.layers[2].self_attn.is_causal = False  # a non-causal window too (|i - j| < W)
    features = torch.randn(1, 150, drafter.fc.in_features)
    context = StaticDraftContext(drafter, 200, drafter.device, drafter.dtype)  # 208 slots: 4 splits of 64 keys
    context.append(features, 150)
    anchor = torch.tensor([[3]])
    with torch.no_grad():
        masked = drafter.draft_static(anchor, context)
        with patches.fused_kernels():
            fast = drafter.draft_static(anchor, context)
    assert kernel_calls["drafter"] == 3
    torch.testing.assert_close(fast, masked, rtol=1e-4, atol=1e-4)
