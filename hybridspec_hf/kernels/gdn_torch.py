"""Block-parallel Gated-DeltaNet verification and commit in torch.

Per value head, S is the [dk, dv] state. For w verified tokens from the committed state S_0:

    G = cumsum(g), γ_i = e^{G_i}, Γ_ij = e^{G_i - G_j} (j <= i)
    A = strictly_lower(diag(β) (K Kᵀ ∘ Γ))
    Z = (I + A)⁻¹ diag(β) (V - diag(γ) K S_0)
    O = diag(γ) Q S_0 + ((Q Kᵀ) ∘ Γ ∘ lower_incl_diag) Z
    S_m = γ_m S_0 + K_{1:m}ᵀ diag(e^{G_m - G_j}) Z_{1:m}

Z of a prefix does not depend on later tokens, so one verification serves every accepted length m and no
per-token state is ever stored. This file is the CPU path and the reference for the Triton kernels.

Layouts follow transformers: q, k [B, T, H, dk]; v [B, T, HV, dv]; g, beta [B, T, HV]; state [B, HV, dk, dv].
Value head h reads key head h // (HV // H) (grouped value heads, `repeat_interleave` order).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|² + eps) over the last dim, the normalisation transformers and fla apply to q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 at least (state, gates and Z are never kept in a narrower type); fp64 when an input is fp64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _heads_first(x: torch.Tensor, num_v_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, d] -> [B, HV, T, d] in `dtype`, repeating key heads for grouped value heads."""
    if x.shape[2] != num_v_heads:
        x = x.repeat_interleave(num_v_heads // x.shape[2], dim=2)
    return x.transpose(1, 2).to(dtype)


@dataclass
class GDNVerifyResult:
    """What one verification leaves for the commit. Nothing here is a per-token state."""

    out: torch.Tensor  # [B, T, HV, dv] in v's dtype
    z: torch.Tensor  # [B, HV, T, dv] fp32 (or fp64)
    g_cum: torch.Tensor  # [B, HV, T] fp32 (or fp64), G = cumsum(g)
    # [B, HV, T, dk] the l2-normalised keys in z's dtype (torch path: `gdn_commit` reuses them, the same bits it
    # would compute; None from the Triton verify, whose commit re-normalises k)
    k_normed: torch.Tensor | None = None


def _decay_matrix(g_cum: torch.Tensor) -> torch.Tensor:
    """Γ_ij = e^{G_i - G_j} on and below the diagonal, 0 above. [B, HV, T] -> [B, HV, T, T].

    Masked before `exp`: above the diagonal G_i - G_j is positive and may overflow, and inf·0 is NaN.
    """
    diff = g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)
    return diff.masked_fill(_strictly_upper(g_cum.shape[-1], g_cum.device), float("-inf")).exp()


@functools.lru_cache(maxsize=64)
def _strictly_upper(t: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool, True above the diagonal (made once per length and device: two ops fewer per layer and round)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> GDNVerifyResult:
    """Outputs of w tokens from the committed `state` and the Z needed to commit any prefix; `state` is not written.

    q, k: [B, T, H, dk] raw (l2-normalised here, in fp32); v: [B, T, HV, dv]; g: [B, T, HV] log-decay (<= 0);
    beta: [B, T, HV]; state: [B, HV, dk, dv]. scale defaults to dk^-0.5.
    """
    num_v_heads = v.shape[2]
    dtype = compute_dtype(q, state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh = l2norm(_heads_first(q, num_v_heads, dtype)) * scale  # [B, HV, T, dk]
    kh = l2norm(_heads_first(k, num_v_heads, dtype))  # [B, HV, T, dk]
    vh = v.transpose(1, 2).to(dtype)  # [B, HV, T, dv]
    bh = beta.transpose(1, 2).to(dtype)  # [B, HV, T]
    g_cum = g.transpose(1, 2).to(dtype).cumsum(-1)  # [B, HV, T]
    s0 = state.to(dtype)

    gamma = g_cum.exp().unsqueeze(-1)  # [B, HV, T, 1]
    t = g_cum.shape[-1]
    if t == 1:  # a plain step: A is empty and the decay 1, so Z is the right-hand side (the same bits, no solve)
        z = bh.unsqueeze(-1) * (vh - gamma * (kh @ s0))  # [B, HV, 1, dv]
        out = gamma * (qh @ s0) + (qh @ kh.transpose(-1, -2)) @ z
        return GDNVerifyResult(out=out.transpose(1, 2).to(v.dtype), z=z, g_cum=g_cum, k_normed=kh)
    decay = _decay_matrix(g_cum)  # [B, HV, T, T]
    # A = strictly_lower(diag(β) (K Kᵀ ∘ Γ)); the solve takes I + A's unit diagonal as given (unitriangular), so no
    # identity is added
    a = (bh.unsqueeze(-1) * (kh @ kh.transpose(-1, -2)) * decay).tril(-1)
    rhs = bh.unsqueeze(-1) * (vh - gamma * (kh @ s0))  # [B, HV, T, dv]
    z = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    out = gamma * (qh @ s0) + ((qh @ kh.transpose(-1, -2)) * decay) @ z  # [B, HV, T, dv]
    return GDNVerifyResult(out=out.transpose(1, 2).to(v.dtype), z=z, g_cum=g_cum, k_normed=kh)


def gdn_commit(
    state: torch.Tensor,
    k: torch.Tensor,
    verified: GDNVerifyResult,
    num_committed: torch.Tensor | int,
) -> None:
    """Write S_m = γ_m S_0 + K_{1:m}ᵀ diag(e^{G_m - G_j}) Z_{1:m} into `state` in place, per request.

    state: [B, HV, dk, dv] holding S_0; k: [B, T, H, dk] raw keys of the verification (re-normalised here in
    fp32, as the Triton commit does, unless the verification kept them: `k_normed`); num_committed: [B] int tensor
    m (0 leaves the state untouched; no host sync), or one int 0 ≤ m ≤ T for every request (the eager loop: the
    sums run over the m committed tokens only, half the ops of the masked form).
    """
    z, g_cum = verified.z, verified.g_cum
    dtype = z.dtype
    kh = verified.k_normed if verified.k_normed is not None else l2norm(_heads_first(k, z.shape[1], dtype))
    t = g_cum.shape[-1]  # kh: [B, HV, T, dk]
    if isinstance(num_committed, int):
        if not 0 <= num_committed <= t:
            raise ValueError(f"num_committed must be in [0, {t}] (the verified tokens), got {num_committed}.")
        if num_committed == 0:
            return
        g_m = g_cum[..., num_committed - 1 : num_committed]  # [B, HV, 1]
        weight = (g_m - g_cum[..., :num_committed]).exp()  # [B, HV, m]
        kh, z = kh[..., :num_committed, :], z[..., :num_committed, :]
    else:
        m = num_committed.to(device=state.device, dtype=torch.long).view(-1, 1, 1)  # [B, 1, 1]
        last = (m - 1).clamp(min=0).expand(-1, g_cum.shape[1], 1)  # index of token m (0-based)
        g_m = torch.where(m > 0, g_cum.gather(-1, last), torch.zeros_like(g_cum[..., :1]))  # [B, HV, 1]
        positions = torch.arange(t, device=state.device).view(1, 1, t)
        # weights e^{G_m - G_j} for j < m, masked before exp (j > m would be a growth factor)
        weight = (g_m - g_cum).masked_fill(positions >= m, float("-inf")).exp()  # [B, HV, T]
    new_state = g_m.exp().unsqueeze(-1) * state.to(dtype) + kh.transpose(-1, -2) @ (weight.unsqueeze(-1) * z)
    state.copy_(new_state.to(state.dtype))


def conv_verify(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """Depthwise causal conv of w new inputs after the cached ones, without writing the cache.

    conv_state: [B, C, K] last K inputs (transformers' layout); x: [B, C, T] new inputs; weight: [C, K].
    Returns [B, C, T] in x's dtype: out_t = act(bias + Σ_j weight_j · input_{t+j}) over each token's K-input window,
    in fp32 at least (fp64 for fp64 inputs). The K-tap sum rather than F.conv1d: on the CPU a depthwise conv1d
    costs 0.1-0.3 ms a call in oneDNN set-up (≈ 30 µs for this), and transformers' conv agrees to the last bit or
    so (its summation order).
    """
    t, k = x.shape[-1], weight.shape[-1]
    dtype = compute_dtype(x, weight)
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)[..., -(t + k - 1) :]  # [B, C, K - 1 + T]
    out = (full.to(dtype).unfold(-1, k, 1) * weight.to(dtype)[:, None, :]).sum(-1)  # [B, C, T]
    if bias is not None:
        out = out + bias.to(dtype)[:, None]
    if activation is not None:
        out = activation(out)
    return out.to(x.dtype)


def commit_conv_state(conv_state: torch.Tensor, x: torch.Tensor, num_committed: torch.Tensor | int) -> None:
    """Roll the conv state to the K inputs ending at committed token m, in place. x: [B, C, T]; m: [B] int tensor,
    or one int 0 ≤ m ≤ T for every request."""
    k = conv_state.shape[-1]
    full = torch.cat([conv_state, x.to(conv_state.dtype)], dim=-1)  # [B, C, K+T]
    if isinstance(num_committed, int):
        conv_state.copy_(full[..., num_committed : num_committed + k])
        return
    m = num_committed.to(device=conv_state.device, dtype=torch.long).view(-1, 1, 1)
    index = (m + torch.arange(k, device=conv_state.device).view(1, 1, k)).expand(-1, full.shape[1], -1)
    conv_state.copy_(full.gather(-1, index))


def gdn_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token oracle: outputs [B, T, HV, dv] and the state after every token [B, T, HV, dk, dv] in `dtype`.

    S_i = e^{g_i} S_{i-1} + k_i z_iᵀ, z_i = β_i (v_i - e^{g_i} S_{i-1}ᵀ k_i), o_i = S_iᵀ q_i.
    """
    num_v_heads = v.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh = l2norm(_heads_first(q, num_v_heads, dtype)) * scale
    kh = l2norm(_heads_first(k, num_v_heads, dtype))
    vh, bh, gh = v.transpose(1, 2).to(dtype), beta.transpose(1, 2).to(dtype), g.transpose(1, 2).to(dtype)
    s = state.to(dtype)
    outs, states = [], []
    for i in range(v.shape[1]):
        s = s * gh[..., i, None, None].exp()
        zi = bh[..., i, None] * (vh[..., i, :] - (s * kh[..., i, :, None]).sum(-2))
        s = s + kh[..., i, :, None] * zi[..., None, :]
        outs.append((s * qh[..., i, :, None]).sum(-2))
        states.append(s)
    return torch.stack(outs, dim=1), torch.stack(states, dim=1)


@dataclass
class PendingGDNLayer:
    """One GDN layer's verification, waiting for the accepted count. Tensors are views of the layer's cache."""

    state: torch.Tensor  # [B, HV, dk, dv] committed recurrent state S_0 (written in place by the commit)
    conv_state: torch.Tensor  # [B, C, K] last K conv inputs (written in place by the commit)
    conv_input: torch.Tensor  # [B, C, T] the verified tokens' conv inputs (pre-conv, model dtype)
    k: torch.Tensor  # [B, T, H, dk] raw post-conv keys of the verified tokens
    verified: GDNVerifyResult


def commit_gdn_states(layers: list[PendingGDNLayer], num_committed: torch.Tensor | int) -> None:
    """Commit m tokens (per request, [B] int tensor; or one int for all) into every pending GDN layer: S_m and the
    conv state.

    The torch path loops over layers; the Triton path does all layers in one launch.
    """
    for layer in layers:
        gdn_commit(layer.state, layer.k, layer.verified, num_committed)
        commit_conv_state(layer.conv_state, layer.conv_input, num_committed)
