"""The round functions that CUDA graphs capture (ResidentRounds._step, _step_append, _spec, _draft, _verify,
_commit) read nothing back to the host, on the CPU twin: a device→host read inside them would fail to capture on a
GPU (or sync the round). Every Tensor method that reads a value on the host raises while one of them runs, and whole
batch-1 and batched calls of every kind of strategy still finish and equal their own generate()."""
import contextlib
import functools

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_batched import assert_rows_equal_own, own_generate, random_prompts, spec_batch
from test_exactness import assert_same_as_ar, reference
from test_properties import latency_model

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation.resident import ResidentRounds

BLOCK = 8
READS = ["item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "numpy"]
CAPTURED = ["_step", "_step_append", "_spec", "_draft", "_verify", "_commit"]


def sync_free_target(name: str, seed: int):
    target = make_target(name, seed=seed, dtype=torch.float32)
    target.set_experts_implementation("grouped_mm")
    return target


@contextlib.contextmanager
def no_host_reads_in_captured_parts(monkeypatch):
    depth, calls = [0], [0]
    caught = []  # the reads that raised; then the number of captured-function calls, appended on exit
    for name in READS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            if depth[0]:
                caught.append(_name)
                raise RuntimeError(f"Tensor.{_name} inside a captured round function")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    for name in CAPTURED:
        original = getattr(ResidentRounds, name)

        @functools.wraps(original)
        def inside(self, *args, _original=original, **kwargs):
            calls[0] += 1
            depth[0] += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(ResidentRounds, name, inside)
    yield caught
    assert calls[0] > 0, "no round function ran: not a resident call"


@pytest.mark.parametrize("verify_shape", ["max", "exact"])
@pytest.mark.parametrize("strategy", ["ar", "dflash", "hybridspec", "ratio"])
def test_batch_one_rounds_read_nothing_back(strategy, verify_shape, monkeypatch):
    target = sync_free_target("qwen3_5_moe", seed=2)
    prompt = torch.randint(0, VOCAB, (1, 9))
    ar = reference(target, prompt, 20)
    drafter = make_drafter(target, BLOCK, ar.sequences, error_rate=0.3).float()
    settings = HybridSpecConfig(latency_model=latency_model(BLOCK, 0.2), cuda_graphs="on", verify_shape=verify_shape)
    with no_host_reads_in_captured_parts(monkeypatch) as caught:
        out = target.generate(prompt, max_new_tokens=20, do_sample=False, generation_strategy=strategy,
                              assistant_model=None if strategy == "ar" else drafter, hybridspec_config=settings,
                              return_dict_in_generate=True)
    assert not caught
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert_same_as_ar(out.sequences, ar)


@pytest.mark.parametrize("strategy", ["ar", "dflash", "hybridspec"])
def test_batched_rounds_read_nothing_back(strategy, monkeypatch):
    target = sync_free_target("qwen3_next", seed=1)
    prompts = random_prompts((4, 9, 2), seed=3)
    own = own_generate(target, prompts, 16)
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in own], error_rate=0.2).float()
    with no_host_reads_in_captured_parts(monkeypatch) as caught:
        out = spec_batch(target, prompts, drafter if strategy != "ar" else None, strategy, 16, "on")
    assert not caught
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert_rows_equal_own(out, prompts, own)
