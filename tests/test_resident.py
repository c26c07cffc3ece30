"""GPU-resident rounds (generation/resident.py) run eagerly on the CPU with cuda_graphs="on": the same static-buffer
code that CUDA graphs replay. Greedy output equals generate(); the returned cache equals AR's."""
import shutil

import pytest
import torch
from _tiny import TARGETS, VOCAB, cache_tensors, make_drafter, make_target, output_cache
from test_exactness import assert_same_as_ar, reference, run
from transformers import StaticCache

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.graphs.static_target import _attention_layers

ON = HybridSpecConfig(cuda_graphs="on")


@pytest.mark.parametrize("strategy", ["dflash", "static", "hybridspec", "nominal", "ratio", "confidence", "ar"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_resident_rounds_match_ar(name, strategy, fp64_gdn):
    target = make_target(name)
    generator = torch.Generator().manual_seed(len(name) + len(strategy))
    for prompt_len in (1, 9, 33):
        prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=generator)
        max_new = int(torch.randint(3, 40, (1,), generator=generator))
        ar = reference(target, prompt, max_new)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.25, seed=prompt_len)
        settings = HybridSpecConfig(cuda_graphs="on", static_length=5)
        assert_same_as_ar(run(target, prompt, drafter, strategy, max_new, hybridspec_config=settings), ar)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.path == "static_eager"
    if strategy != "ar":
        assert max(r.accepted for r in telemetry.rounds) > 0, "the oracle drafter should get drafts accepted"


@pytest.mark.parametrize("verify_shape", ["exact", "max"])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_both_verify_shapes_match_ar_and_exact_verifies_only_the_choice(name, verify_shape, fp64_gdn):
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    ar = reference(target, prompt, 37)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3, seed=5)
    settings = HybridSpecConfig(cuda_graphs="on", verify_shape=verify_shape)
    assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 37, hybridspec_config=settings), ar)
    rounds = target.__dict__["_hybridspec_resident"]
    assert rounds.exact == (verify_shape == "exact")
    drafted = [r for r in hybridspec_hf.get_telemetry(target).rounds if r.drafted]
    assert drafted and all(1 <= r.w <= 8 for r in drafted)
    if verify_shape == "exact":
        # the last round replayed the verify graph of its own length: w0, + 1 while stage 0 held the extra token
        assert rounds.verified - drafted[-1].w in (0, 1)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_max_new_tokens_and_eos_at_every_offset(name, fp64_gdn):
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 6))
    full = reference(target, prompt, 40)
    for max_new in range(1, 19):
        ar = reference(target, prompt, max_new)
        drafter = make_drafter(target, 8, full.sequences, error_rate=0.1, seed=max_new)
        out = run(target, prompt, drafter, "hybridspec", max_new, hybridspec_config=ON)
        assert_same_as_ar(out, ar)
        assert out.shape[1] == prompt.shape[1] + max_new
    for index in (2, 7, 12):
        eos = int(full.sequences[0, 6 + index])
        ar = reference(target, prompt, 30, eos_token_id=[VOCAB - 1, eos], pad_token_id=0)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.0, seed=index)
        out = run(target, prompt, drafter, "dflash", 30, eos_token_id=[VOCAB - 1, eos], pad_token_id=0,
                  hybridspec_config=ON)
        assert_same_as_ar(out, ar)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_returned_cache_equals_ar_and_rounds_are_reused(cache_implementation, fp64_gdn):
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 11))

    def kwargs():
        if cache_implementation is None:
            return {}
        return dict(past_key_values=StaticCache(config=target.config, max_cache_len=64))

    ar = reference(target, prompt, 13, **kwargs())
    drafter = make_drafter(target, 8, reference(target, prompt, 40).sequences, error_rate=0.2)
    ours = run(target, prompt, drafter, "hybridspec", 13, return_dict_in_generate=True, hybridspec_config=ON,
               **kwargs())
    assert torch.equal(ours.sequences, ar.sequences)
    for mine, theirs in zip(cache_tensors(output_cache(ours)), cache_tensors(output_cache(ar)), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    rounds = target.__dict__["_hybridspec_resident"]
    # one row: the attention layers' cumulative_length are views into one buffer, set to the length at each commit
    static = rounds.target
    attention = _attention_layers(static.cache)
    assert attention and all(layer.cumulative_length.data_ptr() == static.attention_lengths[i].data_ptr()
                             for i, layer in enumerate(attention))
    assert torch.equal(static.attention_lengths, static.length.expand(len(attention)))
    # a second call with the same settings reuses the rounds; continuing from the returned cache stays exact
    ar2 = target.generate(ar.sequences, past_key_values=output_cache(ar), do_sample=False, max_new_tokens=9)
    ours2 = run(target, ours.sequences, drafter, "hybridspec", 9, past_key_values=output_cache(ours),
                hybridspec_config=ON)
    assert torch.equal(ours2, ar2)
    assert target.__dict__["_hybridspec_resident"] is rounds


def test_rounds_are_reused_by_shorter_calls_and_rebuilt_for_longer_ones(monkeypatch, fp64_gdn):
    from hybridspec_hf.generation import resident

    monkeypatch.setattr(resident, "_CAPACITY_STEP", 16)
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 11))
    drafter = make_drafter(target, 8, reference(target, prompt, 60).sequences, error_rate=0.2)
    assert torch.equal(run(target, prompt, drafter, "hybridspec", 30, hybridspec_config=ON),
                       reference(target, prompt, 30).sequences)
    rounds = target.__dict__["_hybridspec_resident"]
    assert rounds.key.capacity == 64  # 11 + 30 + block 8 -> 49, in steps of 16
    # a shorter call fits the same static cache: no new capture, same output as AR
    assert torch.equal(run(target, prompt, drafter, "hybridspec", 6, hybridspec_config=ON),
                       reference(target, prompt, 6).sequences)
    assert target.__dict__["_hybridspec_resident"] is rounds
    assert hybridspec_hf.get_telemetry(target).capture_s == 0.0
    # a longer one does not: the rounds are rebuilt for it
    assert torch.equal(run(target, prompt, drafter, "hybridspec", 50, hybridspec_config=ON),
                       reference(target, prompt, 50).sequences)
    assert target.__dict__["_hybridspec_resident"] is not rounds


def test_the_call_that_calibrates_captures_rounds_the_next_call_replays(monkeypatch, tmp_path, fp64_gdn):
    """The first call of a calibrated strategy calibrates (nothing cached yet) and captures; the second call reads
    the calibration from the cache and must find the same rounds (a fresh model's digest once differed from its
    cached copy's, and the second call captured again: run 40's CUDA tests)."""
    monkeypatch.setenv("HYBRIDSPEC_CACHE", str(tmp_path))
    target = make_target("qwen3_5_moe", seed=5)
    prompt = torch.randint(0, VOCAB, (1, 9))
    drafter = make_drafter(target, 8, reference(target, prompt, 30).sequences, error_rate=0.3)
    run(target, prompt, drafter, "nominal", 20, hybridspec_config=ON)
    assert list((tmp_path / "latency").glob("*.json")), "the first call did not calibrate"
    rounds = target.__dict__["_hybridspec_resident"]
    assert torch.equal(run(target, prompt, drafter, "nominal", 20, hybridspec_config=ON),
                       reference(target, prompt, 20).sequences)
    assert target.__dict__["_hybridspec_resident"] is rounds
    assert hybridspec_hf.get_telemetry(target).capture_s == 0.0


@pytest.mark.parametrize("strategy, verify_shape", [("dflash", "auto"), ("hybridspec", "exact"),
                                                    ("hybridspec", "max")])
def test_stop_strings_streamer_and_user_criteria(strategy, verify_shape, fp64_gdn):
    from transformers import StoppingCriteria, StoppingCriteriaList

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 7))
    full = reference(target, prompt, 30).sequences
    stop_at = prompt.shape[1] + 9

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= stop_at, dtype=torch.bool)

    class Collect:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            self.tokens.append("end")

    streamer = Collect()
    drafter = make_drafter(target, 8, full, error_rate=0.0)
    # the host decides m: "exact" replays the commit graph of the length that round verified
    settings = HybridSpecConfig(cuda_graphs="on", verify_shape=verify_shape)
    out = run(target, prompt, drafter, strategy, 30, hybridspec_config=settings, streamer=streamer,
              stopping_criteria=StoppingCriteriaList([StopAtLength()]))
    assert torch.equal(out, full[:, :stop_at])
    assert streamer.tokens == full[0].tolist()[:stop_at] + ["end"]


def test_sampling_runs_resident_and_seed_fixes_output():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 5))
    drafter = make_drafter(target, 8).to(torch.float32)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(target.generate(prompt, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=24,
                                    assistant_model=drafter, generation_strategy="dflash", hybridspec_config=ON))
        assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert torch.equal(outs[0], outs[1])


def test_cuda_graphs_on_refuses_what_it_cannot_run_and_auto_falls_back():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 5))
    drafter = make_drafter(target, 8).to(torch.float32)
    with pytest.raises(ValueError, match="repetition|RepetitionPenalty"):
        target.generate(prompt, max_new_tokens=8, repetition_penalty=1.3, assistant_model=drafter,
                        generation_strategy="dflash", hybridspec_config=ON)
    out = target.generate(prompt, max_new_tokens=8, repetition_penalty=1.3, assistant_model=drafter,
                          generation_strategy="dflash", hybridspec_config=HybridSpecConfig(cuda_graphs="auto"))
    assert out.shape[1] == 13 and hybridspec_hf.get_telemetry(target).path == "eager"
    assert target.generate(prompt, max_new_tokens=8, do_sample=False).shape[1] == 13  # plain generate() intact


@pytest.mark.parametrize("cuda_graphs", ["on", "off"])
@pytest.mark.parametrize("strategy", ["dflash", "hybridspec", "ar"])
@pytest.mark.parametrize("name", ["qwen3_5_moe_odd", "qwen3_next"])
def test_per_token_state_verifier_is_exact_too(name, strategy, cuda_graphs, fp64_gdn):
    """The serving engines' verifier (a state per verified token, the accepted one copied back) as the baseline
    of side-by-side benchmarks: exact like ours, eagerly and on resident rounds."""
    target = make_target(name)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    ar = reference(target, prompt, 30)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.25, seed=1)
    settings = HybridSpecConfig(cuda_graphs=cuda_graphs, gdn_verifier="per_token_state")
    assert_same_as_ar(run(target, prompt, drafter, strategy, 30, hybridspec_config=settings), ar)
    if strategy != "ar":
        assert max(r.accepted for r in hybridspec_hf.get_telemetry(target).rounds) > 0


def test_a_failure_mid_round_leaves_the_next_call_exact(fp64_gdn):
    """A streamer that raises during a resident round: the next call reloads its own cache and is exact; plain
    generate() is unaffected; release_graphs frees the rounds."""
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 7))
    ar = reference(target, prompt, 20)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.2)

    class Boom:
        def __init__(self):
            self.count = 0

        def put(self, value):
            self.count += 1
            if self.count == 6:
                raise RuntimeError("streamer failed")

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="streamer failed"):
        run(target, prompt, drafter, "hybridspec", 20, hybridspec_config=ON, streamer=Boom())
    assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 20, hybridspec_config=ON), ar)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=20), ar.sequences)
    hybridspec_hf.release_graphs(target)
    assert "_hybridspec_resident" not in target.__dict__


@pytest.mark.parametrize("cuda_graphs", ["on", "off"])
def test_online_estimator_update_runs_in_the_loop(cuda_graphs, fp64_gdn):
    """An acceptance estimator built with online_lr > 0 is updated after every drafted round (no-op at 0)."""
    from hybridspec_hf.selector import AcceptanceEstimator

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 8))
    ar = reference(target, prompt, 24)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3)
    estimator = AcceptanceEstimator.default(8, online_lr=0.05)
    settings = HybridSpecConfig(cuda_graphs=cuda_graphs, acceptance_estimator=estimator)
    assert_same_as_ar(run(target, prompt, drafter, "confidence", 24, hybridspec_config=settings), ar)
    assert float(estimator.offset.abs().sum()) > 0


@pytest.mark.parametrize("failure", [RuntimeError("capture failed"), torch.cuda.OutOfMemoryError("simulated OOM")])
def test_a_failed_capture_leaves_the_model_usable(failure, monkeypatch, fp64_gdn):
    """Capture failing (or CUDA running out of memory while capturing): no hook stays on the model, no half-built
    rounds are kept, plain generate() and the next HybridSpec call are exact."""
    from hybridspec_hf.generation import resident

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 7))
    ar = reference(target, prompt, 16)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.2)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in target.modules())

    def failing_replay(*args, **kwargs):
        raise failure

    monkeypatch.setattr(resident, "Replay", failing_replay)
    with pytest.raises(type(failure)):
        run(target, prompt, drafter, "hybridspec", 16, hybridspec_config=ON)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in target.modules()) == hooks
    assert "_hybridspec_resident" not in target.__dict__
    monkeypatch.undo()
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=16), ar.sequences)
    assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 16, hybridspec_config=ON), ar)


def test_auto_verify_shape_is_max_shape_on_cuda_and_exact_elsewhere():
    from hybridspec_hf.config import resolved_verify_shape

    assert resolved_verify_shape(HybridSpecConfig(), torch.device("cuda")) == "max"
    assert resolved_verify_shape(HybridSpecConfig(), torch.device("cpu")) == "exact"
    assert resolved_verify_shape(HybridSpecConfig(verify_shape="exact"), torch.device("cuda")) == "exact"


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_alternating_settings_reuse_their_rounds_and_the_oldest_make_way(monkeypatch, fp64_gdn):
    """A caller alternating strategies gets each one's kept rounds back (no new capture, same output as AR); beyond
    MAX_ROUNDS_PER_TARGET the least recently used set is released (its hooks go, the shared weight copies stay for
    the others); release_graphs frees every set."""
    from hybridspec_hf.generation import resident

    monkeypatch.setattr(resident, "MAX_ROUNDS_PER_TARGET", 2)
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    ar = reference(target, prompt, 20)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.25, seed=3)
    hooks = _hooks(target)

    def call(strategy):
        assert_same_as_ar(run(target, prompt, drafter, strategy, 20, hybridspec_config=ON), ar)
        return target.__dict__["_hybridspec_resident"], hybridspec_hf.get_telemetry(target).capture_s

    first, _ = call("hybridspec")
    second, _ = call("dflash")
    assert second is not first
    again, captured = call("hybridspec")
    assert again is first and captured == 0.0  # kept, reused: nothing captured by this call
    assert target.__dict__[resident._KEPT] == [second, first]
    third, _ = call("ar")  # a third setting: the least recently used (dflash) makes way
    assert target.__dict__[resident._KEPT] == [first, third]
    assert second.step is None and second.spec is None  # released
    again, captured = call("hybridspec")  # still exact after the release: the copies it reads stayed
    assert again is first and captured == 0.0
    hybridspec_hf.release_graphs(target)
    assert resident._KEPT not in target.__dict__ and "_hybridspec_resident" not in target.__dict__
    assert _hooks(target) == hooks
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=20), ar.sequences)


def test_running_out_of_memory_while_capturing_frees_the_kept_sets_and_retries(monkeypatch, fp64_gdn):
    from hybridspec_hf.generation import resident

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    ar = reference(target, prompt, 16)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.2, seed=4)
    kept = run(target, prompt, drafter, "dflash", 16, hybridspec_config=ON)
    assert_same_as_ar(kept, ar)
    built = []
    original = resident.ResidentRounds

    def first_build_runs_out(*args, **kwargs):
        built.append(1)
        if len(built) == 1:
            raise torch.cuda.OutOfMemoryError("simulated OOM")
        return original(*args, **kwargs)

    monkeypatch.setattr(resident, "ResidentRounds", first_build_runs_out)
    assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 16, hybridspec_config=ON), ar)
    assert len(built) == 2 and len(target.__dict__[resident._KEPT]) == 1  # the dflash set made way, then retried


def test_a_later_call_opens_with_a_deciding_plain_step_from_the_calls_before(monkeypatch, fp64_gdn):
    """HybridSpec's resident rounds keep the earlier calls' speculative evidence (HybridSpec.restart with
    carry_rounds): once it holds INFORMED_ROUNDS speculative rounds, a call opens with a plain step that decides the
    next draft, and the output is still AR's; with the carry off (length_rules.CARRY_EVIDENCE) every call's first
    round is drafted."""
    from hybridspec_hf.selector import LatencyModel, length_rules

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    ar = reference(target, prompt, 40)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.1, seed=3)
    # a fixed latency model where drafting pays (not this machine's timings): C(w) = 1.1 + 0.05 w ms, C_ar = 1 ms
    cost = (1.1 + 0.05 * torch.arange(1, 9, dtype=torch.float32)) * 1e-3
    latency = LatencyModel(cost=cost[None], cost_ar=torch.tensor([1e-3]), context_lens=torch.tensor([64]))
    settings = HybridSpecConfig(cuda_graphs="on", latency_model=latency)
    firsts = []
    for _ in range(3):
        assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 40, hybridspec_config=settings), ar)
        rounds = hybridspec_hf.get_telemetry(target).rounds
        firsts.append(rounds[0].drafted)
        assert sum(r.drafted for r in rounds) >= length_rules.INFORMED_ROUNDS  # an oracle-like drafter: it drafts
    assert firsts == [True, False, False]
    monkeypatch.setattr(length_rules, "CARRY_EVIDENCE", False)
    for _ in range(2):
        assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 40, hybridspec_config=settings), ar)
        assert hybridspec_hf.get_telemetry(target).rounds[0].drafted


def test_the_capture_warm_up_teaches_the_selector_nothing(monkeypatch, fp64_gdn):
    """A capture first runs every round function once eagerly (graphs.capture.Replay's warm-up), on whatever the
    buffers hold; the selector's evidence and the estimator's online correction are restored after it, so the calls
    take the decisions they take without a warm-up (emulated here on the CPU, where Replay runs eagerly)."""
    from hybridspec_hf.generation import resident
    from hybridspec_hf.graphs.capture import Replay
    from hybridspec_hf.selector import LatencyModel

    class WarmReplay(Replay):  # the CUDA path's warm-up call, then eager calls
        def __init__(self, fn, device, pool=None, warmup=1, capture=True):
            super().__init__(fn, device, pool, warmup, capture)
            for _ in range(warmup):
                fn()

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    ar = reference(target, prompt, 40)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3, seed=5)
    cost = (1.1 + 0.05 * torch.arange(1, 9, dtype=torch.float32)) * 1e-3  # a fixed latency model: drafting pays
    latency = LatencyModel(cost=cost[None], cost_ar=torch.tensor([1e-3]), context_lens=torch.tensor([64]))
    settings = HybridSpecConfig(cuda_graphs="on", latency_model=latency)

    def decisions():
        hybridspec_hf.release_graphs(target)
        seen = []
        for _ in range(3):
            assert_same_as_ar(run(target, prompt, drafter, "hybridspec", 40, hybridspec_config=settings), ar)
            seen.append([(r.drafted, r.w) for r in hybridspec_hf.get_telemetry(target).rounds])
        return seen

    # the oracle drafter's random errors come from its own generator, from which the warm-up draws too: it restarts
    # at every call's set-up, so that both runs draft the same blocks
    start = resident.ResidentRounds.start
    monkeypatch.setattr(resident.ResidentRounds, "start",
                        lambda self, *a, **k: (start(self, *a, **k), drafter.generator.manual_seed(5)))
    plain = decisions()
    assert any(not drafted for call in plain[1:] for drafted, _ in call)  # decisions the evidence could sway
    monkeypatch.setattr(resident, "Replay", WarmReplay)
    assert decisions() == plain


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_decisions_decide_as_the_eager_ones(backend, fp64_gdn):
    """HybridSpecConfig.compile_decisions: the resident rounds' decisions (length, routing correction, draft or step
    plain, the selector's update) compiled with torch.compile take the eager code's decisions round for round, for
    every selector it compiles. "aot_eager" checks the whole-graph trace (no break, the in-place updates kept);
    "inductor" the generated code too (on the CPU: C++, needs a compiler; on CUDA: Triton, the default there)."""
    if backend == "inductor" and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor's CPU code needs a C++ compiler")
    from hybridspec_hf.selector import LatencyModel

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    ar = reference(target, prompt, 60)
    # near break-even: some stretches step plain, some rounds draft; a sunk stage-0 cost of most of a token's makes
    # the routing correction keep the extra token in some rounds and drop it in others
    cost = (1.6 + 0.05 * torch.arange(1, 9, dtype=torch.float32)) * 1e-3
    latency = LatencyModel(cost=cost[None], cost_ar=torch.tensor([1e-3]), context_lens=torch.tensor([64]),
                           sunk=torch.full((1, 7), 0.035e-3))
    seen = {}
    for strategy in ("hybridspec", "ratio", "confidence"):
        for mode in ("off", backend):
            drafter = make_drafter(target, 8, ar.sequences, error_rate=0.35, seed=11)
            settings = HybridSpecConfig(cuda_graphs="on", latency_model=latency, compile_decisions=mode)
            out = run(target, prompt, drafter, strategy, 60, hybridspec_config=settings)
            assert_same_as_ar(out, ar)
            rounds = target.__dict__["_hybridspec_resident"]
            assert rounds.strategy._compiled == (None if mode == "off" else backend)
            seen[strategy, mode] = [(r.drafted, r.w, r.w0, r.accepted, r.extra_kept, r.n_new)
                                    for r in hybridspec_hf.get_telemetry(target).rounds]
        assert seen[strategy, backend] == seen[strategy, "off"], strategy
    hybrid = seen["hybridspec", "off"]
    assert any(not drafted for drafted, *_ in hybrid) and any(drafted for drafted, *_ in hybrid)
    assert any(kept for *_, kept, _ in hybrid) and any(kept is False for *_, kept, _ in hybrid)


@pytest.mark.parametrize("mode", ["off", "aot_eager"])
def test_the_fused_round_end_decides_as_the_two_calls_apart(mode, monkeypatch, fp64_gdn):
    """resident.FUSED_ROUND_END: a speculative round's draft decision and the selector's update in one call
    (`RoundStrategy.end_round`, one compiled region) take the decisions of should_draft before the commit and
    observe_round in it, round for round, eagerly and compiled (the aot_eager trace: no graph break)."""
    from hybridspec_hf.generation import resident
    from hybridspec_hf.generation.strategy import RoundStrategy
    from hybridspec_hf.selector import LatencyModel

    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(7))
    ar = reference(target, prompt, 60)
    cost = (1.6 + 0.05 * torch.arange(1, 9, dtype=torch.float32)) * 1e-3  # near break-even: plain stretches too
    latency = LatencyModel(cost=cost[None], cost_ar=torch.tensor([1e-3]), context_lens=torch.tensor([64]),
                           sunk=torch.full((1, 7), 0.035e-3))
    seen, calls = {}, []
    fused_end = RoundStrategy.end_round
    monkeypatch.setattr(RoundStrategy, "end_round", lambda self, *a: calls.append(1) or fused_end(self, *a))
    for fused in (False, True):
        monkeypatch.setattr(resident, "FUSED_ROUND_END", fused)
        drafter = make_drafter(target, 8, ar.sequences, error_rate=0.35, seed=11)
        settings = HybridSpecConfig(cuda_graphs="on", latency_model=latency, compile_decisions=mode)
        out = run(target, prompt, drafter, "hybridspec", 60, hybridspec_config=settings)
        assert_same_as_ar(out, ar)
        seen[fused] = [(r.drafted, r.w, r.accepted) for r in hybridspec_hf.get_telemetry(target).rounds]
        assert bool(calls) == fused  # the fused call ran only when switched on
    assert seen[True] == seen[False]
    assert any(not drafted for drafted, *_ in seen[True]) and any(drafted for drafted, *_ in seen[True])


def test_compile_decisions_is_checked_and_auto_compiles_on_cuda_only():
    from hybridspec_hf.config import resolved_compile_backend

    with pytest.raises(ValueError, match="compile_decisions must be one of"):
        HybridSpecConfig(compile_decisions="max-autotune")
    assert resolved_compile_backend(HybridSpecConfig(), torch.device("cpu")) is None
    assert resolved_compile_backend(HybridSpecConfig(), torch.device("cuda")) == "inductor"
    assert resolved_compile_backend(HybridSpecConfig(compile_decisions="off"), torch.device("cuda")) is None
    assert resolved_compile_backend(HybridSpecConfig(compile_decisions="aot_eager"), torch.device("cpu")) == "aot_eager"


def test_a_decision_torch_compile_refuses_runs_eagerly_with_one_warning():
    import torch._dynamo.exc as dynamo_errors

    from hybridspec_hf.generation.strategy import _CompiledDecision

    calls = []

    def eager(x):
        calls.append("eager")
        return x + 1

    def refused(x):
        calls.append("compiled")
        raise dynamo_errors.InternalTorchDynamoError("a trace it cannot take")

    decision = _CompiledDecision(eager, refused)
    with pytest.warns(UserWarning, match="torch.compile could not take eager.*runs eagerly"):
        assert decision(torch.tensor(1)) == 2
    assert decision(torch.tensor(2)) == 3  # eager from then on, without trying again
    assert calls == ["compiled", "eager", "eager"]

    def broken(x):
        raise RuntimeError("a CUDA error while running")  # not a compile failure: it propagates

    with pytest.raises(RuntimeError, match="while running"):
        _CompiledDecision(eager, broken)(torch.tensor(1))


@pytest.mark.parametrize("short", [True, False])
def test_max_shape_rounds_that_choose_a_short_length_verify_only_that_many(short, monkeypatch, fp64_gdn):
    """SHORT_VERIFY: a round whose valid tokens fit SHORT_LENGTHS verifies the shortest that holds them (on CUDA a
    conditional graph branch; here the same choice eagerly), the others the block; greedy output stays AR's."""
    from hybridspec_hf.generation import resident

    monkeypatch.setattr(resident, "SHORT_VERIFY", short)
    verified = []  # (tokens verified, valid tokens) of each round
    verify = resident.ResidentRounds._verify

    def spy(self, n, *args, **kwargs):
        verified.append((n, int(self.round_valid.max())))
        return verify(self, n, *args, **kwargs)

    monkeypatch.setattr(resident.ResidentRounds, "_verify", spy)
    target = make_target("qwen3_next")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(5))
    ar = reference(target, prompt, 37)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3, seed=5)
    settings = HybridSpecConfig(cuda_graphs="on", verify_shape="max")
    # "confidence" chooses w from the drafts alone (no clock): the same lengths on every machine
    assert_same_as_ar(run(target, prompt, drafter, "confidence", 37, hybridspec_config=settings), ar)
    assert len(verified) == len([r for r in hybridspec_hf.get_telemetry(target).rounds if r.drafted])
    assert all(n == (2 if short and valid <= 2 else 8) for n, valid in verified), verified
    assert min(valid for _, valid in verified) <= 2 < max(valid for _, valid in verified)
    assert target.__dict__["_hybridspec_resident"].short_lengths == ((2,) if short else ())
