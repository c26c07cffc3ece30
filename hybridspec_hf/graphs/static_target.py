"""The target with static shapes and device-side lengths: what a CUDA graph can replay.

One `StaticTarget` per (model, capacity, block size) lives across generate() calls. It owns a transformers
`StaticCache` of `capacity` positions and the device-side bookkeeping around it:

- `length` [N] long: tokens in the cache (committed) of each of the N batch rows (N = 1 but for batched resident
  rounds); a verification writes row b's T keys at slots length[b] .. length[b]+T-1. With one row every attention
  layer's `cumulative_length` (views into one buffer) is set to it after each commit (transformers' update writes
  there); with several, the layers' `update` writes each row at its own length (`_write_rows`);
- `next_position` [R, N, 1] long: the position id of each row's next token (R = rows of mRoPE position ids, or 1);
- masks built on the device from `length` (a mask dict, so transformers' mask code, which syncs on 5.17, never
  runs), per row. On CUDA the attention layers of the resident forwards ignore them and read `length` itself
  (patches/_attention.py, kernels/attention_triton.py): keys past the live ones are never read, so a round's
  attention no longer costs the whole capacity. So the mask is built on demand (MASK_ON_DEMAND): by the first
  layer that runs transformers' attention function, and on the kernel path not at all;
- `rope`: the rotary embedding's cos/sin of every cache slot (patches.RopeTable, refilled by `load` and `reset`),
  which the resident forwards gather by slot instead of computing them.

A batch is held without padding: `load` copies row b's real prompt tokens (its attention_mask ones) to slots
0 .. n_b-1, so each row's cache is the one its own generate() would hold, and rows differ only in their lengths.

Nothing here reads a device value on the host. A generate() call prefills with its own cache as AR does, `load`s
that cache into the static one, runs rounds, and `store`s the result back into the caller's cache, so the caller
sees exactly the cache AR decoding would have left.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from hybridspec_hf import patches
from hybridspec_hf.patches._cache import attention_length, row_snapshot

# True: the dense mask is built only for attention layers that run transformers' function (module docstring);
# False: every forward builds it (A/B: `--variants plain,-mask-on-demand`)
MASK_ON_DEMAND = True


class FeatureCapture:
    """Forward hooks that keep the outputs of the chosen decoder layers (z-lab's hidden_states[i + 1]).

    Our own hooks, because `output_hidden_states=[...]` indexes differently in transformers 5.17 and 5.23+.
    """

    def __init__(self, layers: list[torch.nn.Module], layer_ids: list[int]):
        self.outputs: dict[int, torch.Tensor] = {}
        self.layer_ids = list(layer_ids)
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> torch.Tensor | None:
        """Concatenated features of the last forward: [B, T, n_feat * H] (None without feature layers), on the
        first feature layer's device (a device_map may spread the layers)."""
        if not self.layer_ids:
            return None
        device = self.outputs[self.layer_ids[0]].device
        features = torch.cat([self.outputs[i].to(device) for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        return features

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _attention_layers(cache) -> list:
    return [layer for layer in cache.layers if not patches.is_linear_cache_layer(layer)]


def advance_lengths(count: torch.Tensor, length: torch.Tensor, next_position: torch.Tensor,
                    attention_lengths: torch.Tensor | None) -> None:
    """count [N] long tokens committed per row: length [N] and next_position [R, N, 1] move by them (in place, no
    host sync), attention_lengths [L] (one row's; None: not kept) follows length."""
    length.add_(count)
    next_position.add_(count.view(1, -1, 1))
    if attention_lengths is not None:
        attention_lengths.copy_(length.expand_as(attention_lengths))


@contextlib.contextmanager
def without_head(model):
    """Inside: the model's LM head (its `lm_head`, the output embeddings) is an identity, so its forward returns the
    final hidden states where it returns logits (resident greedy rounds take their tokens from them:
    kernels/head_argmax_triton.py). `head_skippable` says where that holds."""
    if not head_skippable(model):
        raise ValueError(f"{type(model).__name__}'s LM head cannot be taken out of its forward: it needs a plain "
                         "`lm_head` nn.Linear without bias that is the model's output embeddings")
    kept = model.lm_head
    model.lm_head = torch.nn.Identity()
    try:
        yield
    finally:
        model.lm_head = kept


def head_skippable(model) -> bool:
    """Whether `without_head` applies: a plain bias-free nn.Linear `lm_head` that is the output embeddings, in a
    model whose config scales or caps no logits (Qwen3.5 / Qwen3-Next do neither)."""
    config = model.config.get_text_config()
    head = getattr(model, "lm_head", None)
    return (type(head) is torch.nn.Linear and head.bias is None and head is model.get_output_embeddings()
            and not getattr(config, "final_logit_softcapping", None) and not getattr(config, "logit_scale", None)
            and getattr(config, "output_multiplier", 1.0) in (None, 1.0))


class StaticTarget:
    """Static cache + static-shape forwards of one target. `capacity` counts cache positions (prompt, generated
    tokens and the B positions a verification may write past the committed length)."""

    def __init__(self, model, capacity: int, feature_layer_ids: list[int], position_rows: int = 1,
                 kernel_backend: str = "auto", verifier: str = "block", max_tokens: int = 16, rows: int = 1):
        from transformers import StaticCache

        self.model = model
        self.capacity = capacity
        self.kernel_backend = kernel_backend
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        text_config = model.config.get_text_config()
        self.cache = StaticCache(config=text_config, max_cache_len=capacity)
        # transformers ≥ 5.23 names the forward's cache argument `cache` (`past_key_values` is deprecated there)
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.gdn_layers = patches.gdn_layers(model)
        self.decoder_layers = patches.text_model(model).layers
        self.feature_layer_ids = list(feature_layer_ids)
        self.rows = rows  # batch rows N
        self.length = torch.zeros(rows, dtype=torch.long, device=self.device)  # [N]
        # position_rows: 1 for position ids [N, T], R for mRoPE position ids [R, N, T] (as generate() passes them)
        self.next_position = torch.zeros(position_rows, rows, 1, dtype=torch.long, device=self.device)
        self.key_positions = torch.arange(capacity, device=self.device)  # [capacity]
        self.attn_impl = getattr(text_config, "_attn_implementation", None) or "sdpa"
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(
                f"GPU-resident rounds need attn_implementation 'sdpa' or 'eager' (masks with device-side lengths); the "
                f"model uses {self.attn_impl!r}. Load it with attn_implementation='sdpa' or pass "
                "HybridSpecConfig(cuda_graphs='off')."
            )
        # the attention layers take None for their mask and ask for it (patches.static_cache_length)
        self.mask_on_demand = patches.routes_attention(patches.family_of(model).modeling)
        self._initialise()
        self.verifier = verifier
        self.state_buffer = None  # [GDN layers, 1, max_tokens, HV, dk, dv] fp32 for the "per_token_state" verifier
        if verifier == "per_token_state" and self.gdn_layers:
            self.state_buffer = patches.per_token_state_buffer(self.gdn_layers, self.cache, max_tokens)

    def close(self) -> None:
        """Nothing is left on the model between forwards (feature hooks live only inside `forward`)."""

    # ------------------------------------------------------------------------------------------------ set-up
    def _initialise(self) -> None:
        """Allocate every cache tensor now (transformers allocates lazily, on the first update): a forward over a
        few tokens, then back to empty. Graph captures need the tensors to exist and keep their addresses."""
        vocab = self.model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (self.rows, 2), device=self.device, generator=None)
        positions = torch.arange(2, device=self.device).view(1, 1, 2).expand(self.next_position.shape[0], self.rows, 2)
        with torch.no_grad():
            self.model(input_ids=ids, position_ids=self._position_ids(positions), use_cache=True,
                       logits_to_keep=1, attention_mask=self.mask(2), **{self.cache_kwarg: self.cache})
        attention = _attention_layers(self.cache)
        if self.rows > 1:
            for layer in attention:
                layer.update = functools.partial(_write_rows, layer, self.length)
        # one row: every attention layer's `cumulative_length` a view into one buffer, so that `advance` sets all of
        # them in one launch (they stay 0-d long tensors that transformers' update advances in place)
        self.attention_lengths = torch.zeros(len(attention), dtype=torch.long, device=self.device)
        if self.rows == 1:
            for index, layer in enumerate(attention):
                layer.cumulative_length = self.attention_lengths[index]
        rotary = getattr(patches.text_model(self.model), "rotary_emb", None)
        self.rope = None  # a table only for the family's rotary embedding (its class is patched to read it)
        if isinstance(rotary, patches.family_of(self.model).ROTARY_CLASS):
            self.rope = patches.RopeTable.build(rotary, self._position_ids(self.next_position), self.capacity,
                                                self.dtype)
        self.reset()

    def reset(self) -> None:
        """Empty cache: length 0 (GDN states are overwritten by `load`)."""
        self.length.zero_()
        self.next_position.zero_()
        for layer in _attention_layers(self.cache):
            layer.cumulative_length.zero_()
        self._fill_rope()

    def _fill_rope(self) -> None:
        """Refill the RoPE table (eager) for the position ids next_position - length + slot that the slots of each
        row hold from now on (positions and lengths advance together)."""
        if self.rope is not None:
            self.rope.fill(self._position_ids(self.next_position - self.length.view(1, -1, 1)))

    def _position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """[R, N, T] -> what the model takes: [N, T] for plain RoPE, [R, N, T] for mRoPE."""
        return positions[0] if positions.shape[0] == 1 else positions

    # ------------------------------------------------------------------------------------------------ masks
    def _slots(self, num_tokens: int) -> torch.Tensor:
        """[N, T] long: the cache slots length .. length+T-1 of each row's T new tokens (at T = 1 a view of
        `length`: no launch)."""
        if num_tokens == 1:
            return self.length.view(-1, 1)
        return self.length.view(-1, 1) + self.key_positions[:num_tokens]

    def _dense_mask(self, slots: torch.Tensor) -> torch.Tensor:
        """[N, 1, T, capacity]: key j visible to the token at slot i iff j <= i (causal over the static cache)."""
        visible = self.key_positions.view(1, 1, -1) <= slots[..., None]  # [N, T, capacity]
        if self.attn_impl == "eager":
            visible = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~visible, torch.finfo(self.dtype).min)
        return visible[:, None]

    def mask(self, num_tokens: int) -> dict:
        """The mask dict for T new tokens at cache positions length .. length+T-1 of each row: [N, 1, T, capacity]."""
        return {"full_attention": self._dense_mask(self._slots(num_tokens)), "linear_attention": None}

    # ------------------------------------------------------------------------------------------------ forwards
    def forward(self, tokens: torch.Tensor, verify: patches.VerifySession | None = None, head: bool = True):
        """Logits [N, T, V] and features [N, T, F] of T tokens [N, T] after each row's committed ones.

        verify=None: the stock forward (AR: GDN and attention caches advance by T in place; use T = 1).
        With a session: GDN layers verify without writing their state; attention writes T keys past `length`.
        head=False: the final hidden states [N, T, H] (what the LM head would multiply) instead of logits
        (`without_head`).
        """
        num_tokens = tokens.shape[1]
        slots = self._slots(num_tokens)
        positions = self.next_position  # one token: the buffer itself (+ 0 would be a launch)
        if num_tokens > 1:
            positions = positions + self.key_positions[:num_tokens].view(1, 1, -1)
        masks, mask = {"full_attention": None, "linear_attention": None}, None
        if MASK_ON_DEMAND and self.mask_on_demand:  # built once, by the first layer that reads it
            mask = functools.cache(functools.partial(self._dense_mask, slots))
        else:
            masks["full_attention"] = self._dense_mask(slots)
        if verify is not None:
            for layer in self.gdn_layers:
                layer._hybridspec_verify = verify
        capture = FeatureCapture(self.decoder_layers, self.feature_layer_ids)  # only for this forward
        try:
            # attention layers read `length` on the device (our static-cache kernel, on CUDA) or the mask (SDPA);
            # the rotary embedding its tokens' rows of the RoPE table
            with (patches.fused_kernels(), patches.static_cache_length(self.length, mask),
                  patches.rope_slots(self.rope, slots), contextlib.nullcontext() if head else without_head(self.model)):
                outputs = self.model(input_ids=tokens, position_ids=self._position_ids(positions),
                                     attention_mask=masks, use_cache=True, logits_to_keep=num_tokens,
                                     **{self.cache_kwarg: self.cache})
            features = capture.take()
        finally:
            capture.remove()
            for layer in self.gdn_layers:
                layer.__dict__.pop("_hybridspec_verify", None)
        if verify is not None:
            patches.check_verified(verify, self.gdn_layers)
        return outputs.logits, features

    def advance(self, count: torch.Tensor) -> None:
        """count [N] long tokens were committed per row: move the lengths (device-side) and realign attention layers
        (with several rows their `cumulative_length` is unused: `_write_rows` reads `length`)."""
        # one row: the attention layers' cumulative_length (views into attention_lengths)
        advance_lengths(count, self.length, self.next_position, self.attention_lengths if self.rows == 1 else None)

    def session(self, valid: torch.Tensor | None = None, decode_step: bool = False) -> patches.VerifySession:
        """A verification session over the static cache (valid: [N] long device tensor, or None: all tokens).
        decode_step: one token that will be committed (m = 1), so GDN layers may update their state in place."""
        return patches.VerifySession(cache=self.cache, kernel_backend=self.kernel_backend, valid_len=valid,
                                     verifier=self.verifier, state_buffer=self.state_buffer, decode_step=decode_step)

    def commit(self, session: patches.VerifySession, count: torch.Tensor) -> None:
        """Keep `count` ([N] long, 0 ≤ count ≤ T, per row) of a verification's tokens: S_m and conv windows of every
        GDN layer in one launch, then the lengths (attention keys past the new length are masked from now on)."""
        self.commit_states(session, count)
        self.advance(count)

    def commit_states(self, session: patches.VerifySession, count: torch.Tensor) -> None:
        """S_m and conv windows of every GDN layer (count [N] long) in one launch; none after a decoding step whose
        layers all updated their state in place (nothing pending)."""
        if session.pending:
            patches.commit_session(session, count.to(torch.int32))

    # ------------------------------------------------------------------------------------------------ caller's cache
    def load(self, cache, position: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Copy a prefilled transformers cache (Dynamic or Static) into the static one.

        position: the position id of each row's last cached token, [R, B, 1] (or anything that reshapes to it).
        real: [B, P] the prompt's attention mask (None: every column real); row b's real columns go to slots
        0 .. n_b-1 (left padding is dropped). B ≤ N: rows B .. N-1 are inert (length 0, zero states)."""
        if real is None:
            real = torch.ones(self.rows, attention_length(cache), dtype=torch.long)
        real = real.to(torch.bool)
        batch, width = real.shape
        counts = real.sum(1).tolist()
        if batch > self.rows:
            raise ValueError(f"a batch of {batch} rows does not fit the static target's {self.rows} rows.")
        if max(counts) + 1 > self.capacity:
            raise ValueError(f"the prompt ({max(counts)} tokens) does not fit the static cache ({self.capacity}).")
        for mine, theirs in zip(self.cache.layers, cache.layers):
            if patches.is_linear_cache_layer(mine):
                for mine_state, their_state in ((mine.conv_states[0], theirs.conv_states[0]),
                                                (mine.recurrent_states[0], theirs.recurrent_states[0])):
                    mine_state[batch:].zero_()
                    mine_state[:batch].copy_(their_state)
                continue
            for row in range(batch):
                columns = real[row].nonzero().view(-1).to(theirs.keys.device)  # the row's real prompt tokens
                mine.keys[row, :, : counts[row]].copy_(theirs.keys[row].index_select(-2, columns))
                mine.values[row, :, : counts[row]].copy_(theirs.values[row].index_select(-2, columns))
        self.length.zero_()
        self.length[:batch].copy_(torch.tensor(counts))
        self.next_position.zero_()
        position = position.reshape(self.next_position.shape[0], batch, 1) if position.numel() > batch \
            else position.reshape(1, batch, 1).expand(self.next_position.shape[0], batch, 1)
        self.next_position[:, :batch].copy_(position + 1)
        if self.rows == 1:
            for layer in _attention_layers(self.cache):
                layer.cumulative_length.fill_(counts[0])
        self._fill_rope()

    def row_snapshot(self, row: int, length: int) -> list:
        """Copies of row `row`'s committed state (`length` tokens, known on the host), in `patches.row_snapshot`'s
        per-layer layout: attention (keys, values) [H, length, D], GDN (conv state, recurrent state)."""
        return row_snapshot(self.cache, row, torch.arange(length, device=self.device))

    def store(self, cache, length: int) -> None:
        """Write the committed state (`length` tokens, known on the host) back into the caller's cache (one row)."""
        for mine, theirs in zip(self.cache.layers, cache.layers):
            if patches.is_linear_cache_layer(mine):
                theirs.conv_states[0].copy_(mine.conv_states[0])
                theirs.recurrent_states[0].copy_(mine.recurrent_states[0])
            elif isinstance(getattr(theirs, "cumulative_length", None), torch.Tensor):  # StaticLayer
                theirs.keys[:, :, :length].copy_(mine.keys[:, :, :length])
                theirs.values[:, :, :length].copy_(mine.values[:, :, :length])
                theirs.keys[:, :, length:].zero_()
                theirs.values[:, :, length:].zero_()
                theirs.cumulative_length.fill_(length)
            else:  # DynamicLayer
                theirs.keys = mine.keys[:, :, :length].clone()
                theirs.values = mine.values[:, :, :length].clone()


def _write_rows(layer, length: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
    """A static layer's `update` for a batch whose rows hold different numbers of tokens: row b's T new keys and
    values [N, H, T, D] at slots length[b] .. length[b]+T-1 (one scatter each, no host sync)."""
    tokens = key_states.shape[-2]
    slots = length.view(-1, 1) + torch.arange(tokens, device=length.device)  # [N, T]
    index = slots[:, None, :, None].expand_as(key_states)
    layer.keys.scatter_(2, index, key_states)
    layer.values.scatter_(2, index, value_states)
    return layer.keys, layer.values
