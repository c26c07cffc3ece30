"""The decoder layers' projections by our skinny GEMM (kernels/gemv_triton.py) inside GPU-resident forwards only.

transformers calls its projections as modules (`self.q_proj(x)`, `layer.out_proj(core)`, `self.in_proj_qkvz(x)`,
the dense MLPs' gate/up/down), so `prepare_linears` gives each plain `nn.Linear` of the decoder layers an instance
`forward` that calls `gemv_triton.linear` while `fused_kernels()` is active (grad off, ≤ 16 rows: `linear` checks) and
`F.linear`, what nn.Linear.forward computes, otherwise. `linear` takes our kernel only where its TABLE names a config
for the shape and the tensors are on CUDA (or under the Triton interpreter, tests); with the table empty (its default)
every projection is F.linear as before. The LM head is not a decoder-layer module: cuBLAS already streams it at
~4.3 TB/s. The fused paths over concatenated copies (GDN input projection, shared expert, router) call `linear`
themselves (patches/_gdn.py, patches/_moe.py, kernels/shared_expert_triton.py).

The resident rounds install the forwards before capture and remove them when they are released (the lifetime of the
weight copies), so plain generate(), training and every CPU path run nn.Linear's own forward. Subclasses (quantized
layers, adapters) and modules whose `forward` was already replaced (e.g. accelerate's offload hooks) are left alone;
forward hooks still fire around ours. `hooked()` (patches/_weight_copies.py) does not count our forward as a change.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridspec_hf.kernels import fused_kernels_active
from hybridspec_hf.kernels.gemv_triton import linear

__all__ = ["is_routed", "prepare_linears", "release_linears"]


def _routed_forward(module: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if fused_kernels_active():
        return linear(input, module.weight, module.bias)
    return F.linear(input, module.weight, module.bias)


def is_routed(module: torch.nn.Module) -> bool:
    """Whether the module's instance `forward` is ours (it computes what the class forward computes)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _routed_forward


def prepare_linears(linears: list[torch.nn.Module]) -> None:
    """Install the routed forward on each plain nn.Linear without a forward of its own (idempotent; outside capture:
    the resident rounds call it with the weight copies)."""
    for module in linears:
        if type(module) is torch.nn.Linear and "forward" not in module.__dict__:
            module.forward = functools.partial(_routed_forward, module)  # a partial pickles and deep-copies


def release_linears(linears: list[torch.nn.Module]) -> None:
    """Remove our forwards (nn.Linear.forward again); a forward replaced by someone else since stays."""
    for module in linears:
        if is_routed(module):
            del module.__dict__["forward"]
