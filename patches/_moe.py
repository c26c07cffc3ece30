"""Fused MoE blocks (router top-k, shared expert, final combine) inside GPU-resident forwards only.

At batch 1 a resident forward is launch-bound. Per MoE layer transformers launches, around the routed experts, ~7
kernels in the router (GEMM, softmax, topk + sort, sum, div, cast) and 9 for the shared expert and the combine
(gate, up, down and shared_expert_gate GEMMs, silu, mul, sigmoid, mul, add). The patched classes launch, with the
routed experts, 5 per layer ("one pass", T <= `moe_triton.direct_limit()` tokens, 32: decode, verification, a batch
of 2 verifying 16 tokens; `SHARED_EXPERT_SLOT`):

    router   GEMM, route_topk                                     (kernels/router_triton.py; in the fused decoder
             layers, patches/_decoder.py, one launch with the residual add and the norm before it:
             `norm_route_block_add`, router_triton.add_norm_route)
    experts  gate_up, down, sum over the k routed experts + the shared expert as one more slot (its weights from
             the concatenated copy; its gate logit computed in the gate_up launch); the sum adds
             sigmoid(logit) · shared and, through `moe_block_add`, the decoder layer's residual
                                                                  (kernels/moe_triton.py `moe_block_triton`;
             at T <= 4 its decode kernels fold the sum into the down launch: 4 launches per layer)

and otherwise (more tokens, the shared expert's I not the routed experts', experts not dispatching to "hybridspec",
a hook on the experts module) 6 around the experts call:

    router   GEMM, route_topk
    shared   GEMM over [gate_proj; up_proj; shared_expert_gate], silu_mul, down GEMM
    combine  gated_add: routed + sigmoid(gate logit) · shared     (kernels/shared_expert_triton.py)

The GEMMs go through `gemv_triton.linear` (kernels/gemv_triton.py): cuBLAS unless its table names the shape.

The router is still called as a module (`self.gate(x)`), so forward hooks on it (RouterRecorder, RoutingReplay,
VerifyWindow's routing correction, users') fire as before. The experts module is called (its hooks fire) except on
the one-pass route, which takes it only when its only hooks are forward pre-hooks marked `routing_pre_hook` (they
rewrite the routing arguments: VerifyWindow's stage-1 mask) and runs those itself. The shared expert's modules are
skipped, so any hook on them (or a replaced forward, LoRA layers, a non-SiLU activation) keeps transformers' forward.

Both patches are inert unless `fused_kernels()` is active (HybridSpec's resident forwards), the input is on CUDA and
grad is off, so plain generate(), training and every CPU path run transformers' code unchanged.

The concatenated weight [2I + 1 rows padded to 8, H] is a copy: (2·512 + 8) × 2048 × 2 bytes = 4.2 MB per layer
at the Qwen3.5-35B-A3B / Qwen3-Next-80B-A3B shapes (169 / 203 MB over 40 / 48 layers). `prepare_fused_moe` makes it
before capture and refreshes it in place (same address, so captured graphs stay right) at the start of every
generate() call whose source weights changed (their data_ptr or in-place `_version`; writes through `.data` are not
seen: release the graphs after those). A forward never builds it: inside a capture the copy would become a graph
node replayed every round. A block without a current copy runs transformers' shared expert. `release_fused_moe`
frees it with the resident rounds (`hybridspec_hf.release_graphs`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.modules import module as nn_module
from transformers.activations import SiLUActivation

from hybridspec_hf.kernels import fused_kernels_active, moe_triton, router_triton, shared_expert_triton
from hybridspec_hf.kernels.gemv_triton import linear

from . import experts as experts_glue
from ._weight_copies import current_copy, hooked, refresh_copy

__all__ = ["moe_block_add", "norm_route_block_add", "patch_moe_classes", "prepare_fused_moe", "release_fused_moe",
           "routing_pre_hook"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE = "_hybridspec_shared_weights"  # a WeightCopy of [gate_proj; up_proj; shared_expert_gate; zero rows] [R, H]
_ON_CPU = False  # tests only: take the fused route on CPU tensors too (with the Triton interpreter)
# the one-pass route (shared expert as an experts slot); False: the 6-launch route. On the H200 (runs 25-27 of
# benchmarks/results/gpu_rounds_runs.md) the one pass equalled the earlier route at one token and saved 4-7 µs per
# layer at 4-16 tokens on its own, but in run 26's full forward its experts kernels took ≈ 60 µs (AR step) to
# ≈ 170 µs (w = 16) more than run 21's separate launches did: to be A/B'ed in one breakdown before this default is
# final (the end-to-end figures of run 27 were measured with it on)
SHARED_EXPERT_SLOT = True
# The decoder layer's residual add, post_attention_layernorm, the router GEMM and its top-k in one launch
# (`norm_route_block_add`, router_triton.add_norm_route) up to `moe_triton.direct_limit()` tokens; False: add_rms_norm,
# the GEMM and route_topk (three launches; A/B, `ar-moe-fused-route`)
FUSED_ROUTE = True
_ROUTING_PRE_HOOK = "_hybridspec_routing_pre_hook"
_NORMALIZES: dict[type, Callable[[torch.nn.Module], bool]] = {}  # patched router class -> renormalises its top-k


def _active(x: torch.Tensor) -> bool:
    return (x.is_cuda or _ON_CPU) and fused_kernels_active() and x.dtype in _DTYPES and not torch.is_grad_enabled()


def mask_invalid_routes(ids: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor):
    """Tokens at or past the device-side `valid` take token 0's experts with weight 0 (stage 1 of a verification):
    one launch inside resident forwards, transformers-free torch elsewhere."""
    if _active(weights):
        return router_triton.mask_invalid_routes(ids, weights, valid)
    return router_triton.mask_invalid_routes_reference(ids, weights, valid)


def patch_moe_classes(router_cls: type | None, block_cls: type | None, normalizes: Callable[[torch.nn.Module], bool]):
    """Install the fused paths on a family's router (softmax top-k, `normalizes(router)`: renormalise the top-k
    probabilities) and sparse MoE block (shared expert and combine) (idempotent)."""
    if router_cls is not None and "_hybridspec_original_forward" not in router_cls.__dict__:
        original_router = router_cls.forward
        _NORMALIZES[router_cls] = normalizes

        def router_forward(self, hidden_states):
            if not _active(hidden_states) or self.num_experts > router_triton.MAX_EXPERTS:
                return original_router(self, hidden_states)
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            router_logits = linear(hidden_states, self.weight)  # [T, E]
            scores, ids = router_triton.route_topk(router_logits, self.top_k, normalizes(self))
            return router_logits, scores, ids

        router_cls._hybridspec_original_forward = original_router
        router_cls.forward = router_forward
    if block_cls is not None and "_hybridspec_original_forward" not in block_cls.__dict__:
        original_block = block_cls.forward

        def block_forward(self, hidden_states):
            weights = _current_weights(self, hidden_states) if _active(hidden_states) else None
            if weights is None:
                return original_block(self, hidden_states)
            return _fused_block_forward(self, hidden_states, weights)

        block_cls._hybridspec_original_forward = original_block
        block_cls.forward = block_forward


def _fused_block_forward(block: torch.nn.Module, hidden_states: torch.Tensor, weights: torch.Tensor,
                         residual: torch.Tensor | None = None, routing: tuple | None = None) -> torch.Tensor:
    """transformers' SparseMoeBlock.forward (+ `residual` when given) with the shared expert and the combine fused:
    in one pass with the routed experts where `_one_pass_hooks` allows, else around the experts module's call.
    `routing`: the router's output (logits, scores, ids) already computed (`norm_route_block_add`), else the
    router is called."""
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    hidden = hidden_states.view(-1, hidden_dim)
    mlp = block.shared_expert
    routing_hooks = _one_pass_hooks(block, hidden, weights)
    if routing_hooks is not None:
        _, routing_weights, selected_experts = block.gate(hidden) if routing is None else routing
        args = (hidden, selected_experts, routing_weights)
        for hook in routing_hooks:  # as torch's Module.__call__ runs forward pre-hooks
            result = hook(block.experts, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
        hidden, selected_experts, routing_weights = args[:3]
        out = moe_triton.moe_block_triton(
            hidden, selected_experts, routing_weights, block.experts.gate_up_proj, block.experts.down_proj, weights,
            mlp.down_proj.weight, None if residual is None else residual.reshape(-1, hidden_dim))
        return out.reshape(batch_size, sequence_length, hidden_dim)
    shared, gate_logit = shared_expert_triton.shared_expert(hidden, weights, mlp.down_proj.weight,
                                                            mlp.gate_proj.out_features)
    _, routing_weights, selected_experts = block.gate(hidden) if routing is None else routing
    routed = block.experts(hidden, selected_experts, routing_weights)
    out = shared_expert_triton.gated_add(routed, gate_logit, shared).reshape(batch_size, sequence_length, hidden_dim)
    return out if residual is None else residual + out


def routing_pre_hook(hook: Callable) -> Callable:
    """Mark a forward pre-hook of an experts module that only rewrites its (hidden, top_k_index, top_k_weights)
    arguments (VerifyWindow's stage-1 mask): the one-pass block runs it itself and keeps its fused route. Any other
    hook on the experts module sends the block to transformers' experts call."""
    setattr(hook, _ROUTING_PRE_HOOK, True)
    return hook


def _one_pass_hooks(block: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor) -> list[Callable] | None:
    """The experts module's (marked) pre-hooks when the block can run in one pass with the shared expert as one more
    experts slot, else None: the switch on, T within the direct rows, experts that would run our kernels anyway
    ("hybridspec" dispatch, its layout) and nothing on them but routing pre-hooks, and a shared expert of the routed
    experts' width and layout (Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B: I = 512 both)."""
    experts = block.experts
    if not SHARED_EXPERT_SLOT or hidden.shape[0] > moe_triton.direct_limit() or not hidden.shape[0]:
        return None
    dispatch = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if not (_ON_CPU or dispatch == experts_glue.NAME) or not experts_glue.supports(experts):
        return None
    if (experts._forward_hooks or experts._forward_pre_hooks_with_kwargs or "forward" in experts.__dict__
            or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks):
        return None
    hooks = list(experts._forward_pre_hooks.values())
    if not all(getattr(hook, _ROUTING_PRE_HOOK, False) for hook in hooks):
        return None
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dtype != hidden.dtype:
        return None
    fits = moe_triton.shared_slot_fits(gate_up, down, weights, block.shared_expert.down_proj.weight)
    return hooks if fits else None


# ----------------------------------------------------------------------------------------------------------------
# the concatenated weight


def _sources(block: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight, block.shared_expert_gate.weight


def _skipped_modules(block: torch.nn.Module) -> list[torch.nn.Module]:
    return [*block.shared_expert.modules(), block.shared_expert_gate]


def _fusable(block: torch.nn.Module) -> bool:
    """transformers' layout (plain bias-free Linears, SiLU) on CUDA (or `_ON_CPU`), float32/bfloat16/float16, with
    nothing else to run: a hooked or wrapped module (tensor parallelism wraps the sharded shared expert's, whose
    weights are shards) keeps transformers' forward, so no copy is made for it."""
    mlp = block.shared_expert
    linears = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    linears.append(getattr(block, "shared_expert_gate", None))
    if not all(type(m) is torch.nn.Linear and m.bias is None for m in linears) or hooked(_skipped_modules(block)):
        return False
    if not isinstance(getattr(mlp, "act_fn", None), (SiLUActivation, torch.nn.SiLU)):
        return False
    weights = [m.weight for m in linears]
    return (linears[-1].out_features == 1 and len({(w.dtype, w.device) for w in weights}) == 1
            and weights[0].dtype in _DTYPES and (weights[0].is_cuda or _ON_CPU))


def _current_weights(block: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The block's concatenated weight if it is current and the skipped modules have nothing that must run."""
    cached = current_copy(block, _CACHE, _sources(block))
    if cached is None or hooked(_skipped_modules(block)):
        return None
    weight = cached.weight
    return weight if weight.dtype == hidden.dtype and weight.device == hidden.device else None


def prepare_fused_moe(blocks: list[torch.nn.Module]) -> None:
    """Make (or refresh in place) each fusable block's concatenated shared-expert weight. Outside graph capture:
    the resident rounds call it before capturing and at the start of every generate() call. An existing copy is
    only refreshed, never dropped here, since captured graphs read it (a hook added since capture would not run in
    a graph anyway: release the graphs after such changes)."""
    for block in blocks:
        if _CACHE in block.__dict__ or _fusable(block):
            refresh_copy(block, _CACHE, _sources(block), shared_expert_triton.concat_shared_weights)


def release_fused_moe(blocks: list[torch.nn.Module]) -> None:
    """Free the concatenated weights (the blocks run transformers' shared expert until the next prepare)."""
    for block in blocks:
        block.__dict__.pop(_CACHE, None)


def moe_block_add(block: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + block(hidden_states)` ([B, T, H], the decoder layer's post-MLP add): on the fused route the add is
    folded into the experts' sum kernel (one launch fewer per layer); otherwise the plain expression (the block's
    hooks fire, transformers' code outside resident forwards)."""
    weights = _fused_add_weights(block, hidden_states, residual)
    if weights is not None:
        return _fused_block_forward(block, hidden_states, weights, residual)
    return residual + block(hidden_states)


def _fused_add_weights(block: torch.nn.Module, hidden_states: torch.Tensor,
                       residual: torch.Tensor) -> torch.Tensor | None:
    """The block's concatenated weight where `residual + block(hidden_states)` may take the fused route (a patched,
    unhooked block inside resident forwards, a residual like hidden_states, a current copy), else None."""
    patched = "_hybridspec_original_forward" in type(block).__dict__
    same = (residual.shape == hidden_states.shape and residual.dtype == hidden_states.dtype
            and residual.device == hidden_states.device)
    if patched and same and _active(hidden_states) and not hooked([block]):
        return _current_weights(block, hidden_states)
    return None


def norm_route_block_add(block: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor,
                         norm: torch.nn.Module) -> torch.Tensor | None:
    """A decoder layer's `h = residual + hidden_states`, `h + block(norm(h))` ([B, T, H]) with the add, the norm, the
    router GEMM and its top-k in one launch (router_triton.add_norm_route), then the experts as `moe_block_add`
    runs them; None where that route does not apply (the caller runs add_rms_norm and `moe_block_add`): the switch
    off, more than `moe_triton.direct_limit()` tokens, no fused block route, a router weight that is not a plain
    tensor (a DTensor shard), or a router whose call would run more than its class forward and plain forward hooks.
    Its forward hooks (RoutingReplay, VerifyWindow's, users') run as a module call would run them, on the normed
    rows and the (logits, scores, ids) the call would return."""
    gate = getattr(block, "gate", None)
    normalizes = _NORMALIZES.get(type(gate))
    tokens = hidden_states.numel() // max(hidden_states.shape[-1], 1)
    if not FUSED_ROUTE or normalizes is None or not 0 < tokens <= moe_triton.direct_limit():
        return None
    hooks = _router_forward_hooks(gate)
    weight = getattr(gate, "weight", None)
    if (hooks is None or type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dtype != hidden_states.dtype
            or weight.device != hidden_states.device or gate.num_experts > router_triton.MAX_EXPERTS):
        return None
    weights = _fused_add_weights(block, hidden_states, residual)
    if weights is None:
        return None
    h, normed, logits, scores, ids = router_triton.add_norm_route(hidden_states, residual, norm.weight, norm.eps,
                                                                  weight, gate.top_k, normalizes(gate))
    output = (logits, scores, ids)
    args = (normed.reshape(-1, normed.shape[-1]),)  # what the block hands its router
    for hook in hooks:  # as torch's Module.__call__ runs forward hooks
        result = hook(gate, args, output)
        if result is not None:
            output = result
    return _fused_block_forward(block, normed, weights, h, routing=output)


def _router_forward_hooks(gate: torch.nn.Module) -> list[Callable] | None:
    """The router's plain forward hooks (module, args, output), or None if its call would run anything else (pre-hooks,
    hooks taking kwargs, global hooks, a replaced forward)."""
    if (gate._forward_pre_hooks or gate._forward_pre_hooks_with_kwargs or gate._forward_hooks_with_kwargs
            or "forward" in gate.__dict__ or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks):
        return None
    return list(gate._forward_hooks.values())
