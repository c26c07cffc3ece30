"""The GDN layer's verify mode, shared by every model family.

Outside verification the patched `forward` calls transformers' own forward unchanged, so plain `generate()` and
training are untouched. During a HybridSpec verification the loop sets `layer._hybridspec_verify` to a
`VerifySession`; the layer then computes its outputs for all w tokens with the block form (no per-token state),
leaves the cache as it was, and records what the commit needs.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from hybridspec_hf.kernels import (
    PendingDefaultLayer,
    PendingGDNLayer,
    allocate_state_buffer,
    commit_default_states,
    commit_gdn_states_auto,
    conv_verify,
    default_verify,
    gdn_verify_auto,
)

# (layer, hidden_states [B, T, H]) -> mixed_qkv [B, T, C] (pre-conv), z [B, T, HV, dv], b [B, T, HV], a [B, T, HV]
ProjectFn = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class VerifySession:
    """State of one verification forward: where the cache lives and what each GDN layer left for the commit."""

    cache: Any  # transformers Cache holding the committed GDN states
    kernel_backend: str = "auto"
    valid_len: Any = None  # [B] long device tensor: tokens of the verification that count (None: all)
    pending: list = field(default_factory=list)  # PendingGDNLayer (block) or PendingDefaultLayer (per-token state)
    # "block": ours (no per-token state; the commit rebuilds S_m); "per_token_state": the serving engines' verifier
    # (a state per verified token in `state_buffer` [GDN layers, B, >= T, HV, dk, dv] fp32; the commit copies S_m)
    verifier: str = "block"
    state_buffer: Any = None


def per_token_state_buffer(gdn_layers: list[torch.nn.Module], cache, max_tokens: int) -> torch.Tensor:
    """The "per_token_state" verifier's buffer for these GDN layers of a prefilled cache:
    [layers, B, max_tokens, HV, dk, dv] fp32 (its memory cost: 960 MiB at w = 16 for Qwen3.5-35B-A3B)."""
    state = cache.layers[gdn_layers[0].layer_idx].recurrent_states[0]
    return allocate_state_buffer(len(gdn_layers), state, max_tokens)


def commit_session(session: VerifySession, num_committed: torch.Tensor) -> None:
    """Commit m tokens ([B] int device tensor) of a verification into every GDN layer, in one launch on CUDA."""
    if not session.pending:
        return
    if session.verifier == "per_token_state":
        commit_default_states(session.pending, num_committed, session.kernel_backend)
    else:
        commit_gdn_states_auto(session.pending, num_committed, session.kernel_backend)


def project_separate(layer: torch.nn.Module, hidden_states: torch.Tensor):
    """Qwen3.5 layout: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""
    batch, seq_len, _ = hidden_states.shape
    z = layer.in_proj_z(hidden_states).reshape(batch, seq_len, -1, layer.head_v_dim)
    return layer.in_proj_qkv(hidden_states), z, layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"GDN conv activation {name!r} is not supported by HybridSpec (expected 'silu').")


def verify_forward(layer: torch.nn.Module, session: VerifySession, hidden_states: torch.Tensor, project: ProjectFn):
    """The GDN layer's output for w tokens from the committed state, without writing the cache."""
    batch, seq_len, _ = hidden_states.shape
    cache_layer = session.cache.layers[layer.layer_idx]
    conv_state = cache_layer.conv_states[0]  # [B, C, K]
    state = cache_layer.recurrent_states[0]  # [B, HV, dk, dv]
    if conv_state is None or state is None:
        raise RuntimeError("HybridSpec verification needs a prefilled cache (GDN layer %d is empty)." % layer.layer_idx)

    mixed_qkv, z, b, a = project(layer, hidden_states)
    conv_input = mixed_qkv.transpose(1, 2)  # [B, C, T]
    mixed = conv_verify(
        conv_state, conv_input, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, _activation(layer.activation)
    ).transpose(1, 2)  # [B, T, C]
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, layer.head_k_dim)
    key = key.reshape(batch, seq_len, -1, layer.head_k_dim)
    value = value.reshape(batch, seq_len, -1, layer.head_v_dim)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)  # [B, T, HV] fp32

    if session.verifier == "per_token_state":
        states = session.state_buffer[len(session.pending)]  # this layer's slot: [B, >= T, HV, dk, dv]
        verified = default_verify(query, key, value, g, beta, state, states, valid_len=session.valid_len,
                                  kernel_backend=session.kernel_backend)
        session.pending.append(PendingDefaultLayer(state, conv_state, conv_input, verified))
    else:
        verified = gdn_verify_auto(query, key, value, g, beta, state, valid_len=session.valid_len,
                                   kernel_backend=session.kernel_backend)
        session.pending.append(PendingGDNLayer(state, conv_state, conv_input, key, verified))

    core = layer.norm(verified.out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(batch, seq_len, -1))


def patch_gdn_class(cls: type, project: ProjectFn) -> None:
    """Install verify mode on a GDN class (idempotent). Without a session the original forward runs unchanged."""
    if getattr(cls, "_hybridspec_original_forward", None) is not None:
        return
    original = cls.forward

    def forward(self, hidden_states, *args, **kwargs):
        session = self.__dict__.get("_hybridspec_verify")
        if session is None:
            return original(self, hidden_states, *args, **kwargs)
        return verify_forward(self, session, hidden_states, project)

    forward.__doc__ = original.__doc__
    forward.__wrapped__ = original
    cls._hybridspec_original_forward = original
    cls.forward = forward


# transformers binds these module-level functions to fla / causal_conv1d kernels when those packages are installed,
# for every device: a CPU model then crashes inside Triton ("cpu tensor?"). Route CPU tensors to the torch reference
# that transformers keeps as `__wrapped__`; CUDA tensors take transformers' own choice, unchanged.
GDN_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                        "causal_conv1d_update")


def route_cpu_to_torch(module) -> None:
    """Wrap each of `module`'s GDN kernel functions so CPU tensors run the torch reference (idempotent)."""
    for name in GDN_KERNEL_FUNCTIONS:
        chosen = getattr(module, name, None)
        if chosen is None or getattr(chosen, "_hybridspec_routed", False) or not hasattr(chosen, "__wrapped__"):
            continue
        reference = inspect.unwrap(chosen)  # the torch function under transformers' kernel wrappers
        setattr(module, name, _routed(chosen, reference))


def _routed(chosen: Callable, reference: Callable) -> Callable:
    accepted = set(inspect.signature(reference).parameters)

    @functools.wraps(chosen)
    def routed(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.device.type == "cpu":
            return reference(*args, **{k: v for k, v in kwargs.items() if k in accepted})
        return chosen(*args, **kwargs)

    routed._hybridspec_routed = True
    routed.__wrapped__ = reference  # unwrapping leads to the torch reference, not to a GPU kernel
    return routed
