"""The target side of a round: prefill, verification of w tokens, and the commit of m of them.

Wraps one generate() call's cache and position bookkeeping so the round loop reads as the algorithm.
"""
from __future__ import annotations

import torch

from hybridspec_hf import patches
from hybridspec_hf.graphs.static_target import FeatureCapture
from hybridspec_hf.patches._cache import attention_length, drop_last_tokens, keep_rows, row_snapshot


class TargetRunner:
    """Runs the target's forwards for one generate() call and keeps its cache equal to AR decoding's.

    positions: [B, 1] or [R, B, 1] (mRoPE rows) position id of the last token in the cache.
    """

    def __init__(self, model, cache, cache_key: str, feature_layer_ids: list[int], kernel_backend: str,
                 verifier: str = "block", max_tokens: int = 16):
        self.model = model
        self.cache = cache
        self.cache_key = cache_key
        self.kernel_backend = kernel_backend
        self.verifier, self.max_tokens = verifier, max_tokens
        self._state_buffer = None  # per-token states of the "per_token_state" verifier, allocated on first use
        self.gdn_layers = patches.gdn_layers(model)
        self.moe_blocks = patches.moe_blocks(model)
        self._verify_experts: dict[int, list] = {}  # rows -> blocks whose experts run as "hybridspec" (CPU)
        decoder_layers = patches.text_model(model).layers
        self.capture = FeatureCapture(decoder_layers, feature_layer_ids)
        self.positions: torch.Tensor | None = None
        self.mask_length: int | None = None  # the prefill's cached length when it gets a mask (_extend_mask)

    def close(self) -> None:
        self.capture.remove()

    def _extend_mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of a forward over `input_ids` after the cached tokens (None: no mask). A batch-1 row
        has no padding, so its mask is all ones: the prefill gets one when generate() gave one (as AR's prefill
        does) and the rounds' forwards get None, which transformers treats alike — with an all-ones mask
        transformers 5.17's recurrent-mask check (`torch.all(mask == 1)`) synced the host inside every round."""
        if self.mask_length is None:
            return None
        length, self.mask_length = self.mask_length + input_ids.shape[1], None
        return torch.ones(input_ids.shape[0], length, dtype=torch.long, device=input_ids.device)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int, **extra):
        outputs = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._extend_mask(input_ids),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **{self.cache_key: self.cache},
            **extra,
        )
        # beside the tokens: a no-op unless a device_map without accelerate's output hook left them elsewhere
        return outputs.logits.to(input_ids.device), self.capture.take()

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, **extra):
        """Process the uncached prompt tokens the way AR's prefill does. Returns last logits [B, V], features."""
        cached = attention_length(self.cache)
        new_ids = input_ids[:, cached:]
        position_ids = position_ids[..., cached:]
        self.mask_length = None if attention_mask is None else cached
        logits, features = self._forward(new_ids, position_ids, 1, **extra)
        self.positions = position_ids[..., -1:]
        return logits[:, -1], features

    def next_positions(self, count: int) -> torch.Tensor:
        steps = torch.arange(1, count + 1, device=self.positions.device)
        return self.positions + steps

    def verify(self, tokens: torch.Tensor, valid: torch.Tensor | None = None):
        """Target logits for T tokens [B, T] from the committed state: ([B, T, V], features, session).

        GDN layers run the block form and leave their state untouched; attention layers append T positions.
        valid: optional [B] device tensor, the tokens that count (the GDN kernels skip the rest).
        """
        session = patches.VerifySession(cache=self.cache, kernel_backend=self.kernel_backend, valid_len=valid,
                                        verifier=self.verifier, state_buffer=self._states())
        for layer in self.gdn_layers:
            layer._hybridspec_verify = session
        try:
            with patches.fused_experts_for(self._dense_experts(tokens.numel())):
                logits, features = self._forward(tokens, self.next_positions(tokens.shape[1]), tokens.shape[1])
        finally:
            for layer in self.gdn_layers:
                layer.__dict__.pop("_hybridspec_verify", None)
        patches.check_verified(session, self.gdn_layers)
        return logits, features, session

    def _dense_experts(self, rows: int) -> list:
        """The MoE blocks a verification of `rows` token rows runs with dense experts (patches.cpu_verification_blocks:
        on the CPU, where transformers' experts loop over the experts hit), cached per row count."""
        if rows not in self._verify_experts:
            self._verify_experts[rows] = patches.cpu_verification_blocks(self.moe_blocks, rows)
        return self._verify_experts[rows]

    def commit(self, session: patches.VerifySession, verified: int, committed: int) -> None:
        """Keep the first `committed` of `verified` tokens: rebuild S_m in every GDN layer, roll conv states,
        truncate attention KV. 0 ≤ committed ≤ verified."""
        if session.pending:
            patches.commit_session(session, committed)
        drop_last_tokens(self.cache, verified - committed)
        self.positions = self.positions + committed

    def _states(self):
        """The per-token state buffer [GDN layers, B, max_tokens, HV, dk, dv] fp32 ("per_token_state" only)."""
        if self.verifier != "per_token_state" or not self.gdn_layers:
            return None
        if self._state_buffer is None:
            self._state_buffer = patches.per_token_state_buffer(self.gdn_layers, self.cache, self.max_tokens)
        return self._state_buffer


class BatchTargetRunner(TargetRunner):
    """The target side of a batch whose rows commit different counts per round (generation/batched.py).

    The rows share the attention cache's slots. A verification appends T slots to every row and row b keeps its m_b
    committed tokens; its other T - m_b slots become holes, masked out of attention for the rest of the call
    (attention_mask 0), and slots past the round's largest m_b are dropped. positions [B, 1] (or [R, B, 1]) are per
    row: the position id of the row's last real token, so RoPE sees what the row's own AR decoding would.
    slots[b] lists, for every sequence column of row b the target has processed, the cache slot that holds it.
    """

    attention_mask: torch.Tensor  # [B, slots] long: 1 = a real token of that row, 0 = left padding or a hole
    slots: list[list[int]]

    def _extend_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The mask over the cache's slots and the new tokens: a verification's tokens are real (ones); the
        prefill's mask came with the prompt."""
        missing = attention_length(self.cache) + input_ids.shape[1] - self.attention_mask.shape[1]
        if missing > 0:
            new = self.attention_mask.new_ones(input_ids.shape[0], missing)
            self.attention_mask = torch.cat([self.attention_mask, new], dim=1)
        return self.attention_mask

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, **extra):
        """The prompt as stock generate() runs it, left padding masked. Returns last logits [B, V], features."""
        cached = attention_length(self.cache)
        self.attention_mask = attention_mask
        logits, features = self._forward(input_ids[:, cached:], position_ids[..., cached:], 1, **extra)
        self.positions = position_ids[..., -1:]
        self.slots = [list(range(input_ids.shape[1])) for _ in range(input_ids.shape[0])]
        return logits[:, -1], features

    def commit_rows(self, session: patches.VerifySession, verified: int, committed: list[int]) -> None:
        """Keep the first committed[b] of the `verified` tokens of row b (0 ≤ committed[b] ≤ verified): S_m and conv
        windows per row, holes in the attention mask, slots past the largest count dropped."""
        device = self.attention_mask.device
        m = torch.tensor(committed, device=device)  # [B]
        if session.pending:
            patches.commit_session(session, m.to(device=session.pending[0].state.device, dtype=torch.int32))
        start, keep = self.attention_mask.shape[1] - verified, max(committed)
        kept = torch.arange(keep, device=device) < m[:, None]  # [B, keep]
        self.attention_mask = torch.cat([self.attention_mask[:, :start], kept.to(self.attention_mask.dtype)], dim=1)
        drop_last_tokens(self.cache, verified - keep)
        self.positions = self.positions + m.to(self.positions.device).view(-1, 1)
        for row, count in zip(self.slots, committed):
            row.extend(range(start, start + count))

    def snapshot(self, row: int) -> list:
        """Copies of batch row `row`'s cache, its processed sequence columns in order (patches.row_snapshot)."""
        slots = torch.tensor(self.slots[row], dtype=torch.long, device=self.attention_mask.device)
        return row_snapshot(self.cache, row, slots)

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every batch row not in `rows` (finished rows leave the batch and cost no more verification)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        keep_rows(self.cache, index)
        self.attention_mask = self.attention_mask.index_select(0, index)
        self.positions = self.positions.index_select(self.positions.dim() - 2, index.to(self.positions.device))
        self.slots = [self.slots[row] for row in rows]
        self._state_buffer = None  # the "per_token_state" verifier's buffer has one slot per row
