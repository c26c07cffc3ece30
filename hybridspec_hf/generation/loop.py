"""The HybridSpec round loop: draft → choose length → verify w tokens → accept → commit. Read top to bottom.

`hybridspec_decode` is a `custom_generate` callable: transformers' generate() has already prepared the generation
config, logits processors, stopping criteria, cache and position ids; this replaces only the decode loop.
Invariant after every round: the target's cache equals what AR decoding would hold after the same tokens.
"""
from __future__ import annotations

import time

import torch

from hybridspec_hf.config import HybridSpecConfig
from hybridspec_hf.generation.acceptance import greedy_accept
from hybridspec_hf.generation.target import TargetRunner
from hybridspec_hf.generation.telemetry import GenerationTelemetry, RoundRecord
from hybridspec_hf.patches._cache import check_supported_cache


class LengthRule:
    """The strategy's choice of w (tokens verified per round, anchor included), the seam for the selector.

    "dflash" verifies the whole block; "static" a fixed length. `choose` sees the draft logits so that
    draft-side selectors can plug in here; `observe` is told how each round went.
    """

    def __init__(self, strategy: str, config: HybridSpecConfig, block_size: int):
        if strategy == "static" and config.static_length > block_size:
            raise ValueError(
                f"static_length={config.static_length} exceeds the drafter's block_size={block_size}; "
                f"choose 1 ≤ static_length ≤ {block_size}."
            )
        self.strategy = strategy
        self.fixed = config.static_length if strategy == "static" else block_size

    def planned(self) -> int | None:
        """w known before drafting (skips drafting when it is 1), or None when it depends on the drafts."""
        return self.fixed

    def choose(self, draft_logits: torch.Tensor | None, context_len: int) -> int:
        return self.fixed

    def observe(self, record: RoundRecord) -> None:
        pass


class Emitter:
    """Appends emitted tokens one at a time, as AR would: streamer, scores and stopping criteria per token."""

    def __init__(self, input_ids, stopping_criteria, streamer, keep_scores: bool, keep_logits: bool):
        self.input_ids = input_ids
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.scores = [] if keep_scores else None
        self.logits = [] if keep_logits else None
        self.finished = False

    def emit(self, token: torch.Tensor, scores: torch.Tensor, raw_logits: torch.Tensor) -> None:
        """token: [B]; scores, raw_logits: [B, V] fp32 (processed and raw logits that produced it)."""
        self.input_ids = torch.cat([self.input_ids, token[:, None]], dim=-1)
        if self.scores is not None:
            self.scores.append(scores)
        if self.logits is not None:
            self.logits.append(raw_logits)
        if self.streamer is not None:
            self.streamer.put(token.cpu())
        self.finished = bool(self.stopping_criteria(self.input_ids, scores).all())


def hybridspec_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    hybridspec_drafter=None,
    hybridspec_streamer=None,
    hybridspec_strategy: str = "hybridspec",
    hybridspec_settings: HybridSpecConfig | None = None,
    **model_kwargs,
):
    """Exact speculative decoding of a hybrid GDN target with a DFlash drafter (batch size 1, greedy)."""
    from hybridspec_hf.generation.integration import check_generation_config, finish_output

    drafter, settings = hybridspec_drafter, hybridspec_settings or HybridSpecConfig()
    streamer = hybridspec_streamer if hybridspec_streamer is not None else streamer
    check_generation_config(generation_config, input_ids, model_kwargs)
    cache_key = "cache" if model_kwargs.get("cache") is not None else "past_key_values"
    cache = model_kwargs.pop(cache_key)
    model_kwargs.pop("cache", None), model_kwargs.pop("past_key_values", None)
    check_supported_cache(cache)
    position_ids = model_kwargs.pop("position_ids")
    attention_mask = model_kwargs.pop("attention_mask", None)
    for key in ("use_cache", "logits_to_keep"):
        model_kwargs.pop(key, None)

    block_size = drafter.config.block_size
    rule = LengthRule(hybridspec_strategy, settings, block_size)
    telemetry = GenerationTelemetry(strategy=hybridspec_strategy, block_size=block_size, prompt_tokens=input_ids.shape[1])
    model.hybridspec_telemetry = telemetry
    max_length = generation_config.max_length
    emitter = Emitter(
        input_ids,
        stopping_criteria,
        streamer,
        generation_config.return_dict_in_generate and generation_config.output_scores,
        generation_config.return_dict_in_generate and generation_config.output_logits,
    )
    if streamer is not None and hybridspec_streamer is not None:
        streamer.put(input_ids.cpu())  # generate() streams the prompt only for its own `streamer` argument

    start = time.perf_counter()
    runner = TargetRunner(model, cache, cache_key, drafter.config.target_layer_ids, settings.kernel_backend)
    with runner.session():
        # Prefill: exactly AR's first forward; its features become the drafter's first context.
        logits, context = runner.prefill(input_ids, position_ids, attention_mask, **model_kwargs)
        raw = logits.float()
        scores = logits_processor(emitter.input_ids, raw)
        emitter.emit(scores.argmax(dim=-1), scores, raw)
        telemetry.prefill_s = time.perf_counter() - start
        draft_cache = drafter.new_context_cache()

        while not emitter.finished:
            round_start = time.perf_counter()
            room = max_length - emitter.input_ids.shape[1]  # tokens that may still be emitted
            anchor = emitter.input_ids[:, -1:]

            # 1. Draft (skipped when the rule already knows that only the anchor is verified).
            planned = rule.planned()
            drafted = planned is None or min(planned, room) > 1
            if drafted:
                draft_logits = drafter.draft(anchor, context, draft_cache)  # [B, block-1, V]
                context = context[:, :0]
                drafts = draft_logits.argmax(dim=-1).to(anchor.device)
            else:
                draft_logits, drafts = None, anchor[:, :0]

            # 2. Choose w (anchor + drafts verified).
            w = min(rule.choose(draft_logits, emitter.input_ids.shape[1]), room) if drafted else 1

            # 3. Verify w tokens from the committed state.
            tokens = torch.cat([anchor, drafts[:, : w - 1]], dim=1)  # [B, w]
            logits, features, session = runner.verify(tokens)
            raw = logits.float()  # [B, w, V], AR compares fp32 logits

            # 4. Accept: position i is scored with the prefix AR would have seen before it.
            scores = torch.empty_like(raw)
            prefix = emitter.input_ids
            for i in range(w):
                scores[:, i] = logits_processor(torch.cat([prefix, tokens[:, 1 : i + 1]], dim=1), raw[:, i])
            target_tokens = scores.argmax(dim=-1)  # [B, w]
            accepted = int(greedy_accept(tokens[:, 1:], target_tokens)[0])

            # 5. Emit token by token until a stopping criterion fires; m = tokens emitted this round.
            committed = 0
            for i in range(accepted + 1):
                emitter.emit(target_tokens[:, i], scores[:, i], raw[:, i])
                committed += 1
                if emitter.finished:
                    break

            # 6. Commit m tokens: GDN states S_m, conv windows, attention KV; their features feed the drafter.
            runner.commit(session, w, committed)
            context = torch.cat([context, features[:, :committed]], dim=1)
            record = RoundRecord(w, accepted, committed, committed, time.perf_counter() - round_start, drafted)
            telemetry.rounds.append(record)
            rule.observe(record)

    telemetry.total_s = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    return finish_output(generation_config, emitter, cache, cache_key)
