"""The Qwen gated-attention layer of a GPU-resident forward in four launches.

transformers' forward (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; 5.17 names the cache `past_key_values`, 5.23+ `cache`):

    q, gate = q_proj(x) split per head;  k = k_proj(x);  v = v_proj(x)
    q, k = q_norm(q), k_norm(k);  q, k = RoPE(q, k);  keys, values = cache.update(k, v)
    o = attention(q, keys, values) · sigmoid(gate);  return o_proj(o)

Inside a resident forward (the static target announced its device-side length, `patches.static_cache_length`)
`fused_attention_forward` runs it as: the projections (one GEMM over the q|k|v weight copy when the caller has one,
else the three modules), `qk_prologue` (norms, RoPE and the cache write, kernels/attention_prologue_triton.py),
`static_attention` with the output gate applied as its rows are written, and o_proj (a module call). At the AR step
that is 5 launches where the layer took ≈ 17. It returns None, and the caller runs transformers' forward, whenever
something it would skip has to run or is not what it expects: hooks on q_norm/k_norm, norm classes other than the
family's RMSNorm, a cache layer that is not a static one, attention weights requested, training, dropout, a sliding
window, shapes the kernels do not take.

The cache layer's `cumulative_length` is not advanced (transformers' update adds T): the static target resets it to
its length at every commit, and nothing later in a resident forward reads it.
"""
from __future__ import annotations

import functools
import inspect

import torch

from hybridspec_hf.kernels import attention_prologue_triton
from hybridspec_hf.kernels.attention_prologue_triton import qk_prologue
from hybridspec_hf.kernels.attention_triton import routed, static_attention
from hybridspec_hf.kernels.gemv_triton import linear

from ._norms import normed
from ._weight_copies import hooked

ENABLED = True  # False: resident forwards run transformers' attention forward (with our attention function)

_CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers 5.23+, 5.17


@functools.lru_cache(maxsize=None)
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def _norm_eps(norm: torch.nn.Module) -> float | None:
    """The epsilon of a family RMSNorm patched by patches/_norms.py ((1 + w) convention), else None."""
    if "_hybridspec_original_forward" not in type(norm).__dict__ or hooked([norm]):
        return None
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    return eps if isinstance(eps, float) else None


def _static_layer(cache, layer_idx: int):
    layers = getattr(cache, "layers", None)
    if layers is None or not 0 <= layer_idx < len(layers):
        return None
    layer = layers[layer_idx]
    keys = getattr(layer, "keys", None)
    if type(layer).__name__ != "StaticLayer" or not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return None
    return layer


def fused_attention_forward(attention: torch.nn.Module, original, qkv_weight: torch.Tensor | None,
                            length: torch.Tensor | None, hidden_states: torch.Tensor, args: tuple, kwargs: dict,
                            input_norm: torch.nn.Module | None = None):
    """(attn_output, None) of `attention`'s forward called as original(attention, hidden_states, *args, **kwargs),
    computed by the fused kernels, or None when this call must run transformers' forward (module docstring).
    qkv_weight: the layer's [q_proj; k_proj; v_proj] weight copy when current (else the three modules run);
    length: the static cache's committed length announced by the resident forward (None: not inside one);
    input_norm: the decoder's input norm still to apply to hidden_states (in the q|k|v GEMM's prologue), or None."""
    if not ENABLED or length is None or attention.training or kwargs.get("output_attentions"):
        return None
    if not getattr(attention, "is_causal", True) or getattr(attention, "sliding_window", None) is not None:
        return None
    try:
        bound = _signature(original).bind(attention, hidden_states, *args, **kwargs).arguments
    except TypeError:
        return None
    cache = next((bound[name] for name in _CACHE_ARGUMENTS if bound.get(name) is not None), None)
    position_embeddings = bound.get("position_embeddings")
    layer = _static_layer(cache, getattr(attention, "layer_idx", -1))
    eps_q, eps_k = _norm_eps(attention.q_norm), _norm_eps(attention.k_norm)
    if layer is None or position_embeddings is None or eps_q is None or eps_q != eps_k:
        return None
    keys, values = layer.keys, layer.values
    # the attention kernel must take this cache (flags, device, dtype, head_dim) before any projection runs: a
    # fallback after them would compute them twice, and inside a capture replay the discarded GEMM every round
    if not routed(keys, keys, values) or hidden_states.dtype != keys.dtype:
        return None
    batch, tokens, _ = hidden_states.shape
    dim = attention.head_dim
    if qkv_weight is not None:
        q_width = attention.q_proj.out_features
        kv_width = attention.k_proj.out_features
        q_gate, k, v = linear(hidden_states, qkv_weight, norm=input_norm).split([q_width, kv_width, kv_width], dim=-1)
    else:
        hidden_states = normed(input_norm, hidden_states)
        q_gate, k, v = attention.q_proj(hidden_states), attention.k_proj(hidden_states), attention.v_proj(hidden_states)
    q_gate = q_gate.view(batch, tokens, -1, 2 * dim)
    query, gate = q_gate[..., :dim], q_gate[..., dim:]  # [B, T, Hq, D] each, strided (transformers' torch.chunk)
    query = query.transpose(1, 2)
    key = k.view(batch, tokens, -1, dim).transpose(1, 2)
    value = v.view(batch, tokens, -1, dim).transpose(1, 2)
    cos, sin = position_embeddings
    if (not attention_prologue_triton.supported(query, key, value, cos, keys, values) or cos.shape != sin.shape
            or cos.stride() != sin.stride() or not routed(query, keys, values)):
        return None
    query = qk_prologue(query, key, value, attention.q_norm.weight, attention.k_norm.weight, eps_q, cos, sin,
                        keys, values, length)
    out = static_attention(query, keys, values, length, attention.scaling, causal=True, gate=gate)
    return attention.o_proj(out.view(batch, tokens, -1)), None
