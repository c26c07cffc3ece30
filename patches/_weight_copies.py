"""Weight copies read by the fused paths of resident forwards (one GEMM over concatenated weights, not several).

A copy is made before CUDA-graph capture and refreshed in place at the start of every generate() call (same
address, so captured graphs stay right) when a source changed: its data_ptr or in-place `_version` (writes through
`.data` are not seen: release the graphs after those). A forward never makes one (inside a capture the copy would
become a graph node replayed every round): it uses the copy while it is current, else the modules themselves.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.modules import module as nn_module

from ._linear import is_routed


@dataclass
class WeightCopy:
    weight: torch.Tensor  # the concatenation the fused path reads
    key: tuple  # `source_key` of its sources when copied


def source_key(weights: Sequence[torch.Tensor]) -> tuple:
    """(data_ptr, in-place version) of each source: a different key means a stale copy."""
    # inference tensors keep no version counter (and cannot be written outside inference mode)
    return tuple((w.data_ptr(), None if w.is_inference() else w._version) for w in weights)


def refresh_copy(module: torch.nn.Module, attr: str, sources: Sequence[torch.Tensor],
                 concatenate: Callable[..., torch.Tensor]) -> None:
    """Make `module`'s copy (kept in its __dict__ under `attr`), or rewrite it when a source changed:
    `concatenate(*sources, out=previous)` writes into the previous copy when that has the right shape."""
    cached, key = module.__dict__.get(attr), source_key(sources)
    if cached is not None and cached.key == key:
        return
    weight = concatenate(*sources, out=cached.weight if cached is not None else None)
    module.__dict__[attr] = WeightCopy(weight, key)


def concatenate_rows(*weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cat(weights) along rows ([sum N_i, K]), into `out` when it has that shape, dtype and device (a refresh in
    place: the address captured graphs read stays)."""
    rows = sum(w.shape[0] for w in weights)
    if out is None or out.shape != (rows, weights[0].shape[1]) or out.dtype != weights[0].dtype or \
            out.device != weights[0].device:
        out = torch.empty(rows, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)
    with torch.no_grad():
        return torch.cat(weights, out=out)


def current_copy(module: torch.nn.Module, attr: str, sources: Sequence[torch.Tensor]) -> WeightCopy | None:
    """The module's copy if it was made from these sources as they are now."""
    cached = module.__dict__.get(attr)
    return cached if cached is not None and cached.key == source_key(sources) else None


def hooked(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether a call of these modules would run anything but their class forward (hooks, a replaced forward; our
    own routed forward of patches/_linear.py computes the class forward's output and does not count)."""
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or ("forward" in m.__dict__ and not is_routed(m))
               for m in modules)
