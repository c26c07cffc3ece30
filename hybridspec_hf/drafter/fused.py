"""The drafter's resident path in few launches: `draft_static` and `StaticDraftContext.append` inside
`fused_kernels()` (GPU-resident rounds, grad off, CUDA tensors).

Per drafter layer the eager static path launches ≈ 23 kernels on CUDA (q, k, v, o, gate, up, down GEMMs, two of
them split-K with a reduce; q_norm, k_norm, two RoPEs, two K/V scatters, attention + combine, two RMSNorms, two
residual adds, silu, mul). Here a layer is

    add_rms_norm   residual add of the previous layer's MLP + input_layernorm       (kernels/dflash_triton.py)
    linear         q|k|v over one concatenated weight                                (kernels/gemv_triton.py)
    qk_norm_rope_store  q_norm, k_norm, RoPE of q and k, block K/V into the context  (kernels/dflash_triton.py)
    static_attention    attention + combine over the live slots                       (kernels/attention_triton.py)
    linear         o_proj
    add_rms_norm   residual add + post_attention_layernorm
    linear         gate|up over one concatenated weight
    silu_mul                                                                         (kernels/shared_expert_triton.py)
    linear         down_proj (its residual add goes into the next add_rms_norm, the last one into the final norm)

and RoPE reads the context's cos/sin table (computed once with the eager rotary code, so the same values), so the
per-draft position, mask and rotary kernels go too. The context append (in the verify and step graphs) projects
every layer's context K/V with ONE GEMM over all layers' [k_proj; v_proj] (they all read the same fused context) and
stores them with one `qk_norm_rope_store` launch, where the eager path runs ≈ 6 launches per layer.

`linear` is cuBLAS unless gemv_triton.TABLE names the shape: at the Qwen3.5-35B-A3B drafter shape gate|up
[12288, 2048] and o_proj [2048, 4096] are in it; q|k|v [5120, 2048] (also the context's k|v of 5 layers), down
[2048, 6144] and fc [2048, 10240] are not timed yet (benchmarks/gemv.py lists them).

With the drafter's config.layers_quantization "int8" the copies also hold int8 rows with a float32 scale per row
(`gemv_triton.quantize_rows`) of each layer's q|k|v, o_proj, gate|up and down_proj, and a draft of up to MAX_ROWS
rows (one request's block) multiplies by them (`linear_int8`): half the bytes a draft reads from its layers.

Weight copies ([q; k; v] and [gate; up] per layer, every layer's [k; v], the k_norm weights stacked, the int8 ones)
belong to the StaticDraftContext: made when it is built (before capture), refreshed in place by `reset()` (every
generate() call) when a source or the quantization option changed (data_ptr or in-place `_version`,
patches/_weight_copies.py), freed with it. A draft never makes one (inside a capture it would be a graph node). The
eager static path runs instead whenever the copies are stale or absent, a drafter module has hooks or a replaced
forward (they would not run here), the drafter trains, grad is on, `ENABLED` is off (also
HYBRIDSPEC_FUSED_KERNELS=0, which turns `fused_kernels()` off), or the layout is not the one fused here (plain
bias-free Linears, SiLU, equal q/k norm eps, a head_dim the attention kernel takes). Same maths as the eager path,
with its rounding steps; only fp32 summation orders differ (with int8 layers: the drafts' products by the int8
copies, not the weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import SiLUActivation

from hybridspec_hf.kernels import fused_kernels_active
from hybridspec_hf.kernels.attention_triton import static_attention
from hybridspec_hf.kernels.attention_triton import supported as attention_supported
from hybridspec_hf.kernels.dflash_triton import add_rms_norm, qk_norm_rope_store
from hybridspec_hf.kernels.gdn_triton import HAS_TRITON
from hybridspec_hf.kernels.gemv_triton import MAX_ROWS, QuantizedRows, linear, linear_int8, quantize_rows
from hybridspec_hf.kernels.shared_expert_triton import silu_mul
from hybridspec_hf.patches._weight_copies import hooked, source_key

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENABLED = True  # the switch (A/B timing: benchmarks/draft_graph.py); read when a draft or append runs (capture)
_ON_CPU = False  # tests only: take the fused path on CPU tensors too (with the Triton interpreter)


@dataclass
class FusedDraftWeights:
    """The concatenated weights the fused path reads (copies of the drafter's, see the module docstring)."""

    qkv: list[torch.Tensor]  # per layer [(Hq + 2Hk)·D, H]: q_proj; k_proj; v_proj
    gate_up: list[torch.Tensor]  # per layer [2I, H]: gate_proj; up_proj
    context_kv: torch.Tensor  # [L·2Hk·D, H]: k_proj; v_proj of layer 0, then layer 1, ...
    k_norms: torch.Tensor  # [L, D]
    key: tuple  # `_key` of the drafter when copied
    # config.layers_quantization "int8": per layer the int8 copies of (q|k|v, o_proj, gate|up, down_proj)
    int8: list[tuple[QuantizedRows, ...]] | None = None


def _quantized(drafter) -> bool:
    return getattr(drafter.config, "layers_quantization", None) == "int8"


def _sources(drafter) -> list[torch.Tensor]:
    weights = []
    for layer in drafter.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight,
                    mlp.up_proj.weight, attn.k_norm.weight]
        if _quantized(drafter):  # their int8 copies too
            weights += [attn.o_proj.weight, mlp.down_proj.weight]
    return weights


def _key(drafter) -> tuple:
    """What the copies were made from: the sources' `source_key` and the quantization they hold."""
    return source_key(_sources(drafter)), _quantized(drafter)


def _modules(drafter) -> list[nn.Module]:
    """The modules whose forwards the fused path replaces (hooks on any of them keep the eager path)."""
    return [drafter.fc, drafter.hidden_norm, drafter.norm, *drafter.layers.modules()]


def _fusable(drafter, device: torch.device, dtype: torch.dtype) -> bool:
    """The layout fused here, where Triton runs, with nothing but class forwards to run."""
    if not HAS_TRITON or dtype not in _DTYPES or not (device.type == "cuda" or _ON_CPU):
        return False
    for layer in drafter.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(type(m) is nn.Linear and m.bias is None for m in linears):
            return False
        if not isinstance(mlp.act_fn, (SiLUActivation, nn.SiLU)) or attn.q_norm.eps != attn.k_norm.eps:
            return False
    return not hooked(_modules(drafter))


def refresh_weights(drafter, previous: FusedDraftWeights | None, device: torch.device,
                    dtype: torch.dtype) -> FusedDraftWeights | None:
    """The copies for `drafter` (None where the path does not apply): `previous` itself while current, else
    rewritten in place (same addresses, so captured graphs read the new weights) or made anew. Never inside a
    capture."""
    if previous is None and not _fusable(drafter, device, dtype):
        return None
    key = _key(drafter)
    if previous is not None and previous.key == key:
        return previous
    with torch.no_grad():
        layers = [(layer.self_attn, layer.mlp) for layer in drafter.layers]

        def cat(tensors, out):
            tensors = [t.detach().to(device=device, dtype=dtype) for t in tensors]
            fits = out is not None and out.shape == (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
            return torch.cat(tensors, out=out) if fits else torch.cat(tensors)

        old = previous or FusedDraftWeights([None] * len(layers), [None] * len(layers), None, None, ())
        qkv = [cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out) for (a, _), out in zip(layers, old.qkv)]
        gate_up = [cat([m.gate_proj.weight, m.up_proj.weight], out) for (_, m), out in zip(layers, old.gate_up)]
        context_kv = cat([w for a, _ in layers for w in (a.k_proj.weight, a.v_proj.weight)], old.context_kv)
        k_norms = cat([a.k_norm.weight[None] for a, _ in layers], old.k_norms)
        int8 = None
        if _quantized(drafter):  # into the old copies' tensors where they fit (captured graphs read them)
            kept = old.int8 or [(None,) * 4] * len(layers)
            int8 = [tuple(_quantize(w.detach().to(device=device, dtype=dtype), out)  # as `_int8_groups`
                          for w, out in zip((qkv[i], a.o_proj.weight, gate_up[i], m.down_proj.weight), kept[i]))
                    for i, (a, m) in enumerate(layers)]
    return FusedDraftWeights(qkv, gate_up, context_kv, k_norms, key, int8)


def _quantize(weight: torch.Tensor, out: QuantizedRows | None) -> QuantizedRows:
    return quantize_rows(weight, out=out if out is not None and out.fits(weight) else None)


def _int8_groups(layer) -> tuple[list[nn.Linear], ...]:
    """The projections of a layer quantized together (one int8 copy each group): q|k|v, o, gate|up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


def int8_equivalent(drafter):
    """A copy of `drafter` (its option off) whose layer projections hold what the int8 copies of
    config.layers_quantization multiply by: each group's int8 rows times their scales, in the drafter's dtype. Its
    drafts on any path (the eager one, training's acceptance measures) are the int8 drafts up to fp32 summation
    order, except that its context k|v come from the dequantized k and v too, where the int8 path projects the
    context with the weights as they are: a slightly larger change than the int8 path's."""
    import copy

    twin = copy.deepcopy(drafter)
    twin.config.layers_quantization = None
    with torch.no_grad():
        for layer in twin.layers:
            for group in _int8_groups(layer):
                q = quantize_rows(torch.cat([m.weight for m in group]))
                rows = (q.weight.float() * q.scale[:, None]).to(group[0].weight.dtype)
                for module, value in zip(group, rows.split([m.out_features for m in group])):
                    module.weight.copy_(value)
    return twin


def active(drafter, ctx) -> bool:
    """Whether `ctx`'s append and `drafter.draft_static` take the fused path now (see the module docstring)."""
    weights = ctx.fused
    if (not ENABLED or weights is None or not fused_kernels_active() or torch.is_grad_enabled() or drafter.training
            or not (ctx.length.is_cuda or _ON_CPU)):
        return False
    if weights.key != _key(drafter) or hooked(_modules(drafter)):
        return False
    keys = ctx.keys[0]
    queries = keys[:, :1, :1].expand(keys.shape[0], drafter.config.num_attention_heads, drafter.config.block_size,
                                     keys.shape[3])  # the block's queries' shape (the kernel checks no more)
    return attention_supported(queries, keys, ctx.values[0])


def append(ctx, features: torch.Tensor) -> None:
    """Project context rows [B, n, n_feat·H] (rows past the count already zeroed) and store every layer's K/V at
    slots length .. length+n-1: fc, hidden_norm, one GEMM for all layers' K/V, one store."""
    drafter, weights = ctx.drafter, ctx.fused
    drafter.check_feature_width(features)
    config = drafter.config
    context = linear(features.to(dtype=drafter.dtype), drafter.fc.weight)  # [B, n, H]
    _, context = add_rms_norm(context, None, drafter.hidden_norm.weight, drafter.hidden_norm.eps)
    kv = linear(context, weights.context_kv)  # [B, n, L·2Hk·D]
    eps = drafter.layers[0].self_attn.k_norm.eps
    qk_norm_rope_store(kv, 0, config.num_key_value_heads, None, weights.k_norms, eps, ctx.cos, ctx.sin, ctx.length,
                       ctx.key_buffer, ctx.value_buffer)


def draft(drafter, embeddings: torch.Tensor, ctx) -> torch.Tensor:
    """`draft_static`'s layers and final norm on the block embeddings [B, bs, H] -> normed hidden [B, bs, H]."""
    batch, size, _ = embeddings.shape
    config, weights = drafter.config, ctx.fused
    q_heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    queries = embeddings.new_empty(batch, size, q_heads, dim)  # [B, bs, Hq, D]
    hidden, delta = embeddings, None
    int8 = weights.int8 if batch * size <= MAX_ROWS else None  # the int8 GEMV's rows: one request's block

    def project(x, weight, i, j):  # projection j of layer i: (q|k|v, o, gate|up, down)
        return linear(x, weight) if int8 is None else linear_int8(x, int8[i][j])

    for i, layer in enumerate(drafter.layers):
        attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
        hidden, x = add_rms_norm(hidden, delta, norm.weight, norm.eps)  # + the previous layer's MLP output
        qkv = project(x, weights.qkv[i], i, 0)  # [B, bs, (Hq + 2Hk)·D]
        qk_norm_rope_store(qkv, q_heads, kv_heads, attn.q_norm.weight[None], attn.k_norm.weight[None],
                           attn.q_norm.eps, ctx.cos, ctx.sin, ctx.length, ctx.key_buffer[i : i + 1],
                           ctx.value_buffer[i : i + 1], queries)
        out = static_attention(queries.transpose(1, 2), ctx.keys[i], ctx.values[i], ctx.length, dim**-0.5,
                               causal=attn.is_causal, window=attn.sliding_window)  # [B, bs, Hq, D]
        norm = layer.post_attention_layernorm
        hidden, x = add_rms_norm(hidden, project(out.view(batch, size, -1), attn.o_proj.weight, i, 1), norm.weight,
                                 norm.eps)
        gate_up = project(x, weights.gate_up[i], i, 2)  # [B, bs, 2I]
        inter = mlp.down_proj.in_features
        delta = project(silu_mul(gate_up.view(batch * size, -1), inter), mlp.down_proj.weight, i, 3).view_as(hidden)
    return add_rms_norm(hidden, delta, drafter.norm.weight, drafter.norm.eps)[1]
