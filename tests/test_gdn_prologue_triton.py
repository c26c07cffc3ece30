"""The GDN verify prologue (conv + silu, gates), the concatenated input projection and the fused verify_forward,
against their torch references and transformers' own code (Triton interpreter on the CPU).

Tolerances:
- fp32: the kernels keep transformers' steps; only the order of the conv's 4-5 term fp32 sum differs, so outputs
  agree to a few fp32 ulps of the terms (atol 2e-6 on O(1) values); the gates to 2e-6 relative (exp, log1p, a
  division: an ulp each, on both sides).
- bf16: the interpreter converts fp32 -> bf16 by truncation (GPUs round to nearest), so each of the kernel's two
  roundings (conv output, silu output) may be one bf16 ulp (<= 2^-7 |x|) off where torch's is half an ulp; through
  silu (|silu'| <= 1.1, |silu(x)| <= |x|) that is at most ~3.2 · 2^-7 |conv| per element: bound 2^-5 |conv|.
  beta (one rounding of a value in (0, 1)) is within one ulp, 2^-8.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from _tiny import make_target  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling  # noqa: E402

from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.kernels import commit_conv_state, commit_gdn_states, conv_verify, fused_kernels  # noqa: E402
from hybridspec_hf.kernels import gdn_prologue_triton, gdn_step_triton  # noqa: E402
from hybridspec_hf.kernels.gdn_prologue_triton import (  # noqa: E402
    conv_silu,
    conv_silu_gates,
    conv_silu_reference,
    gdn_gates,
    gdn_gates_reference,
)
from hybridspec_hf.patches import _gdn  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

BF16_CONV = 2**-5  # of |conv| (before silu), see the module docstring


def conv_inputs(seed: int, batch: int, t: int, channels: int, bias: bool, dtype: torch.dtype, k: int = 4):
    """conv_state [B, C, K], x [B, T, C] as a column slice of a wider projection output (non-contiguous rows),
    weight [C, K], bias [C] or None."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, channels, k, generator=gen).to(dtype)
    wide = torch.randn(batch, t, channels + 24, generator=gen).to(dtype)
    x = wide[..., 8 : 8 + channels]
    weight = (torch.randn(channels, k, generator=gen) * 0.5).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype) if bias else None
    return state, x, weight, b


def assert_conv_close(out: torch.Tensor, expected: torch.Tensor, pre_activation: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.is_contiguous()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=2e-6)
    else:
        bound = BF16_CONV * pre_activation.double().abs() + 1e-6
        assert ((out.double() - expected.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 16])
@pytest.mark.parametrize("channels,bias", [(40, False), (200, True), (136, False)])
def test_conv_silu_equals_the_reference_and_transformers(t, channels, bias, dtype):
    state, x, weight, b = conv_inputs(t * channels, 2, t, channels, bias, dtype)
    pre = conv_verify(state, x.transpose(1, 2), weight, b, None).transpose(1, 2)  # conv before silu
    out = conv_silu(state, x, weight, b)
    assert_conv_close(out, conv_silu_reference(state, x, weight, b), pre)
    # transformers' own decode-path conv (the torch function under its kernel wrappers) on a copy of the state
    update = inspect.unwrap(modeling.causal_conv1d_update)
    theirs = update(x.transpose(1, 2), state.clone(), weight, b, "silu").transpose(1, 2)
    assert_conv_close(out, theirs, pre)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 6])
def test_conv_silu_rolls_the_window_in_place(t, dtype):
    """roll_state: the same outputs, and the conv state becomes the last K inputs (the commit of all T tokens),
    from the old window and the new inputs alike (t < K and t >= K)."""
    state, x, weight, b = conv_inputs(7 * t, 2, t, 200, True, dtype)
    expected_out = conv_silu(state, x, weight, b)
    expected_state = state.clone()
    commit_conv_state(expected_state, x.transpose(1, 2), torch.full((2,), t))
    rolled = state.clone()
    out = conv_silu(rolled, x, weight, b, roll_state=True)
    assert torch.equal(out, expected_out) and torch.equal(rolled, expected_state)


def test_conv_silu_reads_the_window_of_each_token():
    """A unit impulse in one input shows up in exactly the K outputs whose windows cover it, each through its tap."""
    k, t, channels = 4, 6, 3
    x = torch.zeros(1, t, channels)
    x[0, 2, 1] = 1.0  # column K + 2 of [conv_state ‖ x]
    weight = torch.arange(1.0, 1.0 + channels * k).view(channels, k)
    out = conv_silu(torch.zeros(1, channels, k), x, weight, None)[0, :, 1]  # [T]
    # output s reads column s + j + 1 with tap j: column K + 2 is tap K + 1 - s of outputs s = 2 .. 5
    silu = torch.nn.functional.silu
    expected = torch.stack([silu(weight[1, k + 1 - s]) if 0 <= k + 1 - s < k else torch.tensor(0.0)
                            for s in range(t)])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 16])
def test_gdn_gates_equal_the_reference(t, dtype):
    gen = torch.Generator().manual_seed(t)
    heads = 6
    # a + dt_bias spans softplus's regimes: ≪ 0 (log1p of a tiny e^x), around 0, and past the threshold 20
    wide = (torch.randn(2, t, 3 * heads, generator=gen) * torch.tensor([12.0, 3.0, 1.0]).repeat_interleave(heads))
    a, b = wide.to(dtype)[..., :heads], wide.to(dtype)[..., heads : 2 * heads]  # column slices, like the GEMM's
    a_log = torch.linspace(-3.0, 2.7, heads).to(dtype)
    dt_bias = torch.tensor([-30.0, -6.0, 0.0, 1.5, 12.0, 25.0]).to(dtype)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    g_ref, beta_ref = gdn_gates_reference(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.is_contiguous() and beta.is_contiguous()
    torch.testing.assert_close(g, g_ref, rtol=2e-6, atol=0.0)
    tol = dict(rtol=2e-6, atol=2e-7) if dtype == torch.float32 else dict(rtol=0.0, atol=2**-8)
    torch.testing.assert_close(beta, beta_ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, t, channels, heads, roll", [(1, 16, 200, 6, False), (2, 5, 130, 3, False),
                                                             (1, 1, 72, 32, True), (2, 17, 64, 5, True)])
def test_conv_and_gates_in_one_launch_give_the_two_launches_bits(batch, t, channels, heads, roll, dtype):
    """conv_silu_gates runs conv_silu's and gdn_gates' code in one grid: the same bits as the two launches, the
    window rolled alike (ROLL), for several requests, T past one gates program (17 > GATE_ROWS = 16), channels past
    one conv block and column slices of a projection output as inputs."""
    state, x, weight, bias = conv_inputs(channels + t, batch, t, channels, True, dtype)
    gen = torch.Generator().manual_seed(t * heads)
    wide = torch.randn(batch, t, 2 * heads + 3, generator=gen) * 4.0
    a, b = wide.to(dtype)[..., 1 : 1 + heads], wide.to(dtype)[..., 1 + heads : 1 + 2 * heads]
    a_log = torch.linspace(-2.0, 1.0, heads).to(dtype)
    dt_bias = torch.linspace(-5.0, 22.0, heads).to(dtype)
    two_state, one_state = state.clone(), state.clone()
    mixed = conv_silu(two_state, x, weight, bias, roll_state=roll)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    one_mixed, one_g, one_beta = conv_silu_gates(one_state, x, weight, bias, a, b, a_log, dt_bias, roll_state=roll)
    assert torch.equal(one_mixed, mixed) and torch.equal(one_g, g) and torch.equal(one_beta, beta)
    assert torch.equal(one_state, two_state) and torch.equal(one_state, state) != roll
    assert one_g.abs().min() > 0 and one_mixed.abs().max() > 0
    with pytest.raises(ValueError, match="a, b"):
        conv_silu_gates(state, x, weight, bias, a[..., 1:], b[..., 1:], a_log, dt_bias)
    with pytest.raises(ValueError, match="conv_state"):
        conv_silu_gates(state[:, 1:], x, weight, bias, a, b, a_log, dt_bias)


# --------------------------------------------------------------------------------------------------- verify_forward


def verify_once(layer, project, hidden, conv_state, state, fused: bool):
    """verify_forward of one GDN layer over a stand-in cache: (output, the pending entry for the commit)."""
    cache = SimpleNamespace(layers={layer.layer_idx: SimpleNamespace(conv_states=[conv_state.clone()],
                                                                     recurrent_states=[state.clone()])})
    valid = torch.tensor([max(1, hidden.shape[1] - 1)])  # the last token ignored (a max-shape graph's padding)
    session = patches.VerifySession(cache=cache, valid_len=valid)
    with torch.no_grad(), (fused_kernels() if fused else torch.no_grad()):
        out = _gdn.verify_forward(layer, session, hidden, project)
    return out, session.pending[0]


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Elementwise within `rel` of the value or of the tensor's largest magnitude (the layer's outputs are small:
    out_proj is initialised at std 0.02)."""
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * expected.abs().max().item())


@pytest.mark.parametrize("name,dtype", [("qwen3_5_moe_odd", torch.float32), ("qwen3_5_moe", torch.bfloat16),
                                        ("qwen3_next", torch.float32)])
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("one_launch", [False, True], ids=["", "conv_gates_one_launch"])
def test_fused_verify_forward_equals_the_torch_glue(name, dtype, t, one_launch, monkeypatch):
    """Tolerance: fp32 1e-5 of scale (measured 2e-7); bf16 2^-5 of scale, a few bf16 ulps (the interpreter's
    truncated q/k/v carried through the verify, the norm and out_proj's bf16 GEMM; measured 2^-7). With
    gdn_prologue_triton.CONV_GATES the conv and gates run as one launch (conv_silu_gates)."""
    monkeypatch.setattr(gdn_prologue_triton, "CONV_GATES", one_launch)
    target = make_target(name, seed=3, dtype=dtype)
    family = patches.family_of(target)
    layers = patches.gdn_layers(target)
    gen = torch.Generator().manual_seed(t)
    layer = layers[-1]
    hidden = torch.randn(1, t, target.config.hidden_size, generator=gen).to(dtype)
    conv_state = torch.randn(1, layer.conv_dim, layer.conv_kernel_size, generator=gen).to(dtype)
    state = torch.randn(1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, generator=gen) * 0.1
    unfused, plain = verify_once(layer, family.project_gdn_inputs, hidden, conv_state, state, fused=False)
    launches = []
    for kernel in ("conv_silu", "gdn_gates", "conv_silu_gates"):
        original = getattr(_gdn, kernel)
        monkeypatch.setattr(_gdn, kernel,
                            lambda *args, _f=original, _n=kernel, **kw: launches.append(_n) or _f(*args, **kw))
    patches.prepare_gdn_projections(layers)
    separate = "_hybridspec_in_proj" in layer.__dict__
    assert separate == (name != "qwen3_next")  # Qwen3-Next's projections are fused already
    try:
        fused, pending = verify_once(layer, family.project_gdn_inputs, hidden, conv_state, state, fused=True)
    finally:
        patches.release_gdn_projections(layers)
    assert launches == (["conv_silu_gates"] if one_launch else ["conv_silu", "gdn_gates"])
    if separate:  # the conv input is a column slice of the one GEMM's output [B, T, C + HV·dv + 2·HV]
        assert pending.conv_input.stride(2) > plain.conv_input.stride(2) == layer.conv_dim
    rel = 1e-5 if dtype == torch.float32 else 2**-5
    torch.testing.assert_close(pending.conv_input, plain.conv_input, rtol=rel, atol=rel)  # the commit's roll input
    assert_close_to_scale(pending.k, plain.k, rel)  # what the commit folds
    torch.testing.assert_close(pending.verified.g_cum, plain.verified.g_cum, rtol=1e-5, atol=1e-6)
    assert_close_to_scale(fused, unfused, rel)
    assert unfused.abs().max() > 0


def count_launches(monkeypatch) -> list[str]:
    """The names of the GDN step's kernels verify_forward calls, in order."""
    launches = []
    for kernel in ("conv_silu", "gdn_gates", "gdn_decode_step", "gdn_step"):
        original = getattr(_gdn, kernel)
        monkeypatch.setattr(_gdn, kernel,
                            lambda *args, _f=original, _n=kernel, **kw: launches.append(_n) or _f(*args, **kw))
    return launches


@pytest.mark.parametrize("name,dtype", [("qwen3_5_moe_odd", torch.float32), ("qwen3_5_moe", torch.bfloat16),
                                        ("qwen3_next", torch.float32)])
@pytest.mark.parametrize("one_launch", [True, False], ids=["gdn_step", "four_launches"])
@pytest.mark.parametrize("hook_norm", [False, True], ids=["", "hooked_norm"])
def test_decode_step_commits_in_place_like_verify_and_commit(name, dtype, one_launch, hook_norm, monkeypatch):
    """A plain decoding step on the fused route (nothing pending: the state and the conv window are updated in
    place) leaves the output, state and conv window that the verify + commit of m = 1 leaves: by `gdn_step` (conv,
    gates, recurrence and gated norm in one launch) while its switch is on and the norm has nothing else to run,
    else by conv_silu + gdn_gates + gdn_decode_step and the norm module. Tolerances as
    test_fused_verify_forward_equals_the_torch_glue (in bf16 the two paths' q/k/v differ by the interpreter's
    truncation, and the state carries that)."""
    monkeypatch.setattr(gdn_step_triton, "FUSED_STEP", one_launch)
    target = make_target(name, seed=6, dtype=dtype)
    family = patches.family_of(target)
    layer = patches.gdn_layers(target)[0]
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(1, 1, target.config.hidden_size, generator=gen).to(dtype)
    conv_state = torch.randn(1, layer.conv_dim, layer.conv_kernel_size, generator=gen).to(dtype)
    state = torch.randn(1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, generator=gen) * 0.1
    hooked_calls = []
    if hook_norm:  # e.g. an adapter or offloading hook: it must run, so the norm is not fused
        layer.norm.register_forward_hook(lambda *args: hooked_calls.append(1))
    results = {}
    for step in (False, True):
        cache = SimpleNamespace(layers={layer.layer_idx: SimpleNamespace(conv_states=[conv_state.clone()],
                                                                         recurrent_states=[state.clone()])})
        session = patches.VerifySession(cache=cache, kernel_backend="torch" if not step else "auto",
                                        decode_step=step)
        launches = count_launches(monkeypatch) if step else []
        with torch.no_grad(), fused_kernels():
            out = _gdn.verify_forward(layer, session, hidden, family.project_gdn_inputs)
        assert bool(session.pending) != step  # the step leaves nothing to commit
        assert session.stepped == int(step)
        patches.check_verified(session, [layer])  # ... and counts as having run verify mode
        commit_gdn_states(session.pending, torch.ones(1, dtype=torch.int32))
        entry = cache.layers[layer.layer_idx]
        results[step] = out, entry.recurrent_states[0], entry.conv_states[0]
    fused = one_launch and not hook_norm
    assert launches == (["gdn_step"] if fused else ["conv_silu", "gdn_gates", "gdn_decode_step"])
    assert len(hooked_calls) == (2 if hook_norm else 0)
    rel = 1e-5 if dtype == torch.float32 else 2**-5
    for fused_out, torch_glue in zip(results[True][:2], results[False][:2]):
        assert_close_to_scale(fused_out, torch_glue, rel)
    assert torch.equal(results[True][2], results[False][2])


def test_without_the_flag_or_the_interpreter_the_torch_glue_runs(monkeypatch):
    target = make_target("qwen3_5_moe", seed=4, dtype=torch.float32)
    layers = patches.gdn_layers(target)
    layer = layers[0]
    patches.prepare_gdn_projections(layers)
    layer.__dict__["_hybridspec_in_proj"].weight.zero_()  # zero outputs tell which path ran
    hidden = torch.randn(1, 3, target.config.hidden_size)
    try:
        separate = _gdn.project_separate(layer, hidden)
        with fused_kernels():
            concatenated = _gdn.project_separate(layer, hidden)
    finally:
        patches.release_gdn_projections(layers)
    assert separate[0].abs().sum() > 0 and all((x == 0).all() for x in concatenated)
    assert all("_hybridspec_in_proj" not in m.__dict__ for m in target.modules())

    def boom(*args, **kwargs):
        raise AssertionError("the fused kernels ran")

    monkeypatch.setattr(_gdn, "conv_silu", boom)
    monkeypatch.setattr(_gdn, "gdn_gates", boom)
    conv_state = torch.randn(1, layer.conv_dim, layer.conv_kernel_size)
    state = torch.zeros(1, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    verify_once(layer, _gdn.project_separate, hidden, conv_state, state, fused=False)  # no flag
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors outside the interpreter: no fused route, no copies
    verify_once(layer, _gdn.project_separate, hidden, conv_state, state, fused=True)
    patches.prepare_gdn_projections(layers)
    assert "_hybridspec_in_proj" not in layer.__dict__


def test_concatenated_projection_follows_in_place_weight_updates(monkeypatch):
    """What the resident rounds do: prepare before capture, again at every call's start (in place, same address);
    a stale copy is never read; a hook on any layer's projection (or the switch) leaves every layer unfused."""
    target = make_target("qwen3_5_moe", seed=5, dtype=torch.float32)
    layers = patches.gdn_layers(target)
    layer = layers[0]
    copied = lambda: ["_hybridspec_in_proj" in m.__dict__ for m in layers]  # noqa: E731
    monkeypatch.setenv("HYBRIDSPEC_FUSED_KERNELS", "0")  # fused kernels switched off: no copy to make
    patches.prepare_gdn_projections(layers)
    assert not any(copied())
    monkeypatch.delenv("HYBRIDSPEC_FUSED_KERNELS")
    handle = layers[1].in_proj_z.register_forward_hook(lambda *args: None)  # e.g. an adapter or offloading hook
    patches.prepare_gdn_projections(layers)
    assert not any(copied())  # all layers or none: the one-launch commit reads every conv input with one layout
    handle.remove()
    patches.prepare_gdn_projections(layers)
    assert all(copied())
    handle = layers[1].in_proj_z.register_forward_hook(lambda *args: None)
    patches.prepare_gdn_projections(layers)  # a later call's start: graphs captured on the copies still read them
    assert all(copied())
    # but a forward (eager, or a new capture) runs the hooked module itself
    assert _gdn._current_projection_copy(layers[1], _gdn._projections(layers[1])) is None
    handle.remove()
    address = layer.__dict__["_hybridspec_in_proj"].weight.data_ptr()
    hidden = torch.randn(1, 4, target.config.hidden_size)
    try:
        with torch.no_grad():
            layer.in_proj_z.weight.mul_(-2.0)
            layer.in_proj_a.weight.add_(0.5)
            separate = _gdn.project_separate(layer, hidden)
            with fused_kernels():
                stale = _gdn.project_separate(layer, hidden)  # the copy is stale: the four projections run
                patches.prepare_gdn_projections(layers)  # a call's start
                concatenated = _gdn.project_separate(layer, hidden)
        for out in (stale, concatenated):
            for mine, theirs in zip(out, separate, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
        assert layer.__dict__["_hybridspec_in_proj"].weight.data_ptr() == address  # captured graphs still read it
    finally:
        patches.release_gdn_projections(layers)
    assert not any(copied())
