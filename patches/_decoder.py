"""Fused decoder layers inside GPU-resident forwards only: the residual add after the token mixer and the RMSNorm
before the MLP in one launch (kernels/norm_triton.py `add_rms_norm`).

transformers' hybrid decoder layer runs input_layernorm, the token mixer (GDN or gated attention), `residual +
hidden_states`, post_attention_layernorm, the MLP or MoE block, `residual + hidden_states`. The patched layer runs

    input_layernorm (module call) → token mixer (module call, the same arguments) →
    add_rms_norm: h = residual + mixer output, normed = post_attention_layernorm(h) →
    `moe_block_add(mlp, normed, h)` (patches/_moe.py) for a sparse MoE block, h + mlp(normed) for a dense MLP

one launch fewer per layer (40 per step at Qwen3.5-35B-A3B's shape, at every verified length). In a layer with a
sparse MoE block the add, the norm and the block's router (GEMM, softmax top-k) run in one launch up to 16
tokens (patches/_moe.py `norm_route_block_add`: two launches fewer again; the router's forward hooks still run).
The layer's output is the same tensor transformers computes (same sums, same roundings), returned by the layer's
module call, so forward hooks on the layer (our FeatureCapture, transformers' output capturing of `hidden_states`)
see what they saw. post_attention_layernorm is skipped: a hook on it (or a replaced forward, another norm class)
keeps transformers' forward.

The patch is inert unless `fused_kernels()` is active, grad is off and the input is on CUDA (or `_ON_CPU`, tests) in
a float dtype the kernel takes, so plain generate(), training and every CPU path run transformers' code unchanged.
It keeps each transformers version's signature: it is installed only on layers whose forward takes exactly the
arguments of a layout it knows (`LAYOUTS`: 5.17's `past_key_values`, 5.23+'s `cache`), and any call it does not
recognise (a deprecated argument name, missing or duplicated arguments) runs the original forward.

HYBRIDSPEC_FUSED_DECODER=0 in the environment switches this fusion and the attention's one q|k|v GEMM off (read
when a layer runs, so graphs captured afterwards follow it; for A/B timings), leaving the other fused kernels on;
HYBRIDSPEC_FUSED_KERNELS=0 switches them all off.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from hybridspec_hf.kernels import fused_kernels_active, gemv_triton
from hybridspec_hf.kernels.norm_triton import add_rms_norm

from ._moe import moe_block_add, norm_route_block_add
from ._norms import INPUT_NORM
from ._weight_copies import hooked

__all__ = ["LAYOUTS", "decoder_fusion_allowed", "patch_decoder_layer"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ON_CPU = False  # tests only: take the fused route on CPU tensors too (with the Triton interpreter)
_MIXERS = ("linear_attention", "full_attention")
_CACHE_NAMES = {"cache", "past_key_values"}

# the layer forward's parameters after `hidden_states` (before **kwargs) -> the keyword under which the layer hands
# its cache to the GDN layer and to the attention layer
LAYOUTS = {
    ("position_embeddings", "attention_mask", "position_ids", "cache"): ("cache", "cache"),  # transformers ≥ 5.23
    ("position_embeddings", "attention_mask", "position_ids", "past_key_values"):  # transformers 5.17
        ("cache_params", "past_key_values"),
}


def patch_decoder_layer(layer_cls: type, norm_cls: type, moe_block_cls: type | None) -> None:
    """Install the fused path on a family's decoder layer class (idempotent); a forward whose parameters match no
    layout of `LAYOUTS` (another transformers version) is left as it is."""
    if "_hybridspec_original_forward" in layer_cls.__dict__:
        return
    original = layer_cls.forward
    parameters = list(inspect.signature(inspect.unwrap(original)).parameters.values())
    names = tuple(p.name for p in parameters[2:-1])
    if len(parameters) < 3 or parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD or names not in LAYOUTS:
        return
    mixer_cache = LAYOUTS[names]
    # transformers 5.24 (not 5.17) wraps a checkpointing layer class's forward when the class is made, and
    # checkpoints only where that wrapper is the class's forward: ours goes inside it, and the same hook wraps ours
    rewrap = _checkpointing_wrapper(layer_cls)
    inner = original.__wrapped__ if rewrap is not None else original

    @functools.wraps(inner)
    def forward(self, hidden_states, *args, **kwargs):
        bound = _bind(names, args, kwargs) if _fusable(self, hidden_states, norm_cls) else None
        if bound is None:
            return inner(self, hidden_states, *args, **kwargs)
        arguments, rest = bound
        return _fused_forward(self, hidden_states, arguments, rest, mixer_cache, moe_block_cls)

    layer_cls._hybridspec_original_forward = original
    layer_cls.forward = forward
    if rewrap is not None:
        rewrap(layer_cls)


def _checkpointing_wrapper(layer_cls: type):
    """transformers' GradientCheckpointingLayer.__init_subclass__ (as a function of the class) when it wrapped this
    class's forward (transformers 5.24), else None (5.17 checkpoints in `__call__`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    hook = GradientCheckpointingLayer.__dict__.get("__init_subclass__")
    wrapped = issubclass(layer_cls, GradientCheckpointingLayer) and hasattr(layer_cls.forward, "__wrapped__")
    return hook.__func__ if hook is not None and wrapped else None


def decoder_fusion_allowed() -> bool:
    """Whether HYBRIDSPEC_FUSED_DECODER leaves the decoder-layer fusion and the one q|k|v GEMM on (default)."""
    return os.environ.get("HYBRIDSPEC_FUSED_DECODER", "1") != "0"


def _fusable(layer: torch.nn.Module, hidden_states: torch.Tensor, norm_cls: type) -> bool:
    """Inside resident forwards, on a float CUDA tensor (or `_ON_CPU`), grad off, a known token mixer, and a
    post_attention_layernorm of the family's class with nothing else to run, on the input's device."""
    if not ((hidden_states.is_cuda or _ON_CPU) and fused_kernels_active() and hidden_states.dtype in _DTYPES
            and not torch.is_grad_enabled() and decoder_fusion_allowed()):
        return False
    norm = layer.post_attention_layernorm
    return (getattr(layer, "block_type", None) in _MIXERS and type(norm) is norm_cls and not hooked([norm])
            and norm.weight.device == hidden_states.device)


def _defers_input_norm(layer: torch.nn.Module, mixer: torch.nn.Module) -> bool:
    """Whether the layer leaves its input norm to the token mixer (`gemv_triton.NORM_PROLOGUE` on): the norm is of
    the family's class with nothing else to run (as post_attention_layernorm, `_fusable`), and the mixer's call runs
    our patch of its class forward first (no hooks, no replaced forward, not a subclass), which takes the norm."""
    norm = layer.input_layernorm
    return (gemv_triton.NORM_PROLOGUE and type(norm) is type(layer.post_attention_layernorm)
            and "_hybridspec_original_forward" in type(mixer).__dict__ and not hooked([norm, mixer]))


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[dict, dict] | None:
    """(the layer's named arguments, the remaining **kwargs) of a call, or None for a call the original forward
    must judge: too many positional arguments, one given twice, position_embeddings missing, or a cache under the
    other version's name (transformers ≥ 5.23 renames a deprecated `past_key_values` with a warning)."""
    if len(args) > len(names) or (_CACHE_NAMES - {names[-1]}) & kwargs.keys():
        return None
    arguments = dict(zip(names, args))
    if arguments.keys() & kwargs.keys():
        return None
    rest = dict(kwargs)
    arguments.update((name, rest.pop(name)) for name in names if name in rest)
    return (arguments, rest) if "position_embeddings" in arguments else None


def _fused_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, arguments: dict, rest: dict,
                   mixer_cache: tuple[str, str], moe_block_cls: type | None) -> torch.Tensor:
    """transformers' decoder layer forward with the first residual add and post_attention_layernorm in one launch
    (the same module calls to the input norm, the token mixer and the MLP)."""
    gdn_cache, attention_cache = mixer_cache
    cache = arguments.get("cache", arguments.get("past_key_values"))
    attention_mask = arguments.get("attention_mask")
    residual = hidden_states
    linear = layer.block_type == "linear_attention"
    mixer = layer.linear_attn if linear else layer.self_attn
    deferred = _defers_input_norm(layer, mixer)
    if deferred:  # the mixer applies it in its projection's prologue (patches/_norms.py)
        mixer.__dict__[INPUT_NORM] = layer.input_layernorm
    else:
        hidden_states = layer.input_layernorm(hidden_states)
    try:
        if linear:
            hidden_states = mixer(hidden_states=hidden_states, attention_mask=attention_mask, **{gdn_cache: cache},
                                  **rest)
        else:
            hidden_states, _ = mixer(hidden_states=hidden_states, attention_mask=attention_mask,
                                     position_ids=arguments.get("position_ids"), **{attention_cache: cache},
                                     position_embeddings=arguments["position_embeddings"], **rest)
    finally:
        mixer.__dict__.pop(INPUT_NORM, None)  # taken by the mixer's forward; gone even if it raised first
    norm = layer.post_attention_layernorm
    moe = moe_block_cls is not None and isinstance(layer.mlp, moe_block_cls)
    if moe:  # the add, the norm and the MoE router in one launch where it applies
        out = norm_route_block_add(layer.mlp, hidden_states, residual, norm)
        if out is not None:
            return out
    residual, hidden_states = add_rms_norm(hidden_states, residual, norm.weight, norm.eps)
    if moe:
        return moe_block_add(layer.mlp, hidden_states, residual)
    return residual + layer.mlp(hidden_states)
