"""Configuration of the DFlash drafter (z-lab checkpoint compatible).

A DFlash drafter is a few Qwen3-style decoder layers plus a fusion layer over target features; its config is a
Qwen3 config with DFlash fields on top. Two on-disk layouts are read:

- ours: ``model_type: "dflash_drafter"`` with the DFlash fields at the top level;
- z-lab's (``z-lab/*-DFlash``, SpecForge): ``model_type: "qwen3"``, ``architectures: ["DFlashDraftModel"]``,
  top-level ``block_size`` / ``num_target_layers``, and ``dflash_config: {mask_token_id, target_layer_ids, ...}``.
  As in z-lab's ``_draft_value`` (``dflash/model.py``), a key inside ``dflash_config`` wins over the top-level key.

``save_pretrained`` writes ours and mirrors ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}`` so tools that read z-lab's keys find them.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

# DFlash fields that z-lab reads from `dflash_config` first, then from the top level.
DFLASH_KEYS = (
    "block_size",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
    "input_embedding_scale",
    "output_multiplier",
    "final_logit_softcapping",
)
QUANTIZATIONS = (None, "int8")  # DFlashConfig.head_quantization and .layers_quantization
# z-lab keys that mean another architecture (DFlash 2's convolutions and candidate selector, SpecForge's KDA/MLA).
_UNSUPPORTED_DFLASH_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "attention_modes")


class DFlashConfig(PreTrainedConfig):
    """Config of [`DFlashDrafter`]: Qwen3 decoder fields + DFlash fields.

    DFlash fields:
        block_size: tokens per drafted block, anchor included; a draft gives B-1 tokens.
        target_layer_ids: target decoder layers whose OUTPUTS are concatenated as context features, in this order
            (HF ``hidden_states[i + 1]``); ``fc`` maps ``len(target_layer_ids) * hidden_size`` to ``hidden_size``.
        num_target_layers: decoder layers of the target the drafter was built for (informational, as in z-lab).
        mask_token_id: vocabulary row embedded at the B-1 masked block positions.
        input_embedding_scale: factor on the target's embedding rows of the block (z-lab key; 1.0 for Qwen).
        output_multiplier, final_logit_softcapping: optional logit post-processing (z-lab ``compute_logits``).
        head_quantization: None (the target's LM head as it is) or ``"int8"``: drafting (no gradients) multiplies by
            an int8 copy of the target's head, one float32 scale per vocabulary row, made on first use (half the
            bytes a draft reads from a bf16 head; ≈ 0.5 GB of GPU memory more at a 248k x 2048 head, kept until
            ``drafter.release_quantized_head()`` or ``hybridspec_hf.release_graphs(target)``). On a GPU
            only for up to 16 rows of logits (one request's block: the int8 GEMV's limit); a batch's drafts read
            the head as it is. Drafts are proposals, so the output stays the target's; only which drafts are
            proposed may change where two of the drafter's logits nearly tie. Training with gradients uses the
            target's head.
        layers_quantization: None (the drafter's layers as they are) or ``"int8"``: the fused resident path of a
            draft (GPU-resident rounds) multiplies by int8 copies of its layers' projections (q|k|v, o, gate|up,
            down), one float32 scale per output row, made with the path's other weight copies and refreshed with
            them (≈ half the drafter's layer bytes more GPU memory). Up to 16 rows of a draft (one request's block);
            a batch's drafts, the eager path and training use the weights as they are. As for the head, only which
            tokens are drafted may change; the output stays the target's.
    The vocabulary embedding and LM head are the target's: ``vocab_size`` must equal the target's.
    Layers marked ``"sliding_attention"`` in ``layer_types`` attend causally inside the block and within
    ``sliding_window`` positions, as z-lab's ``Qwen3DFlashAttention`` does (``is_causal`` overrides the causality).
    """

    model_type = "dflash_drafter"

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    is_causal: bool | None = None
    tie_word_embeddings: bool = False
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    mask_token_id: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    head_quantization: str | None = None
    layers_quantization: str | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        _reject_unsupported(self.architectures, kwargs.get("dflash_config") or {})
        for key, value in (kwargs.pop("dflash_config", None) or {}).items():
            if key in DFLASH_KEYS:
                setattr(self, key, value)
        # z-lab's remote-code pointer and model_type "qwen3" describe their class, not ours.
        for key in ("auto_map", "model_type"):
            kwargs.pop(key, None)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None and self.num_target_layers:
            # SpecForge configs may leave the ids out: z-lab's default rule then applies (z-lab a3516f8..44947fb).
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.head_quantization not in QUANTIZATIONS:
            raise ValueError(f"head_quantization must be one of {QUANTIZATIONS} (None: the target's LM head as "
                             f"it is; \"int8\": an int8 copy of it for drafting), got {self.head_quantization!r}.")
        if self.layers_quantization not in QUANTIZATIONS:
            raise ValueError(f"layers_quantization must be one of {QUANTIZATIONS} (None: the drafter's layers as "
                             f"they are; \"int8\": int8 copies of their projections for drafting), got "
                             f"{self.layers_quantization!r}.")
        # Same reading of the sliding fields as Qwen3Config, which z-lab's drafter is built on.
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read config.json; a z-lab layout (model_type "qwen3" + DFlash keys) is relabelled as ours."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if is_zlab_dflash_config(config_dict):
            config_dict = {**config_dict, "model_type": cls.model_type}
        return config_dict, kwargs

    def to_dict(self) -> dict[str, Any]:
        """Our layout plus z-lab's `dflash_config` mirror (mask_token_id, target_layer_ids)."""
        output = super().to_dict()
        output["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}
        return output


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default choice of target layers: the middle one for a 1-layer drafter, else evenly from 1 to L-3."""
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}.")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"Spreading {num_draft_layers} feature layers over layers 1..L-3 needs a target with >= 4 layers, got "
            f"{num_target_layers}; pass target_layer_ids explicitly."
        )
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def is_zlab_dflash_config(config_dict: dict[str, Any]) -> bool:
    """True for a z-lab / SpecForge DFlash config.json (a Qwen3 config carrying DFlash keys)."""
    architectures = config_dict.get("architectures") or []
    return config_dict.get("model_type") != DFlashConfig.model_type and (
        "dflash_config" in config_dict or any("DFlash" in name for name in architectures)
    )


def _reject_unsupported(architectures: list[str] | None, dflash_config: dict[str, Any]) -> None:
    """Refuse DFlash variants whose weights this module cannot run, instead of silently dropping their weights."""
    architectures = architectures or []
    unsupported = [key for key in _UNSUPPORTED_DFLASH_KEYS if key in dflash_config]
    if str(dflash_config.get("attention_mode", "gqa")).lower() not in ("gqa", "mha"):
        unsupported.append(f"attention_mode={dflash_config['attention_mode']!r}")
    if "DFlash2DraftModel" in architectures or unsupported:
        raise ValueError(
            f"This checkpoint is not a DFlash (v1) drafter: architectures={architectures}, dflash_config keys "
            f"{unsupported}. DFlashDrafter implements z-lab's DFlashDraftModel only (Qwen3 layers + fc/hidden_norm "
            "KV injection); use a DFlash v1 checkpoint or z-lab's own code for this one."
        )


__all__ = ["DFlashConfig", "build_target_layer_ids", "is_zlab_dflash_config"]
