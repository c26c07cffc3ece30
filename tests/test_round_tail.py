"""A round's bookkeeping after the forward, committed on the device (generation/round_tail.py; compiled with
resident.FUSED_ROUND_TAIL): against a row-by-row reading of the rules, and whole resident calls (one row and a batch,
EOS and max_new_tokens cutting rounds, greedy and sampling) that decide round for round compiled as eagerly."""
import shutil

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_batched import PAD, assert_rows_equal_own, left_pad, own_generate, random_prompts
from test_properties import latency_model
from test_exactness import assert_same_as_ar, reference, run

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident, round_tail


def rows_by_hand(target_tokens, block, valid, replayed, eos, length, limit, live):
    """(a, m, new length, last token, live after) per row, read off the rules one row at a time."""
    out = []
    for b in range(block.shape[0]):
        drafts, said = block[b, 1:].tolist(), target_tokens[b].tolist()
        a = 0
        while a < int(valid[b]) - 1 and drafts[a] == said[a]:
            a += 1
        if replayed is not None:
            a = min(int(replayed[b]), int(valid[b]) - 1)
        emitted = said[: a + 1]
        cut = next((i + 1 for i, token in enumerate(emitted) if token in eos), a + 1)
        m = min(cut, max(int(limit[b]) - int(length[b]) - 1, 0)) * int(live[b])
        new_length = int(length[b]) + m
        ends = any(token in eos for token in said[:m]) or new_length + 1 >= int(limit[b])
        out.append((a, m, new_length, said[m - 1] if m else None, int(live[b]) * (not ends)))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("replay", [False, True])
def test_round_accept_and_advance_follow_the_rules_row_by_row(seed, replay):
    """Rows with drafts matching for a while, valid lengths 1..T, EOS among the emitted tokens (or past them),
    rows at or near their limit and rows not live; `replayed` (timing mode) overriding the accepted count."""
    g = torch.Generator().manual_seed(seed)
    rows, t, vocab = 5, 6, 4  # a small vocabulary: matches and EOS hits are common
    block = torch.randint(0, vocab, (rows, t), generator=g)
    target_tokens = torch.where(torch.rand(rows, t, generator=g) < 0.7, torch.cat([block[:, 1:], block[:, :1]], 1),
                                torch.randint(0, vocab, (rows, t), generator=g))
    valid = torch.randint(1, t + 1, (rows,), generator=g)
    replayed = torch.randint(0, t, (rows,), generator=g) if replay else None
    eos_ids = torch.tensor([3, -1, -1, -1])
    length = torch.randint(0, 9, (rows,), generator=g)
    limit = length + torch.randint(0, t + 3, (rows,), generator=g)
    live = torch.tensor([1, 1, 0, 1, 1])
    expected = rows_by_hand(target_tokens, block, valid, replayed, {3}, length, limit, live)

    count = torch.full((rows,), -7)
    accepted, count32 = round_tail.round_accept(target_tokens, block, valid, replayed, eos_ids, length, limit, live,
                                                count)
    assert accepted.tolist() == [e[0] for e in expected]
    assert count.tolist() == [e[1] for e in expected] and count32.dtype == torch.int32
    assert count32.tolist() == count.tolist()

    next_position = length.view(1, -1, 1).repeat(3, 1, 1) + 2
    last_token = torch.full((rows, 1), -5)
    live_after, handoff = live.clone(), torch.zeros(rows * (t + 3) + 4, dtype=torch.long)
    new_length = length.clone()
    round_tail.round_advance(target_tokens, accepted, count, new_length, next_position, None, last_token, live_after,
                             eos_ids, limit, torch.tensor([4]), torch.tensor([True]), torch.tensor([2]),
                             torch.tensor([1]), handoff)
    assert new_length.tolist() == [e[2] for e in expected]
    assert torch.equal(next_position, new_length.view(1, -1, 1).expand(3, -1, -1) + 2)
    assert last_token.view(-1).tolist() == [-5 if e[3] is None else e[3] for e in expected]
    assert live_after.tolist() == [e[4] for e in expected]
    assert handoff.tolist() == (target_tokens.reshape(-1).tolist() + accepted.tolist() + count.tolist()
                                + live_after.tolist() + [4, 1, 2, 1])


@pytest.mark.parametrize("rows", [1, 4])
def test_round_head_builds_the_block_room_and_lengths(rows):
    """The block [anchor, the first t-1 drafts], each row's room, w_max (the roomiest live row's, in [1, t]) and the
    selector's context length (the row's; a batch: the longest live row's), against a reading of the rules."""
    g = torch.Generator().manual_seed(rows)
    t, drafted = 5, 7
    last_token = torch.randint(0, 50, (rows, 1), generator=g)
    drafts = torch.randint(0, 50, (rows, drafted), generator=g)
    length = torch.tensor([9, 30, 4, 12][:rows])
    limit = length + torch.tensor([3, 40, 1, 2][:rows])  # room 2, 39, 0, 1
    live = torch.tensor([1, 0, 1, 1][:rows])
    block, room, w_max, context_len = round_tail.round_head(last_token, drafts, length, limit, live, t)
    assert torch.equal(block, torch.cat([last_token, drafts[:, :4]], 1))
    assert room.tolist() == [2, 39, 0, 1][:rows]
    assert w_max.tolist() == [2]  # the live rows' largest room (row 1's 39 is not live)
    assert context_len.tolist() == [9 if rows == 1 else 12]
    none_live = round_tail.round_head(last_token, drafts, length, limit, torch.zeros_like(live), t)
    assert none_live[2].tolist() == [1] and none_live[3].tolist() == [9 if rows == 1 else 0]
    huge = round_tail.round_head(last_token, drafts, length, length + 100, live, t)
    assert huge[2].tolist() == [t]  # never past the block


def test_round_advance_keeps_one_rows_attention_lengths():
    """One row: the attention layers' lengths (views of one buffer) follow the new length."""
    attention_lengths = torch.zeros(3, dtype=torch.long)
    length = torch.tensor([10])
    round_tail.round_advance(torch.tensor([[5, 6, 7]]), torch.tensor([2]), torch.tensor([3]), length,
                             torch.zeros(1, 1, 1, dtype=torch.long), attention_lengths, torch.zeros(1, 1,
                                                                                                  dtype=torch.long),
                             torch.ones(1, dtype=torch.long), torch.tensor([-1]), torch.tensor([40]),
                             torch.tensor([3]), torch.tensor([False]), torch.tensor([0]), torch.tensor([1]),
                             torch.zeros(3 + 3 + 4, dtype=torch.long))
    assert length.tolist() == [13] and attention_lengths.tolist() == [13, 13, 13]


def _backends():
    backends = ["aot_eager"]
    if shutil.which("g++") or shutil.which("c++"):  # inductor's CPU code is C++
        backends.append("inductor")
    return backends


@pytest.mark.parametrize("backend", _backends())
def test_single_row_calls_decide_round_for_round_as_the_eager_ops(backend, monkeypatch, fp64_gdn):
    """Whole resident calls (max shape and exact, hybridspec with its routing correction and plain stretches,
    dflash's fixed block, EOS and max_new_tokens cutting rounds, sampling) with the tail compiled and eager: the
    same rounds, the output of generate() (greedy) or the same sample (a seed)."""
    from hybridspec_hf.selector import LatencyModel

    # near break-even (as test_resident's compiled decisions): plain stretches, drafted rounds, extra tokens kept
    # and dropped; fixed, so that no call's choices hang on a timing
    cost = (1.6 + 0.05 * torch.arange(1, 9, dtype=torch.float32)) * 1e-3
    latency = LatencyModel(cost=cost[None], cost_ar=torch.tensor([1e-3]), context_lens=torch.tensor([64]),
                           sunk=torch.full((1, 7), 0.035e-3))
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(3))
    full = reference(target, prompt, 40)
    eos = int(full.sequences[0, 7 + 13])
    cases = [("hybridspec", "max", 40, None, False), ("hybridspec", "exact", 33, None, False),
             ("dflash", "max", 40, eos, False), ("hybridspec", "max", 17, eos, False),
             ("hybridspec", "max", 30, None, True)]
    for strategy, shape, max_new, stop, sample in cases:
        kwargs = {} if stop is None else dict(eos_token_id=[VOCAB - 1, stop], pad_token_id=VOCAB - 1)
        ar = reference(target, prompt, max_new, **kwargs)
        seen = {}
        for fused in (False, True):
            monkeypatch.setattr(resident, "FUSED_ROUND_TAIL", fused)
            drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3, seed=5)
            settings = HybridSpecConfig(cuda_graphs="on", verify_shape=shape, compile_decisions=backend,
                                        latency_model=latency)
            torch.manual_seed(11)
            if sample:
                out = target.generate(prompt, do_sample=True, temperature=0.8, max_new_tokens=max_new,
                                      assistant_model=drafter, generation_strategy=strategy, hybridspec_config=settings)
            else:
                out = run(target, prompt, drafter, strategy, max_new, hybridspec_config=settings, **kwargs)
                assert_same_as_ar(out, ar)
            rounds = target.__dict__["_hybridspec_resident"]
            assert rounds.tail == fused  # compiled only when switched on
            if rounds.tail:
                assert all(fn.fast is not None
                           for fn in (rounds.head_fn, rounds.accept_fn, rounds.count_fn, rounds.advance_fn))
            seen[fused] = ([(r.drafted, r.w, r.accepted, r.extra_kept)
                            for r in hybridspec_hf.get_telemetry(target).rounds], out.tolist())
            hybridspec_hf.release_graphs(target)  # the switch is read when rounds are built
        assert seen[True] == seen[False], (strategy, shape, sample)
        assert sample or any(accepted for _, _, accepted, _ in seen[True][0])


def test_a_batch_with_rows_ending_at_eos_decides_as_the_eager_ops(monkeypatch, fp64_gdn):
    """Five rows in the bucket of 8, rows ending on EOS at different offsets and one at max_new_tokens: the compiled
    tail (aot_eager) gives each row its own generate() and the eager functions' rounds."""
    target = make_target("qwen3_next", seed=1)
    prompts = random_prompts((4, 9, 2, 7, 3), seed=3)
    free = [o.sequences[0, p.numel():] for o, p in zip(own_generate(target, prompts, 24), prompts)]
    eos = sorted({int(free[0][2]), int(free[1][9]), int(free[4][5])} - {PAD})
    own = own_generate(target, prompts, 24, eos_token_id=eos, pad_token_id=PAD)
    ids, mask = left_pad(prompts)
    seen = {}
    for fused in (False, True):
        monkeypatch.setattr(resident, "FUSED_ROUND_TAIL", fused)
        for strategy in ("dflash", "hybridspec"):
            drafter = make_drafter(target, 8, [o.sequences[0] for o in own], error_rate=0.2)  # its errors: seeded
            settings = HybridSpecConfig(latency_model=latency_model(8, 0.2), cuda_graphs="on", verify_shape="max",
                                        compile_decisions="aot_eager")
            out = target.generate(ids, attention_mask=mask, max_new_tokens=24, assistant_model=drafter,
                                  generation_strategy=strategy, hybridspec_config=settings, pad_token_id=PAD,
                                  do_sample=False, eos_token_id=eos)
            assert_rows_equal_own(out, prompts, own)
            assert target.__dict__["_hybridspec_resident"].tail == fused
            seen[fused, strategy] = [(r.w, r.accepted, r.rows) for r in hybridspec_hf.get_telemetry(target).rounds]
            hybridspec_hf.release_graphs(target)
    for strategy in ("dflash", "hybridspec"):
        assert seen[True, strategy] == seen[False, strategy], strategy
