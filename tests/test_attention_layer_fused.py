"""The fused attention layer (patches/_attention_layer.py) against transformers' forward of the same layer, call for
call: the arguments a real forward passes (captured by a pre-hook while the model decodes over a StaticCache), the
cache state at that moment, then both forwards from that state. Float32 under the Triton interpreter: outputs within
1e-4 (the attention kernel's fp32 tolerance, tests/test_attention_triton.py), the new cache slots within 1e-5 (norm
sums in another order), every other slot bit-identical."""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from _tiny import VOCAB, make_target  # noqa: E402
from transformers import StaticCache  # noqa: E402

from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.kernels import attention_triton  # noqa: E402
from hybridspec_hf.patches import _attention_layer  # noqa: E402
from hybridspec_hf.patches._attention_layer import fused_attention_forward  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _attention(model):
    family = patches.family_of(model)
    return next(m for m in patches.text_model(model).modules() if isinstance(m, family.ATTENTION_CLASS))


def _captured_call(model, prompt: int, tokens: int, seed: int):
    """(layer, args, kwargs, cache layer, snapshot) of the attention layer's call while the model decodes `tokens`
    new tokens after `prompt` cached ones; the snapshot is the cache layer's (keys, values, cumulative_length) before
    that call."""
    layer = _attention(model)
    cache = StaticCache(config=model.config.get_text_config(), max_cache_len=32)
    gen = torch.Generator().manual_seed(seed)
    cache_kwarg = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, prompt), generator=gen), use_cache=True, **cache_kwarg)
    seen = {}

    def pre_hook(module, args, kwargs):
        cache_layer = cache.layers[module.layer_idx]
        seen.update(args=args, kwargs=dict(kwargs), layer=cache_layer,
                    snapshot=(cache_layer.keys.clone(), cache_layer.values.clone(),
                              cache_layer.cumulative_length.clone()))

    handle = layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, tokens), generator=gen), use_cache=True, **cache_kwarg)
    handle.remove()
    return layer, seen


def _split(seen):
    """(hidden_states, the other positional arguments, keyword arguments) of the captured call."""
    args, kwargs = list(seen["args"]), dict(seen["kwargs"])
    hidden = args.pop(0) if args else kwargs.pop("hidden_states")
    return hidden, args, kwargs


def _restore(seen):
    seen["layer"].keys.copy_(seen["snapshot"][0])
    seen["layer"].values.copy_(seen["snapshot"][1])
    seen["layer"].cumulative_length.copy_(seen["snapshot"][2])


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "qwen3_5_dense", "qwen3_5_moe_odd"])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("with_copy", [False, True])
def test_fused_layer_equals_transformers(name, tokens, with_copy, monkeypatch):
    model = make_target(name, seed=4, dtype=torch.float32)
    prompt = 6
    layer, seen = _captured_call(model, prompt, tokens, seed=4)
    hidden, args, kwargs = _split(seen)
    original = type(layer).__dict__.get("_hybridspec_original_forward", type(layer).forward)
    _restore(seen)
    with torch.no_grad():
        want, _ = original(layer, hidden, *args, **kwargs)
    want_keys, want_values = seen["layer"].keys.clone(), seen["layer"].values.clone()

    _restore(seen)
    monkeypatch.setattr(attention_triton, "_ON_CPU", True)
    weight = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]) if with_copy else None
    projected = []
    handle = layer.q_proj.register_forward_hook(lambda *a: projected.append(1))
    with torch.no_grad(), patches.fused_kernels(), patches.static_cache_length(torch.tensor([prompt])):
        got = fused_attention_forward(layer, original, weight, torch.tensor([prompt]), hidden, tuple(args), kwargs)
    handle.remove()
    if layer.head_dim & (layer.head_dim - 1):  # head_dim 12: the attention kernel takes powers of two only
        assert got is None and not projected  # refused before projecting (transformers' forward projects once)
        return
    assert len(projected) == (0 if with_copy else 1)
    assert got is not None, "the fused route should take this call"
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)
    assert got[1] is None
    new = slice(prompt, prompt + tokens)
    torch.testing.assert_close(seen["layer"].keys[:, :, new], want_keys[:, :, new], rtol=1e-5, atol=1e-5)
    assert torch.equal(seen["layer"].values[:, :, new], want_values[:, :, new])
    rest = torch.ones(want_keys.shape[2], dtype=torch.bool)
    rest[new] = False
    assert torch.equal(seen["layer"].keys[:, :, rest], seen["snapshot"][0][:, :, rest])
    assert torch.equal(seen["layer"].values[:, :, rest], seen["snapshot"][1][:, :, rest])


def test_fused_layer_steps_aside(monkeypatch):
    """None (transformers' forward runs) outside a resident forward, switched off, with a hook on q_norm, with
    attention weights requested, in training mode, and on CPU tensors without the tests' switch."""
    model = make_target("qwen3_5_moe", seed=5, dtype=torch.float32)
    layer, seen = _captured_call(model, 4, 2, seed=5)
    hidden, args, kwargs = _split(seen)
    original = type(layer).__dict__.get("_hybridspec_original_forward", type(layer).forward)

    def call(length=torch.tensor([4]), **extra):
        with torch.no_grad(), patches.fused_kernels():
            return fused_attention_forward(layer, original, None, length, hidden, tuple(args), {**kwargs, **extra})

    assert call() is None  # CPU tensors, no switch
    monkeypatch.setattr(attention_triton, "_ON_CPU", True)
    assert call(length=None) is None  # no static length announced: not a resident forward
    monkeypatch.setattr(_attention_layer, "ENABLED", False)
    assert call() is None
    monkeypatch.setattr(_attention_layer, "ENABLED", True)
    assert call(output_attentions=True) is None
    handle = layer.q_norm.register_forward_hook(lambda *a: None)
    assert call() is None
    handle.remove()
    layer.train()
    assert call() is None
    layer.eval()
    _restore(seen)
    assert call() is not None
    assert _attention_layer._norm_eps(layer.q_norm) == layer.q_norm.eps
