"""The default GDN verifier that SGLang / vLLM use today, as the baseline our verify + commit is measured against.

Verify runs the recurrence token by token (`gdn_torch.gdn_recurrence` is its float64 oracle),
    S_i = e^{g_i} S_{i-1} + k_i z_iᵀ,  z_i = β_i (v_i - e^{g_i} S_{i-1}ᵀ k_i),  o_i = S_iᵀ q_i,
and stores S_i after EVERY verified token into a preallocated fp32 buffer (L·B·w·HV·dk·dv·4 bytes: 960 MiB per
request for Qwen3.5-35B-A3B at w = 16). The commit copies the accepted one back, state <- buffer[m-1] for m >= 1,
for all layers in one launch (sglang's `fused_mamba_state_scatter_with_mask`), and rolls the conv window.

Kernel: one program per (dv tile, value head, request) keeps its [dk, BV] state tile in registers for the whole
window (fla's `fused_recurrent` layout). Two things make it the efficient version of that baseline rather than a
straw man: both reductions of a step read the same decayed state (o_i = e^{g_i} S_{i-1}ᵀ q_i + (q_i·k_i) z_i, so the
step has one dependent reduction instead of two), and the next token's inputs are loaded while the current token
is computed. Conv: sglang copies the window from a per-token window cache its conv kernel writes; here the commit
rolls it from the verified conv inputs (same bytes, and the conv kernel is common to both verifiers).

The same kernel is the plain decoding step of both verifiers (`gdn_decode_step`, w = 1): with the state itself as
its one-token buffer it reads and writes S once, in place, and leaves nothing to commit. Writing each token's z and
G instead of its state (`recurrent_verify_triton`) it is our verifier's token-by-token form: the program is
`gdn_triton._recurrent_program`, shared with the block verify's branch for short windows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pdl
from .gdn_torch import GDNVerifyResult, commit_conv_state, gdn_recurrence
from .gdn_triton import (
    HAS_TRITON,
    _LazyJit,
    _recurrent_program,
    _check_verify_shapes,
    _last_dim_contiguous,
    _mask_invalid,
    launch_commit,
    select_backend,
)

if HAS_TRITON:
    import triton
    import triton.language as tl
else:
    tl = None


@dataclass
class DefaultVerifyResult:
    """What the default verification leaves for the commit: a state per verified token."""

    out: torch.Tensor  # [B, T, HV, dv] in v's dtype
    states: torch.Tensor  # [B, T, HV, dk, dv] fp32, S after each token (a view of the preallocated buffer)


@dataclass
class PendingDefaultLayer:
    """One layer waiting for the accepted count under the default verifier. Tensors are views of the layer's cache."""

    state: torch.Tensor  # [B, HV, dk, dv] committed state (overwritten by the commit)
    conv_state: torch.Tensor  # [B, C, K] last K conv inputs (written in place by the commit)
    conv_input: torch.Tensor  # [B, C, T] the verified tokens' conv inputs
    verified: DefaultVerifyResult


def allocate_state_buffer(num_layers: int, state: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The per-token state buffer the default verifier needs: [layers, B, w, HV, dk, dv] fp32 (its memory cost)."""
    batch, num_v_heads, dk, dv = state.shape
    return torch.empty(num_layers, batch, max_tokens, num_v_heads, dk, dv, dtype=torch.float32, device=state.device)


def _recurrent_verify_kernel(
    q, k, v, g, beta, state, out, states, valid_len, z, g_cum,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh,
    stride_bb, stride_bt, stride_bh,
    stride_sb, stride_sh, stride_sk,
    stride_pb, stride_pt, stride_ph, stride_pk,
    HV, GROUP, DK, DV, scale,
    T: tl.constexpr, HAS_VALID: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, Z_OUT: tl.constexpr,
    DYNAMIC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)  # PDL: nothing read before the kernel before this one completed
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    i_hk = i_h // GROUP
    n = T
    if HAS_VALID:
        n = tl.minimum(tl.load(valid_len + i_b).to(tl.int32), T)
    _recurrent_program(q, k, v, g, beta, state, out, states, z, g_cum, n, i_v, i_h, i_b, i_hk,
                       stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                       stride_vh, stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh, stride_sb,
                       stride_sh, stride_sk, stride_pb, stride_pt, stride_ph, stride_pk, HV, DK, DV, scale, T, BK, BV,
                       Z_OUT, DYNAMIC)


if HAS_TRITON:
    _recurrent_verify_kernel = _LazyJit(_recurrent_verify_kernel, pdl=True)


def _recurrent_config(batch: int, num_v_heads: int, dv: int) -> tuple[int, int]:
    """(BV, num_warps), the fastest of (4, 1), (8, 1), (16, 2), (32, 4) measured on an H200 at dk = dv = 128
    (benchmarks/results/gdn_kernels.json, sweep): more, narrower programs while there are few heads."""
    if batch * num_v_heads < 128:
        return min(16, triton.next_power_of_2(dv)), 2
    return min(32, triton.next_power_of_2(dv)), 4


def default_verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    states: torch.Tensor,
    scale: float | None = None,
    valid_len: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> DefaultVerifyResult:
    """Token-by-token verification writing S after every token into `states` [B, >= T, HV, dk, dv] fp32.

    Inputs as `gdn_triton.gdn_verify_triton`; `state` is not written. Rows of `states` for ignored tokens
    (>= valid_len) are left as they were.
    """
    _check_verify_shapes(q, k, v, g, beta, state)
    _check_states_buffer(states, state, q.shape[1])
    out = _launch_recurrent(q, k, v, g, beta, state, states, scale, valid_len, block_v, num_warps)
    return DefaultVerifyResult(out=out, states=states[:, : q.shape[1]])


def gdn_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """One decoded token through the recurrence, `state` [B, HV, dk, dv] updated IN PLACE (Triton: CUDA, or the
    interpreter): the kernel above with the state itself as its one-token buffer, so the step reads and writes S
    once and leaves nothing to commit (a plain decoding step commits its token anyway). q, k [B, 1, H, dk];
    v [B, 1, HV, dv]; g, beta [B, 1, HV]. Returns out [B, 1, HV, dv] in v's dtype."""
    _check_verify_shapes(q, k, v, g, beta, state)
    if q.shape[1] != 1 or state.stride(-1) != 1:
        raise ValueError(f"gdn_decode_step takes one token (got T={q.shape[1]}) and a state contiguous in its last "
                         f"dimension (strides {state.stride()}); verify longer inputs with gdn_verify_triton")
    return _launch_recurrent(q, k, v, g, beta, state, state.unsqueeze(1), scale, None, block_v, num_warps)


def _launch_recurrent(q, k, v, g, beta, state, states, scale, valid_len, block_v, num_warps,
                      z_out: GDNVerifyResult | None = None) -> torch.Tensor:
    """`_recurrent_verify_kernel` over [B, T] tokens, S_t written to states[:, t], or with z_out its z and g_cum
    (and out) written there instead; returns out [B, T, HV, dv]."""
    batch, t, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    q, k, v, state = (_last_dim_contiguous(x) for x in (q, k, v, state))
    scale = dk**-0.5 if scale is None else scale
    if z_out is None:
        out = torch.empty(batch, t, num_v_heads, dv, dtype=v.dtype, device=v.device)
        z = g_cum = out  # not written
        state_strides = states.stride()[:4]
    else:
        out, z, g_cum, states = z_out.out, z_out.z, z_out.g_cum, state  # states: not written
        state_strides = (0, 0, 0, 0)
    default_bv, default_warps = _recurrent_config(batch, num_v_heads, dv)
    block_v = block_v or default_bv
    grid = (triton.cdiv(dv, block_v), num_v_heads, batch)
    _recurrent_verify_kernel[grid](
        q, k, v, g, beta, state, out, states, valid_len if valid_len is not None else g, z, g_cum,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *state.stride()[:3],
        *state_strides,
        num_v_heads, num_v_heads // num_k_heads, dk, dv, scale,
        T=t, HAS_VALID=valid_len is not None, BK=max(16, triton.next_power_of_2(dk)), BV=block_v,
        Z_OUT=z_out is not None, DYNAMIC=valid_len is not None and not triton.knobs.runtime.interpret,
        num_warps=num_warps or default_warps,
    )
    return out


def recurrent_verify_triton(q, k, v, g, beta, state, scale=None, valid_len=None, *, block_v=None, num_warps=None,
                            outputs: GDNVerifyResult) -> GDNVerifyResult:
    """`gdn_triton.gdn_verify_triton`'s contract (out, and the z and g_cum its commit rebuilds S_m from; no state per
    token, `state` not written) by the token-by-token recurrence of this file's kernel: z_t = β_t (v_t - e^{g_t}
    S_{t-1}ᵀ k_t) is the block form's Z row t, computed in order instead of by the triangular solve. outputs:
    contiguous out [B, T, HV, dv], z [B, HV, T, dv] and g_cum [B, HV, T] fp32 (checked by the caller)."""
    _launch_recurrent(q, k, v, g, beta, state, None, scale, valid_len, block_v, num_warps, z_out=outputs)
    return outputs


def _check_states_buffer(states: torch.Tensor, state: torch.Tensor, t: int) -> None:
    batch, num_v_heads, dk, dv = state.shape
    if (states.dim() != 5 or states.shape[0] != batch or states.shape[1] < t or states.shape[2:] != state.shape[1:]
            or states.dtype != torch.float32 or states.stride(-1) != 1):
        raise ValueError(
            f"states must be a [B, >= T, HV, dk, dv] = [{batch}, >= {t}, {num_v_heads}, {dk}, {dv}] float32 buffer "
            f"(last dim contiguous), got {tuple(states.shape)} {states.dtype}; see allocate_state_buffer"
        )


def commit_default_states_triton(layers: list[PendingDefaultLayer], num_committed: torch.Tensor) -> None:
    """state <- states[b, m-1] and the conv roll, for every layer in ONE launch (m = 0 leaves both untouched)."""
    if not layers:
        return
    launch_commit(
        [layer.state for layer in layers],
        [layer.verified.states for layer in layers],
        [layer.conv_state for layer in layers],
        [layer.conv_input for layer in layers],
        num_committed,
        num_key_heads=1,
    )


# ----------------------------------------------------------------------------------------------------------------
# torch path and dispatch


def default_verify_torch(q, k, v, g, beta, state, states, scale=None, valid_len=None) -> DefaultVerifyResult:
    """CPU path: the fp32 recurrence (`gdn_recurrence`), per-token states copied into `states`."""
    t = q.shape[1]
    _check_states_buffer(states, state, t)
    if valid_len is not None:
        q, k, v, g, beta = (_mask_invalid(x, valid_len) for x in (q, k, v, g, beta))
    out, per_token = gdn_recurrence(q, k, v, g, beta, state, scale, dtype=torch.float32)
    if valid_len is not None:
        keep = torch.arange(t, device=q.device).view(1, t) < valid_len.to(q.device).view(-1, 1)  # [B, T]
        out = out * keep[:, :, None, None]
        per_token = torch.where(keep[:, :, None, None, None], per_token, states[:, :t])
    states[:, :t].copy_(per_token)
    return DefaultVerifyResult(out=out.to(v.dtype), states=states[:, :t])


def commit_default_states_torch(layers: list[PendingDefaultLayer], num_committed: torch.Tensor) -> None:
    """CPU path of `commit_default_states_triton`."""
    for layer in layers:
        m = num_committed.to(device=layer.state.device, dtype=torch.long)  # [B]
        last = (m - 1).clamp(min=0).view(-1, 1, 1, 1, 1).expand(-1, 1, *layer.state.shape[1:])
        accepted = layer.verified.states.gather(1, last).squeeze(1)  # [B, HV, dk, dv]
        keep = (m > 0).view(-1, 1, 1, 1)
        layer.state.copy_(torch.where(keep, accepted.to(layer.state.dtype), layer.state))
        commit_conv_state(layer.conv_state, layer.conv_input, num_committed)


def default_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    states: torch.Tensor,
    scale: float | None = None,
    valid_len: torch.Tensor | None = None,
    kernel_backend: str = "auto",
) -> DefaultVerifyResult:
    """The default verifier: Triton on CUDA (or under TRITON_INTERPRET=1), torch otherwise."""
    if select_backend(kernel_backend, q, state) == "triton":
        return default_verify_triton(q, k, v, g, beta, state, states, scale, valid_len)
    return default_verify_torch(q, k, v, g, beta, state, states, scale, valid_len)


def commit_default_states(
    layers: list[PendingDefaultLayer], num_committed: torch.Tensor, kernel_backend: str = "auto"
) -> None:
    """Copy each layer's accepted per-token state back and roll the conv window (one launch on the Triton path)."""
    if not layers:
        return
    if select_backend(kernel_backend, layers[0].state) == "triton":
        commit_default_states_triton(layers, num_committed)
    else:
        commit_default_states_torch(layers, num_committed)
