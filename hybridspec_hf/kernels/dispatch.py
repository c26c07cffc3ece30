"""Choose the verify/commit implementation: torch on CPU, Triton on CUDA (when available), or as asked."""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import gdn_torch

BACKENDS = ("auto", "torch", "triton")


def _triton_module():
    try:
        from . import gdn_triton
    except ImportError as error:  # triton missing or the kernels not importable on this machine
        raise RuntimeError(
            f"kernel_backend='triton' needs Triton ({error}); install hybridspec-hf[cuda] or use kernel_backend='torch'."
        ) from error
    return gdn_triton


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' means Triton on CUDA when importable, torch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}.")
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    try:
        _triton_module()
    except RuntimeError:
        return "torch"
    return "triton"


def select_verify(backend: str, like: torch.Tensor) -> Callable:
    if resolve_backend(backend, like.device) == "triton":
        return _triton_module().gdn_verify_triton
    return gdn_torch.gdn_verify


def select_commit(backend: str, like: torch.Tensor) -> Callable:
    if resolve_backend(backend, like.device) == "triton":
        return _triton_module().commit_gdn_states_triton
    return gdn_torch.commit_gdn_states
