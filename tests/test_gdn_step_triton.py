"""The one-launch GDN decoding step (kernels/gdn_step_triton.py) against the four launches it replaces, its torch
reference and the float64 recurrence (Triton interpreter on the CPU), and inside verify_forward.

Tolerances (outputs relative to the output's largest magnitude, states elementwise):
- vs the four launches: the same operations on the same values in the same order, bit-identical under the
  interpreter (measured 0 in fp32 and bf16); asserted to 1e-6 of scale (state 1e-6), after three steps with the
  state and the conv window carried. On a GPU the compiler may reorder fp32 sums (benchmarks/gdn_kernels.py --check).
- fp32 vs the fp32 torch reference: only the order of fp32 sums differs: 1e-5 (measured 3.5e-7).
- fp32 vs float64 (every input upcast; conv, step and norm in float64): fp32 rounding: 1e-5 (measured 3.6e-7).
- bf16 vs the torch reference: the interpreter truncates fp32 -> bf16 where torch rounds to nearest (conv, silu,
  beta, o, the norm's two roundings), a bf16 ulp each: 2^-5 of scale for y (measured 2^-6), as
  test_gdn_prologue_triton's bound; the state carries the ulps of v and k through three updates: 2^-4 (measured
  0.028 on states of magnitude ~1).
- The conv window is copied, never computed: bit-exact in every case.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridspec_hf.kernels import gdn_step_triton  # noqa: E402
from hybridspec_hf.kernels.default_verifier import gdn_decode_step  # noqa: E402
from hybridspec_hf.kernels.gdn_prologue_triton import conv_silu, gdn_gates  # noqa: E402
from hybridspec_hf.kernels.gdn_step_triton import gdn_step, gdn_step_reference  # noqa: E402
from hybridspec_hf.kernels.norm_triton import gated_rms_norm  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

STEPS = 3


def layer_params(seed: int, heads: int, v_heads: int, dk: int, dv: int, dtype: torch.dtype, bias: bool, k: int = 4):
    """A GDN layer's conv, gate and norm parameters and its caches for `batch` requests (random, non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * heads * dk + v_heads * dv
    return dict(
        conv_weight=(torch.randn(channels, k, generator=gen) * 0.5).to(dtype),
        conv_bias=torch.randn(channels, generator=gen).to(dtype) if bias else None,
        A_log=torch.linspace(-3.0, 2.7, v_heads).to(dtype),
        dt_bias=(torch.randn(v_heads, generator=gen) * 2.0).to(dtype),
        norm_weight=(1.0 + 0.3 * torch.randn(dv, generator=gen)).to(dtype),
        norm_eps=1e-6, num_k_heads=heads,
    )


def caches(seed: int, batch: int, heads: int, v_heads: int, dk: int, dv: int, dtype: torch.dtype, k: int = 4):
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * heads * dk + v_heads * dv
    return (torch.randn(batch, channels, k, generator=gen).to(dtype),
            torch.randn(batch, v_heads, dk, dv, generator=gen) * 0.3)


def token_inputs(seed: int, batch: int, heads: int, v_heads: int, dk: int, dv: int, dtype: torch.dtype) -> dict:
    """One token's x, z, b, a as column slices of one wide projection output (strided rows, like the GEMM's)."""
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * heads * dk + v_heads * dv
    widths = [channels, v_heads * dv, v_heads, v_heads]
    wide = torch.randn(batch, 1, sum(widths) + 5, generator=gen)
    wide[..., -2 * v_heads - 5 : -5] *= 3.0  # b, a over sigmoid's and softplus's ranges
    x, z, b, a = wide.to(dtype)[..., :-5].split(widths, dim=-1)
    return dict(x=x, z=z.reshape(batch, 1, v_heads, dv), b=b, a=a)


def four_launches(x, conv_state, conv_weight, conv_bias, a, b, A_log, dt_bias, state, z, norm_weight, norm_eps,
                  num_k_heads):
    """Today's fused route of the step: conv_silu (rolling the window), gdn_gates, gdn_decode_step, gated norm."""
    batch = x.shape[0]
    _, v_heads, dk, dv = state.shape
    mixed = conv_silu(conv_state, x, conv_weight, conv_bias, roll_state=True)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k, v = torch.split(mixed, [num_k_heads * dk, num_k_heads * dk, v_heads * dv], dim=-1)
    out = gdn_decode_step(q.reshape(batch, 1, num_k_heads, dk), k.reshape(batch, 1, num_k_heads, dk),
                          v.reshape(batch, 1, v_heads, dv), g, beta, state)
    return gated_rms_norm(out, z, norm_weight, norm_eps)


def run_steps(fn, params: dict, conv_state: torch.Tensor, state: torch.Tensor, tokens: list[dict], **kw):
    """STEPS steps in a row of `fn` on copies of the caches: (outputs, state, conv window) after the last."""
    conv_state, state = conv_state.clone(), state.clone()
    outs = [fn(t["x"], conv_state, params["conv_weight"], params["conv_bias"], t["a"], t["b"], params["A_log"],
               params["dt_bias"], state, t["z"], params["norm_weight"], params["norm_eps"], params["num_k_heads"],
               **kw) for t in tokens]
    return outs, state, conv_state


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.double().abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0.0, atol=rel * scale)


SHAPES = {  # (batch, key heads, value heads, dk, dv): odd sizes mask every block; grouped value heads
    "odd": (3, 2, 6, 6, 10),
    "pow2": (1, 2, 4, 16, 32),
}


@pytest.mark.parametrize("loads_first", [True, False], ids=["loads-first", "gates-after-counter"])
@pytest.mark.parametrize("fold", [True, False], ids=["fold", "norm-launch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,block_v,bias", [("odd", None, True), ("odd", 4, False), ("pow2", None, False),
                                                ("pow2", 8, True)])
def test_step_equals_the_four_launches_and_the_reference(shape, block_v, bias, dtype, fold, loads_first,
                                                         monkeypatch):
    """block_v None: one program per head, norm in the kernel; 4 / 8: dv split over programs (the q/k window rolled
    by the last of them), then the norm: by the head's last program to arrive (fold) or its own launch. Three steps
    in a row carry the state and the conv window; with and without the conv bias; the gates' inputs loaded with
    the conv's (the window counter read after the math) or after the counter."""
    monkeypatch.setattr(gdn_step_triton, "FOLD_NORM", fold)
    monkeypatch.setattr(gdn_step_triton, "LOADS_FIRST", loads_first)
    batch, heads, v_heads, dk, dv = SHAPES[shape]
    dims = (batch, heads, v_heads, dk, dv)
    params = layer_params(1, heads, v_heads, dk, dv, dtype, bias)
    conv_state, state = caches(2, *dims, dtype)
    tokens = [token_inputs(10 + i, *dims, dtype) for i in range(STEPS)]
    fused = run_steps(gdn_step, params, conv_state, state, tokens, block_v=block_v)
    unfused = run_steps(four_launches, params, conv_state, state, tokens)
    reference = run_steps(gdn_step_reference, params, conv_state, state, tokens)
    assert torch.equal(fused[2], unfused[2]) and torch.equal(fused[2], reference[2])  # the rolled window
    assert not torch.equal(fused[2], conv_state)
    ref_rel, state_tol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-5, 2**-4)
    for mine, theirs, ref in zip(fused[0], unfused[0], reference[0]):
        assert mine.is_contiguous()
        assert_close_to_scale(mine, theirs, 1e-6)
        assert_close_to_scale(mine, ref, ref_rel)
    torch.testing.assert_close(fused[1], unfused[1], rtol=0.0, atol=1e-6)
    torch.testing.assert_close(fused[1], reference[1], rtol=0.0, atol=state_tol)
    assert (gdn_step_triton._COUNTERS[torch.device("cpu")] == 0).all()  # zeroed for the next launch


@pytest.mark.parametrize("block_v", [None, 4])
def test_step_equals_the_float64_recurrence(block_v):
    batch, heads, v_heads, dk, dv = dims = SHAPES["odd"]
    params = layer_params(3, heads, v_heads, dk, dv, torch.float32, bias=True)
    conv_state, state = caches(4, *dims, torch.float32)
    tokens = [token_inputs(20 + i, *dims, torch.float32) for i in range(STEPS)]
    fused = run_steps(gdn_step, params, conv_state, state, tokens, block_v=block_v)
    up = lambda d: {n: v.double() if isinstance(v, torch.Tensor) else v for n, v in d.items()}  # noqa: E731
    oracle = run_steps(gdn_step_reference, up(params), conv_state.double(), state.double(), [up(t) for t in tokens])
    for mine, exact in zip(fused[0], oracle[0]):
        assert_close_to_scale(mine.double(), exact, 1e-5)
    torch.testing.assert_close(fused[1].double(), oracle[1], rtol=0.0, atol=1e-5)
    assert torch.equal(fused[2].double(), oracle[2])


def test_each_request_and_head_reads_its_own_inputs():
    """A change in one request's input or one value head's gate moves only that request's / head's output (the
    programs' offsets: requests, grouped key heads, the value and gate columns)."""
    batch, heads, v_heads, dk, dv = dims = SHAPES["odd"]
    params = layer_params(5, heads, v_heads, dk, dv, torch.float32, bias=False)
    conv_state, state = caches(6, *dims, torch.float32)
    token = token_inputs(30, *dims, torch.float32)
    base = run_steps(gdn_step, params, conv_state, state, [token])[0][0]
    moved = dict(token, x=token["x"].clone())
    moved["x"][1, 0, heads * dk + dk] += 1.0  # request 1, the key of key head 1 (value heads 3, 4, 5)
    out = run_steps(gdn_step, params, conv_state, state, [moved])[0][0]
    changed = (out != base).any(-1)[:, 0]  # [B, HV]
    expected = torch.zeros(batch, v_heads, dtype=torch.bool)
    expected[1, 3:] = True
    assert torch.equal(changed, expected)
    gated = dict(token, z=token["z"].clone())
    gated["z"][2, 0, 4, 0] += 1.0
    out = run_steps(gdn_step, params, conv_state, state, [gated])[0][0]
    assert (out != base).nonzero().tolist() == [[2, 0, 4, 0]]


def test_wrong_shapes_are_refused_with_the_shapes_seen():
    dims = SHAPES["pow2"]
    params = layer_params(7, *dims[1:], torch.float32, bias=False)
    conv_state, state = caches(8, *dims, torch.float32)
    token = token_inputs(9, *dims, torch.float32)
    with pytest.raises(ValueError, match="one token"):
        gdn_step(torch.cat([token["x"]] * 2, 1), conv_state, params["conv_weight"], None, token["a"], token["b"],
                 params["A_log"], params["dt_bias"], state, token["z"], params["norm_weight"], 1e-6, 2)
    with pytest.raises(ValueError, match="float32"):
        gdn_step(token["x"], conv_state, params["conv_weight"], None, token["a"], token["b"], params["A_log"],
                 params["dt_bias"], state.double(), token["z"], params["norm_weight"], 1e-6, 2)


def test_the_early_state_read_changes_no_bit(monkeypatch):
    """pdl.EARLY_READS loads the state before the PDL wait (none under the interpreter): the same bits."""
    from hybridspec_hf.kernels import pdl

    batch, heads, v_heads, dk, dv = dims = SHAPES["pow2"]
    params = layer_params(7, heads, v_heads, dk, dv, torch.float32, bias=True)
    conv_state, state = caches(8, *dims, torch.float32)
    tokens = [token_inputs(40 + i, *dims, torch.float32) for i in range(STEPS)]
    runs = []
    for early in (True, False):
        monkeypatch.setattr(pdl, "EARLY_READS", early)
        runs.append(run_steps(gdn_step, params, conv_state, state, tokens, block_v=8))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
