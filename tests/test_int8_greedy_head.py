"""Resident greedy rounds with their tokens from the LM head's int8 copy (resident.INT8_GREEDY_HEAD,
kernels/head_argmax_triton.py), run on the CPU (the rule's torch form; the kernel itself is tested under the
interpreter in test_head_argmax.py): greedy output equals generate() for every strategy and both verify shapes, the
rounds take their tokens through the copy (plain steps and verifications), the copy is the drafter's int8 head where
it has one and follows the head's weights in place, and sampling (resident rounds take logits processors only
with it), the switch off or another device keep the head's logits."""
import pytest
import torch
from _tiny import TARGETS, VOCAB, make_drafter, make_target
from test_exactness import assert_same_as_ar, reference, run

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident
from hybridspec_hf.kernels import head_argmax_triton
from hybridspec_hf.kernels.gemv_triton import quantize_rows


@pytest.fixture
def copy_calls(monkeypatch):
    """The switch on for the CPU too; each call of greedy_tokens recorded as its hidden states' shape."""
    monkeypatch.setattr(resident, "INT8_GREEDY_HEAD", True)
    monkeypatch.setattr(resident, "INT8_GREEDY_HEAD_DEVICES", ("cuda", "cpu"))
    calls = []
    plain = head_argmax_triton.greedy_tokens

    def recorded(hidden, weight, quantized):
        calls.append(tuple(hidden.shape))
        return plain(hidden, weight, quantized)

    monkeypatch.setattr(head_argmax_triton, "greedy_tokens", recorded)
    return calls


@pytest.mark.parametrize("verify_shape", ["exact", "max"])
@pytest.mark.parametrize("strategy", ["ar", "dflash", "hybridspec"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_greedy_rounds_from_the_int8_copy_equal_ar(name, strategy, verify_shape, copy_calls, fp64_gdn):
    target = make_target(name)
    hybridspec_hf.release_graphs(target)
    generator = torch.Generator().manual_seed(len(name) + len(strategy))
    for prompt_len in (1, 9, 33):
        prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=generator)
        max_new = int(torch.randint(8, 40, (1,), generator=generator))
        ar = reference(target, prompt, max_new)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.25, seed=prompt_len)
        settings = HybridSpecConfig(cuda_graphs="on", verify_shape=verify_shape, static_length=5)
        before = len(copy_calls)
        assert_same_as_ar(run(target, prompt, drafter, strategy, max_new, hybridspec_config=settings), ar)
        rounds = target.__dict__["_hybridspec_resident"]
        assert rounds.greedy_head is not None and len(copy_calls) > before
    shapes = {shape[1] for shape in copy_calls}
    assert shapes == {1} if strategy == "ar" else max(shapes) > 1  # plain steps; verifications
    hybridspec_hf.release_graphs(target)
    assert rounds.greedy_head is None


def test_the_copy_is_the_drafters_int8_head_or_our_own_and_follows_the_head(copy_calls, fp64_gdn):
    target = make_target("qwen3_5_moe")
    hybridspec_hf.release_graphs(target)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    ar = reference(target, prompt, 20)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.25)
    settings = HybridSpecConfig(cuda_graphs="on")
    head = target.lm_head.weight
    original = head.detach().clone()
    try:
        run(target, prompt, drafter, "dflash", 20, hybridspec_config=settings)
        rounds = target.__dict__["_hybridspec_resident"]
        own = rounds.greedy_head
        assert own is not None and rounds.head_copy is None  # no drafter copy: the rounds' own
        with torch.no_grad():
            head.mul_(0.5)
        run(target, prompt, drafter, "dflash", 20, hybridspec_config=settings)
        assert target.__dict__["_hybridspec_resident"] is rounds and rounds.greedy_head is own  # refreshed in place
        fresh = quantize_rows(head)
        assert torch.equal(own.weight, fresh.weight) and torch.equal(own.scale, fresh.scale)
        hybridspec_hf.release_graphs(target)
        drafter.config.head_quantization = "int8"
        with torch.no_grad():
            head.copy_(original)
        assert_same_as_ar(run(target, prompt, drafter, "dflash", 20, hybridspec_config=settings), ar)
        rounds = target.__dict__["_hybridspec_resident"]
        assert rounds.head_copy is not None and rounds.greedy_head is rounds.head_copy  # one copy for both
    finally:
        hybridspec_hf.release_graphs(target)
        with torch.no_grad():
            head.copy_(original)


@pytest.mark.parametrize("case", ["sample", "off", "other device"])
def test_sampling_processors_the_switch_or_the_device_keep_the_heads_logits(case, copy_calls, monkeypatch, fp64_gdn):
    target = make_target("qwen3_5_moe")
    hybridspec_hf.release_graphs(target)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    kwargs = {}
    if case == "sample":
        kwargs = dict(do_sample=True, top_k=0)
    elif case == "off":
        monkeypatch.setattr(resident, "INT8_GREEDY_HEAD", False)
    else:
        monkeypatch.setattr(resident, "INT8_GREEDY_HEAD_DEVICES", ("cuda",))
    drafter = make_drafter(target, 8)
    target.generate(prompt, max_new_tokens=12, assistant_model=drafter, generation_strategy="dflash",
                    hybridspec_config=HybridSpecConfig(cuda_graphs="on"), **{"do_sample": False, **kwargs})
    assert target.__dict__["_hybridspec_resident"].greedy_head is None and copy_calls == []
    hybridspec_hf.release_graphs(target)


def test_greedy_head_option_is_checked():
    with pytest.raises(ValueError, match="greedy_head must be one of"):
        HybridSpecConfig(greedy_head="fp8")
    with pytest.raises(ValueError, match="GPU-resident rounds path"):
        HybridSpecConfig(greedy_head="int8", cuda_graphs="off")


@pytest.mark.parametrize("mode", ["int8", "model"])
def test_the_option_chooses_either_path_on_any_device(mode, monkeypatch, fp64_gdn):
    """greedy_head="int8" takes the copy on the CPU with the switch off; "model" keeps the logits with it on."""
    monkeypatch.setattr(resident, "INT8_GREEDY_HEAD", mode == "model")
    monkeypatch.setattr(resident, "INT8_GREEDY_HEAD_DEVICES", ("cuda", "cpu"))
    target = make_target("qwen3_next")
    hybridspec_hf.release_graphs(target)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    ar = reference(target, prompt, 24)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.25)
    settings = HybridSpecConfig(cuda_graphs="on", greedy_head=mode)
    assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 24, hybridspec_config=settings), ar)
    assert (target.__dict__["_hybridspec_resident"].greedy_head is not None) == (mode == "int8")
    hybridspec_hf.release_graphs(target)


def test_int8_on_a_head_it_cannot_take_out_is_refused_and_the_model_stays_usable(fp64_gdn):
    target = make_target("qwen3_5_moe")
    hybridspec_hf.release_graphs(target)
    target.config.get_text_config().final_logit_softcapping = 30.0  # logits not the head's product alone
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    drafter = make_drafter(target, 8)
    try:
        with pytest.raises(ValueError, match='greedy_head="int8".*LM head is not a plain'):
            run(target, prompt, drafter, "dflash", 12,
                hybridspec_config=HybridSpecConfig(cuda_graphs="on", greedy_head="int8"))
    finally:
        del target.config.get_text_config().final_logit_softcapping
    ar = reference(target, prompt, 12)
    assert_same_as_ar(run(target, prompt, drafter, "dflash", 12, hybridspec_config=HybridSpecConfig(cuda_graphs="on")),
                      ar)
    hybridspec_hf.release_graphs(target)
