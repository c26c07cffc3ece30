"""DFlash drafter: drafts a whole block in one forward, conditioned on the target's hidden states.

Architecture (z-lab `dflash/model.py::DFlashDraftModel`; weight names are identical so z-lab checkpoints load as is):

    ctx    = hidden_norm(fc(cat(target layer outputs)))         # [B, Tc, H]  fused context, computed once
    x      = target_embed([anchor, MASK x (B-1)])               # [B, Tq, H]  the block ("noise")
    layer: x += o_proj(attn(q=block, k/v=cat(proj(ctx), proj(block))));  x += mlp(post_attention_layernorm(x))
    logits = target_lm_head(norm(x))[:, 1:]                      # block position k predicts the token at anchor+k

Every layer reads K/V of the SAME fused context (KV injection): the context K/V of layer l are k_proj/v_proj of `ctx`,
never of layer l-1's output, so they are computed once per token and cached (`DFlashContextCache`); the block's K/V
are recomputed every draft and never stored. Queries come only from the block. Block tokens see each other
(bidirectional) and every context position strictly before the anchor.

The target's input embedding and LM head are shared and frozen: they are held by reference outside the module tree
(`bind_target`), so they are neither parameters, nor saved, nor moved by `.to()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hybridspec_hf.kernels.attention_triton import routed, static_attention
from hybridspec_hf.kernels.dflash_triton import add_rms_norm
from hybridspec_hf.kernels.gemv_triton import MAX_ROWS, QuantizedRows, linear_int8, quantize_rows, weight_version
from hybridspec_hf.kernels.norm_triton import fused_kernels_active
from hybridspec_hf.kernels.rope_triton import rope
from hybridspec_hf.kernels.rope_triton import supported as rope_supported

from . import fused
from .configuration_dflash import DFlashConfig, build_target_layer_ids


def block_attention_mask(
    anchor_positions: torch.Tensor, context_length: int, block_size: int
) -> torch.Tensor:
    """DFlash training mask for N anchor blocks run in one forward (SpecForge `create_dflash_sdpa_mask`).

    Keys are laid out as `[context (context_length) | block 0 | block 1 | ... | block N-1]`, queries as the blocks.
    Block j sees context keys at positions < anchor_positions[:, j] (strict) and all keys of its own block.
    Args:
        anchor_positions: [B, N] long, the anchor's position in the context sequence for every block.
    Returns:
        bool [B, 1, N*block_size, context_length + N*block_size], True = may attend.
    Use with `position_ids = block_position_ids(anchor_positions, block_size)` and
    `context_position_ids = arange(context_length)`. Padding blocks still see their own block (no all-False row,
    which would make SDPA return NaN); leave them out of the loss instead.
    """
    batch, num_blocks = anchor_positions.shape
    device = anchor_positions.device
    anchors = anchor_positions.repeat_interleave(block_size, dim=1)[:, :, None]  # [B, N*bs, 1]
    context_keys = torch.arange(context_length, device=device)  # [Tc]
    sees_context = context_keys[None, None, :] < anchors  # [B, N*bs, Tc]
    block_of_query = torch.arange(num_blocks * block_size, device=device) // block_size
    same_block = block_of_query[:, None] == block_of_query[None, :]  # [N*bs, N*bs]
    sees_block = same_block[None].expand(batch, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def block_position_ids(anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions of N anchor blocks laid out one after another: [B, N] -> [B, N*block_size] (anchor + 0..bs-1)."""
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return (anchor_positions[:, :, None] + offsets).flatten(1)


class DFlashContextCache:
    """Per-layer context K/V of one generate() call (post k_norm + RoPE), positions 0..length-1.

    Buffers are [B, H_kv, capacity, D] and grow by doubling; `length` is how many positions are valid. All rows of
    the batch share `length` (rows advance together). `crop(length)` rolls back; block K/V are never stored here.
    """

    def __init__(self, num_layers: int, capacity: int = 0):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self._initial_capacity = capacity

    def crop(self, length: int) -> None:
        """Forget every position >= length (rollback); length must be in [0, self.length]."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop(length={length}) is outside the cached range [0, {self.length}].")
        self.length = length

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, H_kv, n, D] at positions length..length+n-1 of `layer`; return that layer's K/V up to them.

        `length` itself moves only in `advance(n)`, once every layer has stored its n positions.
        """
        end = self.length + key.shape[2]
        self._reserve(layer, key, end)
        self.keys[layer][:, :, self.length:end] = key
        self.values[layer][:, :, self.length:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def layer(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Cached K/V of `layer`, [B, H_kv, length, D] each (None before the first store)."""
        if self.keys[layer] is None:
            return None, None
        return self.keys[layer][:, :, : self.length], self.values[layer][:, :, : self.length]

    def advance(self, n: int) -> None:
        self.length += n

    def _reserve(self, layer: int, like: torch.Tensor, end: int) -> None:
        buffer = self.keys[layer]
        if buffer is not None and buffer.shape[0] != like.shape[0]:
            raise ValueError(
                f"The context cache holds batch size {buffer.shape[0]}, got {like.shape[0]}; "
                "use one cache per generate() call (drafter.new_context_cache())."
            )
        if buffer is not None and buffer.shape[2] >= end:
            return
        capacity = max(end, self._initial_capacity, 2 * (0 if buffer is None else buffer.shape[2]), 64)
        shape = (*like.shape[:2], capacity, like.shape[3])
        for store in (self.keys, self.values):
            grown = like.new_zeros(shape)
            if store[layer] is not None:
                grown[:, :, : self.length] = store[layer][:, :, : self.length]
            store[layer] = grown


class StaticDraftContext:
    """Context K/V of one drafter for graph-captured rounds: fixed buffers, device-side lengths.

    Buffers are [B, H_kv, capacity + block_size, D] per layer (`keys[l]`, views of one [L, ...] `key_buffer`, which
    the fused path writes for all layers in one launch), allocated once; slot p holds position p. `length` is
    a [B] long tensor on the device: positions 0..length[b]-1 of row b are valid, and rows may differ. `append`
    writes a static number n of rows at length..length+n-1 and counts only `count` of them; `draft_static` writes
    the block's K/V at length..length+block_size-1 (the block_size spare slots leave room for it at full capacity)
    and masks every slot past the block, so rows written but not counted are never seen. Nothing here reads a
    device value on the host, reallocates or changes a shape: append + draft_static can be captured in one CUDA
    graph and replayed. The eager equivalent, with the same maths, is `DFlashContextCache` + `DFlashDrafter.draft`.

    The device cannot check `length + count <= capacity` for free, so the caller must keep it (capacity = the
    generation's max length). A write past the buffers lands in the last slot instead of out of bounds; the
    logits are then meaningless, but memory is safe. Change `length` only through `reset` and `append`.
    """

    def __init__(
        self, drafter: DFlashDrafter, capacity: int, device: torch.device | str, dtype: torch.dtype,
        batch_size: int = 1,
    ):
        config = drafter.config
        if capacity < 1 or batch_size < 1:
            raise ValueError(f"capacity and batch_size must be >= 1, got capacity={capacity}, batch_size={batch_size}.")
        if dtype != drafter.dtype or torch.device(device).type != drafter.device.type:
            raise ValueError(
                f"The static context must live where the drafter computes: got device={device}, dtype={dtype}; the "
                f"drafter is on {drafter.device} in {drafter.dtype}. Pass drafter.device and .dtype."
            )
        self.drafter = drafter
        self.capacity = capacity
        self.batch_size = batch_size
        slots = capacity + config.block_size
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, slots, config.head_dim)
        self.key_buffer = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H_kv, S, D]
        self.value_buffer = torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = list(self.key_buffer.unbind(0)), list(self.value_buffer.unbind(0))
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.positions = torch.arange(slots, device=device)  # [S] the position each slot holds
        # RoPE by position, computed by the eager code once: the fused path reads rows of it (drafter/fused.py)
        self.cos, self.sin = (table[0] for table in drafter.rotary_emb(self.positions[None], dtype))  # [S, D]
        self.fused = fused.refresh_weights(drafter, None, torch.device(device), dtype)  # weight copies, or None
        self.rows = torch.arange(batch_size)  # [B] the batch row each row started as (`keep_rows` drops rows)
        self._host_length: int | None = 0  # exact length while every count was a host int (free overflow check)

    def reset(self) -> None:
        """Forget the whole context (new generation); the buffers stay where they are. The fused path's weight copies
        follow in-place changes of the drafter's weights (same addresses). Not inside a CUDA-graph capture."""
        self.length.zero_()
        self._host_length = 0
        if self.fused is not None:
            self.fused = fused.refresh_weights(self.drafter, self.fused, self.length.device, self.key_buffer.dtype)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` [n] long (a batch whose finished rows leave it); new buffers, not for graphs."""
        index = index.to(self.length.device)
        self.key_buffer = self.key_buffer.index_select(1, index)
        self.value_buffer = self.value_buffer.index_select(1, index)
        self.keys, self.values = list(self.key_buffer.unbind(0)), list(self.value_buffer.unbind(0))
        self.length = self.length.index_select(0, index)
        self.rows = self.rows.index_select(0, index.cpu())
        self.batch_size = index.numel()

    @torch.no_grad()
    def append(self, features: torch.Tensor, count: int | torch.Tensor) -> None:
        """Project n new context rows and write their K/V at length..length+n-1; then length += count on the device.

        Args:
            features: [B, n, n_feat*H] raw target features, as `draft`'s new_context; n is static (the graph's).
            count: how many of the n rows are real, 0 <= count <= n: an int, or a [B] (or scalar) integer tensor on
                the device. Rows count..n-1 are written but not counted: the next append or draft overwrites them.
        Rows past count are zeroed before the projection: they may be garbage (NaN in an uninitialised scratch
        buffer), and a masked key still multiplies its value by 0 in attention, and 0 * NaN = NaN.
        """
        batch, num_rows = features.shape[:2]
        self._check_append(batch, num_rows, count)
        if num_rows > 0:
            drafter = self.drafter
            real = self.positions[:num_rows] < (count.reshape(-1, 1) if isinstance(count, torch.Tensor) else count)
            features = torch.where(real[..., None], features.to(real.device), 0)  # [B, n, n_feat*H]
            if fused.active(drafter, self):  # resident rounds: every layer's K/V in one GEMM and one store
                fused.append(self, features)
                self.length.add_(count)
                self._count_on_host(count)
                return
            context = drafter.project_context(features)  # [B, n, H]
            positions = self.length[:, None] + self.positions[:num_rows]  # [B, n]
            cos, sin = drafter.rotary_emb(positions, drafter.dtype)
            slots = self.slot_index(positions)  # [B, H_kv, n, D]
            for layer, keys, values in zip(drafter.layers, self.keys, self.values, strict=True):
                key, value = layer.self_attn.key_value(context, cos, sin)  # [B, H_kv, n, D] each
                keys.scatter_(2, slots, key)
                values.scatter_(2, slots, value)
        self.length.add_(count)
        self._count_on_host(count)

    def _count_on_host(self, count: int | torch.Tensor) -> None:
        if self._host_length is not None:  # a device count hides the length from the host from here on
            self._host_length = None if isinstance(count, torch.Tensor) else self._host_length + count

    def slot_index(self, positions: torch.Tensor) -> torch.Tensor:
        """scatter_ index along the slot dimension for rows at `positions` [B, n] -> [B, H_kv, n, D] long.

        Clamped to the last slot: an overflowing write (a broken precondition) must not leave the buffers.
        """
        batch, heads, slots, dim = self.keys[0].shape
        return positions.clamp(max=slots - 1)[:, None, :, None].expand(batch, heads, positions.shape[1], dim)

    def _check_append(self, batch: int, num_rows: int, count: int | torch.Tensor) -> None:
        """Shape and range checks that need no device value; the exact one only while the length is host-known."""
        slots = self.positions.shape[0]
        if batch != self.batch_size:
            raise ValueError(f"features have batch size {batch}, the static context holds {self.batch_size}.")
        if num_rows > slots:
            raise ValueError(
                f"append of {num_rows} rows cannot fit the static context ({self.capacity} positions + "
                f"{slots - self.capacity} spare slots); build it with a larger capacity."
            )
        if isinstance(count, torch.Tensor):
            if count.dtype.is_floating_point or count.dtype == torch.bool or count.shape not in ((), (batch,)):
                raise ValueError(
                    f"count must be an int or an integer tensor of shape [{batch}] (or a scalar), got "
                    f"{count.dtype} of shape {tuple(count.shape)}."
                )
            return
        if not 0 <= count <= num_rows:
            raise ValueError(f"count={count} must be in [0, {num_rows}] (the rows given).")
        if self._host_length is not None and self._host_length + count > self.capacity:
            raise ValueError(
                f"appending {count} positions to {self._host_length} exceeds the static context's capacity "
                f"{self.capacity}; build it with capacity >= the generation's max length."
            )


class DFlashRMSNorm(nn.Module):
    """RMSNorm in at least fp32 (fp64 stays fp64), as Qwen3RMSNorm does for bf16/fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused_kernels_active() and x.dtype == self.weight.dtype and x.dtype in fused._DTYPES:
            return add_rms_norm(x, None, self.weight, self.eps)[1]  # one launch inside resident rounds, same roundings
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashRotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary positions; fp32 maths (fp64 for fp64 models), like Qwen3RotaryEmbedding.

    Holds no buffer (nothing to save, load or re-initialise); inv_freq is computed per device on first use.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self._inv_freq: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.attention_scaling = 1.0

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] long -> cos, sin [B, T, head_dim] in `dtype`."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        freqs = positions[..., None].to(compute) * self._inverse_frequencies(positions.device, compute)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _inverse_frequencies(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._inv_freq:
            params = self.config.rope_parameters or {}
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                dim = self.config.head_dim
                exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim
                inv_freq = 1.0 / (float(params.get("rope_theta", 10000.0)) ** exponents)
            elif rope_type in ("dynamic", "longrope") or rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"DFlashDrafter supports static RoPE types (default, linear, yarn, llama3), got "
                                 f"rope_type={rope_type!r}; set rope_parameters to one of those.")
            else:
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, device)
            self._inv_freq[key] = inv_freq.to(device=device, dtype=dtype)
        return self._inv_freq[key]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, heads, T, D] with cos/sin [B, T, D] (half-split rotation, as in transformers' Qwen3)."""
    if x.is_cuda and fused_kernels_active() and rope_supported(x, x, cos, sin):
        return rope(x, cos, sin)  # one launch inside resident rounds, same rounding steps
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Block queries over [context K/V ; block K/V]; QK-norm + RoPE. Weight names as z-lab's Qwen3DFlashAttention."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.dropout = float(config.attention_dropout)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        layer_type = config.layer_types[layer_idx] if config.layer_types else "full_attention"
        # z-lab: sliding layers are causal inside the block (unless `is_causal` says otherwise) and windowed.
        sliding = layer_type == "sliding_attention"
        self.is_causal = sliding if config.is_causal is None else bool(config.is_causal)
        self.sliding_window = config.sliding_window if sliding else None

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V of x [B, T, H] -> [B, H_kv, T, D] each. Used for context and block alike."""
        batch, length = x.shape[:2]
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [B, Tq, H] normed block hidden states
        context_key: torch.Tensor | None,  # [B, H_kv, Tk, D] (None: no context)
        context_value: torch.Tensor | None,
        cos: torch.Tensor,  # [B, Tq, D] of the block positions
        sin: torch.Tensor,
        mask: torch.Tensor | None,  # bool [B|1, 1, Tq, Tk+Tq], True = attend; None = all
        block_slots: torch.Tensor | None = None,  # [B, H_kv, Tq, D] long: static path, see below
        context_length: torch.Tensor | None = None,  # [B] long: static path, the context slots before the block
    ) -> torch.Tensor:
        """Attention output [B, Tq, H] of the block.

        Eager path: keys are cat([context K/V, block K/V]). Static path (`block_slots` given, context K/V are the
        whole static buffers [B, H_kv, S, D]): the block's K/V are scattered into their slots of those buffers and
        the block attends over all S slots with `mask` [B, 1, Tq, S]; no cat, so shapes and addresses stay fixed.
        Inside resident rounds on CUDA the static path reads only the live slots instead (`static_attention`, from
        `context_length`, under this layer's causal and sliding-window rules; `mask` unused).
        """
        batch, length = x.shape[:2]
        q = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rotate(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        if block_slots is not None:
            context_key.scatter_(2, block_slots, k)
            context_value.scatter_(2, block_slots, v)
            k, v = context_key, context_value
            if context_length is not None and not self.training and routed(q, k, v):
                out = static_attention(q, k, v, context_length, self.head_dim**-0.5, causal=self.is_causal,
                                       window=self.sliding_window)  # [B, Tq, Hq, D]
                return self.o_proj(out.reshape(batch, length, -1))
        elif context_key is not None:
            k, v = torch.cat([context_key, k], dim=2), torch.cat([context_value, v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            scale=self.head_dim**-0.5, enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Hq, Tq, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DFlashMLP(nn.Module):
    """SwiGLU MLP (Qwen3MLP weight names)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block over the block tokens; the context K/V come in ready-made (computed from the fused context)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context_key, context_value, cos, sin, mask, block_slots=None,
                context_length=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context_key, context_value, cos, sin, mask, block_slots,
                               context_length)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class _Positions:
    """Positions of the keys ([cached | new context | block]) and of the block queries, each [B, T] long."""

    cached: torch.Tensor
    context: torch.Tensor
    query: torch.Tensor

    @property
    def keys(self) -> torch.Tensor:
        return torch.cat([self.cached, self.context, self.query], dim=1)


class DFlashDrafter(PreTrainedModel):
    """DFlash block drafter (z-lab DFlashDraftModel compatible). See the module docstring for the architecture.

    Inference (the round loop):
        cache = drafter.new_context_cache()
        logits = drafter.draft(anchor_ids, new_context, cache)   # [B, block_size-1, V]
    Graph-captured rounds (same maths; static shapes, device-side lengths, no host sync):
        ctx = StaticDraftContext(drafter, capacity, drafter.device, drafter.dtype)
        ctx.append(features, count)                              # count: int or [B] long on the device
        logits = drafter.draft_static(anchor_ids, ctx)           # [B, block_size-1, V]
    Training: `forward(noise_embeds, context_hidden, position_ids=..., context_position_ids=..., attention_mask=...)`
    with `block_attention_mask` / `block_position_ids`, then `compute_logits(hidden)`.
    """

    config_class = DFlashConfig
    ESTIMATOR_FILE = "acceptance_estimator.json"  # beside the weights: the drafter's fitted acceptance estimator
    LOOKUP_FILE = "lookup_estimator.json"  # beside the weights: survival of context-lookup proposals (lookup.py)
    base_model_prefix = "model"  # as z-lab's (Qwen3PreTrainedModel); checkpoint keys carry no prefix
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        if not config.target_layer_ids:
            raise ValueError(
                "DFlashConfig.target_layer_ids is empty: the drafter needs at least one target layer to read. Set "
                "target_layer_ids (z-lab: dflash_config.target_layer_ids) or build with DFlashDrafter.from_target()."
            )
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self._target_modules: tuple[nn.Module, nn.Module] | None = None  # plain tuple: outside the module tree
        # The calibrated strategies' acceptance estimator when HybridSpecConfig names none (a
        # selector.AcceptanceEstimator fitted on this drafter's traces; None: the uncalibrated prefix product).
        # save_pretrained writes it beside the weights and from_pretrained reads it back from a local folder.
        self.acceptance_estimator = None
        # HybridSpecConfig(context_lookup=...)'s table when the config names none (a selector.lookup.LookupEstimator;
        # None: context lookup stays off under "auto"); saved and read back like the acceptance estimator.
        self.lookup_estimator = None
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "DFlashDrafter":
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        fitted = Path(str(pretrained_model_name_or_path)) / cls.ESTIMATOR_FILE
        if fitted.is_file():
            from hybridspec_hf.selector import AcceptanceEstimator

            model.acceptance_estimator = AcceptanceEstimator.load(fitted)
        table = Path(str(pretrained_model_name_or_path)) / cls.LOOKUP_FILE
        if table.is_file():
            from hybridspec_hf.selector.lookup import LookupEstimator

            model.lookup_estimator = LookupEstimator.load(table)
        return model

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.acceptance_estimator is not None:
            self.acceptance_estimator.save(Path(str(save_directory)) / self.ESTIMATOR_FILE)
        if self.lookup_estimator is not None:
            self.lookup_estimator.save(Path(str(save_directory)) / self.LOOKUP_FILE)

    # ----------------------------------------------------------------------------------------------- target
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        **overrides,
    ) -> DFlashDrafter:
        """A fresh (randomly initialised) drafter matched to `target`, bound to it, in its dtype and device.

        hidden/vocab/RoPE theta/eps/max positions follow the target's text config; attention heads, KV heads and
        head_dim are the target's attention layers'; intermediate_size = 3 * hidden (z-lab's drafters for Qwen3-8B
        and Qwen3.5-35B-A3B). target_layer_ids default to `build_target_layer_ids(L, num_layers)` (z-lab's rule).
        mask_token_id defaults to the last vocabulary row (vocab_size - 1): Qwen3.5/Qwen3-Next pad the vocabulary,
        so that row is never produced by the tokenizer; pass the id of a dedicated mask token if the target has one.
        `overrides` replace any DFlashConfig field.
        """
        text = target.config.get_text_config()
        num_target_layers = text.num_hidden_layers
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        fields = dict(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=3 * text.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
            rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(text)},
            block_size=block_size,
            target_layer_ids=list(target_layer_ids or build_target_layer_ids(num_target_layers, num_layers)),
            num_target_layers=num_target_layers,
            mask_token_id=text.vocab_size - 1 if mask_token_id is None else mask_token_id,
        )
        fields.update(overrides)
        weight = target.get_input_embeddings().weight
        drafter = cls(DFlashConfig(**fields)).to(device=weight.device, dtype=target.dtype)
        return drafter.bind_target(target)

    def bind_target(self, target: PreTrainedModel, validate: bool = True) -> DFlashDrafter:
        """Share `target`'s input embedding and LM head (by reference: not parameters, not saved, not moved)."""
        self._target_modules = (target.get_input_embeddings(), target.get_output_embeddings())
        if validate:
            self.validate_target(target)
        return self

    def validate_target(self, target: PreTrainedModel) -> None:
        """Raise ValueError if this drafter cannot draft for `target` (shapes, layer ids, mask id, binding)."""
        text = target.config.get_text_config()
        name = type(target).__name__
        embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
        fix = "Use the drafter trained for this target, or build one with DFlashDrafter.from_target(target)."
        vocab, hidden = embedding.weight.shape
        head_rows = getattr(head, "weight", embedding.weight).shape[0]
        if self.config.vocab_size != vocab or head_rows != vocab:
            raise ValueError(
                f"Vocabulary mismatch: drafter vocab_size={self.config.vocab_size}, {name} input embedding has "
                f"{vocab} rows and its LM head {head_rows}. The drafter embeds and scores with the target's own "
                f"tables, so they must agree. {fix}"
            )
        if self.config.hidden_size != hidden:
            raise ValueError(
                f"Hidden size mismatch: drafter hidden_size={self.config.hidden_size}, {name} hidden size {hidden}. "
                f"The drafter's layers consume the target's embeddings and feed its LM head. {fix}"
            )
        num_layers = text.num_hidden_layers
        bad = [i for i in self.config.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {self.config.target_layer_ids} contain {bad}, outside the {num_layers} decoder "
                f"layers of {name} (valid: 0..{num_layers - 1}). The drafter was probably built for a different "
                f"target (num_target_layers={self.config.num_target_layers}). {fix}"
            )
        mask = self.config.mask_token_id
        if mask is None or not 0 <= mask < vocab:
            raise ValueError(
                f"mask_token_id={mask} is not a row of {name}'s vocabulary (0..{vocab - 1}). Set "
                "drafter.config.mask_token_id to the mask row the drafter was trained with."
            )
        if self._target_modules is None:
            raise ValueError(f"The drafter is not bound to a target (it drafts with the target's embedding and LM "
                             f"head); call drafter.bind_target(target) with the {name} you generate with.")
        if self._target_modules[0] is not embedding or self._target_modules[1] is not head:
            raise ValueError(
                f"The drafter is bound to another model's embedding/LM head, not {name}'s; call "
                "drafter.bind_target(target) with the target you generate with."
            )

    def _require_target(self) -> tuple[nn.Module, nn.Module]:
        if self._target_modules is None:
            raise RuntimeError(
                "The drafter has no target embedding/LM head; call drafter.bind_target(target) first "
                "(from_target() binds automatically)."
            )
        return self._target_modules

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Target embedding rows of `input_ids` [B, T] * input_embedding_scale -> [B, T, H] in the drafter's dtype."""
        embedding, _ = self._require_target()
        weight = embedding.weight
        if _is_sharded(weight):  # tensor-parallel target: its module's hooks gather the sharded table
            with torch.no_grad():
                rows = embedding(input_ids.to(weight.device))
        else:  # frozen: training never reaches the target's table
            rows = F.embedding(input_ids.to(weight.device), weight.detach())
        scale = float(self.config.input_embedding_scale)
        rows = rows if scale == 1.0 else rows * scale  # x * 1.0 is x: no launch for it in the draft graph
        return rows.to(device=self.device, dtype=self.dtype)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Target LM head on drafter hidden states [B, T, H] -> [B, T, V] (at least fp32), with z-lab's optional
        output_multiplier and final_logit_softcapping. `upcast=False`: the head's own dtype where neither applies
        (no [T, V] fp32 copy, for readers that compute in fp32 themselves: the resident rounds' drafts and signals).
        With config.head_quantization "int8" and no gradients, the head's int8 copy (`quantized_head`) instead."""
        _, head = self._require_target()
        quantized = self._quantized_head(head, hidden.numel() // max(1, hidden.shape[-1]))
        if quantized is not None:  # config.head_quantization, drafting: the head's int8 copy
            logits = linear_int8(hidden.to(device=head.weight.device, dtype=head.weight.dtype), quantized)
            logits = logits if head.bias is None else logits + head.bias.detach()
        elif isinstance(head, nn.Linear) and not _is_sharded(head.weight):  # frozen: gradients reach `hidden` only
            weight = head.weight.detach()
            bias = None if head.bias is None else head.bias.detach()
            logits = F.linear(hidden.to(device=weight.device, dtype=weight.dtype), weight, bias)
        else:
            logits = head(hidden)
        multiplier = float(self.config.output_multiplier)
        softcap = self.config.final_logit_softcapping
        if not upcast and multiplier == 1.0 and (softcap is None or float(softcap) <= 0):
            return logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits = logits if multiplier == 1.0 else logits * multiplier  # x * 1.0 is x: no pass over [T, V] for it
        if softcap is not None and float(softcap) > 0:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits

    def _quantized_head(self, head: nn.Module, rows: int = 1) -> QuantizedRows | None:
        """The int8 copy of the target's head that drafting multiplies by (config.head_quantization "int8", no
        gradients, a plain nn.Linear whose weight is not sharded; on a GPU for at most MAX_ROWS rows of logits —
        the int8 GEMV's limit: a batch's drafts read the head as it is, which costs the same for any rows), else
        None. Made on first use; when the head's weight changes (another tensor, or written in place) made again
        into the same tensors where the shape and device allow (CUDA graphs captured with it read it by address).
        Kept on the drafter (not saved with it) until `release_quantized_head`."""
        if self.config.head_quantization is None or torch.is_grad_enabled() or not isinstance(head, nn.Linear) \
                or _is_sharded(head.weight) or (head.weight.is_cuda and rows > MAX_ROWS):
            return None
        weight = head.weight
        key = weight_version(weight)
        kept = self.__dict__.get("_head_int8")
        if kept is not None and kept[0] == key:
            return kept[1]
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("The drafter's int8 head copy must be made before CUDA-graph capture: draft once "
                               "eagerly first (the resident rounds' warm-up does), or call drafter.quantized_head().")
        reuse = kept is not None and kept[1].fits(weight)
        if not reuse:
            self.__dict__.pop("_head_int8", None)  # the old copy's memory (if no graph holds it) before the new one
        self.__dict__["_head_int8"] = (key, quantize_rows(weight, out=kept[1] if reuse else None))
        return self.__dict__["_head_int8"][1]

    def release_quantized_head(self) -> None:
        """Drop the drafter's int8 head copy (made again on the next use while the option is on). Resident rounds
        captured with it hold their own reference until `hybridspec_hf.release_graphs(target)`."""
        self.__dict__.pop("_head_int8", None)

    @torch.no_grad()
    def quantized_head(self, rows: int = 1) -> QuantizedRows | None:
        """The int8 copy of the bound target's LM head drafting uses for `rows` rows of logits (made now if needed),
        or None where config.head_quantization is None, the head is not a plain unsharded nn.Linear, or a GPU's
        rows exceed what the int8 GEMV takes."""
        return self._quantized_head(self._require_target()[1], rows)

    # ----------------------------------------------------------------------------------------------- inference
    def new_context_cache(self, capacity: int = 0) -> DFlashContextCache:
        """Empty context cache for one generate() call; `capacity` pre-allocates that many positions."""
        return DFlashContextCache(self.config.num_hidden_layers, capacity)

    @torch.no_grad()
    def draft(
        self,
        anchor_ids: torch.Tensor,
        new_context: torch.Tensor | None,
        cache: DFlashContextCache,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Draft block_size-1 tokens after the anchor.

        Args:
            anchor_ids: [B, 1] long, the last emitted token (not yet processed by the target).
            new_context: [B, n, n_feat*H] raw concatenated target features (outputs of target_layer_ids, in that
                order) of the n tokens committed since the previous call (n >= 0, None = 0); appended to `cache` at
                positions cache.length .. cache.length+n-1.
            cache: this generate() call's `DFlashContextCache`.
        The anchor sits at position cache.length (after appending), the block [anchor, MASK x (B-1)] at
        cache.length .. cache.length+B-1.
        Returns:
            logits [B, block_size-1, V] (at least fp32); row k-1 predicts the token at anchor position + k.
            With return_hidden=True also the drafter's final hidden states of those rows, [B, block_size-1, H].
        """
        hidden = self(self._block_embeddings(anchor_ids), context_hidden=new_context, cache=cache).last_hidden_state
        hidden = hidden[:, 1:]
        logits = self.compute_logits(hidden)
        return (logits, hidden) if return_hidden else logits

    @torch.no_grad()
    def draft_static(self, anchor_ids: torch.Tensor, ctx: StaticDraftContext, upcast: bool = True) -> torch.Tensor:
        """`draft` for CUDA-graph capture: same maths, static shapes, no host sync.

        The block [anchor, MASK x (B-1)] sits at positions ctx.length .. ctx.length+B-1 of each row and attends to
        context positions < ctx.length plus the block, under each layer's causal / sliding-window rules. New context
        goes in beforehand with `ctx.append(features, count)`. The block's K/V are written into ctx's spare slots
        (overwritten by the next append), and the mask is built on the device from ctx.length over all
        capacity + B slots; every query sees at least its own key, so no row of the mask is all False. Inside
        resident rounds on CUDA (`fused_kernels()`) the layers read only the live slots instead, from ctx.length
        (kernels/attention_triton.py), so the cost follows the context, not the capacity.
        Args:
            anchor_ids: [B, 1] long, the last emitted token of each row.
            ctx: the `StaticDraftContext` of this generation (this drafter's, batch size B).
        Returns:
            logits [B, block_size-1, V] (at least fp32; `upcast=False`: see `compute_logits`); row k-1 predicts the
            token at anchor position + k.
        """
        if ctx.drafter is not self or anchor_ids.shape[0] != ctx.batch_size:
            raise ValueError(
                f"ctx must be a StaticDraftContext of this drafter with batch size {anchor_ids.shape[0]}, got one of "
                f"{'this' if ctx.drafter is self else 'another'} drafter with batch size {ctx.batch_size}."
            )
        size = self.config.block_size
        hidden = self._block_embeddings(anchor_ids)  # [B, bs, H]
        if fused.active(self, ctx):  # resident rounds: ≈ 11 launches per layer instead of ≈ 23 (drafter/fused.py)
            return self.compute_logits(fused.draft(self, hidden, ctx)[:, 1:], upcast)
        query = ctx.length[:, None] + ctx.positions[:size]  # [B, bs] block positions
        visible = ctx.positions < (ctx.length + size)[:, None]  # [B, S]: context, then the block
        keys = ctx.positions.expand(anchor_ids.shape[0], -1)  # [B, S]
        layer_masks = self._layer_masks(query, keys, visible[:, None, None])
        cos, sin = self.rotary_emb(query, self.dtype)
        slots = ctx.slot_index(query)  # [B, H_kv, bs, D]
        for layer, key, value in zip(self.layers, ctx.keys, ctx.values, strict=True):
            mask = layer_masks[(layer.self_attn.is_causal, layer.self_attn.sliding_window)]
            hidden = layer(hidden, key, value, cos, sin, mask, block_slots=slots, context_length=ctx.length)
        return self.compute_logits(self.norm(hidden)[:, 1:], upcast)

    def _block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of the block [anchor, MASK x (B-1)] for anchor_ids [B, 1] -> [B, block_size, H]."""
        if self.config.mask_token_id is None:
            raise ValueError("config.mask_token_id is None; set it to the mask row the drafter was trained with.")
        if anchor_ids.dim() != 2 or anchor_ids.shape[1] != 1:
            raise ValueError(f"anchor_ids must be [B, 1], got shape {tuple(anchor_ids.shape)}.")
        masks = torch.full(
            (anchor_ids.shape[0], self.config.block_size - 1), self.config.mask_token_id,
            dtype=anchor_ids.dtype, device=anchor_ids.device,
        )
        return self.embed(torch.cat([anchor_ids, masks], dim=1))

    # ----------------------------------------------------------------------------------------------- forward
    def project_context(self, context_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse raw target features [B, Tc, n_feat*H] -> [B, Tc, H] (fc + hidden_norm), cast to the drafter."""
        self.check_feature_width(context_hidden)
        return self.hidden_norm(self.fc(context_hidden.to(device=self.device, dtype=self.dtype)))

    def check_feature_width(self, context_hidden: torch.Tensor) -> None:
        """A ValueError that says what to concatenate when the features are not n_feat * H wide."""
        expected = self.fc.in_features
        if context_hidden.shape[-1] != expected:
            raise ValueError(
                f"context features have width {context_hidden.shape[-1]}, expected {expected} = "
                f"{len(self.config.target_layer_ids)} target layers {self.config.target_layer_ids} x hidden "
                f"{self.config.hidden_size} (concatenate the outputs of exactly those layers, in that order)."
            )

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        context_position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DFlashContextCache | None = None,
    ) -> BaseModelOutput:
        """Run the drafter layers over block inputs, with the target context injected as K/V.

        Args:
            noise_embeds: [B, Tq, H] block inputs (`embed([anchor, MASK, ...])`); one block or N blocks back to back.
            context_hidden: [B, Tc, n_feat*H] raw target features, or None. Without a cache these are all the
                context keys; with one they are appended to it first (after the cache's `length` cached positions).
            position_ids: [B, Tq] (or [Tq]) positions of the queries; default: right after the context
                (start + Tc + arange(Tq), start = cache.length or 0).
            context_position_ids: [B, Tc] (or [Tc]) positions of the new context; default start + arange(Tc).
                Cached positions are 0..cache.length-1.
            attention_mask: bool [B|1, 1, Tq, Tk + Tq], True = may attend, keys ordered [cached | context | block];
                None = everything visible (inference: the whole context is before the anchor). For training with
                N blocks use `block_attention_mask`. Sliding-window / causal layers AND their own limits onto it.
            cache: `DFlashContextCache` to append the context K/V to and read earlier context K/V from (inference).
        Returns:
            BaseModelOutput with last_hidden_state [B, Tq, H] after the final norm; `compute_logits` maps it to
            the vocabulary.
        """
        batch, length = noise_embeds.shape[:2]
        if context_hidden is not None and context_hidden.shape[1] == 0:
            context_hidden = None
        context = None if context_hidden is None else self.project_context(context_hidden)  # [B, Tc, H]
        positions = self._positions(batch, length, context, position_ids, context_position_ids, cache)
        dtype = self.dtype
        q_cos, q_sin = self.rotary_emb(positions.query, dtype)
        c_cos, c_sin = (None, None) if context is None else self.rotary_emb(positions.context, dtype)
        layer_masks = self._layer_masks(positions.query, positions.keys, attention_mask)
        hidden = noise_embeds.to(device=self.device, dtype=dtype)
        for i, layer in enumerate(self.layers):
            key, value = self._context_key_value(i, layer, context, c_cos, c_sin, cache)
            mask = layer_masks[(layer.self_attn.is_causal, layer.self_attn.sliding_window)]
            hidden = layer(hidden, key, value, q_cos, q_sin, mask)
        if cache is not None and context is not None:
            cache.advance(context.shape[1])
        return BaseModelOutput(last_hidden_state=self.norm(hidden))

    def _context_key_value(self, i, layer, context, cos, sin, cache):
        """Layer i's context K/V [B, H_kv, Tk, D]: projected from the fused context (never from layer i-1)."""
        if context is None:
            return (None, None) if cache is None else cache.layer(i)
        key, value = layer.self_attn.key_value(context, cos, sin)
        return (key, value) if cache is None else cache.store(i, key, value)

    def _positions(self, batch, length, context, position_ids, context_position_ids, cache) -> _Positions:
        device = self.device
        start = 0 if cache is None else cache.length
        num_context = 0 if context is None else context.shape[1]

        def rows(ids, default_start, n):
            if ids is None:
                ids = torch.arange(default_start, default_start + n, device=device)
            ids = ids.to(device=device, dtype=torch.long)
            return ids.expand(batch, n) if ids.dim() == 1 else ids

        return _Positions(
            cached=rows(None, 0, start),
            context=rows(context_position_ids, start, num_context),
            query=rows(position_ids, start + num_context, length),
        )

    def _layer_masks(
        self, query_positions: torch.Tensor, key_positions: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> dict:
        """Boolean mask per distinct (is_causal, sliding_window) of the layers: the given mask AND the layer's limits.

        query_positions [B, Tq] and key_positions [B, Tk] long; attention_mask bool, broadcastable to
        [B, 1, Tq, Tk], or None. Pure tensor maths (no host sync), so the static drafting path uses it too.
        """
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be boolean (True = attend), got {attention_mask.dtype}.")
        masks = {}
        for layer in self.layers:
            kind = (layer.self_attn.is_causal, layer.self_attn.sliding_window)
            if kind in masks:
                continue
            causal, window = kind
            if not causal and window is None:
                masks[kind] = attention_mask
                continue
            q, k = query_positions[:, :, None], key_positions[:, None, :]  # [B, Tq, 1], [B, 1, Tk]
            visible = torch.ones_like(q == k)
            if causal:
                visible &= k <= q
            if window is not None:
                visible &= (q - k < window) if causal else ((q - k).abs() < window)
            visible = visible[:, None]
            masks[kind] = visible if attention_mask is None else visible & attention_mask.to(visible.device)
        return masks


def _is_sharded(weight: torch.Tensor) -> bool:
    """A tensor-parallel (DTensor) parameter: use the target's module, whose hooks shard and gather."""
    return type(weight).__name__ == "DTensor"


def _rope_theta(text_config) -> float:
    """The target's RoPE base (flat rope_parameters, per-layer-type nested ones, or legacy rope_theta)."""
    params = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    theta = params.get("rope_theta", getattr(text_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


__all__ = [
    "DFlashContextCache",
    "DFlashDrafter",
    "StaticDraftContext",
    "block_attention_mask",
    "block_position_ids",
]
