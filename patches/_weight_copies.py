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

from hybridspec_hf.kernels import fused_kernels_allowed, select_backend

from ._linear import is_routed

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def plain_linears(owner: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Module] | None:
    """The owner's projections of these names if they are plain bias-free nn.Linear modules (not quantized, no
    adapters), else None."""
    modules = [getattr(owner, name, None) for name in names]
    return modules if all(type(m) is torch.nn.Linear and m.bias is None for m in modules) else None


def fusable_linears(owner: torch.nn.Module, names: Sequence[str]) -> list[torch.nn.Module] | None:
    """The `plain_linears` when one GEMM over a copy of their weights computes what they do: nothing else to run
    (hooks, a replaced forward), one float dtype, device and input width, where the fused kernels run (CUDA, or the
    Triton interpreter in tests) and are not switched off."""
    modules = plain_linears(owner, names)
    if modules is None or hooked(modules):
        return None
    weights = [m.weight for m in modules]
    one_kind = len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1 and weights[0].dtype in _DTYPES
    on_route = fused_kernels_allowed() and select_backend("auto", weights[0]) == "triton"
    return modules if one_kind and on_route else None
