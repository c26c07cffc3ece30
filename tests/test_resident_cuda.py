"""GPU-resident rounds on CUDA: whole generate() calls captured in graphs, no device→host sync inside a round
(torch.cuda.set_sync_debug_mode("error") inside HybridSpec's decoding; the per-call set-up and the per-round hand-off
are the allowed syncs).
Skipped without CUDA; the CPU twin of every path is tests/test_resident.py."""
import functools

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident
from hybridspec_hf.graphs import capture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STRATEGIES = ["ar", "dflash", "static", "hybridspec", "nominal", "ratio", "confidence"]


@pytest.fixture
def sync_errors(monkeypatch):
    """Device→host syncs raise inside HybridSpec's decoding (generate()'s `custom_generate`, where only `host_syncs`
    may sync), not in transformers' generate() around it: from 5.25 on its set-up checks the attention mask on the
    host once a call (`(attention_mask == 1).all()`), as it does for stock decoding. Only the outermost call turns
    them on: the generate() calls the calibration makes run inside that call's `host_syncs`, where syncs are allowed."""
    from hybridspec_hf.generation import integration

    decode = integration.hybridspec_decode
    depth = [0]

    @functools.wraps(decode)
    def strict(*args, **kwargs):
        depth[0] += 1
        if depth[0] == 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return decode(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(integration, "hybridspec_decode", strict)


def _pair(name="qwen3_5_moe", reference=None, seed=0):
    """An fp32 tiny target on CUDA (batched_mm experts: capturable in fp32) and an oracle drafter steered to
    `reference` (a CPU [1, L] sequence)."""
    target = make_target(name, dtype=torch.float32)
    if hasattr(target, "set_experts_implementation"):
        target.set_experts_implementation("batched_mm")
    drafter = make_drafter(target, 8, reference, error_rate=0.25, seed=seed).float()
    target.cuda()
    drafter.cuda().bind_target(target)
    return target, drafter


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_calls_run_captured_without_syncs(strategy, do_sample, sync_errors):
    target, _ = _pair()
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0)).cuda()
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40)
    target, drafter = _pair(reference=ar.cpu())
    kwargs = dict(do_sample=do_sample, max_new_tokens=40, assistant_model=drafter, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on", static_length=5))
    if do_sample:
        kwargs.update(temperature=0.7, top_p=0.9)
    target.generate(prompt, **kwargs)  # first call: captures
    first = hybridspec_hf.get_telemetry(target)
    out = target.generate(prompt, **kwargs)  # second call: replays the same graphs
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "cuda_graphs" and telemetry.capture_s == 0.0
    assert out.shape[1] == 52
    if not do_sample:
        assert torch.equal(out, ar), "fp32 greedy output differs from AR"
    if strategy in ("hybridspec", "nominal"):
        # the first call's first round drafts; later rounds (the second call's too) may step plain where a tiny fp32
        # model's plain step is cheaper than a speculative round (the selector's choice, priced by the rounds' own
        # timing), so acceptance is asserted over both calls (the oracle's first block accepts 2 in the CPU twin)
        assert first.rounds[0].drafted
        if not do_sample:
            assert max(r.accepted for r in first.rounds + telemetry.rounds) > 0
    elif strategy != "ar" and not do_sample:
        assert max(r.accepted for r in telemetry.rounds) > 0


def test_fp32_greedy_equals_ar_every_family():
    for name in ["qwen3_5_moe", "qwen3_next", "qwen3_5_dense", "qwen3_5_moe_vlm"]:
        target, _ = _pair(name)
        for seed in range(3):
            prompt = torch.randint(0, VOCAB, (1, 5 + 7 * seed), generator=torch.Generator().manual_seed(seed))
            ar = target.generate(prompt.cuda(), do_sample=False, max_new_tokens=33)
            target, drafter = _pair(name, ar.cpu(), seed)
            for strategy in ("hybridspec", "dflash", "ar"):
                out = target.generate(prompt.cuda(), do_sample=False, max_new_tokens=33, assistant_model=drafter,
                                      generation_strategy=strategy, hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
                assert torch.equal(out, ar), (name, seed, strategy)


@pytest.mark.parametrize("verify_shape", ["exact", "max"])
def test_both_verify_shapes_run_captured_and_equal_ar(verify_shape, sync_errors):
    target, _ = _pair()
    prompt = torch.randint(0, VOCAB, (1, 12), device="cuda")
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40)
    target, drafter = _pair(reference=ar.cpu())
    kwargs = dict(do_sample=False, max_new_tokens=40, assistant_model=drafter, generation_strategy="hybridspec",
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on", verify_shape=verify_shape))
    target.generate(prompt, **kwargs)
    out = target.generate(prompt, **kwargs)
    assert torch.equal(out, ar)
    assert target.__dict__["_hybridspec_resident"].exact == (verify_shape == "exact")


@pytest.mark.skipif(not torch.cuda.is_available() or not capture.branches_capture(torch.device("cuda")),
                    reason="needs torch's conditional graph nodes (CUDA >= 12.4, torch 2.13)")
@pytest.mark.parametrize("do_sample", [False, True])
def test_short_verify_branches_run_captured_without_syncs_and_equal_ar(do_sample, monkeypatch, sync_errors):
    monkeypatch.setattr(resident, "SHORT_VERIFY", True)
    target, _ = _pair("qwen3_next")
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3)).cuda()
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40)
    target, drafter = _pair("qwen3_next", reference=ar.cpu())
    drafter.steer(ar.cpu(), 0.7, seed=5)  # many rejections: rounds choose short lengths
    kwargs = dict(do_sample=do_sample, max_new_tokens=40, assistant_model=drafter, generation_strategy="hybridspec",
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on", verify_shape="max"))
    target.generate(prompt, **kwargs)
    out = target.generate(prompt, **kwargs)
    assert target.__dict__["_hybridspec_resident"].short_lengths == (2,)
    rounds = [r for r in hybridspec_hf.get_telemetry(target).rounds if r.drafted]
    assert rounds and min(r.w for r in rounds) <= 2
    if not do_sample:
        assert torch.equal(out, ar)


@pytest.mark.parametrize("strategy", ["ar", "dflash", "hybridspec"])
def test_batched_calls_run_captured_without_syncs_and_equal_each_rows_ar(strategy, monkeypatch):
    """A left-padded batch of 3 in the bucket of 4, captured: no device→host sync inside its rounds (only the
    per-round hand-off), every row's fp32 greedy output equal to its own AR, the bucket's graphs reused by a second
    call."""
    from hybridspec_hf.generation import resident

    rounds_only = resident.resident_decode_rows

    def sync_free_rounds(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return rounds_only(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(resident, "resident_decode_rows", sync_free_rounds)
    target, _ = _pair()
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator) for n in (9, 3, 14)]
    own = [target.generate(p[None].cuda(), do_sample=False, max_new_tokens=30).cpu() for p in prompts]
    target, drafter = _pair(reference=[o[0] for o in own])
    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, 14 - prompt.numel():], mask[row, 14 - prompt.numel():] = prompt, 1
    kwargs = dict(attention_mask=mask.cuda(), do_sample=False, max_new_tokens=30, pad_token_id=0,
                  assistant_model=drafter if strategy != "ar" else None, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    target.generate(ids.cuda(), **kwargs)  # first call: captures the bucket of 4
    out = target.generate(ids.cuda(), **kwargs).cpu()
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "cuda_graphs" and telemetry.capture_s == 0.0
    assert target.__dict__["_hybridspec_resident"].rows == 4
    for row, (prompt, ar) in enumerate(zip(prompts, own)):
        assert torch.equal(out[row, 14:], ar[0, prompt.numel():]), (strategy, row)


@pytest.mark.parametrize("strategy", ["dflash", "hybridspec"])
def test_the_fused_round_tail_runs_compiled_captured_without_syncs_and_equals_ar(strategy, monkeypatch,
                                                                                sync_errors):
    """resident.FUSED_ROUND_TAIL: a greedy round's bookkeeping in two inductor-compiled regions inside the captured
    round (no sync, no fallback to eager), the output AR's, with an EOS cutting a round."""
    monkeypatch.setattr(resident, "FUSED_ROUND_TAIL", True)
    target, _ = _pair()
    prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6)).cuda()
    free = target.generate(prompt, do_sample=False, max_new_tokens=40)
    eos = [int(free[0, 12 + 23])]
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    target, drafter = _pair(reference=free.cpu())
    kwargs = dict(do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=0, assistant_model=drafter,
                  generation_strategy=strategy, hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    target.generate(prompt, **kwargs)  # captures
    out = target.generate(prompt, **kwargs)
    assert torch.equal(out, ar)
    rounds = target.__dict__["_hybridspec_resident"]
    assert rounds.tail and all(fn.fast is not None for fn in (rounds.head_fn, rounds.accept_fn, rounds.advance_fn))
    assert hybridspec_hf.get_telemetry(target).path == "cuda_graphs"


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("strategy", ["dflash", "hybridspec"])
def test_the_commit_beside_the_round_runs_captured_and_changes_no_token(strategy, do_sample, monkeypatch,
                                                                         sync_errors):
    """resident.COMMIT_BESIDE: the GDN commit on a side stream inside the captured round (no sync), joined before the
    round ends: greedy output AR's (an EOS cutting a round), sampled output with a seed the same tokens as with the
    commit in line (the next round reads the committed states either way)."""
    target, _ = _pair()
    prompt = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(8)).cuda()
    free = target.generate(prompt, do_sample=False, max_new_tokens=40)
    eos = [int(free[0, 12 + 29])]
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    outputs = []
    for beside in (False, True):
        monkeypatch.setattr(resident, "COMMIT_BESIDE", beside)
        target, drafter = _pair(reference=free.cpu())
        kwargs = dict(do_sample=do_sample, max_new_tokens=40, eos_token_id=eos, pad_token_id=0,
                      assistant_model=drafter, generation_strategy=strategy,
                      hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
        target.generate(prompt, **kwargs)  # captures
        torch.manual_seed(11)
        outputs.append(target.generate(prompt, **kwargs))
        assert (target.__dict__["_hybridspec_resident"].beside is not None) == beside
        assert hybridspec_hf.get_telemetry(target).path == "cuda_graphs"
    assert torch.equal(outputs[0], outputs[1])
    if not do_sample:
        assert torch.equal(outputs[1], ar)


def test_image_prompts_run_captured_and_equal_ar():
    """A vision-language target's image prompt: the rounds continue from the multimodal RoPE positions the prefill
    set (the cos/sin table is indexed by slot from each row's next position)."""
    from test_image_inputs import resident_image_calls

    resident_image_calls("cuda")


def _captured_int8_call(strategy: str, option: str, seed: int):
    """(target, drafter, tokens, AR's tokens) of a greedy call with the drafter's config.`option` "int8", captured
    (the second of two identical calls: it must replay the graphs without capturing or syncing)."""
    target, _ = _pair()
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(seed)).cuda()
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40)
    target, drafter = _pair(reference=ar.cpu())
    setattr(drafter.config, option, "int8")
    kwargs = dict(do_sample=False, max_new_tokens=40, assistant_model=drafter, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    target.generate(prompt, **kwargs)  # captures
    out = target.generate(prompt, **kwargs)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "cuda_graphs" and telemetry.capture_s == 0.0
    return target, drafter, out, ar


@pytest.mark.parametrize("strategy", ["dflash", "hybridspec"])
def test_the_int8_draft_head_runs_captured_and_equals_ar(strategy, sync_errors):
    """DFlashConfig.head_quantization "int8": the draft graph multiplies by the int8 copy of the target's head (made
    in the warm-up, before the capture), the call runs captured without syncs, and greedy output is AR's."""
    _, drafter, out, ar = _captured_int8_call(strategy, "head_quantization", seed=5)
    assert torch.equal(out, ar)
    quantized = drafter.quantized_head()
    assert quantized is drafter.__dict__["_head_int8"][1], "the copy was made again after the capture"
    assert quantized.weight.dtype == torch.int8 and quantized.weight.is_cuda


@pytest.mark.parametrize("strategy", ["dflash", "hybridspec"])
def test_int8_drafter_layers_run_captured_and_equal_ar(strategy, sync_errors):
    """DFlashConfig.layers_quantization "int8": the draft graph multiplies by the int8 copies of the drafter's layer
    projections (made with the resident draft path's copies, before the capture), the call runs captured without
    syncs, and greedy output is AR's."""
    target, _, out, ar = _captured_int8_call(strategy, "layers_quantization", seed=7)
    assert torch.equal(out, ar)
    rounds = target.__dict__[resident._KEPT]  # HybridSpec's calibration keeps rounds of its own beside the call's
    assert rounds and all(r.key.layers == "int8" for r in rounds)
    assert all(r.context.fused.int8[0][0].weight.is_cuda for r in rounds if r.context is not None)
    hybridspec_hf.release_graphs(target)


def test_the_int8_draft_head_serves_one_requests_block_on_a_gpu():
    """On a GPU the int8 copy serves up to MAX_ROWS rows of logits (one request's block); a batch's drafts read the
    head as it is (the int8 GEMV's limit), and no copy is made for them."""
    from hybridspec_hf.kernels.gemv_triton import MAX_ROWS

    target, drafter = _pair()
    drafter.config.head_quantization = "int8"
    head = target.get_output_embeddings()
    hidden = torch.randn(1, MAX_ROWS + 1, drafter.config.hidden_size, device="cuda")  # e.g. 2 requests' blocks
    with torch.no_grad():
        batch = drafter.compute_logits(hidden)
        assert "_head_int8" not in drafter.__dict__
        one = drafter.compute_logits(hidden[:, :MAX_ROWS])
    assert drafter.__dict__["_head_int8"] is not None
    plain = torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight).float()
    assert torch.equal(batch, plain)
    block = plain[:, :MAX_ROWS]
    assert not torch.equal(one, block) and torch.allclose(one, block, rtol=0.05, atol=0.05 * block.abs().max().item())


@pytest.mark.parametrize("verify_shape", ["max", "exact"])
@pytest.mark.parametrize("strategy", ["hybridspec", "confidence"])
def test_context_lookup_runs_captured_without_syncs_and_equals_ar(verify_shape, strategy, sync_errors):
    """Each round's lookup proposal is made inside the captured draft graph (kernels/lookup_triton.py, over the
    rounds' token buffer), which chooses between it and the drafts; no sync while decoding; greedy output stays AR's
    and copies are verified."""
    from test_context_lookup import always_copy, flat_latency, repetitive_prompt

    prompt = repetitive_prompt(3)
    target, _ = _pair()
    with torch.no_grad():
        ar = target.generate(prompt.cuda(), do_sample=False, max_new_tokens=40)
    target, drafter = _pair(reference=ar.cpu())
    settings = HybridSpecConfig(verify_shape=verify_shape, context_lookup="on", lookup_estimator=always_copy(8),
                                latency_model=flat_latency())
    out = target.generate(prompt.cuda(), do_sample=False, max_new_tokens=40, assistant_model=drafter,
                          generation_strategy=strategy, hybridspec_config=settings)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.path == "cuda_graphs" and telemetry.context_lookup
    assert torch.equal(out.cpu(), ar.cpu())
    assert sum(bool(r.lookup) for r in telemetry.rounds) > 0
