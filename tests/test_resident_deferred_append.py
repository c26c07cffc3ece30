"""Deferred context appends of GPU-resident rounds (generation/resident.py), on the CPU twin: a plain step parks its
features instead of running the drafter, and the next speculative round appends them before it drafts. The drafter
sees the same context at every draft as when each plain step appends at once (float64), the greedy output still
equals generate(), and the plain step runs no drafter code; a plain stretch longer than the buffer goes through the
step-and-append graph, and batch rows that end at different times count only their own steps."""
import functools

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_batched import PAD, assert_rows_equal_own, left_pad, own_generate, random_prompts
from test_exactness import assert_same_as_ar, reference
from test_properties import latency_model

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.drafter import StaticDraftContext
from hybridspec_hf.generation import resident
from hybridspec_hf.selector import StaticLength

BLOCK = 8
# a round drafts where the pattern says 1 (cycled): short and long plain stretches, the longest past 32 columns
PATTERN = [1, 0, 0, 1, 1, 0] + [0] * 40 + [1, 0, 1] + [0] * 5


class Pattern(StaticLength):
    """Drafts by a fixed pattern of rounds, on the device (the rounds' should_draft calls count them), w tokens."""

    name = "pattern"

    def __init__(self, pattern: list[int], w: int):
        super().__init__(w)
        self.pattern = torch.tensor(pattern, dtype=torch.bool)
        self.round = torch.zeros(1, dtype=torch.long)

    def restart(self, context_len) -> None:
        self.round.zero_()

    def should_draft(self, context_len):
        decision = self.pattern[self.round % self.pattern.numel()]
        self.round.add_(1)
        return decision

    def plain_run(self, context_len):
        """The plain steps until the pattern's next 1 (this round's included in the count of rounds passed)."""
        ahead = self.pattern[(self.round + torch.arange(self.pattern.numel())) % self.pattern.numel()]
        k = ahead.long().argmax().view(1)  # the first 1 from this round on
        self.round.add_(k + 1)
        return k


def drafted_contexts(target, drafter, ids, defer: bool, columns: int, verify_shape: str, **kwargs):
    """generate() through resident rounds forced by PATTERN, with a buffer of `columns` plain steps, deferring their
    appends or not: (output, every draft's context: per row its length and K/V [L, H_kv, length, D] of every
    drafter layer, {"step appends": context appends inside plain steps, "step_append": its replays}, telemetry)."""
    resident.release_resident_rounds(target)
    drafter.generator.manual_seed(0)  # the steered drafter's errors: the same draws in both runs
    seen, in_step, counts = [], [0], {"step appends": 0, "step_append": 0}

    def draft_static(anchor_ids, ctx, _original=drafter.draft_static):
        seen.append([(int(ctx.length[b]), ctx.key_buffer[:, b, :, : int(ctx.length[b])].clone(),
                      ctx.value_buffer[:, b, :, : int(ctx.length[b])].clone()) for b in range(ctx.batch_size)])
        return _original(anchor_ids, ctx)

    def append(self, features, count, _original=StaticDraftContext.append):
        counts["step appends"] += in_step[0]
        return _original(self, features, count)

    def step(self, decide=False, _original=resident.ResidentRounds._step):
        in_step[0] += 1
        try:
            return _original(self, decide)
        finally:
            in_step[0] -= 1

    def step_append(self, decide=False, _original=resident.ResidentRounds._step_append):
        counts["step_append"] += 1
        return _original(self, decide)

    settings = HybridSpecConfig(selector=Pattern(PATTERN, 6), cuda_graphs="on", verify_shape=verify_shape)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resident, "DEFER_CONTEXT_APPENDS", defer)
        patch.setattr(resident.ResidentRounds, "DEFERRED_STEPS", columns)
        patch.setattr(drafter, "draft_static", draft_static)
        patch.setattr(StaticDraftContext, "append", append)
        patch.setattr(resident.ResidentRounds, "_step", step)
        patch.setattr(resident.ResidentRounds, "_step_append", step_append)
        out = target.generate(ids, do_sample=False, assistant_model=drafter, generation_strategy="hybridspec",
                              hybridspec_config=settings, **kwargs)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "static_eager"
    assert target.__dict__["_hybridspec_resident"].defers == defer
    return out, seen, counts, telemetry


def assert_same_contexts(deferred: list, immediate: list) -> None:
    assert len(deferred) == len(immediate) > 3
    for draft, (mine, theirs) in enumerate(zip(deferred, immediate)):
        for row, ((length, keys, values), (their_length, their_keys, their_values)) in enumerate(zip(mine, theirs)):
            assert length == their_length, (draft, row)
            torch.testing.assert_close(keys, their_keys, rtol=0, atol=1e-12)
            torch.testing.assert_close(values, their_values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("verify_shape, columns", [("max", 32), ("exact", 4)])
def test_the_drafter_sees_the_same_context_as_with_immediate_appends(columns, verify_shape, fp64_gdn):
    """Batch 1: the contexts at every draft equal the immediate appends' (to 1e-12 in float64), the output equals
    AR, plain steps append nothing, and a plain stretch past the buffer replays the step-and-append graph."""
    target = make_target("qwen3_5_moe", seed=4)
    prompt = torch.randint(0, VOCAB, (1, 7))
    ar = reference(target, prompt, 90)
    drafter = make_drafter(target, BLOCK, ar.sequences, error_rate=0.3)
    call = functools.partial(drafted_contexts, target, drafter, prompt, columns=columns, verify_shape=verify_shape,
                             max_new_tokens=90)
    out, deferred, counts, _ = call(True)
    again, immediate, immediate_counts, _ = call(False)
    assert_same_as_ar(out, ar)
    assert torch.equal(out, again)
    assert_same_contexts(deferred, immediate)
    assert counts["step appends"] == 0 and immediate_counts["step appends"] > 41
    assert counts["step_append"] >= 41 // columns  # PATTERN's stretch of 41 plain steps


def test_batch_rows_that_end_at_different_times_keep_their_own_context(fp64_gdn):
    """A batch of 3 in the bucket of 4 whose rows reach EOS at different rounds (one never), some inside a plain
    stretch: each row's context at every draft equals the immediate appends', each row's output its own
    generate()."""
    target = make_target("qwen3_next", seed=2)
    prompts = random_prompts((4, 9, 6), seed=6)
    free = [o.sequences[0, p.numel():] for o, p in zip(own_generate(target, prompts, 70), prompts)]
    eos = [int(free[0][26])]  # its first in row 1 is token 42 (inside PATTERN's long plain stretch), none in row 2
    own = own_generate(target, prompts, 70, eos_token_id=eos, pad_token_id=PAD)
    assert [o.sequences.shape[1] - p.numel() for o, p in zip(own, prompts)] == [27, 43, 70]
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in own], error_rate=0.2)
    ids, mask = left_pad(prompts)
    call = functools.partial(drafted_contexts, target, drafter, ids, columns=8, verify_shape="max",
                             attention_mask=mask, max_new_tokens=70, eos_token_id=eos, pad_token_id=PAD)
    out, deferred, counts, telemetry = call(True)
    again, immediate, _, _ = call(False)
    assert_rows_equal_own(out, prompts, own)
    assert torch.equal(out, again)
    assert_same_contexts(deferred, immediate)
    assert counts["step appends"] == 0 and counts["step_append"] > 0
    rounds = [(r.drafted, r.rows) for r in telemetry.rounds]  # rows ended inside the plain stretch, drafted after
    assert (False, 2) in rounds and (False, 1) in rounds and (True, 1) in rounds


@pytest.mark.parametrize("strategy, defers", [("dflash", False), ("static", False), ("hybridspec", True)])
def test_only_strategies_that_take_plain_steps_defer(strategy, defers, fp64_gdn, monkeypatch):
    """Strategies that draft every round append nothing parked (deferring would only add an empty append to each
    of their rounds); HybridSpec's latency-aware selector may skip drafting, so it defers."""
    monkeypatch.setattr(resident, "DEFER_CONTEXT_APPENDS", True)
    target = make_target("qwen3_5_moe", seed=1)
    prompt = torch.randint(0, VOCAB, (1, 5))
    drafter = make_drafter(target, BLOCK)
    settings = HybridSpecConfig(latency_model=latency_model(BLOCK, 0.2), cuda_graphs="on")
    target.generate(prompt, do_sample=False, max_new_tokens=4, assistant_model=drafter, generation_strategy=strategy,
                    hybridspec_config=settings)
    assert target.__dict__["_hybridspec_resident"].defers == defers
