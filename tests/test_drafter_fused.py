"""The drafter's fused resident path (drafter/fused.py, kernels/dflash_triton.py) against its references and the eager
drafter (CPU, Triton interpreter, the fused path forced onto CPU tensors with `fused._ON_CPU`).

Tolerances. Kernels in fp32: 1e-6 relative to the largest output (only the order of the fp32 sum of squares
differs; the roundings to fp32 are the identity). bf16: two roundings of the model dtype (2^-6 relative): the
interpreter truncates fp32 -> bf16 casts where torch rounds to nearest. Whole drafts in fp32: the static path's
1e-5 relative to the largest logit (tests/test_drafter.py), every draft token equal, signals to 1e-5.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from _tiny import make_target  # noqa: E402
from test_drafter import _SCHEDULE, _eager_rounds, _round_inputs, _static_drafter, _static_rounds  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.drafter import StaticDraftContext, fused  # noqa: E402
from hybridspec_hf.kernels import dflash_triton, gemv_triton  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import GemvConfig  # noqa: E402
from hybridspec_hf.selector.survival import draft_signals  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _close(actual, expected, rtol):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * expected.abs().max().item())


# ------------------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("q_heads,layers", [(3, 1), (0, 3)], ids=["block", "context"])
def test_qk_norm_rope_store_equals_its_reference(q_heads, layers, dtype):
    """Odd head_dim (24: a masked 32-wide block), 2 KV heads, rows of different lengths (one writing the last
    slot): queries, keys and values as the reference writes them, every other slot untouched."""
    generator = torch.Generator().manual_seed(3)
    batch, tokens, kv_heads, dim, slots = 2, 5, 2, 24, 13

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    x = randn(batch, tokens, layers * (q_heads + 2 * kv_heads) * dim)
    q_weight = (torch.rand(layers, dim, generator=generator) + 0.5).to(dtype) if q_heads else None
    k_weight = (torch.rand(layers, dim, generator=generator) + 0.5).to(dtype)
    cos, sin = randn(slots, dim), randn(slots, dim)
    length = torch.tensor([0, slots - tokens])
    keys, values = randn(layers, batch, kv_heads, slots, dim), randn(layers, batch, kv_heads, slots, dim)
    outputs = []
    for function in (dflash_triton.qk_norm_rope_store, dflash_triton.qk_norm_rope_store_reference):
        k, v = keys.clone(), values.clone()
        q = torch.zeros(batch, tokens, q_heads, dim, dtype=dtype) if q_heads else None
        function(x, q_heads, kv_heads, q_weight, k_weight, 1e-6, cos, sin, length, k, v, q)
        outputs.append((k, v, q))
    (k, v, q), (k_ref, v_ref, q_ref) = outputs
    rtol = 1e-6 if dtype == torch.float32 else 2 ** -6
    _close(k.float(), k_ref.float(), rtol)
    assert torch.equal(v, v_ref)  # values are copied, never rounded
    if q_heads:
        _close(q.float(), q_ref.float(), rtol)
    assert not torch.equal(k, keys) and torch.equal(k[:, 0, :, tokens:], keys[:, 0, :, tokens:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "norm_only"])
def test_add_rms_norm_equals_its_reference(with_delta, dtype):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 37, generator=generator).to(dtype)  # 37 columns: a masked 64-wide block
    delta = torch.randn(2, 3, 37, generator=generator).to(dtype) if with_delta else None
    weight = (torch.rand(37, generator=generator) + 0.5).to(dtype)
    h, y = dflash_triton.add_rms_norm(x, delta, weight, 1e-6)
    h_ref, y_ref = dflash_triton.add_rms_norm_reference(x, delta, weight, 1e-6)
    if delta is None:
        assert h is x
    else:  # one rounding of an exact fp32 sum: equal in fp32, one bf16 rounding (truncation here) apart in bf16
        torch.testing.assert_close(h.float(), h_ref.float(), rtol=0 if dtype == torch.float32 else 2 ** -7, atol=0)
    _close(y.float(), y_ref.float(), 1e-6 if dtype == torch.float32 else 2 ** -6)


# ----------------------------------------------------------------------------------------------- the fused path
@pytest.fixture
def fused_calls(monkeypatch):
    """The fused path allowed on CPU tensors, counting its drafts and appends."""
    calls = {"draft": 0, "append": 0}

    def counting(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(fused, "_ON_CPU", True)
    monkeypatch.setattr(fused, "draft", counting("draft", fused.draft))
    monkeypatch.setattr(fused, "append", counting("append", fused.append))
    return calls


def _fused_rounds(drafter, steps, batch, ctx=None):
    with patches.fused_kernels():
        return _static_rounds(drafter, steps, batch, ctx=ctx)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("layers", ["full", "sliding", "causal"])
def test_fused_drafts_equal_eager_drafts(layers, batch, fused_calls):
    """Every draft of the schedule (device-side and host counts, junk rows past the count): logits, draft tokens and
    signals as the eager drafter's (float32)."""
    drafter = _static_drafter(torch.float32, layers)
    steps = _round_inputs(drafter, batch, junk=lambda rows, width: 1e3 * torch.randn(rows, width))
    eager = _eager_rounds(drafter, steps, batch)
    fast = _fused_rounds(drafter, steps, batch)
    assert fused_calls == {"draft": sum(d for *_, d in _SCHEDULE), "append": len(_SCHEDULE)}
    for static, expected in zip(fast, eager, strict=True):
        _close(static, expected, 1e-5)
        assert torch.equal(static.argmax(-1), expected.argmax(-1))
        for name, value in draft_signals(static).items():
            torch.testing.assert_close(value, draft_signals(expected)[name], rtol=1e-5, atol=1e-5)


def test_fused_context_equals_the_eager_static_context(fused_calls):
    """The context K/V every layer holds after the schedule's appends, stored by one launch for all layers."""
    drafter = _static_drafter(torch.float32, "sliding")
    steps = _round_inputs(drafter, 2, junk=lambda rows, width: torch.randn(rows, width))
    contexts = [StaticDraftContext(drafter, 24, drafter.device, drafter.dtype, batch_size=2) for _ in range(2)]
    _static_rounds(drafter, steps, 2, ctx=contexts[0])
    _fused_rounds(drafter, steps, 2, ctx=contexts[1])
    assert fused_calls["append"] == len(_SCHEDULE)
    live = contexts[0].positions[None, None, :, None] < contexts[0].length[:, None, None, None]  # [B, 1, S, 1]
    for eager, fast in zip(contexts[0].keys + contexts[0].values, contexts[1].keys + contexts[1].values, strict=True):
        _close(torch.where(live, fast, 0), torch.where(live, eager, 0), 1e-6)


def test_fused_projections_take_the_skinny_gemm(fused_calls, monkeypatch):
    """With gemv_triton's table naming every shape, the drafter's projections run our GEMM on the copies (q|k|v,
    gate|up, all layers' k|v) and its own o_proj, down_proj and fc weights; drafts still equal the eager ones."""
    drafter = _static_drafter(torch.float32)
    steps = _round_inputs(drafter, 1, junk=lambda rows, width: torch.randn(rows, width))
    eager = _eager_rounds(drafter, steps, 1)
    seen, launch = set(), gemv_triton.gemv

    def counted(x, weight, bias, config, norm=None):
        seen.add(weight.data_ptr())
        return launch(x, weight, bias, config, norm)

    monkeypatch.setattr(gemv_triton, "gemv", counted)
    monkeypatch.setattr(gemv_triton, "_FORCE", GemvConfig(16, 16, 2))
    ctx = StaticDraftContext(drafter, 24, drafter.device, drafter.dtype)
    for static, expected in zip(_fused_rounds(drafter, steps, 1, ctx=ctx), eager, strict=True):
        _close(static, expected, 1e-5)
    copies = ctx.fused
    own = [drafter.fc.weight] + [w for layer in drafter.layers for w in (layer.self_attn.o_proj.weight,
                                                                            layer.mlp.down_proj.weight)]
    assert seen == {w.data_ptr() for w in [*copies.qkv, *copies.gate_up, copies.context_kv, *own]}


def test_hooks_and_stale_copies_keep_the_eager_path(fused_calls):
    """A hook on a drafter module, or a weight changed in place since the copies, keeps the eager path (so the hook
    runs and the new weight counts); `reset()` refreshes the copies in place and the fused path resumes."""
    drafter = _static_drafter(torch.float32)
    steps = _round_inputs(drafter, 1, junk=lambda rows, width: torch.randn(rows, width))
    ctx = StaticDraftContext(drafter, 24, drafter.device, drafter.dtype)
    address = ctx.fused.qkv[0].data_ptr()
    ran = []
    handle = drafter.layers[0].mlp.register_forward_hook(lambda *args: ran.append(True))
    _fused_rounds(drafter, steps, 1, ctx=ctx)
    handle.remove()
    assert ran and fused_calls == {"draft": 0, "append": 0}
    with torch.no_grad():
        drafter.layers[1].self_attn.k_proj.weight.mul_(1.5)
    ctx.reset()
    assert ctx.fused.qkv[0].data_ptr() == address  # rewritten in place: captured graphs see the new weights
    with torch.no_grad():
        drafter.layers[0].mlp.up_proj.weight.mul_(0.5)  # stale from here until the next reset
    ctx.reset()
    for static, expected in zip(_fused_rounds(drafter, steps, 1, ctx=ctx), _eager_rounds(drafter, steps, 1),
                                strict=True):
        _close(static, expected, 1e-5)
    assert fused_calls["draft"] > 0
    with torch.no_grad():
        drafter.layers[0].mlp.up_proj.weight.mul_(2.0)
    calls = dict(fused_calls)
    ctx.length.zero_()
    _fused_rounds(drafter, steps, 1, ctx=ctx)
    assert fused_calls == calls  # stale copies: the eager path ran


def test_eager_and_training_paths_never_take_the_fused_path(fused_calls):
    """Outside `fused_kernels()`, with grad on, or training, nothing changes."""
    drafter = _static_drafter(torch.float32)
    steps = _round_inputs(drafter, 1, junk=lambda rows, width: torch.randn(rows, width))
    _static_rounds(drafter, steps, 1)
    drafter.train()
    _fused_rounds(drafter, steps, 1)
    assert fused_calls == {"draft": 0, "append": 0}


def test_resident_generate_with_the_fused_drafter_equals_ar(fused_calls):
    """A whole resident generate() (greedy, float32) with the drafter's fused path: AR's tokens."""
    from test_exactness import resident_and_ar

    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    out, ar = resident_and_ar(target, 9, 7, 12)
    assert torch.equal(out, ar)
    assert fused_calls["draft"] > 0 and fused_calls["append"] > 0
    hybridspec_hf.release_graphs(target)


# ------------------------------------------------------------------------------------------ int8 layer projections
def _active(drafter, ctx) -> bool:
    with patches.fused_kernels(), torch.no_grad():
        return fused.active(drafter, ctx)


def test_int8_layers_draft_as_the_dequantized_weights_do(fused_calls, monkeypatch):
    """config.layers_quantization "int8": the fused drafts multiply by the int8 copies (every projection of every
    layer: the drafts equal those of a drafter holding the dequantized weights, whose context k|v stay the weights
    as they are, to fp32 summation order), differ from the plain weights' drafts and stay within a few % of them;
    the copies are refreshed in place."""
    drafter = _static_drafter(torch.float32)
    steps = _round_inputs(drafter, 1, junk=lambda rows, width: torch.randn(rows, width))
    plain = _fused_rounds(drafter, steps, 1)
    int8_calls, launch = [], gemv_triton.linear_int8
    monkeypatch.setattr(fused, "linear_int8", lambda x, q: int8_calls.append(q.weight.data_ptr()) or launch(x, q))
    drafter.config.layers_quantization = "int8"
    ctx = StaticDraftContext(drafter, 24, drafter.device, drafter.dtype)
    assert len(ctx.fused.int8) == len(drafter.layers) and ctx.fused.int8[0][0].weight.dtype == torch.int8
    quantized = _fused_rounds(drafter, steps, 1, ctx=ctx)
    twin = fused.int8_equivalent(drafter)
    assert twin.config.layers_quantization is None and drafter.config.layers_quantization == "int8"
    twin_ctx = StaticDraftContext(twin, 24, twin.device, twin.dtype)
    twin_ctx.fused.context_kv.copy_(ctx.fused.context_kv)  # the context's k|v stay the weights as they are
    expected = _fused_rounds(twin, steps, 1, ctx=twin_ctx)
    drafts = sum(d for *_, d in _SCHEDULE)
    assert len(int8_calls) == drafts * 4 * len(drafter.layers)
    assert {ptr for ptr in int8_calls} == {q.weight.data_ptr() for layer in ctx.fused.int8 for q in layer}
    for mine, theirs, bf16 in zip(quantized, expected, plain, strict=True):
        _close(mine, theirs, 1e-5)
        assert not torch.equal(mine, bf16)
        _close(mine, bf16, 0.05)
    address = ctx.fused.int8[1][3].weight.data_ptr()
    with torch.no_grad():
        drafter.layers[1].mlp.down_proj.weight.mul_(2.0)
    assert not _active(drafter, ctx)  # stale: the eager path until the next reset
    ctx.reset()
    assert ctx.fused.int8[1][3].weight.data_ptr() == address  # quantized again in place
    assert _active(drafter, ctx)


def test_int8_layers_serve_one_requests_block_and_follow_the_config(fused_calls, monkeypatch):
    """Two requests' blocks within the int8 GEMV's rows multiply by the int8 copies; more rows than it takes by
    the weights as they are; switching the option off makes the copies stale (the eager path) until the next reset
    drops them."""
    drafter = _static_drafter(torch.float32)
    drafter.config.layers_quantization = "int8"
    steps = _round_inputs(drafter, 2, junk=lambda rows, width: torch.randn(rows, width))
    int8_calls, launch = [], gemv_triton.linear_int8
    monkeypatch.setattr(fused, "linear_int8", lambda x, q: int8_calls.append(1) or launch(x, q))
    ctx = StaticDraftContext(drafter, 24, drafter.device, drafter.dtype, batch_size=2)
    assert 2 * drafter.config.block_size <= gemv_triton.MAX_ROWS
    with patches.fused_kernels(), torch.no_grad():  # two requests' blocks: 2 x 8 rows, within the GEMV's 16
        ctx.append(*steps[0][:2])
        first = drafter.draft_static(steps[0][2], ctx)
        assert len(int8_calls) == 4 * len(drafter.layers)
        monkeypatch.setattr(fused, "MAX_ROWS", drafter.config.block_size)  # as if the GEMV took one block only
        second = drafter.draft_static(steps[0][2], ctx)
    assert fused_calls["draft"] == 2 and len(int8_calls) == 4 * len(drafter.layers)  # the second: plain weights
    assert not torch.equal(first, second)
    drafter.config.layers_quantization = None
    assert not _active(drafter, ctx)
    ctx.reset()
    assert ctx.fused.int8 is None and _active(drafter, ctx)


def test_layers_quantization_is_checked_and_saved(tmp_path):
    from hybridspec_hf import DFlashConfig

    with pytest.raises(ValueError, match="layers_quantization must be one of"):
        DFlashConfig(hidden_size=32, num_attention_heads=2, layers_quantization="int4")
    config = DFlashConfig(hidden_size=32, num_attention_heads=2, layers_quantization="int8")
    config.save_pretrained(tmp_path)
    assert DFlashConfig.from_pretrained(tmp_path).layers_quantization == "int8"


def test_resident_generate_with_int8_drafter_layers_equals_ar(fused_calls):
    """A whole resident generate() (greedy, float32) whose drafts multiply by int8 layer copies: AR's tokens (drafts
    are proposals), and the rounds' key records the option."""
    from _tiny import VOCAB, make_drafter
    from test_exactness import run

    from hybridspec_hf.generation import resident

    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ar = target.generate(prompt, do_sample=False, max_new_tokens=12)
    drafter = make_drafter(target, 4, ar, error_rate=0.3).to(torch.float32)
    drafter.config.layers_quantization = "int8"
    out = run(target, prompt, drafter, "dflash", 12, hybridspec_config=hybridspec_hf.HybridSpecConfig(cuda_graphs="on"))
    assert torch.equal(out, ar)
    rounds = target.__dict__[resident._KEPT]
    assert fused_calls["draft"] > 0 and [r.key.layers for r in rounds] == ["int8"]
    assert all(r.context.fused.int8 for r in rounds)
    hybridspec_hf.release_graphs(target)
