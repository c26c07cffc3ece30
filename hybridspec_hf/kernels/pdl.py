"""Programmatic dependent launch (PDL) for our Triton kernels: a kernel starts while the one before it finishes.

A resident plain step is ≈ 470 kernels in one CUDA graph (benchmarks/results/breakdown_run34_decode_on.md): the GPU
idles ≈ 11 % of the step between them, and each kernel's first weight loads wait for the kernel before it to end.
On Hopper a kernel launched with the programmatic-stream-serialization attribute may start once every program of
the kernel before it has signalled (`griddepcontrol.launch_dependents`), and must execute `griddepcontrol.wait`
before it reads what that kernel wrote: the wait returns when the kernel before has completed and its writes are
visible. CUDA graphs captured from such launches keep these programmatic edges.

The rule every kernel that takes part follows (`_LazyJit(fn, pdl=True)` in gdn_triton.py passes `PDL` and the
launch option): before `enter(PDL)` it reads nothing but weights (tensors no kernel of the graph writes) and writes
nothing; `enter` waits, then signals the next kernel, so at most two kernels overlap: one running, the
next one's programs resident and prefetching their weights. Every program executes the wait, so a kernel completes
only after the kernel before it has (kernels further back are then complete too: the chain is transitive), and
kernels that do not take part (torch's, cuBLAS's) keep plain stream order on both sides.

Early reads (`EARLY_READS`): a kernel starts only after the kernel right before it passed its own wait (a kernel
that does not take part: after it completed), so every kernel before that one has completed and its writes are in
global memory. Before `enter` a kernel may therefore also read what those kernels wrote, never what the kernel right
before it writes, and past L1 (`.cg`: a line cached by an earlier kernel on the same SM could be stale). The MoE
decode down kernel reads the routing (written by the router, two kernels back: the gate_up kernel is between) and
streams its first weight tile while gate_up ends; the GDN decoding step loads its state (written by the previous
step's launch) before waiting for its input projection. False: those reads after `enter` (A/B).

ENABLED switches it (A/B: `--pdl on|off` in the benchmarks); it applies on CUDA devices of compute capability ≥ 9
only, and never under TRITON_INTERPRET=1 (the CPU tests run the kernels with PDL=False: the same code otherwise).
Read when a kernel launches, so graphs captured afterwards follow it. On since run 47 on the H200
(benchmarks/results/batch_pdl_run47.md, A/B in one run, Qwen3.5-35B-A3B shape): our AR step 2.95 → 2.70-2.76 ms at
batch 1, 4.26 → 3.93-3.98 at batch 2, 6.02 → 5.66-5.69 at batch 4 (1.06-1.09x tokens/s); the same bits
(tests/test_pdl_cuda.py).
"""
from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs without triton
    triton = tl = gdc_wait = gdc_launch_dependents = None

ENABLED = True
EARLY_READS = True  # see the module docstring; read when a kernel launches


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def active(interpret: bool) -> bool:
    """Whether launches now take PDL: switched on, not interpreted, and the current device an NVIDIA GPU of compute
    capability ≥ 9 (Hopper or newer; not ROCm, whose capability numbers mean something else)."""
    return (ENABLED and not interpret and torch.version.hip is None and torch.cuda.is_available()
            and _capable(torch.cuda.current_device()))


def enter(PDL):
    """In a kernel, before anything but weight reads: wait for the kernel before it to complete (its writes visible),
    then let the next kernel's programs start (they wait for this one in their own `enter`). No-op with PDL False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


if triton is not None:
    enter = triton.jit(enter)
