"""Fused decoder layers (patches/_decoder.py: residual add + post_attention_layernorm in one launch) and the attention's
q|k|v as one GEMM (patches/_attention.py) against transformers' own forwards on tiny models of every family (CPU,
Triton interpreter, the fused route forced onto CPU tensors), in the installed transformers version.

Tolerances, relative Frobenius error of logits and every hidden state: fp32 1e-6 (measured ~1.3e-7: the residual
sums are the same IEEE sums; only the order of the norm's fp32 sum of squares and of the one GEMM's sums differ),
bf16 3e-2 (measured ~1.2e-2: the interpreter truncates fp32 -> bf16 casts where torch rounds to nearest, one bf16
ulp on the sum and on the norm, carried through the layers). float64 does not take the fused layer (its kernel
computes in fp32): there the output is transformers' bit for bit.
"""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from _tiny import VOCAB, make_target  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import hybridspec_hf  # noqa: E402,F401  (installs the patches)
from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.patches import _attention, _decoder  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = {torch.float32: 1e-6, torch.bfloat16: 3e-2}
NAMES = ["qwen3_5_moe", "qwen3_5_moe_odd", "qwen3_next", "qwen3_5_dense"]


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    error = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error < TOL[expected.dtype], f"relative error {error:.3g} in {expected.dtype}"


@pytest.fixture
def calls(monkeypatch):
    """The fused decoder route allowed on CPU tensors, with counters of its fused launches: `add_rms_norm` (one per
    fused layer) and the one q|k|v GEMM (one per fused attention layer)."""
    counts = {"add_rms_norm": 0, "qkv": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(_decoder, "add_rms_norm", counted("add_rms_norm", _decoder.add_rms_norm))
    monkeypatch.setattr(_attention, "linear", counted("qkv", _attention.linear))
    monkeypatch.setattr(_decoder, "_ON_CPU", True)
    return counts


def cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward(model, ids, fused: bool, cache=None):
    """Logits and every hidden state (transformers' output capturing), as a resident forward (fused) or plain."""
    kwargs = {cache_kwarg(model): cache} if cache is not None else {"use_cache": False}
    with torch.no_grad():
        if fused:
            with patches.fused_kernels():
                out = model(ids, output_hidden_states=True, **kwargs)
        else:
            out = model(ids, output_hidden_states=True, **kwargs)
    return [out.logits, *out.hidden_states]


def prepared(name: str, dtype: torch.dtype, seed: int = 3):
    model = make_target(name, seed=seed, dtype=dtype)
    patches.prepare_attention_projections(patches.attention_layers(model))
    return model


def layers_of(model) -> list[torch.nn.Module]:
    return list(patches.text_model(model).layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_fused_layers_equal_transformers(name, dtype, calls):
    model = prepared(name, dtype)
    attention = patches.attention_layers(model)
    assert attention and all(_attention._QKV in a.__dict__ for a in attention)
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 5, 16):
        ids = torch.randint(0, VOCAB, (1, tokens), generator=gen)
        for fused, plain in zip(forward(model, ids, True), forward(model, ids, False)):
            assert_near(fused, plain)
    layers = len(layers_of(model))
    assert calls == {"add_rms_norm": 3 * layers, "qkv": 3 * len(attention)}
    for a in attention:  # the projections' own forwards are back
        assert all("forward" not in getattr(a, n).__dict__ for n in _attention.QKV_PROJECTIONS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_moe_layers_add_norm_and_route_in_one_launch(name, dtype, calls, monkeypatch):
    """With the fused MoE route on (the block's shared-expert copy made), every MoE layer runs its residual add,
    post_attention_layernorm and router in one launch (`_moe.norm_route_block_add`) up to 16 tokens and
    add_rms_norm + the router beyond; the logits and hidden states stay transformers'."""
    from hybridspec_hf.kernels import router_triton
    from hybridspec_hf.patches import _moe

    monkeypatch.setattr(_moe, "_ON_CPU", True)
    launched = []
    fused = router_triton.add_norm_route
    monkeypatch.setattr(router_triton, "add_norm_route", lambda *a: launched.append(1) or fused(*a))
    model = prepared(name, dtype)
    moe = patches.moe_blocks(model)
    patches.prepare_fused_moe(moe)
    gen = torch.Generator().manual_seed(8)
    for tokens in (1, 5, 16, 17):
        ids = torch.randint(0, VOCAB, (1, tokens), generator=gen)
        for fused_out, plain in zip(forward(model, ids, True), forward(model, ids, False)):
            assert_near(fused_out, plain)
    layers = len(layers_of(model))
    assert moe and len(launched) == 3 * len(moe)
    assert calls["add_rms_norm"] == 3 * (layers - len(moe)) + layers  # the dense layers, and all at 17 tokens


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_the_input_norm_is_left_to_the_mixer_only_where_nothing_sees_the_raw_rows(name, calls, monkeypatch):
    """The fused layer leaves input_layernorm to its token mixer (applied in the projection's prologue or by the
    module, once, first thing in the mixer's forward) only while the switch is on and the norm and the mixer have
    nothing else to run: a pre-hook on a mixer sees the normed rows, as in transformers; the parked norm never
    outlives the call; the outputs stay transformers'."""
    from hybridspec_hf.kernels import gemv_triton
    from hybridspec_hf.patches._norms import INPUT_NORM

    monkeypatch.setattr(gemv_triton, "NORM_PROLOGUE", True)  # (A/B switch, off by default)
    model = prepared(name, torch.float32)
    layers = layers_of(model)
    mixers = [layer.linear_attn if layer.block_type == "linear_attention" else layer.self_attn for layer in layers]
    assert all(_decoder._defers_input_norm(layer, mixer) for layer, mixer in zip(layers, mixers))
    seen = []
    handle = mixers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["hidden_states"]),
                                                 with_kwargs=True)
    assert not _decoder._defers_input_norm(layers[0], mixers[0]) and _decoder._defers_input_norm(layers[1], mixers[1])
    normed = []
    layers[0].input_layernorm.register_forward_hook(lambda module, args, output: normed.append(output))
    ids = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(4))
    for fused, plain in zip(forward(model, ids, True), forward(model, ids, False)):
        assert_near(fused, plain)
    assert len(seen) == 2 and torch.equal(seen[0], normed[0])  # the fused forward's: the norm's output
    handle.remove()
    assert not any(INPUT_NORM in mixer.__dict__ for mixer in mixers)
    monkeypatch.setattr(gemv_triton, "NORM_PROLOGUE", False)
    assert not any(_decoder._defers_input_norm(layer, mixer) for layer, mixer in zip(layers, mixers))


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "qwen3_5_dense"])
def test_fused_layers_pass_the_cache_as_transformers_does(name, calls):
    """Prefill then two decoding steps on a cache: the GDN and attention layers get the cache under the name this
    transformers version uses (5.17: cache_params / past_key_values; 5.23+: cache), so states and keys advance
    as in transformers' forward."""
    model = prepared(name, torch.float32, seed=4)
    gen = torch.Generator().manual_seed(6)
    steps = [torch.randint(0, VOCAB, (1, t), generator=gen) for t in (5, 1, 3)]
    fused_cache, plain_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for ids in steps:
        fused, plain = forward(model, ids, True, fused_cache), forward(model, ids, False, plain_cache)
        for a, b in zip(fused, plain):
            assert_near(a, b)
    assert calls["add_rms_norm"] == 3 * len(layers_of(model))


def test_float64_keeps_transformers_bit_for_bit(calls):
    model = prepared("qwen3_5_moe", torch.float64)
    ids = torch.randint(0, VOCAB, (1, 4))
    for fused, plain in zip(forward(model, ids, True), forward(model, ids, False)):
        assert torch.equal(fused, plain)
    assert calls["add_rms_norm"] == 0


def test_inert_outside_the_flag_with_grad_and_on_cpu(calls, monkeypatch):
    model = prepared("qwen3_next", torch.float32)
    ids = torch.randint(0, VOCAB, (1, 3))
    forward(model, ids, False)  # flag off
    with patches.fused_kernels():
        model(ids, use_cache=False)  # grad on
    monkeypatch.setattr(_decoder, "_ON_CPU", False)
    forward(model, ids, True)  # CPU tensors: transformers' layers; the q|k|v copy is used wherever it is current
    assert calls["add_rms_norm"] == 0 and calls["qkv"] == len(patches.attention_layers(model))


def test_hooks_on_skipped_modules_keep_transformers_and_hooks_on_layers_see_the_same_output(calls):
    """A hook on post_attention_layernorm keeps that layer's transformers forward, a hook on k_proj that attention's
    three projections (the hook fires once per forward); forward hooks on the layers (FeatureCapture's) see the
    outputs transformers' layers give."""
    model = prepared("qwen3_5_moe", torch.float32)
    layers = layers_of(model)
    attention = patches.attention_layers(model)[0]
    ids = torch.randint(0, VOCAB, (1, 4))
    seen = {"norm": 0, "k_proj": 0}
    captured: list[torch.Tensor] = []

    def count(name):
        return lambda *args: seen.__setitem__(name, seen[name] + 1)

    handles = [layers[0].post_attention_layernorm.register_forward_hook(count("norm")),
               attention.k_proj.register_forward_hook(count("k_proj")),
               *(layer.register_forward_hook(lambda m, a, out: captured.append(out)) for layer in layers)]
    fused = forward(model, ids, True)
    assert calls == {"add_rms_norm": len(layers) - 1, "qkv": 0}
    assert seen == {"norm": 1, "k_proj": 1}
    fused_layers, captured[:] = list(captured), []
    for a, b in zip(fused, forward(model, ids, False)):
        assert_near(a, b)
    assert len(fused_layers) == len(captured) == len(layers)
    for a, b in zip(fused_layers, captured):
        assert_near(a, b)
    for handle in handles:
        handle.remove()


def test_the_layer_keeps_its_signature_and_unknown_calls_run_the_original():
    for family in patches._families():
        layer_cls = family.DECODER_LAYER_CLASS
        original = layer_cls.__dict__["_hybridspec_original_forward"]  # installed for this transformers version
        assert inspect.signature(layer_cls.forward) == inspect.signature(original)
    names = ("position_embeddings", "attention_mask", "position_ids", "cache")
    pe, mask, cache = object(), object(), object()
    arguments, rest = _decoder._bind(names, (pe, mask), {"cache": cache, "output_attentions": False})
    assert arguments == {"position_embeddings": pe, "attention_mask": mask, "cache": cache}
    assert rest == {"output_attentions": False}
    assert _decoder._bind(names, (pe,), {"past_key_values": cache}) is None  # the deprecated name: the original's
    assert _decoder._bind(names, (pe,), {"position_embeddings": pe}) is None  # given twice
    assert _decoder._bind(names, (), {"attention_mask": mask}) is None  # position_embeddings missing
    assert _decoder._bind(names, (pe, mask, None, cache, 1), {}) is None  # too many


def test_qkv_copy_follows_in_place_updates_at_the_same_address_and_is_released(calls):
    model = prepared("qwen3_5_moe", torch.float32, seed=6)
    layers = patches.attention_layers(model)
    attention = layers[0]
    copy = attention.__dict__[_attention._QKV].weight
    address = copy.data_ptr()
    ids = torch.randint(0, VOCAB, (1, 3))
    with torch.no_grad():
        attention.k_proj.weight.mul_(-2.0)
    for a, b in zip(forward(model, ids, True), forward(model, ids, False)):
        assert_near(a, b)  # a stale copy is not used ...
    assert calls["qkv"] == 0  # ... the three projections run
    patches.prepare_attention_projections(layers)  # what every generate() call's start does
    assert attention.__dict__[_attention._QKV].weight.data_ptr() == address
    q_rows = attention.q_proj.out_features
    assert torch.equal(copy[q_rows : q_rows + attention.k_proj.out_features], attention.k_proj.weight)
    for a, b in zip(forward(model, ids, True), forward(model, ids, False)):
        assert_near(a, b)
    assert calls["qkv"] == 1
    patches.release_attention_projections(layers)
    assert all(_attention._QKV not in a.__dict__ for a in layers)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_5_dense"])
def test_resident_rounds_run_the_fused_layers_and_release_the_copies(name, calls):
    from test_exactness import resident_and_ar

    target = make_target(name, seed=8, dtype=torch.float32)
    out, ar = resident_and_ar(target, 8, 5, 6)
    assert torch.equal(out, ar)
    assert calls["add_rms_norm"] > 0 and calls["qkv"] > 0
    layers = patches.attention_layers(target)
    assert all(_attention._QKV in a.__dict__ for a in layers)
    hybridspec_hf.release_graphs(target)
    assert all(_attention._QKV not in a.__dict__ for a in layers)


@pytest.mark.parametrize("switches", [(), ("CONV_GATES", "ROUTE_WIDE_ROUNDS")],
                         ids=["defaults", "conv_gates-route_wide"])
def test_resident_rounds_with_the_fused_moe_stay_exact_under_the_prepared_switches(switches, calls, monkeypatch):
    """Whole HybridSpec calls through the fused decoder, MoE blocks included, equal AR (fp32) with the defaults and
    with two switches that are off by default turned on: a GDN verification's conv and gates in one launch, the
    wide router programs."""
    from test_exactness import resident_and_ar

    from hybridspec_hf.kernels import gdn_prologue_triton, moe_triton, router_triton
    from hybridspec_hf.patches import _gdn, _moe

    monkeypatch.setattr(_moe, "_ON_CPU", True)
    owners = {"CONV_GATES": gdn_prologue_triton, "ROUTE_WIDE_ROUNDS": router_triton}
    for name, owner in owners.items():
        monkeypatch.setattr(owner, name, name in switches)
    launched, routed, conv_gates = [], [], []
    sum_kernel = moe_triton._sum_kernel
    monkeypatch.setattr(moe_triton, "_sum_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or sum_kernel[grid]})())
    fused_route, one_launch = router_triton.add_norm_route, _gdn.conv_silu_gates
    monkeypatch.setattr(router_triton, "add_norm_route", lambda *a: routed.append(1) or fused_route(*a))
    monkeypatch.setattr(_gdn, "conv_silu_gates", lambda *a, **k: conv_gates.append(1) or one_launch(*a, **k))
    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    out, ar = resident_and_ar(target, 9, 5, 6)
    hybridspec_hf.release_graphs(target)
    assert torch.equal(out, ar)
    assert routed  # the fused MoE route ran
    assert launched  # the direct rows ran (a verification's block)
    assert bool(conv_gates) == ("CONV_GATES" in switches)


def test_the_environment_switch_keeps_transformers_layers_and_makes_no_copy(calls, monkeypatch):
    monkeypatch.setenv("HYBRIDSPEC_FUSED_DECODER", "0")
    model = prepared("qwen3_5_moe", torch.float32)
    assert all(_attention._QKV not in a.__dict__ for a in patches.attention_layers(model))
    ids = torch.randint(0, VOCAB, (1, 3))
    for fused, plain in zip(forward(model, ids, True), forward(model, ids, False)):
        assert torch.equal(fused, plain)
    assert calls == {"add_rms_norm": 0, "qkv": 0}


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")  # renamed in 5.24
def test_gradient_checkpointing_still_checkpoints_the_patched_layers():
    """transformers 5.24 wraps each checkpointing layer class's forward at class creation and checkpoints only
    through that wrapper: the patched class must keep it outermost, so training still checkpoints every layer."""
    model = make_target("qwen3_5_moe", seed=2, dtype=torch.float32).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = layers_of(model)
    used = []
    for layer in layers:
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, f=checkpoint, **k: used.append(1) or f(*a, **k)
    model(torch.randint(0, VOCAB, (1, 4)), use_cache=False).logits.sum().backward()
    assert len(used) == len(layers)
