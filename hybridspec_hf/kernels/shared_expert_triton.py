"""The shared expert of a Qwen3.5-MoE / Qwen3-Next block and the block's final combine, in few launches.

transformers (5.17 and 5.24 alike) computes, per MoE layer, on top of the router and the routed experts:

    shared = down(silu(gate_proj x) · up_proj x)                    [T, H]
    out    = routed + sigmoid(shared_expert_gate x) · shared          shared_expert_gate: [1, H], no bias

nine launches on CUDA (four GEMMs, silu, mul, sigmoid, mul, add). `shared_expert` runs it as one GEMM over the rows
[gate_proj; up_proj; shared_expert_gate] concatenated once (`concat_shared_weights`), the `silu_mul` kernel, the
down GEMM, and `gated_add` fuses the sigmoid gate with the final add: four launches.

Rounding: the kernels keep transformers' steps (each torch op on bf16/fp16 computes in fp32 and rounds its output):
silu(g) is rounded to the model dtype before the product with up, sigmoid(gate logit) before the product with the
shared output, that product before the add. In fp32 every rounding is the identity. What differs from transformers
is the order of the GEMMs' fp32 accumulation (cuBLAS may pick another split for the concatenated GEMM) and Triton's
exp (not libm's): fp32 outputs agree to ~1e-6 relative, bf16 ones to a rounding or two of the model dtype. Under
the interpreter (triton 3.6, the CPU tests) fp32 -> bf16 casts truncate where the GPU rounds to nearest, so bf16
results there are ~1e-2 off transformers' (relative Frobenius error).

Kernels bind to `triton.jit` at launch (`_LazyJit`); Triton compiles on the first launch of each shape: call once
before CUDA-graph capture (the warm-up does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl
from .gdn_triton import HAS_TRITON, _LazyJit, tl, tl_dtype, triton
from .gemv_triton import linear
from .norm_triton import _rows

ROW_ALIGN = 8  # rows of the concatenated weight, padded so that each GEMM output row starts 16-byte aligned


def shared_expert_reference(hidden: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                            down_proj: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' shared expert: hidden [T, H], gate_proj/up_proj [I, H], down_proj [H, I], gate [1, H] ->
    (shared [T, H], gate logit [T, 1]), both in hidden's dtype."""
    shared = F.linear(F.silu(F.linear(hidden, gate_proj)) * F.linear(hidden, up_proj), down_proj)
    return shared, F.linear(hidden, gate)


def gated_add_reference(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The block's combine: routed [T, H] + sigmoid(gate_logit [T, 1]) · shared [T, H]."""
    return routed + torch.sigmoid(gate_logit) * shared


def concat_shared_weights(gate_proj: torch.Tensor, up_proj: torch.Tensor, gate: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """[gate_proj; up_proj; gate; zero rows] [2I + 1 rows padded to ROW_ALIGN, H]. Written into `out` when it has
    that shape, dtype and device (its address stays, so graphs captured on it read the new weights)."""
    inter, hidden = gate_proj.shape
    rows = -(-(2 * inter + 1) // ROW_ALIGN) * ROW_ALIGN
    like = dict(dtype=gate_proj.dtype, device=gate_proj.device)
    if out is None or out.shape != (rows, hidden) or out.dtype != like["dtype"] or out.device != like["device"]:
        out = torch.zeros(rows, hidden, **like)
    with torch.no_grad():
        out[:inter].copy_(gate_proj)
        out[inter : 2 * inter].copy_(up_proj)
        out[2 * inter : 2 * inter + 1].copy_(gate)
    return out


def _silu_mul_kernel(gate_up, act, stride_g, stride_a, inter, BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)  # F.silu's output, in the model dtype
    tl.store(act + row * stride_a + cols, (silu * up).to(OUT_DTYPE), mask=mask)


def _gated_add_kernel(routed, gate_logit, shared, out, stride_r, stride_g, stride_s, stride_o, hidden,
                      BLOCK: tl.constexpr, OUT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    logit = tl.load(gate_logit + row * stride_g).to(tl.float32)
    weight = (1.0 / (1.0 + tl.exp(-logit))).to(OUT_DTYPE).to(tl.float32)  # torch.sigmoid's output
    value = tl.load(shared + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    gated = (weight * value).to(OUT_DTYPE).to(tl.float32)
    base = tl.load(routed + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (base + gated).to(OUT_DTYPE), mask=mask)


if HAS_TRITON:
    _silu_mul_kernel = _LazyJit(_silu_mul_kernel, pdl=True)
    _gated_add_kernel = _LazyJit(_gated_add_kernel, pdl=True)


def _grid(rows: int, cols: int) -> tuple[int, tuple[int, int]]:
    block = min(1024, triton.next_power_of_2(cols))
    return block, (rows, triton.cdiv(cols, block))


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate_up[:, :I]) · gate_up[:, I:2I] (one launch): gate_up [T, ≥ 2I] -> [T, I] in its dtype."""
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0] == 0:
        return out
    block, grid = _grid(gate_up.shape[0], inter)
    _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
                           OUT_DTYPE=tl_dtype(gate_up.dtype), num_warps=4)
    return out


def gated_add(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Triton `gated_add_reference` (one launch): routed, shared [T, H] and gate_logit [T, 1] (any row stride, e.g. a
    column of the shared expert's GEMM output) of one dtype -> [T, H]."""
    routed, shared = _rows(routed), _rows(shared)
    out = torch.empty(routed.shape, dtype=routed.dtype, device=routed.device)
    if routed.shape[0] == 0:
        return out
    block, grid = _grid(*routed.shape)
    _gated_add_kernel[grid](routed, gate_logit, shared, out, routed.stride(0), gate_logit.stride(0), shared.stride(0),
                            out.stride(0), routed.shape[1], BLOCK=block, OUT_DTYPE=tl_dtype(routed.dtype),
                            num_warps=4)
    return out


def shared_expert(hidden: torch.Tensor, weights: torch.Tensor, down_proj: torch.Tensor,
                  inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`shared_expert_reference` in three launches: hidden [T, H], weights from `concat_shared_weights`, down_proj
    [H, I] -> (shared [T, H], gate logit [T, 1], a column view of the first GEMM's output)."""
    gate_up = linear(hidden, weights)  # [T, rows]: gate | up | gate logit | padding
    return linear(silu_mul(gate_up, inter), down_proj), gate_up[:, 2 * inter : 2 * inter + 1]
