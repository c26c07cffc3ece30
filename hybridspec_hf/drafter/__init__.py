"""DFlash drafter: z-lab checkpoint compatible block drafter that shares the target's embedding and LM head."""

from transformers import AutoConfig, AutoModel

from .configuration_dflash import DFlashConfig, build_target_layer_ids
from .modeling_dflash import (
    DFlashContextCache,
    DFlashDrafter,
    StaticDraftContext,
    block_attention_mask,
    block_position_ids,
)

# AutoConfig/AutoModel.from_pretrained on a directory we saved (model_type "dflash_drafter").
AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDrafter, exist_ok=True)

__all__ = [
    "DFlashConfig",
    "DFlashContextCache",
    "DFlashDrafter",
    "StaticDraftContext",
    "block_attention_mask",
    "block_position_ids",
    "build_target_layer_ids",
]
