"""Property-based exactness: over random tiny hybrid targets of every supported family, prompts, block sizes,
strategies, verification shapes, max_new_tokens, EOS sets and stop strings, greedy HybridSpec == generate() in
float64 (a divergence is tolerated only at an AR near-tie, counted).

CI runs HYBRIDSPEC_PROPERTY_EXAMPLES examples (default 200, fixed: derandomized). The long run draws fresh examples:

    HYBRIDSPEC_PROPERTY_EXAMPLES=5000 HYBRIDSPEC_PROPERTY_SEED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
        .venv/bin/python -m pytest tests/test_properties.py -q
"""
import os

import torch
from _tiny import FAMILIES, VOCAB, OracleDrafter, build_target, float64_gdn, prepare
from hypothesis import HealthCheck, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from test_exactness import assert_same_as_ar
from test_generate_semantics import char_tokenizer

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.selector import LatencyModel

EXAMPLES = int(os.environ.get("HYBRIDSPEC_PROPERTY_EXAMPLES", "200"))
SEED = os.environ.get("HYBRIDSPEC_PROPERTY_SEED")
STRATEGIES = ("dflash", "static", "confidence", "hybridspec", "nominal", "ratio")
TOKENIZER = char_tokenizer()


@st.composite
def targets(draw):
    """(family, text-config kwargs): small, odd shapes; GDN and attention layers in any order (transformers'
    hybrid cache needs at least one attention layer)."""
    family = draw(st.sampled_from(FAMILIES))
    layers = draw(st.integers(2, 4))
    layer_types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=layers,
                                max_size=layers))
    linear, full = draw(st.permutations(range(layers)))[:2]
    layer_types[linear], layer_types[full] = "linear_attention", "full_attention"
    key_heads = draw(st.integers(1, 2))
    config = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=layers, layer_types=layer_types,
        num_attention_heads=2, num_key_value_heads=draw(st.sampled_from([1, 2])), head_dim=draw(st.sampled_from([8, 12])),
        linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * draw(st.integers(1, 3)),
        linear_key_head_dim=draw(st.sampled_from([4, 6, 8])), linear_value_head_dim=draw(st.sampled_from([4, 6, 8])),
        linear_conv_kernel_dim=draw(st.integers(2, 4)), max_position_embeddings=256,
    )
    if family != "qwen3_5_dense":
        experts = draw(st.integers(2, 5))
        config.update(moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=experts,
                      num_experts_per_tok=draw(st.integers(1, min(3, experts))))
    if family == "qwen3_next":
        config["mlp_only_layers"] = draw(st.lists(st.integers(0, layers - 1), max_size=layers - 1, unique=True))
        config["norm_topk_prob"] = draw(st.booleans())
    return family, config


def latency_model(block_size: int, slope: float) -> LatencyModel:
    """A synthetic calibration (the real one times rounds: too slow per random model, and not the point here)."""
    cost = (1.0 + slope * torch.arange(1, block_size + 1, dtype=torch.float32)).view(1, -1) * 1e-3
    return LatencyModel(cost=cost, cost_ar=cost[:, 0] * 0.9, context_lens=torch.tensor([64]), eta=1e-5)


def example_settings():
    decorators = [settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                           suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])]
    if SEED is not None:
        decorators.append(hypothesis_seed(int(SEED)))

    def apply(test):
        for decorator in decorators:
            test = decorator(test)
        return test

    return apply


@example_settings()
@given(
    target=targets(),
    seed=st.integers(0, 2**16),
    prompt_len=st.integers(1, 24),
    block_size=st.integers(2, 16),
    strategy=st.sampled_from(STRATEGIES),
    verify_shape=st.sampled_from(["max", "exact"]),
    static_length=st.integers(1, 16),
    max_new_tokens=st.integers(1, 40),
    error_rate=st.sampled_from([0.0, 0.1, 0.3, 1.0]),
    eos=st.lists(st.integers(0, 24), max_size=3),  # indices into the free continuation: EOS that really occur
    stop=st.one_of(st.none(), st.tuples(st.integers(0, 24), st.integers(1, 3))),  # (start, length) in it
    slope=st.floats(0.0, 0.5),
)
def test_greedy_hybridspec_equals_generate(target, seed, prompt_len, block_size, strategy, verify_shape,
                                           static_length, max_new_tokens, error_rate, eos, stop, slope):
    family, config = target
    torch.manual_seed(seed)
    model = prepare(build_target(family, config))
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=generator)
    with float64_gdn():
        free = model.generate(prompt, do_sample=False, max_new_tokens=25)[0, prompt_len:]
        options = dict(do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                       output_logits=True, attention_mask=torch.ones_like(prompt))  # pad_token_id may occur in it
        if eos:
            options.update(eos_token_id=sorted({int(free[i % free.numel()]) for i in eos}), pad_token_id=0)
        else:
            options.update(eos_token_id=None)
        if stop is not None:
            start, length = stop
            text = TOKENIZER.decode(free[start % free.numel():][:length])
            if text.strip():
                options.update(stop_strings=[text], tokenizer=TOKENIZER)
        ar = model.generate(prompt, **options)
        torch.manual_seed(seed + 1)
        drafter = OracleDrafter.from_target(model, num_layers=1, block_size=block_size).to(torch.float64).eval()
        drafter.bind_target(model)
        drafter.steer(ar.sequences, error_rate, seed)
        config = HybridSpecConfig(verify_shape=verify_shape, static_length=min(static_length, block_size),
                                  latency_model=latency_model(block_size, slope))
        ours = model.generate(prompt, assistant_model=drafter, generation_strategy=strategy, hybridspec_config=config,
                              **options)
    assert_same_as_ar(ours.sequences, ar)
    rounds = hybridspec_hf.get_telemetry(model).rounds
    assert all(1 <= r.w <= block_size and 0 <= r.accepted < r.w for r in rounds)
    event(f"family {family}, strategy {strategy}")
    event("drafts accepted" if any(r.accepted for r in rounds) else "no draft accepted")
    event("stopped early (EOS or stop string)" if ar.sequences.shape[1] < prompt_len + max_new_tokens else "ran to max_new_tokens")
