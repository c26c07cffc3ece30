"""Weight prefetch into the L2 cache for our decode kernels (Hopper's bulk prefetch, `cp.async.bulk.prefetch.L2`).

A batch-1 step is a chain of short kernels, each bound by how fast its weights stream; between them HBM idles while a
kernel ramps up, waits for the kernel before it (kernels/pdl.py) or runs a latency-bound part (the GDN step, the
router, a split-K reduction). One bulk prefetch instruction asks the L2 for a contiguous span of up to a few KB and
returns at once (no registers, no shared memory; the copy engine issues the line requests), so a program can put
its whole weight slice, or other programs' slices, in flight before it needs them:

- `gemv_triton`'s programs prefetch their own [BLOCK_N, K / SPLIT_K] slice (up to a byte budget per launch) before
  the PDL wait: the weights stream while the kernel before ends, not tile by tile as the pipeline asks for them
  (`WEIGHTS`);
- the MoE decode gate_up's first programs (grid z = 0: resident first) prefetch every routed expert's [2I, H] block
  once the router's ids are known, so the later programs' tiles are in the L2 when they start (`EXPERTS`).

A prefetch changes no value (the tests check the same bits on and off). It is an NVIDIA sm_90+ instruction: `active`
is False under TRITON_INTERPRET=1 (CPU tests), on ROCm and below compute capability 9, and the kernels then run
without it (the same code otherwise). Spans must be 16-byte aligned with sizes a multiple of 16 bytes: the launchers
check the tensors (`aligned`) and switch it off for a launch where they are not.
"""
from __future__ import annotations

import torch

from . import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = tl = None

WEIGHTS = False  # A/B switch `l2-weights` (off until measured on the H200)
EXPERTS = False  # A/B switch `l2-experts` (off until measured on the H200)
DOWN = False  # with EXPERTS, their down blocks too (A/B switch `l2-down`)
BUDGET_BYTES = 32 * 1024 * 1024  # at most this much of one GEMM's weight is prefetched (the L2 holds 50 MB)


def active(interpret: bool) -> bool:
    """Whether kernels launched now may prefetch: not interpreted, an NVIDIA GPU of compute capability ≥ 9 (the same
    test as PDL's, which needs Hopper too)."""
    return (not interpret and torch.version.hip is None and torch.cuda.is_available()
            and pdl._capable(torch.cuda.current_device()))


def aligned(*tensors_and_strides) -> bool:
    """Every tensor's start and every given stride in bytes a multiple of 16 (bulk prefetch spans: 16-byte aligned)."""
    for item in tensors_and_strides:
        value = item.data_ptr() if isinstance(item, torch.Tensor) else int(item)
        if value % 16:
            return False
    return True


def prefetch(ptrs, nbytes):
    """Ask the L2 for nbytes (int32, a multiple of 16; 0: nothing) at each pointer of `ptrs` (16-byte aligned), one
    bulk prefetch per element; returns at once. Elements a program holds twice (a tensor smaller than its threads)
    are asked for twice, which the L2 merges."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


if triton is not None:
    prefetch = triton.jit(prefetch)
