"""What the round loop needs from transformers' hybrid caches (DynamicCache and StaticCache, 5.17 … 5.x)."""
from __future__ import annotations

import torch


def is_linear_cache_layer(layer) -> bool:
    """A GDN (linear-attention) cache layer: conv and recurrent states instead of keys and values."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def attention_length(cache) -> int:
    """Positions the cache holds: the first attention layer's length (0 before any is filled). Not
    `cache.get_seq_length()`: from transformers 5.25 on that reads layer 0, a GDN layer in these models, whose own
    count (`cumulative_length_linear`) only transformers' conv updates advance, not our commits (`sync_linear_lengths`
    puts it right at the end of a call)."""
    for index, layer in enumerate(cache.layers):
        if not is_linear_cache_layer(layer):
            return int(cache.get_seq_length(index))
    return int(cache.get_seq_length())


def sync_linear_lengths(cache) -> None:
    """Set every GDN layer's token count (`cumulative_length_linear`, transformers ≥ 5.25) to the attention layers'
    length, as transformers' own decoding leaves it: our verifications never touch it and our commits rebuild the
    states directly, so without this `cache.get_seq_length()` would still count the prompt alone after a call (and
    a later generate() on the same cache would place its tokens there). No-op where the layers keep no count."""
    layers = [layer for layer in cache.layers
              if is_linear_cache_layer(layer) and isinstance(getattr(layer, "cumulative_length_linear", None),
                                                              torch.Tensor)]
    if layers:
        length = attention_length(cache)
        for layer in layers:
            layer.cumulative_length_linear.fill_(length)


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


def keep_rows(cache, index: torch.Tensor) -> None:
    """Keep only the batch rows `index` [n] long of every layer: attention K/V and GDN conv/recurrent states."""
    for layer in cache.layers:
        layer.reorder_cache(index)


def row_snapshot(cache, row: int, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one batch row's cache, per layer: attention (keys, values) [H, n, D] at `slots` [n] long, in that
    order; GDN layers (conv state [C, K], recurrent state [HV, dk, dv])."""
    snapshot = []
    for layer in cache.layers:
        if is_linear_cache_layer(layer):
            snapshot.append((layer.conv_states[0][row].clone(), layer.recurrent_states[0][row].clone()))
        else:
            snapshot.append((layer.keys[row].index_select(-2, slots), layer.values[row].index_select(-2, slots)))
    return snapshot


def set_rows(cache, snapshots: list[list[tuple[torch.Tensor, torch.Tensor]]], length: int) -> None:
    """Rebuild every layer of a DynamicCache from per-row `row_snapshot`s: attention K/V [B, H, length, D], row b's
    own n_b ≤ length positions first and zeros after them; GDN states stacked in row order."""
    for index, layer in enumerate(cache.layers):
        parts = [snapshot[index] for snapshot in snapshots]
        if is_linear_cache_layer(layer):
            layer.conv_states[0] = torch.stack([conv for conv, _ in parts])
            layer.recurrent_states[0] = torch.stack([state for _, state in parts])
            continue
        keys, values = parts[0]
        shape = (len(parts), keys.shape[0], length, keys.shape[-1])
        layer.keys, layer.values = keys.new_zeros(shape), values.new_zeros(shape)
        for row, (keys, values) in enumerate(parts):
            n = min(keys.shape[-2], length)
            layer.keys[row, :, :n] = keys[:, :n]
            layer.values[row, :, :n] = values[:, :n]
