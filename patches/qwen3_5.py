"""Qwen3.5 dense hybrid (`qwen3_5`): separate q/k/v/z/b/a projections, dense MLPs (no router: no routing correction)."""
from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

from ._gdn import project_separate

NAME = "qwen3_5"
RMS_NORM_CLASS = modeling.Qwen3_5RMSNorm
GATED_NORM_CLASS = modeling.Qwen3_5RMSNormGated
GDN_CLASS = modeling.Qwen3_5GatedDeltaNet
ATTENTION_CLASS = modeling.Qwen3_5Attention  # the text model's (gated) full attention
DECODER_LAYER_CLASS = modeling.Qwen3_5DecoderLayer  # norm, mixer, add, norm, MLP, add
ROTARY_CLASS = modeling.Qwen3_5TextRotaryEmbedding  # cos/sin: looked up in resident forwards (_rope.py)
MODEL_CLASSES = (modeling.Qwen3_5ForCausalLM, modeling.Qwen3_5ForConditionalGeneration)
MOE_BLOCK_CLASS = None  # dense MLPs: no router, no routing correction
ROUTER_CLASS = None
project_gdn_inputs = project_separate
router_normalizes = None  # no router
