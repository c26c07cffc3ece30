"""Qwen3-Next (`qwen3_next`): fused in_proj_qkvz / in_proj_ba, interleaved per key head; `mlp_only_layers` allowed."""
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as modeling

from ._norms import normed

NAME = "qwen3_next"
RMS_NORM_CLASS = modeling.Qwen3NextRMSNorm
GATED_NORM_CLASS = modeling.Qwen3NextRMSNormGated
GDN_CLASS = modeling.Qwen3NextGatedDeltaNet
ATTENTION_CLASS = modeling.Qwen3NextAttention  # the text model's (gated) full attention
DECODER_LAYER_CLASS = modeling.Qwen3NextDecoderLayer  # norm, mixer, add, norm, MLP, add
ROTARY_CLASS = modeling.Qwen3NextRotaryEmbedding  # cos/sin: looked up in resident forwards (_rope.py)
MODEL_CLASSES = (modeling.Qwen3NextForCausalLM,)
MOE_BLOCK_CLASS = modeling.Qwen3NextSparseMoeBlock  # .gate (router -> logits, scores, top-k ids) and .experts
ROUTER_CLASS = getattr(modeling, "Qwen3NextTopKRouter", None)


def router_normalizes(router) -> bool:
    """The router renormalises its top-k probabilities when the config says `norm_topk_prob`."""
    return bool(router.norm_topk_prob)


def project_gdn_inputs(layer: torch.nn.Module, hidden_states: torch.Tensor, norm: torch.nn.Module | None = None):
    """Un-interleave the fused projections into the conv input [B, T, C] = cat(q, k, v) and z, b, a (the decoder's
    input `norm`, if left to this layer, by its module call first)."""
    hidden_states = normed(norm, hidden_states)
    query, key, value, z, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
    )
    batch, seq_len = hidden_states.shape[:2]
    mixed_qkv = torch.cat([x.reshape(batch, seq_len, -1) for x in (query, key, value)], dim=-1)
    return mixed_qkv, z, b, a
