"""Model-family patches (shipped as `hybridspec_hf.patches`): one file per family, nothing else imports internals.

Each family module exposes NAME, GDN_CLASS, ATTENTION_CLASS, DECODER_LAYER_CLASS, ROTARY_CLASS, MODEL_CLASSES,
MOE_BLOCK_CLASS, ROUTER_CLASS, `router_normalizes` (None for dense families) and `project_gdn_inputs`.
"""
from __future__ import annotations

import weakref
from types import ModuleType

import torch

from ._attention import (
    patch_attention,
    patch_attention_projections,
    prepare_attention_projections,
    release_attention_projections,
    routes_attention,
    static_cache_length,
)
from ._cache import is_linear_cache_layer
from ._decoder import patch_decoder_layer
from ._gdn import (
    GDN_KERNEL_FUNCTIONS,
    VerifySession,
    check_verified,
    commit_session,
    patch_gdn_class,
    per_token_state_buffer,
    prepare_gdn_projections,
    release_gdn_projections,
    route_cpu_to_torch,
)
from ._linear import prepare_linears, release_linears
from ._moe import (
    mask_invalid_routes,
    moe_block_add,
    patch_moe_classes,
    prepare_fused_moe,
    release_fused_moe,
    routing_pre_hook,
)
from ._norms import fused_kernels, patch_norm_classes
from ._rope import RopeTable, patch_rope, patch_rotary_embedding, rope_slots
from .experts import cpu_verification_blocks, fused_experts_for, register_experts_implementation


def _families() -> list[ModuleType]:
    from . import qwen3_5, qwen3_5_moe, qwen3_next

    return [qwen3_5_moe, qwen3_5, qwen3_next]


def supported_classes() -> list[type]:
    return [cls for family in _families() for cls in family.MODEL_CLASSES]


def family_of(model: torch.nn.Module) -> ModuleType:
    """The family module of a supported hybrid target, or a ValueError that says what is supported."""
    for family in _families():
        if isinstance(model, family.MODEL_CLASSES):
            return family
    names = ", ".join(cls.__name__ for cls in supported_classes())
    raise ValueError(
        f"HybridSpec supports hybrid Gated-DeltaNet targets ({names}); got {type(model).__name__}. "
        "For other models use transformers' own assisted decoding (generate without generation_strategy)."
    )


def install() -> None:
    """Patch every family's GDN layer with verify mode, its RMSNorms, RoPE (rotation; cos/sin by table), attention
    function and q|k|v projections, decoder layers (residual add + RMSNorm) and MoE blocks (router, shared expert)
    with the fused paths (all inert outside HybridSpec's resident forwards), route CPU tensors of transformers' GDN
    kernel functions to their torch references (fla crashes on CPU tensors), and register
    experts_implementation="hybridspec" (idempotent)."""
    for family in _families():
        patch_gdn_class(family.GDN_CLASS, family.project_gdn_inputs)
        route_cpu_to_torch(family.modeling)
        patch_norm_classes(family.RMS_NORM_CLASS, family.GATED_NORM_CLASS)
        patch_rope(family.modeling)
        patch_rotary_embedding(family.ROTARY_CLASS)
        patch_attention(family.modeling, family.ATTENTION_CLASS)
        patch_attention_projections(family.ATTENTION_CLASS)
        patch_decoder_layer(family.DECODER_LAYER_CLASS, family.RMS_NORM_CLASS, family.MOE_BLOCK_CLASS)
        if family.MOE_BLOCK_CLASS is not None:
            patch_moe_classes(family.ROUTER_CLASS, family.MOE_BLOCK_CLASS, family.router_normalizes)
    register_experts_implementation()


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (has `.layers`, `.embed_tokens`) of a CausalLM or a ConditionalGeneration model."""
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") and hasattr(decoder, "language_model"):
        decoder = decoder.language_model
    return decoder


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Sparse MoE blocks in layer order (MLP-only / dense layers skipped); empty for dense hybrids.

    Each has `.gate` (router returning (logits, scores, top-k ids [T, k])) and `.experts(hidden, ids, weights)`.
    """
    family = family_of(model)
    if family.MOE_BLOCK_CLASS is None:
        return []
    return _modules_of(model, family.MOE_BLOCK_CLASS)


def gdn_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return _modules_of(model, family_of(model).GDN_CLASS)


# Per model and class: the modules found under the decoder stack, with the stack's layout they were found in (the
# decoder, its children and every decoder layer's children, by identity: the GDN layers and MoE blocks of every
# supported family are children of a decoder layer, so replacing or wrapping one changes the layout). A generate()
# call asks several times, and a walk over every module costs ≈ 0.1 ms on a CPU.
_FOUND: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _modules_of(model: torch.nn.Module, cls: type) -> list[torch.nn.Module]:
    """The modules of `cls` under the decoder stack, in module order (a new list; walked again when the layout
    changed)."""
    decoder = text_model(model)
    layers = getattr(decoder, "layers", ())
    tree = (id(decoder), tuple(map(id, decoder._modules.values())),
            tuple((id(layer), tuple(map(id, layer._modules.values()))) for layer in layers))
    found = _FOUND.setdefault(model, {})
    hit = found.get(cls)
    if hit is None or hit[0] != tree:
        hit = found[cls] = (tree, [m for m in decoder.modules() if isinstance(m, cls)])
    return list(hit[1])


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The text model's full-attention layers in layer order (what `prepare_attention_projections` takes)."""
    family = family_of(model)
    return [m for m in text_model(model).modules() if isinstance(m, family.ATTENTION_CLASS)]


def decoder_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The plain nn.Linear modules of the decoder layers (projections of attention, GDN, shared expert and dense
    MLPs; not the LM head or the embedding): what `prepare_linears` routes to our skinny GEMM."""
    return [m for m in text_model(model).layers.modules() if type(m) is torch.nn.Linear]


__all__ = [
    "GDN_KERNEL_FUNCTIONS",
    "attention_layers",
    "VerifySession",
    "check_verified",
    "commit_session",
    "cpu_verification_blocks",
    "decoder_linears",
    "family_of",
    "fused_experts_for",
    "fused_kernels",
    "gdn_layers",
    "install",
    "is_linear_cache_layer",
    "moe_block_add",
    "moe_blocks",
    "per_token_state_buffer",
    "prepare_attention_projections",
    "prepare_fused_moe",
    "prepare_gdn_projections",
    "prepare_linears",
    "RopeTable",
    "rope_slots",
    "register_experts_implementation",
    "mask_invalid_routes",
    "release_attention_projections",
    "release_fused_moe",
    "routing_pre_hook",
    "release_gdn_projections",
    "release_linears",
    "route_cpu_to_torch",
    "routes_attention",
    "static_cache_length",
    "supported_classes",
    "text_model",
]
