"""Fused RMSNorms (kernels/norm_triton.py) inside GPU-resident forwards only.

The class patch is inert unless `fused_kernels()` is active and the input is on CUDA, so plain generate(), training
and every CPU path run transformers' own norms unchanged.

A decoder layer's input norm may also be left to its token mixer (patches/_decoder.py): the layer calls the mixer on
the un-normed rows with the norm module parked under INPUT_NORM in the mixer's __dict__; the mixer's forward takes it
(`take_input_norm`) first thing and applies it in its projection GEMM's prologue (`gemv_triton.linear(..., norm=)`)
or by calling the module (`normed`), so every path of the mixer sees the normed rows.
"""
from __future__ import annotations

import torch

from hybridspec_hf.kernels.norm_triton import fused_kernels, fused_kernels_active

__all__ = ["INPUT_NORM", "fused_kernels", "normed", "patch_norm_classes", "take_input_norm"]

INPUT_NORM = "_hybridspec_input_norm"  # the module's __dict__ key of a norm its caller left to it


def take_input_norm(module: torch.nn.Module) -> torch.nn.Module | None:
    """The norm the caller left to `module` for this call (removed: it applies once), or None."""
    return module.__dict__.pop(INPUT_NORM, None)


def normed(norm: torch.nn.Module | None, hidden_states: torch.Tensor) -> torch.Tensor:
    """norm(hidden_states) (a module call), or hidden_states itself without a norm."""
    return hidden_states if norm is None else norm(hidden_states)


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
