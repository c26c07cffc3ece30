"""Batched HybridSpec: batch > 1 (or a left-padded prompt) with per-row drafts, accepted counts and commits.

One round, over the rows still generating:
    draft (each row from its own context) → one shared w (pooled objective) → verify w tokens of every row →
    accept per row (a_b) → emit per row until its stopping criteria fire (m_b) → commit m_b per row → retire the
    rows that finished.

Why each row's tokens are those of its own generate() (greedy):
- Attention: the rows share the cache's slots. A round appends w slots to every row; row b keeps m_b of them and
  the other w - m_b become holes, masked (attention_mask 0) for the rest of the call, so no real token ever attends
  to a rejected one (a masked key gets weight exactly 0). Left padding is masked the same way, as stock generate()
  masks it. Position ids are per row (its count of real tokens), so RoPE gives row b's tokens the positions of its
  own AR decoding; holes between them change no position.
- GDN layers hold no slots: the commit rebuilds each row's state S_{m_b} and rolls its conv window to the inputs
  ending at its token m_b (a per-request m; 0 for a row that emitted nothing), so a rejected token never enters a
  recurrent or conv state. Left pads: stock generate() zeroes their hidden states in GDN layers, which keeps S = 0
  and zero conv inputs, the state of an empty prefix.
- MLPs, MoE blocks and norms work per token.
So every verified token of row b sees exactly row b's real prefix, as in AR, and greedy acceptance emits AR's
tokens. Tested in float64 against each prompt's own generate() (tests/test_batched.py).

Rows leave the batch when they finish (an EOS-type criterion fired, or max_length): their cache rows are copied
out and dropped, so later rounds verify only the rows still running. Stopping criteria and logits processors are
asked per row with the row's own sequence, left padding included: what transformers' batched loop shows them for
that row at that length (a custom processor marked `hybridspec_stateless` must accept one row). As there, a
finished row is filled with pad_token_id when an EOS criterion is present, and otherwise (only custom criteria or
stop strings stopped it) keeps generating until every row has stopped.
The returned cache is rebuilt so that, as after stock generate(), column j of every attention layer holds the
keys of sequences[:, j] (zeros for columns a row never processed: its tokens after it finished; a row that kept
generating past the returned length has its GDN states from further on).
Every round verifies exactly the chosen w tokens (verify_shape is a batch-1 setting).
GPU-resident rounds (cuda_graphs "auto" on CUDA, "on", timing mode) take over after the same prefill when the batch
fits a bucket (up to 16 rows) and EOS and max_length are its only stopping rules (`_resident_rows`,
generation/resident.py); otherwise this eager loop runs, with the reason in telemetry.path_reason.
Not here: the routing correction ("hybridspec" runs as "nominal" at batch > 1, eager or resident), streamers at
batch > 1 (transformers' refuse batches too) and StaticCache.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from hybridspec_hf.drafter.modeling_dflash import StaticDraftContext
from hybridspec_hf.generation.acceptance import greedy_accept, sample_tokens, score_positions, speculative_sample
from hybridspec_hf.generation.checks import finish_output
from hybridspec_hf.generation.telemetry import RoundRecord
from hybridspec_hf.graphs.capture import host_syncs
from hybridspec_hf.generation.target import BatchTargetRunner
from hybridspec_hf.patches._cache import set_rows
from hybridspec_hf.selector.length import batch_row_stats


def check_batched_call(streamer, cache, batch: int) -> None:
    """What a batched call cannot do, as one clear error."""
    problems = []
    if streamer is not None and batch > 1:
        problems.append("a streamer: transformers' streamers take one sequence (TextStreamer raises for batches); "
                        "generate without streamer=, or one prompt per call")
    if any(type(layer).__name__ == "StaticLayer" for layer in cache.layers):
        problems.append("a StaticCache: rejected drafts stay in a batch's cache as masked slots, so it grows past "
                        "max_length; use the default DynamicCache (cache_implementation=None)")
    if problems:
        raise ValueError(f"HybridSpec with batch size {batch} (or a left-padded prompt) does not support "
                         + "; ".join(problems) + ".")


class RowEmitter:
    """Each row's tokens, scores and stopping state, emitted one token at a time as AR would.

    Stopping criteria see the row's own sequence [1, L_b] (left padding included), i.e. what transformers' batched
    loop shows them for that row at that length; `done` is sticky, as there.
    """

    def __init__(self, input_ids, stopping_criteria, generation_config, keep_scores: bool, keep_logits: bool,
                 streamer=None):
        self.sequences = [input_ids[row: row + 1] for row in range(input_ids.shape[0])]
        self.streamer = streamer  # batch size 1 only (a left-padded prompt), as transformers' streamers
        self.prompt_length = input_ids.shape[1]
        self.stopping_criteria = stopping_criteria
        self.max_length = generation_config.max_length
        # transformers pads finished rows only when an EOS criterion is present; otherwise they keep generating
        self.pad_after_stop = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        self.pad_token_id = generation_config.pad_token_id
        if self.pad_after_stop and self.pad_token_id is None:
            raise ValueError("`pad_token_id` must be set for a batch with an EOS token: finished rows are filled with "
                             "it (pass pad_token_id=..., e.g. the EOS id).")
        self.scores = [[] for _ in self.sequences] if keep_scores else None
        self.logits = [[] for _ in self.sequences] if keep_logits else None
        self.done_length: list[int | None] = [None] * len(self.sequences)  # the row's length when it first stopped

    def length(self, row: int) -> int:
        return self.sequences[row].shape[1]

    def emit(self, row: int, token: torch.Tensor, scores: torch.Tensor, raw_logits: torch.Tensor) -> None:
        """token: 0-dim; scores, raw_logits: [V] fp32 (copies are kept, not views of the round's [B, T, V])."""
        sequence = torch.cat([self.sequences[row], token.view(1, 1)], dim=1)
        self.sequences[row] = sequence
        if self.scores is not None:
            self.scores[row].append(scores.clone())
        if self.logits is not None:
            self.logits[row].append(raw_logits.clone())
        if self.streamer is not None:
            self.streamer.put(token.view(1).cpu())
        if self.done_length[row] is None and (sequence.shape[1] >= self.max_length or
                                              bool(self.stopping_criteria(sequence, scores[None]).all())):
            self.done_length[row] = sequence.shape[1]

    def stops(self, row: int) -> bool:
        """The row emits nothing more: it stopped and is padded from here on, or it reached max_length."""
        stopped = self.done_length[row] is not None and self.pad_after_stop
        return stopped or self.length(row) >= self.max_length

    def finished(self, row: int) -> bool:
        """The row can leave the batch: it emits nothing more, or every row has stopped and this one is long enough
        (rows that keep generating after their own stop do so until the last row stops, as in transformers)."""
        if self.stops(row):
            return True
        lengths = self.done_length
        return all(n is not None for n in lengths) and self.length(row) >= max(lengths)

    def output_length(self) -> int:
        return max(n for n in self.done_length)

    def finish(self, device) -> None:
        """`input_ids` [B, N] (rows padded with pad_token_id or cut at N, the length when the last row stopped),
        and `scores`/`logits` as tuples of N - prompt [B, V] (zeros where a row had finished)."""
        length = self.output_length()
        rows = []
        for sequence in self.sequences:
            sequence = sequence[:, :length]
            if sequence.shape[1] < length:
                pad = sequence.new_full((1, length - sequence.shape[1]), self.pad_token_id)
                sequence = torch.cat([sequence, pad], dim=1)
            rows.append(sequence)
        self.input_ids = torch.cat(rows).to(device)
        self.scores = None if self.scores is None else self._steps(self.scores, length)
        self.logits = None if self.logits is None else self._steps(self.logits, length)

    def _steps(self, per_row: list[list[torch.Tensor]], length: int) -> tuple[torch.Tensor, ...]:
        like = next(row[0] for row in per_row if row)
        steps = []
        for i in range(length - self.prompt_length):
            steps.append(torch.stack([row[i] if i < len(row) else torch.zeros_like(like) for row in per_row]))
        return tuple(steps)


def row_processors(logits_processor, row: int, rows: int) -> LogitsProcessorList:
    """The processors as batch row `row` of `rows` sees them when called with that row alone ([1, L] input_ids).

    Processors hold no per-row state except these, which transformers builds for the whole batch: the repetition
    penalty's per-row prompt padding (transformers ≥ 5.2x), the prefix constraint's batch id, and the encoder
    penalties' prompt rows (one per prompt: with num_return_sequences=n, rows are the prompts' expanded n times)."""
    views = LogitsProcessorList()
    for processor in logits_processor:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and \
                isinstance(processor.prompt_ignore_length, torch.Tensor):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row: row + 1]
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            processor = copy.copy(processor)
            allowed = processor._prefix_allowed_tokens_fn
            processor._prefix_allowed_tokens_fn = lambda batch_id, ids, allowed=allowed: allowed(row + batch_id, ids)
        elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
            processor = copy.copy(processor)
            prompt = row // max(1, rows // processor.encoder_input_ids.shape[0])
            processor.encoder_input_ids = processor.encoder_input_ids[prompt: prompt + 1]
        elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
            processor = copy.copy(processor)
            prompt = row // max(1, rows // processor.batch_size)
            processor.generated_ngrams, processor.batch_size = processor.generated_ngrams[prompt: prompt + 1], 1
        views.append(processor)
    return views


def _row_scores(processors: list, emitter: RowEmitter, active: list[int], tokens, raw) -> torch.Tensor:
    """Each row's processors at every verified position, with its own prefix. raw: [n, T, V] -> [n, T, V]."""
    if len(processors[0]) == 0:
        return raw
    return torch.cat([score_positions(processors[row], emitter.sequences[row], tokens[i: i + 1], raw[i: i + 1])
                      for i, row in enumerate(active)])


def _real_first(features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's features [B, P, F] with its real (mask 1) positions moved to the front, and their count [B]."""
    order = torch.sort((mask == 0).long(), dim=1, stable=True).indices  # real columns first, in order
    index = order.to(features.device)[..., None].expand(-1, -1, features.shape[-1])
    return features.gather(1, index), mask.sum(dim=1).to(features.device)


def batched_decode(model, input_ids, position_ids, attention_mask, cache, cache_key, drafter, strategy, settings,
                   logits_processor, stopping_criteria, generation_config, streamer, telemetry, home, model_kwargs,
                   resident: bool = False):
    """The batched round loop (see the module docstring). Returns what generate() returns, on device `home` (the
    model's: generate()'s wrapper moves outputs back to where the prompt was). resident: the rounds after the
    prefill run on GPU-resident rounds of the batch's bucket (`_resident_rows`)."""
    batch = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    do_sample = generation_config.do_sample
    keep = generation_config.return_dict_in_generate
    emitter = RowEmitter(input_ids, stopping_criteria, generation_config, keep and generation_config.output_scores,
                         keep and generation_config.output_logits, streamer)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # generate() streams the prompt only for its own `streamer` argument
    block_size = drafter.config.block_size if drafter is not None else 1
    feature_ids = drafter.config.target_layer_ids if drafter is not None else []
    runner = BatchTargetRunner(model, cache, cache_key, feature_ids, settings.kernel_backend, settings.gdn_verifier,
                               max_tokens=block_size)
    processors = [row_processors(logits_processor, row, batch) for row in range(batch)]
    start = time.perf_counter()
    active = list(range(batch))  # the batch row each row of the running batch started as
    snapshots: list = [None] * batch  # each finished row's cache (BatchTargetRunner.snapshot)
    try:
        # Prefill: exactly stock generate()'s first forward, left padding masked.
        with host_syncs() if resident else contextlib.nullcontext():
            logits, features = runner.prefill(input_ids, position_ids, attention_mask, **model_kwargs)
            raw = logits.float()
            scores = logits_processor(input_ids, raw)
            first = sample_tokens(scores.softmax(-1)) if do_sample else scores.argmax(-1)
            for row in active:
                emitter.emit(row, first[row], scores[row], raw[row])
        telemetry.prefill_tokens = batch
        telemetry.prefill_s = time.perf_counter() - start
        if resident:
            output = _resident_rows(model, drafter, strategy, logits_processor, generation_config, input_ids,
                                    attention_mask, cache, runner, features, first, telemetry)
            telemetry.total_s = time.perf_counter() - start
            return finish_output(generation_config, output, cache, cache_key)
        context = None
        if drafter is not None:  # each row's context holds its real tokens only, at positions 0, 1, ...
            context = StaticDraftContext(drafter, generation_config.max_length, drafter.device, drafter.dtype, batch)
            context.append(*_real_first(features, attention_mask[:, attention_mask.shape[1] - features.shape[1]:]))
        draft_next = drafter is not None
        active = _retire(emitter, runner, context, active, snapshots)

        while active:
            round_start = time.perf_counter()
            context_len = runner.attention_mask.shape[1]  # cache slots: what verification attends over
            w_max = min(block_size, max(emitter.max_length - emitter.length(row) for row in active))
            anchor = torch.cat([emitter.sequences[row][:, -1:] for row in active])  # [n, 1]
            max_tokens = strategy.max_tokens(w_max)

            # 1. Draft, and 2. one w for all rows (the strategy's rule on the rows' mean survival).
            drafted = draft_next and max_tokens > 1
            signals = None
            tokens = anchor
            if drafted:
                draft_logits = drafter.draft_static(anchor, context)  # [n, block-1, V]
                w = max_tokens
                if strategy.mode != "fixed":
                    w, signals = strategy.choose_shared(draft_logits, context_len, max_tokens)
                drafts = draft_logits.argmax(dim=-1).to(anchor.device)
                tokens = torch.cat([anchor, drafts[:, : w - 1]], dim=1)  # [n, w]

            # 3. Verify every row's w tokens from its committed state.
            logits, features, session = runner.verify(tokens)
            raw = logits.float()  # [n, w, V]

            # 4. Accept per row: greedy, or lossless speculative sampling.
            scores = _row_scores(processors, emitter, active, tokens, raw)
            if do_sample:
                accepted, sampled = speculative_sample(tokens[:, 1:], scores.softmax(dim=-1))
                target_tokens = torch.cat([tokens[:, 1:], sampled[:, None]], dim=1)
                target_tokens = target_tokens.scatter(1, accepted.view(-1, 1), sampled.view(-1, 1))
            else:
                target_tokens = scores.argmax(dim=-1)  # [n, w]
                accepted = greedy_accept(tokens[:, 1:], target_tokens)
            if signals is not None:
                strategy.estimator.observe(signals, accepted, tokens.shape[1] - 1)
            # as in loop.py: before this round is observed; for this batch (its rows, the roomiest one's room)
            lengths = [emitter.length(row) for row in active]  # before this round's tokens
            strategy.batch_state(len(active), max(emitter.max_length - length for length in lengths), accepted)
            next_draft = strategy.should_draft(context_len)

            # 5. Emit per row, token by token, until its criteria fire; m_b = tokens it emitted.
            counts = accepted.tolist()
            committed = []
            for i, row in enumerate(active):
                emitted = 0
                for j in range(counts[i] + 1):
                    emitter.emit(row, target_tokens[i, j], scores[i, j], raw[i, j])
                    emitted += 1
                    if emitter.stops(row):
                        break
                committed.append(emitted)

            # 6. Commit m_b per row: GDN states and conv windows, attention holes; their features feed the drafter.
            runner.commit_rows(session, tokens.shape[1], committed)
            if context is not None:
                context.append(features, torch.tensor(committed, device=context.length.device))
            # tokens per row and their spread between rows (selector.batch_row_stats; the resident rounds' rule)
            mean, spread = batch_row_stats(torch.tensor(committed), torch.ones(len(committed)))
            strategy.observe(tokens.shape[1], float(mean), None, drafted, like=accepted, spread=float(spread))
            draft_next = drafter is not None and bool(torch.as_tensor(next_draft).all())
            telemetry.rounds.append(RoundRecord(
                tokens.shape[1], sum(counts), sum(committed), sum(committed), time.perf_counter() - round_start,
                drafted, w0=tokens.shape[1] if signals is not None else None,
                predicted_s=strategy.predicted_latency(tokens.shape[1], context_len, drafted), rows=len(active),
            ))
            active = _retire(emitter, runner, context, active, snapshots)
    finally:
        runner.close()

    telemetry.total_s = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    emitter.finish(home)
    set_rows(cache, snapshots, emitter.input_ids.shape[1] - 1)
    return finish_output(generation_config, emitter, cache, cache_key)


def _retire(emitter: RowEmitter, runner: BatchTargetRunner, context, active: list[int], snapshots: list) -> list[int]:
    """Copy out the cache of every row that finished and drop those rows from the batch; returns the rows left."""
    leaving = [i for i, row in enumerate(active) if emitter.finished(row)]
    if not leaving:
        return active
    for i in leaving:
        snapshots[active[i]] = runner.snapshot(i)
    staying = [i for i in range(len(active)) if i not in leaving]
    if staying:
        runner.keep_rows(staying)
        if context is not None:
            context.keep_rows(torch.tensor(staying, dtype=torch.long))
    return [active[i] for i in staying]


class _Sequences:
    """What `finish_output` reads of a call that ran resident rounds (no scores: those calls keep none)."""

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids, self.scores, self.logits = input_ids, None, None


def _resident_rows(model, drafter, strategy, logits_processor, generation_config, input_ids, attention_mask, cache,
                   runner, features, first, telemetry) -> _Sequences:
    """The rounds after the prefill on GPU-resident rounds of the batch's bucket (generation/resident.py): EOS and
    max_length decided per row on the device, one hand-off per round. The caller's cache is rebuilt as this eager
    loop leaves it."""
    from hybridspec_hf.generation.resident import (RowsHost, batch_bucket, eos_ids, resident_decode_rows,
                                                   resident_rounds)

    positions = runner.positions  # [B, 1] or [R, B, 1]: position id of each row's last cached token
    with host_syncs():  # set-up of the call: capture (first call only), loading the prefilled cache
        eos = eos_ids(generation_config)
        host = RowsHost(input_ids, first.tolist(), generation_config, eos)
        rounds = resident_rounds(model, drafter, strategy, logits_processor, generation_config.do_sample,
                                 generation_config.max_length, positions.shape[0] if positions.dim() == 3 else 1,
                                 True, capture=telemetry.path == "cuda_graphs", rows=batch_bucket(input_ids.shape[0]))
        telemetry.capture_s, rounds.capture_s = rounds.capture_s, 0.0  # reported by the call that captured
        telemetry.resident_memory_bytes = rounds.memory_bytes
        rounds.start(cache, positions, features, first, generation_config.max_length, eos, real=attention_mask,
                     live=host.live, profile_start=getattr(strategy.profile, "start_row", 0))
    resident_decode_rows(rounds, host, telemetry, strategy.predicted_latency)  # syncs only at each hand-off
    with host_syncs():
        sequences = host.sequences()
        pads = (attention_mask == 0).sum(1).tolist()
        lengths = [host.length(row) - 1 - pads[row] for row in range(input_ids.shape[0])]
        rounds.finish_rows(cache, lengths, attention_mask, sequences.shape[1])
    return _Sequences(sequences)
