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
live keys instead of the whole static capacity. So the static target may announce the mask as a function instead
of building it (`static_cache_length(length, mask)`, its layers then get None): the first layer that runs
transformers' function calls it, once per forward, and a forward whose layers all take the kernel builds none.

Inside the same forwards the attention's q_proj, k_proj and v_proj (one input) run as ONE GEMM over a concatenated
copy of their weights (`prepare_attention_projections`, made by the resident rounds before capture and refreshed in
place: patches/_weight_copies.py), by `gemv_triton.linear`: two launches fewer per attention layer. The attention
forward itself stays transformers' (each version's own): for that one call the three modules return their column
slices of the GEMM's output when called on its input (`_projections_given`). A hook on one of them, a replaced
forward, biases, a stale copy, or HYBRIDSPEC_FUSED_DECODER=0 (patches/_decoder.py) keep the three calls.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from hybridspec_hf.kernels import fused_kernels_active
from hybridspec_hf.kernels.attention_triton import routed, static_attention
from hybridspec_hf.kernels.gemv_triton import linear

from ._attention_layer import fused_attention_forward
from ._decoder import decoder_fusion_allowed
from ._norms import normed, take_input_norm
from ._weight_copies import (
    WeightCopy,
    concatenate_rows,
    current_copy,
    fusable_linears,
    hooked,
    plain_linears,
    refresh_copy,
)

_length: torch.Tensor | None = None  # the static target's [1] long length, while its resident forward runs
_mask: Callable[[], torch.Tensor] | None = None  # its dense mask on demand (layers given None), while it runs


@contextlib.contextmanager
def static_cache_length(length: torch.Tensor, mask: Callable[[], torch.Tensor] | None = None):
    """Announce the static cache's committed length ([1] long, device) to the attention layers of one resident
    forward: their T new keys sit at slots length .. length+T-1 of the cache tensors they read. `mask`: the
    forward passed its attention layers None for their mask; transformers' attention function gets mask() instead
    (the caller memoises it: one build per forward)."""
    global _length, _mask
    previous, _length, _mask = (_length, _mask), length, mask
    try:
        yield
    finally:
        _length, _mask = previous


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
        if attention_mask is None and _mask is not None and isinstance(module, attention_class):
            attention_mask = _mask()  # the static target's mask, built for the layers that need it
        return chosen(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    return attention


def patch_attention(modeling: ModuleType, attention_class: type) -> None:
    """Give a family's modeling module the routed attention interface (idempotent)."""
    shared = getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None)
    if shared is None or isinstance(shared, _StaticCacheAttention):
        return
    modeling.ALL_ATTENTION_FUNCTIONS = _StaticCacheAttention(shared, attention_class)


def routes_attention(modeling: ModuleType) -> bool:
    """Whether a family's attention layers pick their function through `_route` (`patch_attention` installed it),
    so that a resident forward may give them None for their mask (`static_cache_length`'s `mask`)."""
    return isinstance(getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None), _StaticCacheAttention)


# ---------------------------------------------------------------------------------------------------------------
# q_proj, k_proj and v_proj as one GEMM (GPU-resident forwards; patches/_weight_copies.py)

QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # in the order of the concatenation
_QKV = "_hybridspec_qkv"  # a WeightCopy of [q_proj; k_proj; v_proj] [Q + 2·KV, H] in the attention's __dict__


def prepare_attention_projections(layers: list[torch.nn.Module]) -> None:
    """Make (or refresh in place) each attention layer's concatenated q|k|v weight, one more copy of those weights:
    (8192 + 2·512) x 2048 bf16 ≈ 38 MB per layer at Qwen3.5-35B-A3B's shape (10 layers: ≈ 377 MB). Outside graph
    capture: the resident rounds call it before capturing and at the start of every generate() call. An existing
    copy is only refreshed, never dropped here, since captured graphs read it. None is made while
    HYBRIDSPEC_FUSED_DECODER=0."""
    for layer in layers:
        if _QKV in layer.__dict__:
            modules = plain_linears(layer, QKV_PROJECTIONS)
        else:
            modules = fusable_linears(layer, QKV_PROJECTIONS) if decoder_fusion_allowed() else None
        if modules is not None:
            refresh_copy(layer, _QKV, [m.weight for m in modules], concatenate_rows)


def release_attention_projections(layers: list[torch.nn.Module]) -> None:
    """Free the copies (the layers run their three projections until the next prepare)."""
    for layer in layers:
        layer.__dict__.pop(_QKV, None)


def _current_qkv(attention: torch.nn.Module, hidden_states: torch.Tensor) -> WeightCopy | None:
    """The attention's q|k|v copy inside a resident forward, if it is current and the three modules have nothing
    else to run."""
    if (not fused_kernels_active() or torch.is_grad_enabled() or _QKV not in attention.__dict__
            or not decoder_fusion_allowed()):
        return None
    modules = plain_linears(attention, QKV_PROJECTIONS)
    if modules is None or hooked(modules):
        return None
    copy = current_copy(attention, _QKV, [m.weight for m in modules])
    if copy is None or copy.weight.dtype != hidden_states.dtype or copy.weight.device != hidden_states.device:
        return None
    return copy


def _given_output(module: torch.nn.Module, given_input: torch.Tensor, output: torch.Tensor,
                  input: torch.Tensor) -> torch.Tensor:
    return output if input is given_input else F.linear(input, module.weight, module.bias)


@contextlib.contextmanager
def _projections_given(attention: torch.nn.Module, hidden_states: torch.Tensor, weight: torch.Tensor):
    """For one forward, q_proj, k_proj and v_proj called on `hidden_states` return their column slices of one GEMM
    over the concatenated weight (views: [B, T, N_i] with the token stride of the whole output); their own
    forwards (ours of patches/_linear.py, or the class's) are back afterwards."""
    modules = [getattr(attention, name) for name in QKV_PROJECTIONS]
    outputs = linear(hidden_states, weight).split([m.out_features for m in modules], dim=-1)
    previous = [m.__dict__.get("forward") for m in modules]
    for module, output in zip(modules, outputs):
        module.forward = functools.partial(_given_output, module, hidden_states, output)
    try:
        yield
    finally:
        for module, forward in zip(modules, previous):
            if forward is None:
                del module.__dict__["forward"]
            else:
                module.forward = forward


def patch_attention_projections(attention_class: type) -> None:
    """Install the resident forwards' paths on a family's attention class (idempotent): the fused layer
    (patches/_attention_layer.py) when it takes the call, else transformers' forward with the one-GEMM q|k|v. Without
    a current copy, or outside resident forwards, transformers' forward runs unchanged."""
    if "_hybridspec_original_forward" in attention_class.__dict__:
        return
    original = attention_class.forward

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        norm = take_input_norm(self)  # the decoder's input norm, if it left it to this layer
        copy = _current_qkv(self, hidden_states)
        if _length is not None:  # a resident forward: the whole layer in four launches when it can
            fused = fused_attention_forward(self, original, None if copy is None else copy.weight, _length,
                                            hidden_states, args, kwargs, norm)
            if fused is not None:
                return fused
        hidden_states = normed(norm, hidden_states)
        if copy is None:
            return original(self, hidden_states, *args, **kwargs)
        with _projections_given(self, hidden_states, copy.weight):
            return original(self, hidden_states, *args, **kwargs)

    attention_class._hybridspec_original_forward = original
    attention_class.forward = forward
