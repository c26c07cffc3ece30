"""Clear errors that leave the model usable; plain generate() untouched; the stock refusal kept."""
import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3_5_moe", seed=11)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=12)
    return target, prompt, make_drafter(target, 8, ar), ar


def spec(target, prompt, drafter, **kwargs):
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", 12)
    return target.generate(prompt, assistant_model=drafter, generation_strategy="dflash", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "num_beams=2"),
        (dict(use_cache=False), "use_cache=False"),
        (dict(num_return_sequences=2, num_beams=1), "num_return_sequences"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(cache_implementation="offloaded"), "cache_implementation"),
        (dict(num_assistant_tokens=5), "num_assistant_tokens=5 .*leave it at 20.*static_length"),
        (dict(generation_config=GenerationConfig(num_assistant_tokens_schedule="heuristic", max_new_tokens=12)),
         "num_assistant_tokens_schedule='heuristic'"),
        (dict(assistant_confidence_threshold=0.9), "assistant_confidence_threshold=0.9 .*confidence_threshold"),
        (dict(penalty_alpha=0.6, top_k=4), r"penalty_alpha=0.6 with top_k=4 \(contrastive search\)"),
        (dict(dola_layers="high"), r"dola_layers='high' \(dola generation\)"),
        (dict(token_healing=True), "token_healing=True.*heal_tokens"),
        (dict(generation_config=GenerationConfig(max_new_tokens=12, force_words_ids=[[5]])),
         r"force_words_ids \(constrained beam search\)"),
        (dict(generation_config=GenerationConfig(max_new_tokens=12, prompt_lookup_num_tokens=3)),
         "prompt_lookup_num_tokens=.*is not supported"),
        (dict(hybridspec_config=HybridSpecConfig(static_length=9)), None),  # only an error for "static"
    ],
)
def test_unsupported_options_raise_clearly_and_model_keeps_working(pair, kwargs, message):
    target, prompt, drafter, ar = pair
    if message is None:
        with pytest.raises(ValueError, match="static_length=9 exceeds"):
            target.generate(prompt, assistant_model=drafter, generation_strategy="static", do_sample=False,
                            max_new_tokens=12, **kwargs)
    else:
        with pytest.raises(ValueError, match=message):
            spec(target, prompt, drafter, **kwargs)
    assert torch.equal(spec(target, prompt, drafter), ar)


class CallCounter(LogitsProcessor):
    """A stateful processor: its output depends on how often it was called."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores + self.calls * 0.0


class Shift(LogitsProcessor):
    """Stateless: depends only on (input_ids, scores); opted in."""

    hybridspec_stateless = True

    def __call__(self, input_ids, scores):
        return scores.index_add(1, input_ids[:, -1], torch.full_like(scores[:, :1], 0.5))


def test_stateful_logits_processors_are_refused(pair):
    """Processors run once per verified position, on speculative prefixes: only stateless ones keep AR's output.
    Classifier-free guidance runs the model on its own cache at every call, so rejected drafts would enter it."""
    target, prompt, drafter, ar = pair
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor.*guidance_scale"):
        spec(target, prompt, drafter, guidance_scale=3.0)
    with pytest.raises(ValueError, match="CallCounter.*hybridspec_stateless = True"):
        spec(target, prompt, drafter, logits_processor=LogitsProcessorList([CallCounter()]))
    assert torch.equal(spec(target, prompt, drafter), ar)
    shifted = target.generate(prompt, do_sample=False, max_new_tokens=12, logits_processor=LogitsProcessorList([Shift()]))
    assert torch.equal(spec(target, prompt, drafter, logits_processor=LogitsProcessorList([Shift()])), shifted)


def test_prompt_errors(pair):
    target, prompt, drafter, ar = pair
    with pytest.raises(ValueError, match="prompt is empty"):
        spec(target, prompt[:, :0], drafter)
    too_long = torch.zeros(1, target.config.max_position_embeddings, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        spec(target, too_long, drafter)
    right_padded = torch.cat([prompt, torch.zeros(1, 2, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones_like(prompt), torch.zeros(1, 2, dtype=torch.long)], dim=1)
    with pytest.raises(ValueError, match="not left padding.*padding_side = 'left'"):
        spec(target, right_padded, drafter, attention_mask=mask)
    assert torch.equal(spec(target, prompt, drafter, attention_mask=torch.ones_like(prompt)), ar)


def test_strategy_and_drafter_errors(pair):
    target, prompt, drafter, _ = pair
    with pytest.raises(ValueError, match="generation_strategy must be one of"):
        target.generate(prompt, assistant_model=drafter, generation_strategy="medusa")
    with pytest.raises(ValueError, match="needs a drafter"):
        target.generate(prompt, generation_strategy="hybridspec")
    with pytest.raises(TypeError, match="DFlashDrafter"):
        target.generate(prompt, assistant_model=target, generation_strategy="dflash")
    with pytest.raises(ValueError, match="without generation_strategy"):
        target.generate(prompt, hybridspec_config=HybridSpecConfig())
    other = make_target("qwen3_next")
    with pytest.raises(ValueError):
        target.generate(prompt, assistant_model=make_drafter(other, 8), generation_strategy="dflash")


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda p: dict(input_ids=p.float()), TypeError, "integer token ids"),
        (lambda p: dict(input_ids=p + VOCAB), ValueError, f"token ids in 0..{VOCAB - 1}"),
        (lambda p: dict(input_ids=p - VOCAB), ValueError, "token ids in"),
        (lambda p: dict(synced_gpus=True), ValueError, "synced_gpus"),
        (lambda p: dict(hybridspec_config=HybridSpecConfig(selector=object())), TypeError, "LengthSelector"),
        (lambda p: dict(hybridspec_config=HybridSpecConfig(acceptance_estimator=123)), TypeError,
         "AcceptanceEstimator or a path"),
    ],
)
def test_invalid_inputs_raise_clearly_and_model_keeps_working(pair, make, error, message):
    target, prompt, drafter, ar = pair
    with pytest.raises(error, match=message):
        kwargs = make(prompt)
        ids = kwargs.pop("input_ids", prompt)
        target.generate(ids, assistant_model=drafter, generation_strategy="confidence", do_sample=False,
                        max_new_tokens=12, **kwargs)
    assert torch.equal(spec(target, prompt, drafter), ar)


@pytest.mark.parametrize("key", ["custom_generate", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp",
                                 "assistant_tokenizer", "inputs_embeds", "negative_prompt_ids"])
def test_every_unsupported_generate_kwarg_is_refused(pair, key):
    target, prompt, drafter, ar = pair
    with pytest.raises(ValueError, match=f"{key}=.*is not supported"):
        spec(target, prompt, drafter, **{key: 1})


@pytest.mark.parametrize("block_size, backend, message", [(0, "auto", "block_size=0"), (1, "torch", "block_size=1"),
                                                          (17, "triton", "at most 16")])
def test_block_size_outside_what_the_loop_runs_is_refused(pair, block_size, backend, message):
    target, prompt, drafter, ar = pair
    bad = make_drafter(target, 8)
    bad.config.block_size = block_size
    with pytest.raises(ValueError, match=message):
        spec(target, prompt, bad, hybridspec_config=HybridSpecConfig(kernel_backend=backend))
    assert torch.equal(spec(target, prompt, drafter), ar)


def test_drafter_in_another_dtype_is_supported(pair, fp64_gdn):
    """The drafter casts the target's features to its own dtype: a float32 drafter on a float64 target only
    changes the drafts, never the output."""
    target, prompt, drafter, ar = pair
    assert torch.equal(spec(target, prompt, make_drafter(target, 8, ar, error_rate=0.0).float()), ar)
    assert max(r.accepted for r in hybridspec_hf.get_telemetry(target).rounds) > 0


def test_drafter_mismatch_is_reported(pair):
    target, prompt, drafter, _ = pair
    bad = make_drafter(target, 8)
    bad.config.target_layer_ids = [0, 99]
    with pytest.raises(ValueError, match="99"):
        spec(target, prompt, bad)


def test_unsupported_target_is_reported():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    target = make_target("qwen3_5_moe")
    with pytest.raises(ValueError, match="HybridSpec supports hybrid Gated-DeltaNet targets"):
        llama.generate(torch.ones(1, 3, dtype=torch.long), assistant_model=make_drafter(target, 8),
                       generation_strategy="hybridspec")


def test_a_dflash_drafter_without_generation_strategy_is_refused_with_what_to_pass(pair):
    """Stock assisted decoding cannot run our drafter (it drafts from the target's features): a clear error in every
    transformers version (< 5.25 refused the stateful target; 5.25 would fail inside its candidate generator)."""
    target, prompt, drafter, ar = pair
    with pytest.raises(ValueError, match="generation_strategy='hybridspec'"):
        target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=5)
    assert torch.equal(spec(target, prompt, drafter), ar)


def test_stock_assisted_decoding_with_an_ordinary_assistant_is_transformers_own(pair):
    """An ordinary assistant model without generation_strategy: transformers decides. Before 5.25 it refuses the
    stateful target (our note says what to do); from 5.25 on it runs its own assisted decoding, and our patches
    leave that path as it is (the same tokens as with the patched methods put back to transformers' own). Not
    asserted: that it equals AR (benchmarks/results/stock_assisted_tf525.md: 5.25 keeps one GDN state too few)."""
    target, prompt, drafter, expected = pair
    torch.manual_seed(0)
    assistant = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             pad_token_id=0)).to(torch.float64)
    options = dict(assistant_model=assistant, do_sample=False, max_new_tokens=12)
    if getattr(type(target), "_is_stateful", False):
        with pytest.raises(ValueError, match="stateful") as raised:
            target.generate(prompt, **options)
        assert any("generation_strategy='hybridspec'" in note for note in raised.value.__notes__)
    else:
        patched = target.generate(prompt, **options)
        gdn_cls, lm_cls = modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet, modeling_qwen3_5_moe.Qwen3_5MoeForCausalLM
        saved = gdn_cls.forward, lm_cls.generate
        gdn_cls.forward, lm_cls.generate = gdn_cls._hybridspec_original_forward, lm_cls._hybridspec_original_generate
        try:
            stock = target.generate(prompt, **options)
        finally:
            gdn_cls.forward, lm_cls.generate = saved
        assert torch.equal(patched, stock) and patched.shape[1] == prompt.shape[1] + 12
    assert torch.equal(spec(target, prompt, drafter), expected)  # the model still runs HybridSpec afterwards


def test_plain_generate_is_unaffected_by_the_patches():
    """Outputs and caches of plain generate() equal those with every patch removed."""
    gdn_cls = modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet
    lm_cls = modeling_qwen3_5_moe.Qwen3_5MoeForCausalLM
    target = make_target("qwen3_5_moe", seed=5, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 9))
    patched = target.generate(prompt, do_sample=False, max_new_tokens=20, return_dict_in_generate=True, output_logits=True)
    saved = gdn_cls.forward, lm_cls.generate
    gdn_cls.forward, lm_cls.generate = gdn_cls._hybridspec_original_forward, lm_cls._hybridspec_original_generate
    try:
        stock = target.generate(prompt, do_sample=False, max_new_tokens=20, return_dict_in_generate=True, output_logits=True)
    finally:
        gdn_cls.forward, lm_cls.generate = saved
    assert torch.equal(patched.sequences, stock.sequences)
    for mine, theirs in zip(patched.logits, stock.logits, strict=True):
        assert torch.equal(mine, theirs)


def test_enable_is_idempotent():
    before = modeling_qwen3_5_moe.Qwen3_5MoeForCausalLM.generate
    hybridspec_hf.enable()
    hybridspec_hf.enable()
    assert modeling_qwen3_5_moe.Qwen3_5MoeForCausalLM.generate is before


@pytest.mark.parametrize("options, error, message", [
    (dict(static_length=0), ValueError, "static_length must be an int ≥ 1"),
    (dict(static_length=True), ValueError, "static_length must be an int ≥ 1"),
    (dict(static_length=2.5), ValueError, "static_length must be an int ≥ 1"),
    (dict(confidence_threshold=1.5), ValueError, r"confidence_threshold is a probability in \[0, 1\]"),
    (dict(kernel_backend="cuda"), ValueError, "kernel_backend must be one of"),
    (dict(verify_shape="bogus"), ValueError, "verify_shape must be one of"),
    (dict(cuda_graphs=True), ValueError, "cuda_graphs must be one of"),
    (dict(calibration="never"), ValueError, "calibration must be one of"),
    (dict(gdn_verifier="fast"), ValueError, "gdn_verifier must be one of"),
    (dict(latency_model=3), TypeError, "latency_model must be a LatencyModel or a path"),
])
def test_hybridspec_config_rejects_bad_values_by_name(options, error, message):
    with pytest.raises(error, match=message):
        HybridSpecConfig(**options)


def test_a_missing_file_named_in_the_config_is_reported_at_the_call(pair, tmp_path):
    target, prompt, drafter, ar = pair
    missing = tmp_path / "missing.json"
    for options, message in [(dict(latency_model=str(missing)), "Could not read a latency model"),
                             (dict(acceptance_profile=str(missing)), "No acceptance profile at .*benchmarks/profiles")]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            target.generate(prompt, assistant_model=drafter, generation_strategy="hybridspec", do_sample=False,
                            max_new_tokens=12, hybridspec_config=HybridSpecConfig(**options))
    assert torch.equal(spec(target, prompt, drafter), ar)
