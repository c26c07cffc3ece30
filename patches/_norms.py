"""Fused RMSNorms (kernels/norm_triton.py) inside GPU-resident forwards only.

The class patch is inert unless `fused_kernels()` is active and the input is on CUDA, so plain generate(), training
and every CPU path run transformers' own norms unchanged.
"""
from __future__ import annotations

from hybridspec_hf.kernels.norm_triton import fused_kernels, fused_kernels_active

__all__ = ["fused_kernels", "patch_norm_classes"]


def patch_norm_classes(rms_cls: type, gated_cls: type | None) -> None:
    """Install the fused path on a family's RMSNorm (weight offset 1 + w) and gated RMSNorm (silu) (idempotent)."""
    from hybridspec_hf.kernels.norm_triton import gated_rms_norm, rms_norm

    if "_hybridspec_original_forward" not in rms_cls.__dict__:
        original = rms_cls.forward

        def forward(self, x):
            if x.is_cuda and fused_kernels_active():
                return rms_norm(x, self.weight, self.eps, offset=True)
            return original(self, x)

        rms_cls._hybridspec_original_forward = original
        rms_cls.forward = forward
    if gated_cls is not None and "_hybridspec_original_forward" not in gated_cls.__dict__:
        original_gated = gated_cls.forward

        def gated_forward(self, hidden_states, gate):
            if hidden_states.is_cuda and fused_kernels_active() and getattr(self, "activation", "silu") == "silu":
                return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)
            return original_gated(self, hidden_states, gate)

        gated_cls._hybridspec_original_forward = original_gated
        gated_cls.forward = gated_forward
