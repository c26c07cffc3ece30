"""Routing correction stays exact whatever is kept; no hidden host sync inside a round."""
import contextlib
import traceback

import pytest
import torch
from _tiny import VOCAB, cache_tensors, make_drafter, make_target, output_cache
from test_exactness import assert_same_as_ar, reference
from transformers import StaticCache

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import loop
from hybridspec_hf.selector import LengthSelector


class RandomSelector(LengthSelector):
    """Random w0 and random keep decisions (device RNG, no sync): exactness must not depend on them."""

    routing_correction = True

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def choose(self, survival, context_len, w_max=None):
        high = survival.shape[1] + 1 if w_max is None else w_max
        return torch.randint(1, high + 1, survival.shape[:1], generator=self.generator)

    def keep_extra(self, survival, w0, n_new, context_len, w_max=None):
        return torch.rand(w0.shape, generator=self.generator) < 0.5


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "qwen3_5_moe_odd"])
def test_routing_correction_is_exact_whatever_is_kept(name, fp64_gdn):
    target = make_target(name)
    kept = set()
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed))
        ar = reference(target, prompt, 30)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.15, seed=seed)
        out = target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=drafter,
                              generation_strategy="hybridspec",
                              hybridspec_config=HybridSpecConfig(selector=RandomSelector(seed),
                                                                 verify_shape=("max", "exact")[seed % 2]))
        assert_same_as_ar(out, ar)
        rounds = hybridspec_hf.get_telemetry(target).rounds
        kept |= {r.extra_kept for r in rounds if r.w0 is not None and r.w0 < 8}
        assert all(r.w == r.w0 + int(r.extra_kept) for r in rounds if r.extra_kept is not None)
    assert kept == {True, False}


def assert_same_cache(mine, theirs, tolerance: float = 1e-12) -> None:
    for a, b in zip(cache_tensors(mine), cache_tensors(theirs), strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("user_cache", [False, True])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_static_cache_with_max_shape_and_routing_correction(name, user_cache, fp64_gdn):
    """StaticCache + max-shape verification with a device-side valid length + random routing-correction decisions:
    AR's tokens and AR's cache, and generation continues from it."""
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))

    def cache_kwargs():
        if user_cache:
            return dict(past_key_values=StaticCache(config=target.config, max_cache_len=60))
        return dict(cache_implementation="static")

    ar = reference(target, prompt, 25, **cache_kwargs())
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.2, seed=3)
    settings = HybridSpecConfig(selector=RandomSelector(3), verify_shape="max")
    ours = target.generate(prompt, do_sample=False, max_new_tokens=25, assistant_model=drafter,
                           generation_strategy="hybridspec", hybridspec_config=settings, return_dict_in_generate=True,
                           **cache_kwargs())
    assert torch.equal(ours.sequences, ar.sequences)
    assert_same_cache(output_cache(ours), output_cache(ar))
    rounds = hybridspec_hf.get_telemetry(target).rounds
    assert {r.extra_kept for r in rounds if r.w0 is not None and r.w0 < 8} == {True, False}
    if user_cache:  # continue from the returned static caches
        ar2 = target.generate(ar.sequences, past_key_values=output_cache(ar), do_sample=False, max_new_tokens=9)
        ours2 = target.generate(ours.sequences, past_key_values=output_cache(ours), do_sample=False, max_new_tokens=9,
                                assistant_model=drafter, generation_strategy="hybridspec", hybridspec_config=settings)
        assert torch.equal(ours2, ar2)


def test_sampling_on_static_cache_with_max_shape(fp64_gdn):
    """Sampling on a StaticCache draws the same tokens as on a DynamicCache (same seed), and the cache it returns
    equals the one AR builds from the sampled tokens."""
    target = make_target("qwen3_5_moe", seed=4)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=30)
    outs = []
    for cache_implementation in (None, "static"):
        drafter = make_drafter(target, 8, greedy, error_rate=0.3, seed=4)
        torch.manual_seed(7)
        outs.append(target.generate(
            prompt, do_sample=True, temperature=0.005, top_k=3, max_new_tokens=30, assistant_model=drafter,
            generation_strategy="hybridspec", cache_implementation=cache_implementation, return_dict_in_generate=True,
            hybridspec_config=HybridSpecConfig(selector=RandomSelector(4), verify_shape="max"),
        ))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max(r.accepted for r in hybridspec_hf.get_telemetry(target).rounds) > 0
    sampled = outs[1].sequences
    teacher = target.generate(sampled[:, :-1], do_sample=False, max_new_tokens=1, cache_implementation="static",
                              return_dict_in_generate=True)  # AR's prefill of the same tokens
    assert_same_cache(output_cache(outs[1]), output_cache(teacher), tolerance=1e-10)


class ConstantSelector(LengthSelector):
    """A custom selector that returns the same (possibly out-of-range) w0 every round and the same keep decision."""

    def __init__(self, w0: int, routing_correction: bool, keep: bool = True):
        self.w0, self.routing_correction, self.keep = w0, routing_correction, keep

    def choose(self, survival, context_len, w_max=None):
        return torch.full(survival.shape[:1], self.w0, dtype=torch.long)

    def keep_extra(self, survival, w0, n_new, context_len, w_max=None):
        return torch.full_like(w0, self.keep, dtype=torch.bool)


@pytest.mark.parametrize("keep", [False, True])
def test_every_reader_sees_the_corrected_valid_length(keep, monkeypatch, fp64_gdn):
    """The routing-correction contract: the valid length is one device tensor, updated in place at the first MoE
    router. Stage 0 (layer 0's GDN) sees w0 + 1; every later GDN layer, every experts call and the acceptance see
    w0 + keep. A copy anywhere would split stage 0 from stage 1 and accept a draft verified with the wrong length."""
    from hybridspec_hf import patches
    from hybridspec_hf.generation import loop
    from hybridspec_hf.patches import _gdn

    target = make_target("qwen3_5_moe")  # layers: GDN, GDN, GDN, attention; MoE in each
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    ar = reference(target, prompt, 12)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.0)
    seen = {"gdn": [], "experts": [], "accept": []}

    def gdn_verify(*args, valid_len=None, **kwargs):
        seen["gdn"].append(int(valid_len))
        return verify_auto(*args, valid_len=valid_len, **kwargs)

    def accept(drafts, target_tokens, valid=None):
        seen["accept"].append(int(valid))
        return greedy_accept(drafts, target_tokens, valid)

    verify_auto, greedy_accept = _gdn.gdn_verify_auto, loop.greedy_accept
    monkeypatch.setattr(_gdn, "gdn_verify_auto", gdn_verify)
    monkeypatch.setattr(loop, "greedy_accept", accept)
    # forward hooks receive the arguments as the window's pre-hook rewrote them: count tokens with expert weight
    handles = [b.experts.register_forward_hook(lambda m, args, out: seen["experts"].append(int((args[2] != 0).any(-1).sum())))
               for b in patches.moe_blocks(target)]
    try:
        out = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafter,
                              generation_strategy="hybridspec", hybridspec_config=HybridSpecConfig(
                                  selector=ConstantSelector(3, routing_correction=True, keep=keep), verify_shape="max"))
    finally:
        for handle in handles:
            handle.remove()
    assert_same_as_ar(out, ar)
    first_round = slice(0, 3)  # three GDN layers per verification
    valid = 3 + int(keep)
    assert seen["gdn"][first_round] == [4, valid, valid]
    assert seen["experts"][4:8] == [valid] * 4  # [0:4] is the prefill
    assert seen["accept"][0] == valid


@pytest.mark.parametrize("verify_shape", ["max", "exact"])
@pytest.mark.parametrize("routing_correction", [False, True])
@pytest.mark.parametrize("w0", [0, -2, 9, 1000])
def test_out_of_range_w0_from_a_custom_selector_is_clamped(w0, routing_correction, verify_shape, fp64_gdn):
    """w0 is clamped on the device to 1 ≤ w0 ≤ min(B, room): never an empty verification or a read past the block."""
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    ar = reference(target, prompt, 20)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.1)
    selector = ConstantSelector(w0, routing_correction)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                          generation_strategy="hybridspec",
                          hybridspec_config=HybridSpecConfig(selector=selector, verify_shape=verify_shape))
    assert_same_as_ar(out, ar)
    drafted = [r for r in hybridspec_hf.get_telemetry(target).rounds if r.drafted]
    assert all(1 <= r.w0 <= r.w <= 8 for r in drafted)
    assert {r.w0 for r in drafted} == {1} if w0 < 1 else drafted[0].w0 == 8


@pytest.mark.parametrize("routing_correction", [False, True])
@pytest.mark.parametrize("verify_shape", ["max", "exact"])
def test_masks_only_where_a_token_can_be_past_the_valid_length(routing_correction, verify_shape, monkeypatch,
                                                               fp64_gdn):
    """A round masks tokens past its valid length (the experts hooks, the GDN layers' valid_len) only where some can
    be: with the routing correction (its extra token may be dropped) or the max shape (B tokens, w0 of them valid).
    One row verifying exactly its w0 ("exact", no correction: a CPU's HybridSpec) masks nothing, and gives AR's
    output."""
    from hybridspec_hf.generation.target import TargetRunner

    seen = {"valid": [], "armed": 0}
    verify, arm = TargetRunner.verify, loop.VerifyWindow.arm

    def spy_verify(self, tokens, valid=None):
        seen["valid"].append(valid)
        return verify(self, tokens, valid)

    def spy_arm(self, choice):
        seen["armed"] += 1
        return arm(self, choice)

    monkeypatch.setattr(TargetRunner, "verify", spy_verify)
    monkeypatch.setattr(loop.VerifyWindow, "arm", spy_arm)
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    ar = reference(target, prompt, 20)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.2)
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                          generation_strategy="hybridspec",
                          hybridspec_config=HybridSpecConfig(selector=ConstantSelector(3, routing_correction),
                                                             verify_shape=verify_shape))
    assert_same_as_ar(out, ar)
    drafted = sum(r.drafted for r in hybridspec_hf.get_telemetry(target).rounds)
    masks = routing_correction or verify_shape == "max"
    assert drafted > 1 and seen["armed"] == (drafted if masks else 0)
    assert sum(v is not None for v in seen["valid"]) == (drafted if masks else 0)


def test_dropped_extra_token_reads_no_new_experts(fp64_gdn):
    """Tokens beyond the valid length reuse token 0's experts with weight 0 in every MoE layer (stage 1)."""
    from hybridspec_hf import patches
    from hybridspec_hf.generation.router_hooks import VerifyWindow
    from hybridspec_hf.generation.strategy import Choice

    target = make_target("qwen3_5_moe")
    seen = []
    blocks = patches.moe_blocks(target)
    handles = [b.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1:3])) for b in blocks]
    window = VerifyWindow(blocks)  # registered after our spy: the spy sees the original ids
    spy_after = [b.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1:3])) for b in blocks]
    try:
        window.arm(Choice(torch.tensor([3]), torch.tensor([3]), torch.tensor([False]), torch.tensor([0])))
        target(torch.randint(0, VOCAB, (1, 6)))
    finally:
        window.remove()
        for h in handles + spy_after:
            h.remove()
    for before, after in zip(seen[0::2], seen[1::2], strict=True):
        ids, weights = after
        assert torch.equal(ids[:3], before[0][:3]) and torch.equal(weights[:3], before[1][:3])
        assert torch.equal(ids[3:], ids[:1].expand(3, -1)) and bool((weights[3:] == 0).all())


@contextlib.contextmanager
def syncs_raise():
    """Make device→host syncs raise inside a round, except in its hand-off (loop.host_syncs_allowed())."""
    names = ["item", "__bool__", "tolist", "nonzero", "__int__", "__float__"]
    originals = {n: getattr(torch.Tensor, n) for n in names}
    caught = []

    def guard(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            if not loop.host_syncs_allowed():
                caught.append((name, "".join(traceback.format_stack(limit=8))))
                raise RuntimeError(f"host sync Tensor.{name} inside a round")
            return original(self, *args, **kwargs)

        return method

    for n in names:
        setattr(torch.Tensor, n, guard(n))
    try:
        yield caught
    finally:
        for n, original in originals.items():
            setattr(torch.Tensor, n, original)


@pytest.mark.parametrize("strategy", ["hybridspec", "nominal", "confidence"])
def test_no_host_sync_between_drafting_and_commit(strategy):
    """fp32 model with transformers' grouped_mm experts (sync-free); the one hand-off per round is allowed."""
    target = make_target("qwen3_5_moe", seed=2, dtype=torch.float32)
    target.set_experts_implementation("grouped_mm")
    prompt = torch.randint(0, VOCAB, (1, 12))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=30)
    drafter = make_drafter(target, 8, ar, error_rate=0.2).float()
    kwargs = dict(do_sample=False, max_new_tokens=30, assistant_model=drafter, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(verify_shape="max"))  # the GPU design, run on the CPU
    target.generate(prompt, **kwargs)  # calibrates (host code) outside the guard
    with syncs_raise() as caught:
        try:
            out = target.generate(prompt, **kwargs)
        except RuntimeError as error:
            raise AssertionError(caught[0][1] if caught else str(error)) from error
    assert torch.equal(out, ar)
    assert len(hybridspec_hf.get_telemetry(target).rounds) > 3
