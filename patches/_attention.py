"""Our static-cache attention (kernels/attention_triton.py) in the target's attention layers, inside GPU-resident
forwards only.

transformers' attention layers pick their attention function at every forward from their modeling module's
`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)`. `patch_attention`
gives a family's modeling module its own AttentionInterface (transformers' documented way to override a function
for one model file), sharing the library's registrations, whose "sdpa" and "eager" run `static_attention` when
  - the static target announced its device-side length around its resident forward (`static_cache_length`),
  - `fused_kernels()` is active, grad is off, the tensors are on CUDA and the kernel takes them (`routed`),
  - the layer is the family's text attention (causal, no sliding window, no dropout).
Anything else runs transformers' own function unchanged: plain generate(), prefill, training, the vision tower,
CPU tensors. The dense mask is ignored on the kernel path: the kernel derives the visibility `StaticTarget.mask`
encodes (key j visible to new token i iff j <= length + i) from the same `length` tensor, so the read stops at the
live keys instead of the whole static capacity.
"""
from __future__ import annotations

import contextlib
import functools
from types import ModuleType

import torch
from transformers import AttentionInterface

from hybridspec_hf.kernels.attention_triton import routed, static_attention

_length: torch.Tensor | None = None  # the static target's [1] long length, while its resident forward runs


@contextlib.contextmanager
def static_cache_length(length: torch.Tensor):
    """Announce the static cache's committed length ([1] long, device) to the attention layers of one resident
    forward: their T new keys sit at slots length .. length+T-1 of the cache tensors they read."""
    global _length
    previous, _length = _length, length
    try:
        yield
    finally:
        _length = previous


class _StaticCacheAttention(AttentionInterface):
    """A family module's attention interface: the library's functions (registrations and the shared instance's
    local overrides, by reference), with "sdpa" and "eager" routed through `_route`."""

    def __init__(self, shared: AttentionInterface, attention_class: type):
        super().__init__()
        self._local_mapping = shared._local_mapping
        self.attention_class = attention_class

    def get_interface(self, attn_implementation: str, default):
        chosen = super().get_interface(attn_implementation, default)
        if attn_implementation in ("sdpa", "eager"):
            return _route(chosen, self.attention_class)
        return chosen


@functools.lru_cache(maxsize=None)
def _route(chosen, attention_class: type):
    @functools.wraps(chosen)
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if (_length is not None and isinstance(module, attention_class) and getattr(module, "is_causal", True)
                and getattr(module, "sliding_window", None) is None and kwargs.get("sliding_window") is None
                and not dropout and routed(query, key, value)):
            scale = module.scaling if scaling is None else scaling
            return static_attention(query, key, value, _length, scale, causal=True), None
        return chosen(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    return attention


def patch_attention(modeling: ModuleType, attention_class: type) -> None:
    """Give a family's modeling module the routed attention interface (idempotent)."""
    shared = getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None)
    if shared is None or isinstance(shared, _StaticCacheAttention):
        return
    modeling.ALL_ATTENTION_FUNCTIONS = _StaticCacheAttention(shared, attention_class)
