"""`experts_implementation="hybridspec"`: transformers' MoE experts through `kernels.moe_triton.fused_experts`.

transformers (5.17 and 5.24 alike) decorates each experts class with `@use_experts_implementation`; its forward
looks `config._experts_implementation` up in `ExpertsInterface` (transformers/integrations/moe.py) and calls
`fn(experts_module, hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`. Registering a name there makes
`model.set_experts_implementation("hybridspec")` accept it (the name check reads the same registry).
HybridSpec's verifications switch to it for their forward only: GPU-resident rounds always (`fused_experts_for`
around capture), CPU verifications where `cpu_verification_blocks` says so (`dense_experts`).
"""
from __future__ import annotations

import contextlib

import torch
from transformers.integrations import moe

from hybridspec_hf.kernels.moe_triton import dense_fits, fused_experts

NAME = "hybridspec"
# Prefill on a GPU goes to transformers' grouped_mm (CUTLASS grouped GEMM); the Triton path is shaped for the
# few-token calls of decoding and verification, and captured in CUDA graphs only there.
GROUPED_MM_FROM_TOKENS = 128


def hybridspec_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ExpertsInterface function: [T, H] from `fused_experts` (Triton on CUDA, the torch reference on CPU)."""
    reason = _unsupported_reason(self)
    if reason is not None:
        raise ValueError(reason)
    if hidden_states.is_cuda and hidden_states.shape[0] >= GROUPED_MM_FROM_TOKENS:
        return moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return fused_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def register_experts_implementation() -> None:
    """Register "hybridspec" in transformers' ExpertsInterface (idempotent), so that
    `model.set_experts_implementation("hybridspec")` or `from_pretrained(..., experts_implementation="hybridspec")`
    works on every model whose experts use transformers' experts interface with SiLU-gated [gate; up] weights."""
    moe.ExpertsInterface.register(NAME, hybridspec_experts_forward)


def supports(experts: torch.nn.Module) -> bool:
    """Whether "hybridspec" can compute this experts module (transformers' SiLU [gate; up] layout)."""
    return _unsupported_reason(experts) is None


@contextlib.contextmanager
def fused_experts_for(blocks: list[torch.nn.Module]):
    """Inside: the given MoE blocks' experts dispatch to "hybridspec" (when every one supports it), restored after.
    Used around the capture of GPU-resident rounds, so their graphs replay our experts kernel while the model's
    own setting stays what the user chose for everything else."""
    configs = list({id(b.experts.config): b.experts.config for b in blocks}.values())
    if not blocks or not all(supports(b.experts) for b in blocks):
        yield False
        return
    saved = [c._experts_implementation_internal for c in configs]
    for config in configs:
        config._experts_implementation_internal = NAME
    try:
        yield True
    finally:
        for config, value in zip(configs, saved):
            config._experts_implementation_internal = value


# transformers' own implementations (None: its "eager" forward): the same maths as "hybridspec" (a custom registered
# one is left alone)
TRANSFORMERS_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")


def cpu_verification_blocks(blocks: list[torch.nn.Module], num_tokens: int) -> list[torch.nn.Module]:
    """The MoE blocks whose experts a CPU verification of `num_tokens` rows runs as "hybridspec" (inside
    `fused_experts_for`): all of `blocks` when every one is on the CPU, supported, set to one of transformers' own
    implementations and small enough for `dense_experts` at that many rows (kernels/moe_triton.py `dense_fits`),
    else none. `dense_experts` is a dozen ops, no host sync, where "eager" loops over the experts hit (≈ 10 ops
    each: 3.5 times slower at the tiny pair's 16 tokens) and grouped_mm / batched_mm are slower still on the CPU.
    Plain generate() and the prefill keep the user's choice."""
    for block in blocks:
        experts = block.experts
        weight = getattr(experts, "gate_up_proj", None)
        config = experts.config
        top_k = getattr(config, "num_experts_per_tok", None)
        if (not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dim() != 3
                or getattr(config, "_experts_implementation", None) not in TRANSFORMERS_IMPLEMENTATIONS
                or not isinstance(top_k, int) or not supports(experts) or not dense_fits(num_tokens, top_k, weight)):
            return []
    return list(blocks)


def _unsupported_reason(experts: torch.nn.Module) -> str | None:
    """Why "hybridspec" cannot compute this experts module (a message for the user), or None."""
    layout = {
        "has_gate": getattr(experts, "has_gate", True),
        "is_concatenated": getattr(experts, "is_concatenated", True),
        "is_transposed": getattr(experts, "is_transposed", False),
        "has_bias": getattr(experts, "has_bias", False),
        "has_post_expert_norm": getattr(experts, "has_post_expert_norm", False),  # 5.24+
    }
    act = getattr(experts.config, "hidden_act", None)
    default_gate = getattr(type(experts), "_apply_gate", moe._default_apply_gate) is moe._default_apply_gate
    expected = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
                "has_post_expert_norm": False}
    if layout != expected or act not in ("silu", "swish") or not default_gate:
        return (
            f'experts_implementation="{NAME}" computes SiLU(gate)·up experts with gate_up_proj [E, 2I, H] '
            f"(gate rows first), down_proj [E, H, I] and no bias; {type(experts).__name__} has {layout}, "
            f"hidden_act={act!r}, {'its own' if not default_gate else 'the default'} gate. "
            'Use experts_implementation="grouped_mm" for this model.'
        )
    return None
