"""Routing correction: keep the extra token d_{w0} or not, after seeing its first-layer experts.

Stage 0 runs the target up to the first MoE router on w0 + 1 tokens. The extra (last) token's marginal value is
p̂_{w0} = P(d_1..d_{w0} accepted) tokens; its marginal cost, now that stage 0 is paid and its layer-0 experts are known,
is ΔL = C(w0+1) - C(w0) - s(w0) + η·(n̄_all(w0 | n_new) - n̄_all(w0)). Keep it iff p̂_{w0} > ρ·ΔL: the same
Dinkelbach test as the length selection, re-run with better information. Pure torch, no host sync.
"""
from __future__ import annotations

import torch

from .latency import LatencyModel
from .length import on_device


def count_new_experts(first_layer_topk_ids: torch.Tensor, w0: torch.Tensor | None = None) -> torch.Tensor:
    """n_new = experts of the extra token that none of the first w0 tokens used (first MoE layer) -> [batch] long.

    first_layer_topk_ids: [batch, T, top_k] long router choices of the first MoE layer for the stage-0 tokens.
    w0: [batch] long index of the extra token per row (tokens 0..w0-1 are the nominal ones); default T - 1, i.e. the
    last token is the extra one. Rows with different w0 share one padded tensor this way.
    """
    batch, T, _ = first_layer_topk_ids.shape
    if w0 is None:
        w0 = torch.full((batch,), T - 1, dtype=torch.long, device=first_layer_topk_ids.device)
    idx = w0.long().clamp(0, T - 1)
    extra = first_layer_topk_ids.gather(1, idx.view(batch, 1, 1).expand(batch, 1, first_layer_topk_ids.shape[2]))
    earlier = torch.arange(T, device=idx.device) < idx.unsqueeze(1)  # [batch, T]
    same = extra.view(batch, -1, 1, 1) == first_layer_topk_ids.unsqueeze(1)  # [batch, top_k, T, top_k]
    used = (same & earlier.view(batch, 1, T, 1)).flatten(2).any(-1)  # [batch, top_k]
    return (~used).sum(-1)


def predicted_delta_latency(latency_model: LatencyModel, w0: torch.Tensor, n_new: torch.Tensor,
                            context_len) -> torch.Tensor:
    """ΔL = C(w0+1) - C(w0) - s(w0) + η·(n̄_all(w0 | n_new) - n̄_all(w0)) seconds -> [batch] fp32.

    w0: [batch] long; n_new: [batch] long (count_new_experts); context_len: int or [batch] long.
    Rows with w0 >= B (no extra token exists) get +inf. Without an expert model (dense target) the η term is 0.
    latency_model must be on w0's device (LatencyModel.to).
    """
    B, batch = latency_model.block_size, w0.shape[0]
    cost = latency_model.cost_for(context_len).expand(batch, -1)  # [batch, B]
    sunk = latency_model.sunk_for(context_len).expand(batch, -1)  # [batch, B-1]
    i = (w0.long() - 1).clamp(0, B - 2).unsqueeze(1)  # [batch, 1] index of C(w0)
    step = cost.gather(1, i + 1) - cost.gather(1, i) - sunk.gather(1, i)
    delta = step.squeeze(1)  # [batch]
    if latency_model.prices_experts:
        delta = delta + latency_model.eta * latency_model.experts.extra_delta(w0, n_new)
    return torch.where(w0 >= B, torch.full_like(delta, float("inf")), delta)


def extra_survival(survival: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """p̂_{w0} (survival of the extra draft d_{w0}) -> [batch] fp32; 0 where w0 >= B (there is no d_{w0})."""
    P = survival.shape[-1]
    if P == 0:  # B = 1: no drafts at all
        return torch.zeros(survival.shape[0], device=survival.device)
    p = survival.float().gather(1, (w0.long() - 1).clamp(0, P - 1).unsqueeze(1)).squeeze(1)
    return torch.where(w0 > P, torch.zeros_like(p), p)


def keep_extra_token(p_hat_w0: torch.Tensor, rho, delta_latency: torch.Tensor) -> torch.Tensor:
    """Keep the extra token iff p̂_{w0} > ρ·ΔL. p_hat_w0, delta_latency: [batch]; rho: float or [batch].

    Returns [batch] bool. A +inf ΔL (no extra token) never keeps; a negative ΔL (the token is cheaper than the
    sunk stage-0 work saved) always keeps when p̂ > 0.
    """
    return p_hat_w0 > on_device(rho, p_hat_w0.device, torch.float32) * delta_latency
