"""Tiny hybrid targets built in code, a float64 GDN oracle, and an oracle drafter for loop tests."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

from hybridspec_hf import DFlashDrafter
from hybridspec_hf.kernels import gdn_recurrence

VOCAB = 96

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
)
_MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
_ATTN_LAST = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_ATTN_FIRST = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]


def _vision():
    return dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)


def build_target(family: str, text_config: dict):
    """A randomly initialised model of one supported family from text-config kwargs."""
    if family == "qwen3_5_moe":
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_config))
    if family == "qwen3_5_moe_vlm":
        return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text_config, vision_config=_vision()))
    if family == "qwen3_next":
        return Qwen3NextForCausalLM(Qwen3NextConfig(**text_config))
    if family == "qwen3_5_dense":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config))
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("qwen3_5_moe", "qwen3_5_moe_vlm", "qwen3_next", "qwen3_5_dense")

# name -> builder of a float64 eval model. Odd shapes: value heads ≠ key heads, head dims not powers of two,
# full attention first or last, few experts with top-k ≥ 2, mlp-only layers.
TARGETS = {
    "qwen3_5_moe": lambda: build_target("qwen3_5_moe", dict(**_COMMON, **_MOE, layer_types=_ATTN_LAST)),
    "qwen3_5_moe_odd": lambda: build_target("qwen3_5_moe", dict(
        **{**_COMMON, "linear_key_head_dim": 6, "linear_value_head_dim": 10, "linear_num_value_heads": 6,
           "head_dim": 12, "num_hidden_layers": 5},
        **{**_MOE, "num_experts": 3, "num_experts_per_tok": 2},
        layer_types=_ATTN_FIRST + ["linear_attention"],
    )),
    "qwen3_5_moe_vlm": lambda: build_target("qwen3_5_moe_vlm", dict(**_COMMON, **_MOE, layer_types=_ATTN_LAST)),
    "qwen3_next": lambda: build_target(
        "qwen3_next", dict(**_COMMON, **_MOE, layer_types=_ATTN_FIRST, mlp_only_layers=[2], norm_topk_prob=True)
    ),
    "qwen3_5_dense": lambda: build_target("qwen3_5_dense", dict(**_COMMON, layer_types=_ATTN_LAST)),
}


def make_target(name: str, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    return prepare(TARGETS[name](), dtype)


def prepare(model, dtype=torch.float64):
    """Eval mode in `dtype`, an experts path that runs it on the CPU, and spread GDN decays."""
    model = model.eval().to(dtype)
    if hasattr(model, "set_experts_implementation") and dtype == torch.float64:
        # transformers' default grouped_mm experts path has no float64 CPU kernel
        with contextlib.suppress(Exception):
            model.set_experts_implementation("eager")
    _strengthen_gates(model)
    return model


def _strengthen_gates(model) -> None:
    """Random init gives near-uniform logits; spread A_log so both strong and weak decay occur."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.linspace(-3.0, 2.0, param.numel(), dtype=param.dtype))


def _gdn_float64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=True, **kwargs):
    """Drop-in for transformers' torch GDN functions that computes (and keeps the state) in float64."""
    assert use_qk_l2norm_in_kernel
    batch, _, _, dk = key.shape
    heads, dv = value.shape[-2:]
    state = initial_state if initial_state is not None else torch.zeros(batch, heads, dk, dv, dtype=torch.float64)
    out, states = gdn_recurrence(query, key, value, g, beta, state, dtype=torch.float64)
    return out.to(query.dtype), (states[:, -1] if output_final_state else None)


_GDN_MODULES = (modeling_qwen3_5_moe, modeling_qwen3_5, modeling_qwen3_next)


@contextlib.contextmanager
def float64_gdn():
    """Make the AR oracle's GDN float64 end to end (transformers computes it in fp32 even for float64 models)."""
    saved = [(m, m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule) for m in _GDN_MODULES]
    for module in _GDN_MODULES:
        module.torch_chunk_gated_delta_rule = _gdn_float64
        module.torch_recurrent_gated_delta_rule = _gdn_float64
    try:
        yield
    finally:
        for module, chunk, recurrent in saved:
            module.torch_chunk_gated_delta_rule = chunk
            module.torch_recurrent_gated_delta_rule = recurrent


class OracleDrafter(DFlashDrafter):
    """A real DFlash drafter whose logits are steered towards a known continuation, wrong at random positions.

    Random-weight drafters are almost never right, which would test only the a = 0 path; this one makes every
    acceptance length occur while still running the real drafter code and context cache.
    """

    def steer(self, reference, error_rate: float, seed: int) -> "OracleDrafter":
        """reference: [R, L] token ids, or a list of R 1-D ones of any lengths: row b of a batch is steered towards
        reference b (R = 1: every row towards the same one), in the row's own positions (no padding)."""
        rows = [torch.as_tensor(r).reshape(-1) for r in reference]
        width = max(r.numel() for r in rows)
        self.reference = torch.stack([F.pad(r, (0, width - r.numel())) for r in rows])  # [R, L]
        self.reference_lengths = torch.tensor([r.numel() for r in rows])
        self._reference_device = None
        self.error_rate = error_rate
        self.generator = torch.Generator().manual_seed(seed)
        return self

    def draft(self, anchor_ids, new_context, cache, return_hidden=False):
        logits = super().draft(anchor_ids, new_context, cache).clone()  # [B, bs-1, V]
        return self._steered(logits, cache.length)

    def draft_static(self, anchor_ids, ctx):
        """The same steering on the static-context path (the anchor of each row sits at ctx.length, on the device)."""
        return self._steered(super().draft_static(anchor_ids, ctx).clone(), ctx.length, ctx.rows)

    def _steered(self, logits, anchor_position, rows=None):
        if getattr(self, "reference", None) is None:
            return logits
        device = logits.device
        if getattr(self, "_reference_device", None) is None or self._reference_device[0].device != device:
            # before any graph capture (warm-up runs first)
            self._reference_device = (self.reference.to(device), self.reference_lengths.to(device))
        reference, lengths = self._reference_device
        steps = torch.arange(1, self.config.block_size, device=device)
        if isinstance(anchor_position, torch.Tensor):
            positions = anchor_position.view(-1, 1) + steps  # [B, bs-1] tokens predicted
        else:
            positions = (anchor_position + steps).view(1, -1)
        if reference.shape[0] > 1:  # one reference per batch row (a CPU batch: `rows` says which)
            if rows is not None and not torch.equal(rows, torch.arange(rows.numel())):  # rows left the batch: an
                which = rows.to(device)  # eager batch (never captured: a CPU tensor may not be copied in a capture)
            else:  # every row as it started (a resident bucket: its rows never leave), made on the device
                which = torch.arange(logits.shape[0], device=device)
            which = which.clamp(max=reference.shape[0] - 1)  # the inert rows filling a resident batch's bucket
        else:
            which = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
        inside = positions < lengths[which].view(-1, 1)
        if device.type == "cpu":
            right = torch.rand(positions.shape, generator=self.generator) >= self.error_rate
        else:  # the default CUDA generator: graph-safe
            right = torch.rand(positions.shape, device=device) >= self.error_rate
        tokens = reference[which.view(-1, 1), positions.clamp(max=reference.shape[1] - 1)]  # [B or 1, bs-1]
        boost = torch.where(inside & right, logits.abs().amax() + 10.0, 0.0)  # no host sync
        shape = (logits.shape[0], -1, 1)
        boost = boost.unsqueeze(-1).expand(shape).to(logits.dtype)
        return logits.scatter_add(2, tokens.unsqueeze(-1).expand(shape), boost)


def make_drafter(target, block_size: int = 8, reference=None, error_rate: float = 0.25, seed: int = 0):
    torch.manual_seed(seed + 1)
    drafter = OracleDrafter.from_target(target, num_layers=1, block_size=block_size)
    drafter = drafter.to(torch.float64).eval()
    drafter.bind_target(target)
    if reference is not None:
        drafter.steer(reference, error_rate, seed)
    return drafter


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor that defines the cache's content (GDN conv/recurrent states, attention K/V up to length)."""
    tensors = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            tensors += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            length = int(layer.get_seq_length())
            tensors += [layer.keys[..., :length, :], layer.values[..., :length, :]]
    return tensors


def output_cache(output):
    return output.cache if hasattr(output, "cache") and output.cache is not None else output.past_key_values
