"""Greedy HybridSpec ("dflash", "static") output is token-identical to target.generate(do_sample=False)."""
import copy

import pytest
import torch
from _tiny import TARGETS, VOCAB, cache_tensors, make_drafter, make_target, output_cache
from conftest import NEAR_TIES
from transformers import StaticCache

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig

NEAR_TIE_GAP = 1e-6


def reference(target, prompt, max_new_tokens, **kwargs):
    return target.generate(
        prompt, do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True, output_logits=True, **kwargs
    )


def assert_same_as_ar(ours: torch.Tensor, ar) -> None:
    """Equal token for token; a divergence is tolerated only where AR's top-2 logit gap is < 1e-6 (counted)."""
    ref = ar.sequences
    if ours.shape == ref.shape and torch.equal(ours, ref):
        return
    length = min(ours.shape[1], ref.shape[1])
    first = int((ours[0, :length] != ref[0, :length]).nonzero()[0]) if not torch.equal(ours[0, :length], ref[0, :length]) else length
    step = first - (ref.shape[1] - len(ar.logits))
    top2 = ar.logits[step][0].topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE_GAP, f"diverged from AR at token {first} where AR's top-2 gap is {gap:.3g} (not a near-tie)"
    NEAR_TIES.append({"position": first, "gap": gap})


def run(target, prompt, drafter, strategy, max_new_tokens, **kwargs):
    return target.generate(
        prompt, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter,
        generation_strategy=strategy, **kwargs,
    )


def resident_and_ar(target, seed: int, prompt_len: int, max_new_tokens: int):
    """(a resident greedy DFlash call's tokens, AR's) for a random prompt, an oracle drafter of block 4 in fp32."""
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ar = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
    drafter = make_drafter(target, 4, ar, error_rate=0.3).to(torch.float32)
    settings = hybridspec_hf.HybridSpecConfig(cuda_graphs="on")
    return run(target, prompt, drafter, "dflash", max_new_tokens, hybridspec_config=settings), ar


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_dflash_matches_ar_over_prompts(name, block_size, fp64_gdn):
    target = make_target(name)
    generator = torch.Generator().manual_seed(block_size)
    for prompt_len in (1, 2, 5, 17, 64):
        prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=generator)
        max_new = int(torch.randint(1, 3 * block_size, (1,), generator=generator))
        ar = reference(target, prompt, max_new)
        drafter = make_drafter(target, block_size, ar.sequences, error_rate=0.2, seed=prompt_len)
        assert_same_as_ar(run(target, prompt, drafter, "dflash", max_new), ar)
    accepted = [r.accepted for r in hybridspec_hf.get_telemetry(target).rounds]
    assert max(accepted) > 0, "the oracle drafter should get drafts accepted"


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_max_new_tokens_at_every_offset_within_a_block(name, fp64_gdn):
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 6))
    block_size = 8
    full = reference(target, prompt, 3 * block_size)
    for max_new in range(1, 2 * block_size + 2):
        ar = reference(target, prompt, max_new)
        drafter = make_drafter(target, block_size, full.sequences, error_rate=0.1, seed=max_new)
        out = run(target, prompt, drafter, "dflash", max_new)
        assert_same_as_ar(out, ar)
        assert out.shape[1] == prompt.shape[1] + max_new


@pytest.mark.parametrize("name", ["qwen3_5_moe_odd", "qwen3_5_dense"])
def test_static_lengths_1_to_16(name, fp64_gdn):
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 9))
    ar = reference(target, prompt, 40)
    for length in range(1, 17):
        drafter = make_drafter(target, 16, ar.sequences, error_rate=0.15, seed=length)
        out = run(target, prompt, drafter, "static", 40, hybridspec_config=HybridSpecConfig(static_length=length))
        assert_same_as_ar(out, ar)
        rounds = hybridspec_hf.get_telemetry(target).rounds
        assert max(r.w for r in rounds) == length


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_5_moe_vlm", "qwen3_next"])
def test_eos_inside_an_accepted_block_stops_where_ar_stops(name, fp64_gdn):
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 8))
    free = reference(target, prompt, 30).sequences[0, 8:]
    for index in (3, 6, 11):  # EOS = a token that appears mid-continuation
        eos = int(free[index])
        ar = reference(target, prompt, 30, eos_token_id=[VOCAB - 1, eos], pad_token_id=0)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.0, seed=index)
        out = run(target, prompt, drafter, "dflash", 30, eos_token_id=[VOCAB - 1, eos], pad_token_id=0)
        assert_same_as_ar(out, ar)
        assert int(out[0, -1]) in (VOCAB - 1, eos) and out.shape[1] < 8 + 30


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "qwen3_5_dense"])
def test_returned_cache_equals_ar_cache_and_generation_continues(name, cache_implementation, fp64_gdn):
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 11))

    def kwargs():  # a static cache with room for the continuation too
        if cache_implementation is None:
            return {}
        return dict(past_key_values=StaticCache(config=target.config, max_cache_len=64))

    ar = reference(target, prompt, 13, **kwargs())
    drafter = make_drafter(target, 8, reference(target, prompt, 40).sequences, error_rate=0.2)
    ours = run(target, prompt, drafter, "dflash", 13, return_dict_in_generate=True, **kwargs())
    assert torch.equal(ours.sequences, ar.sequences)
    for mine, theirs in zip(cache_tensors(output_cache(ours)), cache_tensors(output_cache(ar)), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    # the cache says how many tokens it holds, as AR's does (transformers >= 5.25 asks a GDN layer's own count)
    assert int(output_cache(ours).get_seq_length()) == int(output_cache(ar).get_seq_length()) == 11 + 13 - 1
    # continue from the returned caches: HybridSpec on ours, AR on AR's, and stock AR on a copy of ours
    stock_on_ours = target.generate(ours.sequences, past_key_values=copy.deepcopy(output_cache(ours)),
                                    do_sample=False, max_new_tokens=9)
    ar2 = target.generate(ar.sequences, past_key_values=output_cache(ar), do_sample=False, max_new_tokens=9)
    ours2 = run(target, ours.sequences, drafter, "dflash", 9, past_key_values=output_cache(ours))
    assert torch.equal(ours2, ar2)
    assert torch.equal(stock_on_ours, ar2)


def test_ar_oracle_without_float64_swap_diverges_only_at_near_ties():
    """transformers computes GDN in fp32 inside a float64 model: compare without the swap, count near-ties."""
    target = make_target("qwen3_5_moe", seed=3)
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(seed))
        ar = reference(target, prompt, 24)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.2, seed=seed)
        assert_same_as_ar(run(target, prompt, drafter, "dflash", 24), ar)


@pytest.mark.parametrize("verify_shape", ["max", "exact"])
@pytest.mark.parametrize("strategy", ["hybridspec", "nominal", "ratio", "confidence"])
@pytest.mark.parametrize("name", ["qwen3_5_moe_odd", "qwen3_5_moe_vlm", "qwen3_next", "qwen3_5_dense"])
def test_device_side_strategies_match_ar(name, strategy, verify_shape, fp64_gdn):
    """Max-shape verification with a device-side valid length (and the routing correction) stays exact."""
    target = make_target(name)
    generator = torch.Generator().manual_seed(len(name))
    for prompt_len in (1, 9, 40):
        prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=generator)
        max_new = int(torch.randint(5, 40, (1,), generator=generator))
        ar = reference(target, prompt, max_new)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3, seed=prompt_len)
        settings = HybridSpecConfig(verify_shape=verify_shape)
        assert_same_as_ar(run(target, prompt, drafter, strategy, max_new, hybridspec_config=settings), ar)
    rounds = hybridspec_hf.get_telemetry(target).rounds
    assert all(1 <= r.w <= 8 and r.w0 is not None for r in rounds if r.drafted)
