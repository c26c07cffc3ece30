"""Batched GPU-resident rounds (generation/resident.py with N rows) on the CPU twin: the static-buffer code CUDA
graphs replay, run eagerly with cuda_graphs="on". A batch runs in the smallest bucket of BATCH_BUCKETS that holds it
(the rest inert rows), each row's prompt without its left padding, one shared w per round, per-row m and EOS/length
decided on the device. Each row's greedy output equals its own generate() in float64 (every strategy and family:
tests/test_batched.py, test_every_strategy_gives_each_row_its_own_generate with cuda_graphs="on")."""
import pytest
import torch
from _tiny import VOCAB, cache_tensors, make_drafter, make_target, output_cache
from test_batched import (PAD, assert_rows_equal_own, left_pad, nominal_strategy, own_generate, random_prompts,
                          spec_batch)
from test_properties import latency_model

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident

BLOCK = 8


@pytest.mark.parametrize("verify_shape", ["exact", "max"])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_eos_at_different_positions_like_batched_generate(name, verify_shape, fp64_gdn):
    """Rows stop at EOS tokens at different offsets (one never), decided on the device: the output equals each
    row's own generate() and transformers' batched generate(); finished rows stop being emitted (counted rows
    fall) while they stay in the bucket's replay; the returned cache equals the eager batched loop's."""
    target = make_target(name, seed=1)
    prompts = random_prompts((4, 9, 2, 7, 3), seed=3)  # 5 prompts: the bucket of 8
    free = [o.sequences[0, p.numel():] for o, p in zip(own_generate(target, prompts, 30), prompts)]
    eos = sorted({int(free[0][2]), int(free[1][9]), int(free[4][5])} - {PAD})
    own = own_generate(target, prompts, 30, eos_token_id=eos, pad_token_id=PAD)
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in own], error_rate=0.2)
    ids, mask = left_pad(prompts)
    stock = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=eos,
                            pad_token_id=PAD)
    for strategy in ("dflash", "hybridspec", "ar"):
        out = spec_batch(target, prompts, drafter if strategy != "ar" else None, strategy, 30, "on", verify_shape,
                         eos_token_id=eos, return_dict_in_generate=True)
        assert_rows_equal_own(out.sequences, prompts, own)
        assert torch.equal(out.sequences, stock)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.path == "static_eager" and target.__dict__["_hybridspec_resident"].rows == 8
        rows = [r.rows for r in telemetry.rounds]
        assert rows == sorted(rows, reverse=True) and rows[-1] < len(prompts)
        eager = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                                pad_token_id=PAD, assistant_model=drafter if strategy != "ar" else None,
                                generation_strategy=strategy, return_dict_in_generate=True,
                                hybridspec_config=HybridSpecConfig(latency_model=latency_model(BLOCK, 0.2)))
        assert hybridspec_hf.get_telemetry(target).path == "eager"
        assert torch.equal(eager.sequences, out.sequences)
        for mine, theirs in zip(cache_tensors(output_cache(out)), cache_tensors(output_cache(eager)), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)


def test_max_new_tokens_across_calls_reuse_the_bucket(fp64_gdn):
    """Calls with different max_new_tokens (each row's room decided on the device) and batch sizes 3 and 4 share
    the bucket of 4: one set of rounds, every output equal to each row's own generate()."""
    target = make_target("qwen3_5_moe_odd", seed=2)
    prompts = random_prompts((3, 8, 5, 1), seed=4)
    full = own_generate(target, prompts, 24)
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in full], error_rate=0.1)
    for max_new in (1, 2, 7, 9, 17):
        own = own_generate(target, prompts, max_new)
        for strategy, batch in (("static", 4), ("nominal", 3)):
            out = spec_batch(target, prompts[:batch], drafter, strategy, max_new, "on")
            assert out.shape[1] == max(p.numel() for p in prompts[:batch]) + max_new
            assert_rows_equal_own(out, prompts[:batch], own[:batch])
            rounds = target.__dict__["_hybridspec_resident"]
            assert rounds.rows == 4
    assert len(target.__dict__[resident._KEPT]) == 2  # static and nominal: one set each, reused by every call


def test_the_shared_length_is_the_live_rows_pooled_choice(fp64_gdn):
    """choose_rows on the device equals the eager batched loop's choice over the same rows; finished and inert rows
    weigh nothing and verify only their anchor."""
    strategy = nominal_strategy()
    generator = torch.Generator().manual_seed(0)
    for case in range(10):
        logits = torch.randn(4, BLOCK - 1, VOCAB, generator=generator) * (1 + 4 * torch.rand(4, 1, 1,
                                                                                            generator=generator))
        live = torch.tensor([1, 0, 1, 0])
        choice = strategy.choose_rows(logits, torch.tensor([64]), torch.tensor([BLOCK]), live)
        w, _ = strategy.choose_shared(logits[live.bool()], 64, BLOCK)
        assert int(choice.w0) == w, case
        assert choice.valid.tolist() == [w, 1, w, 1]


def test_timing_mode_replays_each_rows_own_profile_rows():
    """acceptance_profile= at batch > 1: row b replays the profile from its own offset; the accepted counts the
    rounds report are the profile's, cut at the verified length."""
    from hybridspec_hf.selector.profiles import synthetic_profile

    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = make_drafter(target, BLOCK).float()
    profile = synthetic_profile("p", 4.0, block_size=BLOCK, rows=64, seed=3)
    prompts = random_prompts((5, 3), seed=12)
    ids, mask = left_pad(prompts)
    settings = HybridSpecConfig(acceptance_profile=profile, cuda_graphs="on")
    target.generate(ids, attention_mask=mask, max_new_tokens=40, assistant_model=drafter, generation_strategy="dflash",
                    hybridspec_config=settings, pad_token_id=PAD)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "static_eager"
    stride = profile.accepted.shape[0] // 2
    expected = [min(int(profile.accepted[(b * stride) % profile.accepted.shape[0]]), BLOCK - 1) for b in (0, 1)]
    first = telemetry.rounds[0]
    assert first.rows == 2 and first.accepted == sum(expected)


def test_what_resident_batches_cannot_run_is_named(fp64_gdn):
    from transformers import StoppingCriteria, StoppingCriteriaList

    target = make_target("qwen3_5_moe")
    drafter = make_drafter(target, BLOCK)
    prompts = random_prompts([3] * 17, seed=9)
    with pytest.raises(ValueError, match="batch size 17.*up to 16"):
        spec_batch(target, prompts, drafter, "dflash", 4, "on")

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(ValueError, match="Never.*host"):
        spec_batch(target, prompts[:2], drafter, "dflash", 4, "on", stopping_criteria=StoppingCriteriaList([Never()]))
    with pytest.raises(ValueError, match="rows=3"):
        resident.resident_rounds(target, drafter, None, [], False, 16, 1, True, capture=False, rows=3)
    # "auto" falls back to the eager loop (on the CPU it always runs it); the output is the same
    ids, mask = left_pad(prompts)
    own = own_generate(target, prompts[:2], 4)
    out = target.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                          assistant_model=drafter, generation_strategy="dflash",
                          stopping_criteria=StoppingCriteriaList([Never()]))
    assert_rows_equal_own(out, prompts[:2], own, width=ids.shape[1])


@pytest.mark.usefixtures("triton_interpreter")  # module-scoped: keep this test last in the file
def test_the_cuda_kernels_route_takes_each_rows_length(monkeypatch):
    """Every fused route of the resident forwards forced onto CPU tensors (the Triton interpreter): the attention
    prologue writes each row at its own length, the static-cache attention reads each row's live keys, the MoE
    routes are masked per row, the drafter's fused path; float32 greedy output equals each row's own generate()."""
    from hybridspec_hf.drafter import fused
    from hybridspec_hf.kernels import attention_prologue_triton, attention_triton
    from hybridspec_hf.patches import _decoder, _moe

    calls = {"qk_prologue": 0}
    prologue = attention_prologue_triton.qk_prologue

    def counted(*args, **kwargs):
        calls["qk_prologue"] += 1
        return prologue(*args, **kwargs)

    from hybridspec_hf.patches import _attention_layer

    monkeypatch.setattr(_attention_layer, "qk_prologue", counted)
    for module in (attention_triton, fused, _decoder, _moe):
        monkeypatch.setattr(module, "_ON_CPU", True)
    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    prompts = random_prompts((7, 2), seed=9)
    own = own_generate(target, prompts, 9)
    drafter = make_drafter(target, 4, [o.sequences[0] for o in own], error_rate=0.3).float()
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=PAD,
                          assistant_model=drafter, generation_strategy="nominal",
                          hybridspec_config=HybridSpecConfig(cuda_graphs="on", latency_model=latency_model(4, 0.2)))
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert calls["qk_prologue"] > 0
    assert_rows_equal_own(out, prompts, own)
    hybridspec_hf.release_graphs(target)
