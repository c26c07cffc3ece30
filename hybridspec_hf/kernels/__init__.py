"""GDN verify/commit kernels. A leaf package: torch (+ triton) only.

`gdn_torch` is the CPU implementation and the reference for every Triton kernel beside it. `gdn_triton` and
`default_verifier` import without triton (their `*_auto` / `kernel_backend="auto"` entry points then use torch);
`default_verifier.gdn_decode_step` is the in-place recurrent step of a plain decoding step (Triton only).
`moe_triton` is the routed-experts path (`fused_experts`, reference `fused_experts_reference` beside it).
`norm_triton`, `router_triton` and `shared_expert_triton` hold the fused norms and MoE-block kernels of the resident
forwards (used by patches/_norms.py and patches/_moe.py), each with its torch reference.
`gdn_prologue_triton` is the GDN layer's conv + gates in verify mode (references `conv_silu_reference`,
`gdn_gates_reference` beside it); `gdn_step_triton` is the whole plain decoding step of a GDN layer in one launch
(conv, gates, recurrence in place, gated norm; reference `gdn_step_reference`). `gemv_triton` is the projections' skinny GEMM at ≤ 16 rows (`linear`: ours where
its TABLE names the shape, else F.linear; reference `linear_reference`; used by patches/_linear.py).
`attention_triton` is the attention of a few queries over a static KV cache with a device-side length
(`static_attention`, reference `attention_reference`), for the target's attention layers (patches/_attention.py) and
the drafter's `draft_static`. `dflash_triton` is the drafter's fused resident layer pieces (`qk_norm_rope_store`,
`add_rms_norm`, references beside them; used by drafter/fused.py). `signals_triton` is the drafter's per-position
signals in one launch. `step_tail_triton` is a resident plain step's bookkeeping after its token in one launch
(`step_tail`, reference `step_tail_reference`; used by generation/resident.py). `lookup_triton` is context lookup
over the resident rounds' token buffer in one launch (`context_lookup_static`, reference
`context_lookup_static_reference`, which drafter/lookup.py's `context_lookup` also runs). `fused_kernels()` is the flag that
routes patched modules to these kernels inside GPU-resident forwards.
"""
from .gdn_torch import (
    GDNVerifyResult,
    PendingGDNLayer,
    commit_conv_state,
    commit_gdn_states,
    conv_verify,
    gdn_commit,
    gdn_recurrence,
    gdn_verify,
    l2norm,
)
from .default_verifier import (
    DefaultVerifyResult,
    PendingDefaultLayer,
    allocate_state_buffer,
    commit_default_states,
    default_verify,
    gdn_decode_step,
)
from .gdn_triton import (
    HAS_TRITON,
    commit_gdn_states_auto,
    fused_kernels,
    fused_kernels_active,
    fused_kernels_allowed,
    gdn_verify_auto,
    select_backend,
)
from .gdn_prologue_triton import conv_silu, conv_silu_gates, conv_silu_reference, gdn_gates, gdn_gates_reference
from .moe_triton import fused_experts, fused_experts_reference
from .attention_triton import attention_reference, static_attention

__all__ = [
    "HAS_TRITON",
    "DefaultVerifyResult",
    "PendingDefaultLayer",
    "allocate_state_buffer",
    "attention_reference",
    "commit_default_states",
    "commit_gdn_states_auto",
    "conv_silu",
    "conv_silu_gates",
    "conv_silu_reference",
    "default_verify",
    "fused_experts",
    "fused_experts_reference",
    "fused_kernels",
    "fused_kernels_active",
    "fused_kernels_allowed",
    "gdn_gates",
    "gdn_decode_step",
    "gdn_gates_reference",
    "gdn_verify_auto",
    "select_backend",
    "static_attention",
    "GDNVerifyResult",
    "PendingGDNLayer",
    "commit_conv_state",
    "commit_gdn_states",
    "conv_verify",
    "gdn_commit",
    "gdn_recurrence",
    "gdn_verify",
    "l2norm",
]
