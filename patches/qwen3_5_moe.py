"""Qwen3.5-MoE / Qwen3.6-MoE (`qwen3_5_moe`): separate q/k/v/z/b/a projections, every layer MoE."""
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

from ._gdn import project_separate

NAME = "qwen3_5_moe"
RMS_NORM_CLASS = modeling.Qwen3_5MoeRMSNorm
GATED_NORM_CLASS = modeling.Qwen3_5MoeRMSNormGated
GDN_CLASS = modeling.Qwen3_5MoeGatedDeltaNet
ATTENTION_CLASS = modeling.Qwen3_5MoeAttention  # the text model's (gated) full attention
DECODER_LAYER_CLASS = modeling.Qwen3_5MoeDecoderLayer  # norm, mixer, add, norm, MLP, add
ROTARY_CLASS = modeling.Qwen3_5MoeTextRotaryEmbedding  # cos/sin: looked up in resident forwards (_rope.py)
MODEL_CLASSES = (modeling.Qwen3_5MoeForCausalLM, modeling.Qwen3_5MoeForConditionalGeneration)
MOE_BLOCK_CLASS = modeling.Qwen3_5MoeSparseMoeBlock  # .gate (router -> logits, scores, top-k ids) and .experts
ROUTER_CLASS = modeling.Qwen3_5MoeTopKRouter
project_gdn_inputs = project_separate


def router_normalizes(router) -> bool:
    """The router renormalises its top-k probabilities to sum 1 (always, in this family)."""
    return True
