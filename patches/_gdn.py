"""The GDN layer's verify mode, shared by every model family.

Outside verification the patched `forward` calls transformers' own forward unchanged, so plain `generate()` and
training are untouched. During a HybridSpec verification the loop sets `layer._hybridspec_verify` to a
`VerifySession`; the layer then computes its outputs for all w tokens with the block form (no per-token state),
leaves the cache as it was, and records what the commit needs.

Inside GPU-resident forwards (`fused_kernels()`, CUDA-graph captured) the glue is fused, because at batch 1 the
forward is launch-bound: the conv and the gates take one Triton launch each (kernels/gdn_prologue_triton.py) instead
of ~11 small kernels, and the Qwen3.5 layout's four input projections one GEMM over a concatenated weight
(`concatenate_projections`, built by the resident rounds before capture). Elsewhere the torch code runs unchanged.
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
    conv_silu,
    conv_verify,
    default_verify,
    fused_kernels_active,
    fused_kernels_allowed,
    gdn_gates,
    gdn_gates_reference,
    gdn_verify_auto,
    select_backend,
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
    """Qwen3.5 layout: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; inside resident forwards one GEMM
    over their concatenated weight when `concatenate_projections` made one (the outputs are then column slices)."""
    batch, seq_len, _ = hidden_states.shape
    concatenated = _current_concatenation(layer) if fused_kernels_active() else None
    if concatenated is not None:
        mixed_qkv, z, b, a = F.linear(hidden_states, concatenated.weight).split(concatenated.sizes, dim=-1)
    else:
        mixed_qkv, z, b, a = (getattr(layer, name)(hidden_states) for name in SEPARATE_PROJECTIONS)
    return mixed_qkv, z.reshape(batch, seq_len, -1, layer.head_v_dim), b, a


# ---------------------------------------------------------------------------------------------------------------
# the Qwen3.5 layout's projections as one GEMM (GPU-resident forwards)

SEPARATE_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # in the order of the concatenation
_CONCATENATED = "_hybridspec_in_proj"  # key in the layer's __dict__: not a parameter, buffer or state_dict entry


@dataclass
class ConcatenatedProjection:
    """A copy of the four projection weights stacked along the output features, for one GEMM instead of four."""

    weight: torch.Tensor  # [C + HV·dv + 2·HV, H] (qkv, z, b, a), the weights' dtype and device
    sizes: list[int]  # output features of each projection
    stamp: tuple  # (data_ptr, _version) of each source weight when copied: a different stamp means a stale copy


def _projection_weights(layer: torch.nn.Module) -> list[torch.Tensor] | None:
    """The four weights when a concatenation computes the same thing: plain bias-free nn.Linear modules without
    hooks (not quantized, no adapters, no offloading), all of one dtype and device. Else None."""
    modules = [getattr(layer, name, None) for name in SEPARATE_PROJECTIONS]
    if not all(type(m) is torch.nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
               for m in modules):
        return None
    weights = [m.weight for m in modules]
    return weights if len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1 else None


def _stamp(weights: list[torch.Tensor]) -> tuple:
    # inference tensors keep no version counter (and cannot be written outside inference mode)
    return tuple((w.data_ptr(), None if w.is_inference() else w._version) for w in weights)


def _refreshed(entry: ConcatenatedProjection, weights: list[torch.Tensor] | None) -> bool:
    """Bring the copy up to date in place (captured graphs keep reading its address); False when it cannot be: a
    projection was replaced by one of another shape, dtype or kind."""
    if weights is None or [w.shape[0] for w in weights] != entry.sizes or \
            (weights[0].dtype, weights[0].device, weights[0].shape[1]) != \
            (entry.weight.dtype, entry.weight.device, entry.weight.shape[1]):
        return False
    stamp = _stamp(weights)
    if stamp != entry.stamp:  # the weights were updated in place (or re-allocated) since the copy
        with torch.no_grad():
            torch.cat(weights, out=entry.weight)
        entry.stamp = stamp
    return True


def concatenate_projections(layers: list[torch.nn.Module]) -> bool:
    """Give each Qwen3.5-layout GDN layer its concatenated projection weight, or refresh an existing one in place
    after in-place weight updates. Costs one more copy of the weights: 2048 x 12352 bf16 ≈ 50 MB per layer at
    Qwen3.5-35B-A3B's size (30 GDN layers: ≈ 1.5 GB). Call it outside CUDA-graph capture: a copy made inside
    one would be a graph node re-run at every replay. No new copies while HYBRIDSPEC_FUSED_KERNELS=0 (nothing
    would read them). False when an existing copy could not be refreshed (the graphs that read it must be
    dropped; `release_concatenated_projections` then removes it)."""
    for layer in layers:
        weights = _projection_weights(layer)
        entry = layer.__dict__.get(_CONCATENATED)
        if entry is not None:
            if not _refreshed(entry, weights):
                return False
        elif weights is not None and fused_kernels_allowed():
            with torch.no_grad():
                layer.__dict__[_CONCATENATED] = ConcatenatedProjection(
                    torch.cat(weights), [w.shape[0] for w in weights], _stamp(weights))
    return True


def release_concatenated_projections(model: torch.nn.Module) -> None:
    """Drop every concatenated projection weight under `model` (any module: nothing else is touched)."""
    for module in model.modules():
        module.__dict__.pop(_CONCATENATED, None)


def _current_concatenation(layer: torch.nn.Module) -> ConcatenatedProjection | None:
    entry = layer.__dict__.get(_CONCATENATED)
    if entry is not None and not _refreshed(entry, _projection_weights(layer)):
        raise RuntimeError(
            f"GDN layer {layer.layer_idx}'s input projections changed shape, dtype or kind after HybridSpec's "
            "resident rounds were built; call hybridspec_hf.release_graphs(model) before generating again.")
    return entry


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
    activation = _activation(layer.activation)
    weight = layer.conv1d.weight.squeeze(1)  # [C, K]
    if fused_kernels_active() and select_backend(session.kernel_backend, mixed_qkv, conv_state) == "triton":
        mixed = conv_silu(conv_state, mixed_qkv, weight, layer.conv1d.bias)  # [B, T, C] contiguous
        g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)
    else:
        mixed = conv_verify(conv_state, conv_input, weight, layer.conv1d.bias, activation).transpose(1, 2)
        g, beta = gdn_gates_reference(a, b, layer.A_log, layer.dt_bias)  # [B, T, HV] fp32, in b's dtype
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, layer.head_k_dim)
    key = key.reshape(batch, seq_len, -1, layer.head_k_dim)
    value = value.reshape(batch, seq_len, -1, layer.head_v_dim)

    if session.verifier == "per_token_state":
        states = session.state_buffer[len(session.pending)]  # this layer's slot: [B, >= T, HV, dk, dv]
        verified = default_verify(query, key, value, g, beta, state, states, valid_len=session.valid_len,
                                  kernel_backend=session.kernel_backend)
        session.pending.append(PendingDefaultLayer(state, conv_state, conv_input, verified))
    else:
        verified = gdn_verify_auto(query, key, value, g, beta, state, valid_len=session.valid_len,
                                   kernel_backend=session.kernel_backend)
        session.pending.append(PendingGDNLayer(state, conv_state, conv_input, key, verified))

    # [B, T, HV, dv] (transformers flattens to rows first): a z sliced from the concatenated GEMM stays a view
    core = layer.norm(verified.out, z)
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
