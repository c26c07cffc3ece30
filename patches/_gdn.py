"""The GDN layer's verify mode, shared by every model family.

Outside verification the patched `forward` calls transformers' own forward unchanged, so plain `generate()` and
training are untouched. During a HybridSpec verification the loop sets `layer._hybridspec_verify` to a
`VerifySession`; the layer then computes its outputs for all w tokens with the block form (no per-token state),
leaves the cache as it was, and records what the commit needs.

Inside GPU-resident forwards (`fused_kernels()`, CUDA-graph captured) the glue is fused, because at batch 1 the
forward is launch-bound: the conv and the gates take one Triton launch each (kernels/gdn_prologue_triton.py) instead
of ~11 small kernels, and the Qwen3.5 layout's four input projections one GEMM over a concatenated weight
(`prepare_gdn_projections`, made by the resident rounds before capture; by `gemv_triton.linear`: cuBLAS unless its
table names the shape). A plain decoding step (`VerifySession.decode_step`, one token) takes ONE launch between the
projections and out_proj (`gdn_step_triton.gdn_step`: conv + window roll, gates, recurrence in place, gated norm)
while `gdn_step_triton.FUSED_STEP` is on and the norm module has nothing else to run; otherwise four (conv, gates,
`gdn_decode_step`, the norm). Elsewhere the torch code runs unchanged.
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
    conv_silu_gates,
    conv_verify,
    default_verify,
    fused_kernels_active,
    gdn_decode_step,
    gdn_gates,
    gdn_gates_reference,
    gdn_verify_auto,
    select_backend,
)
from hybridspec_hf.kernels import gdn_prologue_triton, gdn_step_triton
from hybridspec_hf.kernels.gdn_step_triton import gdn_step
from hybridspec_hf.kernels.gemv_triton import linear

from ._norms import normed, take_input_norm
from ._weight_copies import (
    WeightCopy,
    concatenate_rows,
    current_copy,
    fusable_linears,
    hooked,
    plain_linears,
    refresh_copy,
)

# (layer, hidden_states [B, T, H], the decoder's input norm still to apply or None) -> mixed_qkv [B, T, C] (pre-conv),
# z [B, T, HV, dv], b [B, T, HV], a [B, T, HV]
ProjectFn = Callable[[torch.nn.Module, torch.Tensor, torch.nn.Module | None],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


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
    # a plain decoding step, its one token committed (m = 1): on the fused route each GDN layer runs one recurrent
    # step that updates state and conv window in place (`gdn_step`, or `gdn_decode_step` after conv_silu), and
    # leaves nothing to commit
    decode_step: bool = False
    stepped: int = 0  # GDN layers that took that in-place step (counted by `check_verified` beside `pending`)


def per_token_state_buffer(gdn_layers: list[torch.nn.Module], cache, max_tokens: int) -> torch.Tensor:
    """The "per_token_state" verifier's buffer for these GDN layers of a prefilled cache:
    [layers, B, max_tokens, HV, dk, dv] fp32 (its memory cost: 960 MiB at w = 16 for Qwen3.5-35B-A3B)."""
    state = cache.layers[gdn_layers[0].layer_idx].recurrent_states[0]
    return allocate_state_buffer(len(gdn_layers), state, max_tokens)


def commit_session(session: VerifySession, num_committed: torch.Tensor | int) -> None:
    """Commit m tokens of a verification into every GDN layer: one launch per device on CUDA (one in all, unless a
    device_map spreads the layers over several GPUs). num_committed: [B] int device tensor, or one int for every
    row (the eager loop: the torch commit then sums over the m committed tokens only)."""
    per_token = session.verifier == "per_token_state"
    commit = commit_default_states if per_token else commit_gdn_states_auto
    by_device: dict[torch.device, list] = {}
    for pending in session.pending:
        by_device.setdefault(pending.state.device, []).append(pending)
    for device, layers in by_device.items():
        count = num_committed
        if not isinstance(count, int):
            count = count.to(device)
        elif per_token or select_backend(session.kernel_backend, layers[0].state) == "triton":
            count = torch.full((layers[0].state.shape[0],), count, dtype=torch.int32, device=device)
        commit(layers, count, session.kernel_backend)


def check_verified(session: VerifySession, gdn_layers: list[torch.nn.Module]) -> None:
    """Every GDN layer ran in verify mode during the session's forward (host-side count, no sync). A layer whose
    forward was replaced or hooked before `import hybridspec_hf` patched its class ran transformers' forward
    instead, which advanced its state by every verified token: the output would no longer be exact."""
    ran = len(session.pending) + session.stepped
    if ran != len(gdn_layers):
        raise RuntimeError(
            f"Only {ran} of {len(gdn_layers)} Gated-DeltaNet layers ran HybridSpec's verify mode: "
            "the others' forward was replaced or wrapped before hybridspec_hf patched their class (e.g. accelerate "
            "hooks on the GDN modules themselves). Import hybridspec_hf before loading the model, and keep "
            "device_map entries at decoder-layer granularity."
        )


def project_separate(layer: torch.nn.Module, hidden_states: torch.Tensor, norm: torch.nn.Module | None = None):
    """Qwen3.5 layout: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; inside resident forwards one GEMM
    over their concatenated weight while `prepare_gdn_projections`' copy is current (outputs are column slices),
    the decoder's input `norm` (if left to this layer) in its prologue."""
    batch, seq_len, _ = hidden_states.shape
    modules = _projections(layer)
    copy = _current_projection_copy(layer, modules) if fused_kernels_active() else None
    if copy is not None:
        sizes = [m.out_features for m in modules]
        mixed_qkv, z, b, a = linear(hidden_states, copy.weight, norm=norm).split(sizes, dim=-1)
    else:
        hidden_states = normed(norm, hidden_states)
        mixed_qkv, z, b, a = (getattr(layer, name)(hidden_states) for name in SEPARATE_PROJECTIONS)
    return mixed_qkv, z.reshape(batch, seq_len, -1, layer.head_v_dim), b, a


# ---------------------------------------------------------------------------------------------------------------
# the Qwen3.5 layout's projections as one GEMM (GPU-resident forwards; patches/_weight_copies.py)

SEPARATE_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # in the order of the concatenation
_COPY = "_hybridspec_in_proj"  # a WeightCopy of the four weights [C + HV·dv + 2·HV, H] in the layer's __dict__
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _projections(layer: torch.nn.Module) -> list[torch.nn.Module] | None:
    return plain_linears(layer, SEPARATE_PROJECTIONS)


def prepare_gdn_projections(layers: list[torch.nn.Module]) -> None:
    """Make (or refresh in place) each Qwen3.5-layout GDN layer's concatenated projection weight, one more copy of
    those weights: 12352 x 2048 bf16 ≈ 50 MB per layer at Qwen3.5-35B-A3B's shape (30 GDN layers: ≈ 1.5 GB).
    Outside graph capture: the resident rounds call it before capturing and at the start of every generate() call.
    All layers or none: the one-launch commit reads every layer's conv input (a column slice of this GEMM's
    output, or the separate projection's own output) with one layout. Existing copies are only refreshed, never
    dropped here, since captured graphs read them (a hook added since capture would not run in a graph anyway:
    release the graphs after such changes)."""
    if any(_COPY in layer.__dict__ for layer in layers):
        fusable = [_projections(layer) for layer in layers]
    else:
        fusable = [fusable_linears(layer, SEPARATE_PROJECTIONS) for layer in layers]
        if not layers or any(modules is None for modules in fusable):
            return
    for layer, modules in zip(layers, fusable):
        if modules is not None:
            refresh_copy(layer, _COPY, [m.weight for m in modules], concatenate_rows)


def release_gdn_projections(layers: list[torch.nn.Module]) -> None:
    """Free the copies (the layers run their four projections until the next prepare)."""
    for layer in layers:
        layer.__dict__.pop(_COPY, None)


def _current_projection_copy(layer: torch.nn.Module, modules: list[torch.nn.Module] | None) -> WeightCopy | None:
    if modules is None or _COPY not in layer.__dict__ or hooked(modules):
        return None
    return current_copy(layer, _COPY, [m.weight for m in modules])


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"GDN conv activation {name!r} is not supported by HybridSpec (expected 'silu').")


def _fused_route(session: VerifySession, mixed_qkv: torch.Tensor, conv_state: torch.Tensor,
                 weight: torch.Tensor) -> bool:
    """Conv and gates by our kernels: inside resident forwards, on the Triton backend (CUDA tensors, or the
    interpreter in tests), in a dtype the kernels take."""
    return (fused_kernels_active() and all(t.dtype in _DTYPES for t in (mixed_qkv, conv_state, weight))
            and select_backend(session.kernel_backend, mixed_qkv, conv_state) == "triton")


def _one_launch_step(layer: torch.nn.Module, mixed_qkv: torch.Tensor, state: torch.Tensor) -> bool:
    """The decoding step by `gdn_step` (kernels/gdn_step_triton.py): while its switch is on, with an fp32 state and
    a gated norm that computes transformers' RMSNormGated (silu gate, weight in the model dtype) with nothing else
    to run (no hooks, no replaced forward); otherwise the four launches."""
    norm = layer.norm
    weight = getattr(norm, "weight", None)
    return (gdn_step_triton.FUSED_STEP and state.dtype == torch.float32 and type(norm).__name__.endswith("RMSNormGated")
            and getattr(norm, "activation", "silu") == "silu" and hasattr(norm, "variance_epsilon")
            and isinstance(weight, torch.Tensor) and weight.shape == (layer.head_v_dim,)
            and weight.dtype == mixed_qkv.dtype and not hooked([norm]))


def verify_forward(layer: torch.nn.Module, session: VerifySession, hidden_states: torch.Tensor, project: ProjectFn,
                   input_norm: torch.nn.Module | None = None):
    """The GDN layer's output for w tokens from the committed state, without writing the cache (a decoding step
    on the fused route writes it: see `VerifySession.decode_step`). input_norm: the decoder's input norm, left to
    the projection (patches/_norms.py)."""
    batch, seq_len, _ = hidden_states.shape
    cache_layer = session.cache.layers[layer.layer_idx]
    conv_state = cache_layer.conv_states[0]  # [B, C, K]
    state = cache_layer.recurrent_states[0]  # [B, HV, dk, dv]
    if conv_state is None or state is None:
        raise RuntimeError("HybridSpec verification needs a prefilled cache (GDN layer %d is empty)." % layer.layer_idx)

    mixed_qkv, z, b, a = project(layer, hidden_states, input_norm)
    conv_input = mixed_qkv.transpose(1, 2)  # [B, C, T]
    activation = _activation(layer.activation)
    weight = layer.conv1d.weight.squeeze(1)  # [C, K]
    fused = _fused_route(session, mixed_qkv, conv_state, weight)
    step = fused and session.decode_step and seq_len == 1  # commit in place, as the layer goes
    if step and _one_launch_step(layer, mixed_qkv, state):  # conv, gates, recurrence and norm: one kernel
        session.stepped += 1
        core = gdn_step(mixed_qkv, conv_state, weight, layer.conv1d.bias, a, b, layer.A_log, layer.dt_bias, state,
                        z, layer.norm.weight, layer.norm.variance_epsilon, layer.num_k_heads)
        return layer.out_proj(core.reshape(batch, seq_len, -1))
    if fused and gdn_prologue_triton.CONV_GATES:  # [B, T, C] contiguous; g, beta [B, T, HV]
        mixed, g, beta = conv_silu_gates(conv_state, mixed_qkv, weight, layer.conv1d.bias, a, b, layer.A_log,
                                         layer.dt_bias, roll_state=step)
    elif fused:
        mixed = conv_silu(conv_state, mixed_qkv, weight, layer.conv1d.bias, roll_state=step)  # [B, T, C] contiguous
        g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)
    else:
        mixed = conv_verify(conv_state, conv_input, weight, layer.conv1d.bias, activation).transpose(1, 2)
        g, beta = gdn_gates_reference(a, b, layer.A_log, layer.dt_bias)  # [B, T, HV] fp32, in b's dtype
    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, layer.head_k_dim)
    key = key.reshape(batch, seq_len, -1, layer.head_k_dim)
    value = value.reshape(batch, seq_len, -1, layer.head_v_dim)

    valid = session.valid_len  # read now: the routing correction may have rewritten it since the session began
    if valid is not None and valid.device != state.device:  # a device_map put this layer on another device
        valid = valid.to(state.device)
    if step:
        session.stepped += 1
        out = gdn_decode_step(query, key, value, g, beta, state)
    elif session.verifier == "per_token_state":
        states = session.state_buffer[len(session.pending)]  # this layer's slot: [B, >= T, HV, dk, dv]
        verified = default_verify(query, key, value, g, beta, state, states, valid_len=valid,
                                  kernel_backend=session.kernel_backend)
        session.pending.append(PendingDefaultLayer(state, conv_state, conv_input, verified))
        out = verified.out
    else:
        verified = gdn_verify_auto(query, key, value, g, beta, state, valid_len=valid,
                                   kernel_backend=session.kernel_backend)
        session.pending.append(PendingGDNLayer(state, conv_state, conv_input, key, verified))
        out = verified.out

    # [B, T, HV, dv] (transformers flattens to rows first): a z sliced from the concatenated GEMM stays a view
    core = layer.norm(out, z)
    return layer.out_proj(core.reshape(batch, seq_len, -1))


def patch_gdn_class(cls: type, project: ProjectFn) -> None:
    """Install verify mode on a GDN class (idempotent). Without a session the original forward runs unchanged."""
    if getattr(cls, "_hybridspec_original_forward", None) is not None:
        return
    original = cls.forward

    def forward(self, hidden_states, *args, **kwargs):
        norm = take_input_norm(self)
        session = self.__dict__.get("_hybridspec_verify")
        if session is None:
            return original(self, normed(norm, hidden_states), *args, **kwargs)
        return verify_forward(self, session, hidden_states, project, norm)

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
    parameters = inspect.signature(reference).parameters
    # keyword arguments the reference does not name are dropped (the kernels' own, e.g. cu_seqlens), unless it
    # takes **kwargs (transformers ≥ 5.25 with the `kernels` package: a kernel function is a `Func(*args, **kwargs)`)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())

    @functools.wraps(chosen)
    def routed(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.device.type == "cpu":
            return reference(*args, **(kwargs if takes_any else {k: v for k, v in kwargs.items() if k in parameters}))
        return chosen(*args, **kwargs)

    routed._hybridspec_routed = True
    routed.__wrapped__ = reference  # unwrapping leads to the torch reference, not to a GPU kernel
    return routed
