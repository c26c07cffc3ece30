"""Fused RoPE (kernels/rope_triton.py) inside GPU-resident forwards only.

transformers' attention forwards call their module's `apply_rotary_pos_emb` by its global name; the patch replaces
that name with a function that takes the fused path for CUDA tensors while the resident forwards' flag is on
(`fused_kernels()`), and calls transformers' own function otherwise (plain generate(), training, every CPU path).
"""
from __future__ import annotations

import functools
from types import ModuleType

from hybridspec_hf.kernels import fused_kernels_active
from hybridspec_hf.kernels.rope_triton import rope_qk, supported


def patch_rope(modeling: ModuleType) -> None:
    """Install the fused path on a family's `apply_rotary_pos_emb` (idempotent; no-op if the module has none)."""
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None or getattr(original, "_hybridspec_original", None) is not None:
        return

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and q.is_cuda and fused_kernels_active() and supported(q, k, cos, sin):
            return rope_qk(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._hybridspec_original = original
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
