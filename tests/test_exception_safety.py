"""Exception safety: whatever interrupts a HybridSpec call (Ctrl-C mid-round, a failing streamer, criterion, drafter
or commit, a failure during calibration), no hook or verify session is left behind, the next HybridSpec call is
exact and plain generate() is unaffected."""
import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_routing_and_syncs import RandomSelector
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hybridspec_hf import HybridSpecConfig, patches
from hybridspec_hf.generation import calibration, loop
from hybridspec_hf.generation.calibration import cache_key, cache_path


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def assert_clean(model, hooks_before: int) -> None:
    assert hook_count(model) == hooks_before, "a hook was left on the model"
    assert all("_hybridspec_verify" not in layer.__dict__ for layer in patches.gdn_layers(model))
    assert loop.host_syncs_allowed()


class RaiseAfter:
    """Raises `error` on its `after`-th call."""

    def __init__(self, after: int, error: type[BaseException] = KeyboardInterrupt):
        self.calls, self.after, self.error = 0, after, error

    def tick(self):
        self.calls += 1
        if self.calls == self.after:
            raise self.error("interrupted")


class FailingStreamer(BaseStreamer):
    def __init__(self, failure: RaiseAfter):
        self.failure = failure

    def put(self, value):
        self.failure.tick()

    def end(self):
        pass


class FailingCriterion(StoppingCriteria):
    def __init__(self, failure: RaiseAfter):
        self.failure = failure

    def __call__(self, input_ids, scores, **kwargs):
        self.failure.tick()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3_5_moe", seed=8)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(8))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=30)
    return target, prompt, ar


def spec(target, prompt, drafter, **kwargs):
    settings = HybridSpecConfig(selector=RandomSelector(0), verify_shape="max")  # routing correction armed
    return target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=drafter,
                           generation_strategy="hybridspec", hybridspec_config=settings, **kwargs)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("where", ["verify", "draft", "streamer", "criterion", "commit"])
def test_interrupted_round_leaves_the_model_usable(pair, where, error, monkeypatch, fp64_gdn):
    target, prompt, ar = pair
    drafter = make_drafter(target, 8, ar, error_rate=0.2)
    hooks_before = hook_count(target)
    failure = RaiseAfter(3, error)
    kwargs = {}
    if where == "verify":  # inside the verification forward, after the first MoE router (stage 1)
        layer = patches.text_model(target).layers[2]
        handle = layer.register_forward_hook(lambda *args: failure.tick())
    if where == "draft":
        original = drafter.draft
        monkeypatch.setattr(drafter, "draft", lambda *a, **k: (failure.tick(), original(*a, **k))[1])
    if where == "streamer":
        kwargs["streamer"] = FailingStreamer(failure)
    if where == "criterion":
        kwargs["stopping_criteria"] = StoppingCriteriaList([FailingCriterion(failure)])
    if where == "commit":
        commit = patches.commit_session  # what every commit goes through (eager and resident rounds)
        monkeypatch.setattr(patches, "commit_session", lambda *a: (failure.tick(), commit(*a))[1])
    try:
        with pytest.raises(error, match="interrupted"):
            spec(target, prompt, drafter, **kwargs)
    finally:
        if where == "verify":
            handle.remove()
        monkeypatch.undo()
    assert failure.calls == 3
    assert_clean(target, hooks_before)
    assert torch.equal(spec(target, prompt, drafter.steer(ar, 0.2, 0)), ar)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30), ar)


def test_failure_during_calibration_caches_nothing_and_the_next_call_calibrates(pair, tmp_path, monkeypatch,
                                                                               fp64_gdn):
    target, prompt, ar = pair
    drafter = make_drafter(target, 8, ar, error_rate=0.2)
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    hooks_before = hook_count(target)
    failure = RaiseAfter(10)
    measure = calibration.calibrate

    def calibrate_then_fail(measure_round, *args, **kwargs):
        return measure(lambda w, context: (failure.tick(), measure_round(w, context))[1], *args, **kwargs)

    monkeypatch.setattr(calibration, "calibrate", calibrate_then_fail)
    kwargs = dict(do_sample=False, max_new_tokens=30, assistant_model=drafter, generation_strategy="nominal")
    with pytest.raises(KeyboardInterrupt):
        target.generate(prompt, **kwargs)
    monkeypatch.setattr(calibration, "calibrate", measure)
    assert failure.calls == 10
    assert_clean(target, hooks_before)
    path = cache_path(cache_key(target, drafter, "auto"))
    assert not path.exists(), "a half-measured calibration must not be cached"
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30), ar)
    assert torch.equal(target.generate(prompt, **kwargs), ar)  # calibrates now, then generates
    assert path.exists()
