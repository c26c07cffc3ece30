"""What the round loop needs from transformers' hybrid caches (DynamicCache and StaticCache, 5.17 … 5.x)."""
from __future__ import annotations

import torch


def is_linear_cache_layer(layer) -> bool:
    """A GDN (linear-attention) cache layer: conv and recurrent states instead of keys and values."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def drop_last_tokens(cache, num_tokens: int) -> None:
    """Remove the last `num_tokens` positions from every attention layer (GDN layers are committed separately).

    Dynamic layers are sliced; static layers rewind their device-side length and zero the dropped slots, so the
    cache equals the one autoregressive decoding would hold after the same tokens.
    """
    if num_tokens <= 0:
        return
    for layer in cache.layers:
        if is_linear_cache_layer(layer) or not getattr(layer, "is_initialized", False):
            continue
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):  # StaticLayer
            layer.cumulative_length.sub_(num_tokens)
            stale = layer.cumulative_length + torch.arange(num_tokens, device=layer.keys.device)
            layer.keys.index_fill_(2, stale, 0)
            layer.values.index_fill_(2, stale, 0)
        elif hasattr(layer, "keys") and layer.keys is not None:  # DynamicLayer
            layer.keys = layer.keys[..., :-num_tokens, :]
            layer.values = layer.values[..., :-num_tokens, :]
        else:
            raise TypeError(
                f"HybridSpec cannot roll back cache layer {type(layer).__name__}; use DynamicCache or StaticCache."
            )


def check_supported_cache(cache) -> None:
    """Reject caches whose layers we cannot roll back (e.g. sliding-window, quantized or offloaded layers)."""
    for layer in cache.layers:
        if is_linear_cache_layer(layer):
            continue
        name = type(layer).__name__
        if name not in ("DynamicLayer", "StaticLayer"):
            raise ValueError(
                f"HybridSpec supports DynamicCache and StaticCache (attention layers DynamicLayer/StaticLayer); "
                f"this cache has a {name}. Pass cache_implementation=None or 'static'."
            )
        if getattr(layer, "record_past", False):
            raise ValueError("HybridSpec keeps no conv history: pass a cache without activate_past_recording().")


def gdn_layer_is_prefilled(cache, layer_idx: int) -> bool:
    layer = cache.layers[layer_idx]
    return layer.recurrent_states.get(0) is not None and layer.conv_states.get(0) is not None
