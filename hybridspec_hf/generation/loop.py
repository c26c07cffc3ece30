"""The HybridSpec round loop: draft → choose length → stage 0 → routing correction → stage 1 → accept → commit.

`hybridspec_decode` is a `custom_generate` callable: transformers' generate() has already prepared the generation
config, logits processors, stopping criteria, cache and position ids; this replaces only the decode loop.
Invariant after every round: the target's cache equals what AR decoding would hold after the same tokens.

Host syncs: one per round, the hand-off of the round's tokens to the streamer and stopping criteria (which decide
m). Everything from drafting to the hand-off and from there to the end of the commit stays on the device when the
strategy chooses w on the device (tested with syncs made to raise).
"""
from __future__ import annotations

import contextlib
import time

import torch

from hybridspec_hf import patches
from hybridspec_hf.config import HybridSpecConfig
from hybridspec_hf.drafter.lookup import ContextIndex
from hybridspec_hf.generation.acceptance import greedy_accept, sample_tokens, score_positions, speculative_sample
from hybridspec_hf.generation.batched import batched_decode, check_batched_call
from hybridspec_hf.generation.calibration import retire_if_busy
from hybridspec_hf.generation.checks import check_generation_config, check_logits_processors, finish_output
from hybridspec_hf.generation.router_hooks import VerifyWindow
from hybridspec_hf.generation.strategy import RoundStrategy
from hybridspec_hf.generation.target import TargetRunner
from hybridspec_hf.generation.telemetry import GenerationTelemetry, RoundRecord
from hybridspec_hf.graphs.capture import collective_capture_failure, distributed, host_syncs
from hybridspec_hf.patches._cache import check_supported_cache

_sync_allowed = True


def host_syncs_allowed() -> bool:
    """False inside a round except during its hand-off (tests make device→host syncs raise there)."""
    return _sync_allowed


@contextlib.contextmanager
def _sync_free(free: bool):
    global _sync_allowed
    previous, _sync_allowed = _sync_allowed, not free
    try:
        yield
    finally:
        _sync_allowed = previous


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
        """token: [B]; scores, raw_logits: [B, V] fp32 (processed and raw logits that produced it). Kept as copies:
        a view would keep the round's whole [B, T, V] tensor alive."""
        self.input_ids = torch.cat([self.input_ids, token[:, None]], dim=-1)
        if self.scores is not None:
            self.scores.append(scores.clone())
        if self.logits is not None:
            self.logits.append(raw_logits.clone())
        if self.streamer is not None:
            self.streamer.put(token.cpu())
        self.finished = bool(self.stopping_criteria(self.input_ids, scores).all())


def _use_resident_rounds(settings, model, drafter, strategy, generation_config, logits_processor, cache,
                         telemetry, batch_reason: str | None = None) -> bool:
    """GPU-resident rounds for this call? ("auto": on CUDA when possible; "on": required; "off": never;
    "uncaptured": required, never captured). Sets telemetry.path, and telemetry.path_reason when "auto" fell back.
    batch_reason: why this batch cannot run them (resident.batch_unsupported_reason), or None."""
    from hybridspec_hf.generation.resident import unsupported_reason

    telemetry.path = "eager"
    profile = settings.acceptance_profile is not None
    if settings.cuda_graphs == "off" and profile:
        raise ValueError("acceptance_profile= (timing mode) runs on GPU-resident rounds only; use cuda_graphs='auto'.")
    if settings.cuda_graphs == "off":
        return False
    reason = unsupported_reason(model, drafter, strategy, generation_config, logits_processor, cache) or batch_reason
    if reason is not None:
        if settings.cuda_graphs in ("on", "uncaptured") or profile:
            asked = ("acceptance_profile= (timing mode)" if profile
                     else f"HybridSpecConfig(cuda_graphs={settings.cuda_graphs!r})")
            raise ValueError(f"{asked} needs GPU-resident rounds, which this call cannot run: {reason}. "
                             "Change that option, or use cuda_graphs='auto' (falls back to the eager loop).")
        telemetry.path_reason = reason
        return False
    device = next(model.parameters()).device
    if settings.cuda_graphs == "auto" and device.type != "cuda" and not profile:
        return False
    capture = device.type == "cuda" and settings.cuda_graphs != "uncaptured"
    failure = collective_capture_failure(device) if capture and distributed() else None
    if failure is not None:  # tensor parallelism whose collectives do not capture here: the same rounds, uncaptured
        if settings.cuda_graphs == "on":
            raise ValueError(f"HybridSpecConfig(cuda_graphs='on') needs CUDA-graph capture, which fails here: "
                             f"{failure}. Use cuda_graphs='uncaptured' or 'auto'.")
        telemetry.path_reason, capture = f"no CUDA-graph capture: {failure}", False
    telemetry.path = "cuda_graphs" if capture else "static_eager"
    return True


def _context_index(lookup, input_ids: torch.Tensor, block_size: int) -> ContextIndex | None:
    """The n-grams of the call's tokens so far (prompt + first token), for context lookup's proposals; None where
    the call runs without it (`lookup`: the strategy's table, or None)."""
    if lookup is None:
        return None
    return ContextIndex(input_ids[0].tolist(), block_size, lookup.min_ngram, lookup.max_ngram)


def _resident(model, drafter, strategy, logits_processor, generation_config, stopping_criteria, streamer, emitter,
              runner, cache, context, first, telemetry) -> None:
    """The rest of the call on GPU-resident rounds (generation/resident.py); the prefill ran eagerly."""
    from hybridspec_hf.generation.resident import MAX_EOS_IDS, HostEmitter, resident_decode, resident_rounds

    positions = runner.positions  # [1, 1] or [R, 1, 1]: position id of the last cached token
    rows = positions.shape[0] if positions.dim() == 3 else 1
    with host_syncs():  # set-up of the call: capture (first call only), loading the prefilled cache
        host = HostEmitter(emitter.input_ids, generation_config, stopping_criteria, streamer)
        device_commit = not host.criteria and len(host.eos) <= MAX_EOS_IDS  # m known on the device
        rounds = resident_rounds(model, drafter, strategy, logits_processor, generation_config.do_sample,
                                 generation_config.max_length, rows, device_commit,
                                 capture=telemetry.path == "cuda_graphs")
        telemetry.capture_s, rounds.capture_s = rounds.capture_s, 0.0  # reported by the call that captured
        telemetry.resident_memory_bytes = rounds.memory_bytes
        rounds.start(cache, positions, context, first, generation_config.max_length, host.eos,
                     profile_start=getattr(strategy.profile, "start_row", 0), prompt_ids=emitter.input_ids)
    # syncs only at each hand-off
    resident_decode(rounds, host, telemetry, rounds.strategy.predicted_latency)
    with host_syncs():
        rounds.finish(cache, host.length - 1)
        emitter.input_ids = host.sequences()


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
    """Exact speculative decoding of a hybrid GDN target with a DFlash drafter (greedy output equals AR token for
    token, sampling keeps the target distribution). Batch size 1 here; a batch or a left-padded prompt runs the
    batched loop (generation/batched.py)."""
    drafter, settings = hybridspec_drafter, hybridspec_settings or HybridSpecConfig()
    streamer = hybridspec_streamer if hybridspec_streamer is not None else streamer
    padded = check_generation_config(model, generation_config, input_ids, model_kwargs)
    check_logits_processors(logits_processor)
    cache_key = "cache" if model_kwargs.get("cache") is not None else "past_key_values"
    cache = model_kwargs.pop(cache_key)
    for key in ("cache", "past_key_values", "use_cache", "logits_to_keep"):
        model_kwargs.pop(key, None)
    check_supported_cache(cache)
    position_ids = model_kwargs.pop("position_ids")
    attention_mask = model_kwargs.pop("attention_mask", None)

    block_size = drafter.config.block_size if drafter is not None else 1
    moe_blocks = patches.moe_blocks(model)
    strategy = RoundStrategy.build(hybridspec_strategy, settings, model, drafter, has_router=bool(moe_blocks),
                                   batch=input_ids.shape[0])
    telemetry = GenerationTelemetry(strategy=hybridspec_strategy, block_size=block_size, prompt_tokens=input_ids.shape[1])
    model.hybridspec_telemetry = telemetry
    batched = input_ids.shape[0] > 1 or padded
    telemetry.routing_correction, telemetry.routing_correction_off = strategy.correction_state(batched)
    if batched:
        strategy.switch_lookup_off("a batched call (batch > 1 or a left-padded prompt): context lookup runs one "
                                   "row at a time")
        telemetry.context_lookup_off = strategy.lookup_off
        from hybridspec_hf.generation.resident import batch_unsupported_reason

        check_batched_call(streamer, cache, input_ids.shape[0])
        reason = batch_unsupported_reason(input_ids.shape[0], generation_config, stopping_criteria, streamer)
        resident = _use_resident_rounds(settings, model, drafter, strategy, generation_config, logits_processor,
                                        cache, telemetry, reason)
        return batched_decode(model, input_ids, position_ids, attention_mask, cache, cache_key, drafter, strategy,
                              settings, logits_processor, stopping_criteria, generation_config, streamer, telemetry,
                              input_ids.device, model_kwargs, resident)
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
    feature_ids = drafter.config.target_layer_ids if drafter is not None else []
    runner = TargetRunner(model, cache, cache_key, feature_ids, settings.kernel_backend, settings.gdn_verifier,
                          max_tokens=block_size)
    window = VerifyWindow(moe_blocks)
    resident = _use_resident_rounds(settings, model, drafter, strategy, generation_config, logits_processor, cache,
                                    telemetry)
    telemetry.context_lookup, telemetry.context_lookup_off = strategy.lookup is not None, strategy.lookup_off
    try:
        # Prefill: exactly AR's first forward; its features become the drafter's first context.
        with host_syncs() if resident else contextlib.nullcontext():
            logits, context = runner.prefill(input_ids, position_ids, attention_mask, **model_kwargs)
            raw = logits.float()
            scores = logits_processor(emitter.input_ids, raw)
            first = sample_tokens(scores.softmax(-1)) if generation_config.do_sample else scores.argmax(-1)
            emitter.emit(first, scores, raw)
        telemetry.prefill_tokens = 1
        telemetry.prefill_s = time.perf_counter() - start
        if resident:
            if not emitter.finished:
                _resident(model, drafter, strategy, logits_processor, generation_config, stopping_criteria, streamer,
                          emitter, runner, cache, context, first, telemetry)
            telemetry.total_s = time.perf_counter() - start
            if streamer is not None:
                streamer.end()
            return finish_output(generation_config, emitter, cache, cache_key)
        draft_cache = drafter.new_context_cache() if drafter is not None else None
        draft_next = drafter is not None
        # plain steps: the first after a speculative round decides how many follow before the next draft
        # (Strategy.plain_run); those run no selector work
        decides = drafter is not None and strategy.takes_plain_steps()
        plain_left = 0
        index = _context_index(strategy.lookup, emitter.input_ids, block_size)

        while not emitter.finished:
            round_start = time.perf_counter()
            committed_len = emitter.input_ids.shape[1] - 1  # tokens in the target's cache
            w_max = min(block_size, generation_config.max_length - emitter.input_ids.shape[1])  # room left
            anchor = emitter.input_ids[:, -1:]
            max_tokens = strategy.max_tokens(w_max)
            with _sync_free(strategy.mode == "max"):
                # 1. Draft (not when the round is a plain decoding step), and the context-lookup proposal.
                drafted = draft_next and max_tokens > 1
                lookup_ngram = None
                if drafted:
                    # [B, block-1, V], beside the tokens (a no-op unless the drafter or the LM head is elsewhere)
                    draft_logits = drafter.draft(anchor, context, draft_cache).to(anchor.device)
                    context = context[:, :0]
                    drafts = draft_logits.argmax(dim=-1)
                    if index is not None:
                        proposal, ngram = index.propose()
                        staged = torch.tensor([[*proposal, ngram]], device=anchor.device)  # one copy to the device
                        copied, lookup_ngram = staged[:, :-1], staged[0, -1:]  # [1, block-1], [1]

                # 2. Choose w0 on the device (and the proposal: the drafts or the copy, whichever is expected to
                # yield more); stage 0 runs w0 + 1 tokens when the routing correction is on.
                choice = (strategy.choose(draft_logits, committed_len, w_max,
                                          lookup=None if lookup_ngram is None else (copied, lookup_ngram, drafts))
                          if drafted and strategy.mode != "fixed" else None)
                if drafted:
                    if lookup_ngram is not None:
                        drafts = torch.where(choice.lookup[:, None], copied, drafts)
                    tokens = torch.cat([anchor, drafts[:, : max_tokens - 1]], dim=1)  # [B, T]
                else:
                    tokens = anchor
                valid = choice.valid if choice is not None else None  # [B] tokens that count, or all
                masked = valid  # the valid length the verification masks tokens past
                if choice is not None:
                    if strategy.mode == "exact":  # CPU: verify only w0 (+ the extra token); this read is a free sync
                        tokens = tokens[:, : int(choice.valid.max())]
                    # the experts hooks and the GDN layers mask tokens past the valid length: none are when one row
                    # verifies exactly its w0 without a correction (on a CPU ≈ 0.5 ms of host ops a round for the
                    # hooks, 0.3 ms for the GDN masks)
                    if choice.corrects or strategy.mode != "exact" or tokens.shape[0] > 1:
                        window.arm(choice)
                    else:
                        masked = None

                # 3. Verify (stage 0 → routing correction at the first MoE router → stage 1, one forward).
                try:
                    logits, features, session = runner.verify(tokens, masked)
                finally:
                    window.disarm()
                raw = logits.float()  # [B, T, V]: AR compares fp32 logits

                # 4. Accept on the device: greedy, or lossless speculative sampling.
                scores = score_positions(logits_processor, emitter.input_ids, tokens, raw)
                if generation_config.do_sample:
                    accepted, sampled = speculative_sample(tokens[:, 1:], scores.softmax(dim=-1), valid)
                    target_tokens = torch.cat([tokens[:, 1:], sampled[:, None]], dim=1)
                    target_tokens = target_tokens.scatter(1, accepted.view(-1, 1), sampled.view(-1, 1))
                else:
                    target_tokens = scores.argmax(dim=-1)  # [B, T]
                    accepted = greedy_accept(tokens[:, 1:], target_tokens, valid)
                strategy.observe_acceptance(choice, accepted)
                decide = decides and not drafted and plain_left == 0
                if drafted or not decides:
                    next_draft = strategy.should_draft(committed_len)
                elif decide:  # the plain steps to come, the selector advanced past them and this one
                    next_draft = strategy.plain_run(committed_len)
                else:
                    next_draft = plain_left - 1  # the plain steps still to come after this one

            # 5. Hand-off: the round's one device→host transfer; emit token by token until a criterion fires.
            handoff = strategy.handoff(accepted, valid, choice, next_draft, tokens.shape[1]).tolist()
            a, w, kept, n_new, draft_next, copied_used = handoff[:6]
            if decides and not drafted:  # handoff[4] counts the plain steps still to come
                plain_left, draft_next = draft_next, draft_next == 0
            draft_next = bool(draft_next)
            committed = 0
            for i in range(a + 1):
                emitter.emit(target_tokens[:, i], scores[:, i], raw[:, i])
                committed += 1
                if emitter.finished:
                    break
            if index is not None:
                index.extend(target_tokens[0, :committed].tolist())

            # 6. Commit m tokens: GDN states S_m, conv windows, attention KV; their features feed the drafter.
            with _sync_free(strategy.mode == "max"):
                runner.commit(session, tokens.shape[1], committed)
                if context is not None:
                    context = torch.cat([context, features[:, :committed]], dim=1)
                seconds = time.perf_counter() - round_start
                if drafted or not decides:  # plain_run accounted the plain steps
                    strategy.observe(w, committed, seconds, drafted, like=accepted)
            corrected = choice is not None and strategy.corrects
            telemetry.rounds.append(RoundRecord(
                w, a, committed, committed, seconds, drafted,
                w0=w - kept if choice is not None else None,
                extra_kept=bool(kept) if corrected else None,
                n_new=n_new if corrected else None,
                predicted_s=strategy.predicted_latency(w, committed_len, drafted),
                lookup=bool(copied_used) if lookup_ngram is not None else None,
            ))
    finally:
        runner.close()
        window.remove()

    telemetry.total_s = time.perf_counter() - start
    retire_if_busy(strategy.calibration_file, telemetry.rounds)  # rounds timed here, as calibration times them
    if streamer is not None:
        streamer.end()
    return finish_output(generation_config, emitter, cache, cache_key)
