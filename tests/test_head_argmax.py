"""Greedy tokens from the LM head's int8 copy and its candidate rows (kernels/head_argmax_triton.py): the bound holds,
the kernel (under the Triton interpreter) and its torch reference give the head's own first argmax
(`greedy_tokens_plain`: logits rounded to the head's dtype) on random heads, exact ties, ties made by the dtype's
rounding, flat rows of logits (every row a candidate), negative logits, NaN, across program boundaries and for up to
MAX_ROWS tokens, with the first pass (TWO_PASS) and without, the candidates' loop bounded by each block's count and
walking every step; they read no row of the head outside the candidates; the counters are zero after a launch.

Tokens are compared exactly: the rule is exact for the head's rounding; the only freedom left is the order of the
fp32 sums, which the constructed ties below keep far from a rounding edge (their values are exact in fp32)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridspec_hf.kernels import head_argmax_triton as ha  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import (  # noqa: E402
    MAX_ROWS,
    linear_int8_reference,
    quantize_rows,
    split_counters,
)


@pytest.fixture(params=[True, False], ids=["two-pass", "one-pass"], autouse=True)
def two_pass(request, monkeypatch):
    """Every test with the first pass (each block judged against the token's bound) and without (its own)."""
    monkeypatch.setattr(ha, "TWO_PASS", request.param)
    return request.param


@pytest.fixture(params=[True, False], ids=["bounded", "every-step"], autouse=True)
def bounded(request, monkeypatch):
    """Every test with the candidates' loop bounded by each block's count and walking every step of the block."""
    monkeypatch.setattr(ha, "BOUNDED_CANDIDATES", request.param)
    return request.param


@pytest.fixture
def interpreter():
    from conftest import interpreted

    with interpreted():
        yield


def head(v: int, k: int, dtype=torch.bfloat16, seed: int = 0, std: float = 0.05) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(v, k, generator=generator) * std).to(dtype)


def hidden(rows: int, k: int, dtype=torch.bfloat16, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=generator).to(dtype)


def both(h, w):
    """(kernel, reference, truth) tokens."""
    q = quantize_rows(w)
    return ha.greedy_tokens(h, w, q), ha.greedy_tokens_reference(h, w, q), ha.greedy_tokens_plain(h, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_bound_holds_for_every_row(dtype):
    """|s_i - ŝ_i| ≤ ε_i (module docstring) for random heads and for a hidden state of one sign (the L1 norm's worst
    case for the quantization error), with the int8 logits rounded to the hidden state's dtype as the GEMV's are."""
    for seed, h in ((0, hidden(4, 512, dtype)), (1, hidden(4, 512, dtype).abs())):
        w = head(3000, 512, dtype, seed=seed)
        q = quantize_rows(w)
        exact = h.double() @ w.double().T
        approx = linear_int8_reference(h, q).double()
        eps = ha.error_bound(512) * q.scale.double()[None, :] * h.double().abs().sum(-1, keepdim=True) \
            + approx.abs() / 128
        assert ((exact - approx).abs() <= eps).all()
        assert ((exact - approx).abs() / eps).max() > 0.01  # the bound is not vacuous by orders of magnitude


@pytest.mark.parametrize("v,k,rows,dtype", [(3000, 256, 1, torch.bfloat16), (2500, 192, 3, torch.bfloat16),
                                            (4100, 128, MAX_ROWS, torch.float16), (1500, 64, 2, torch.float32),
                                            (5000, 96, 6, torch.bfloat16)])
def test_random_heads_give_the_heads_argmax(v, k, rows, dtype, interpreter):
    kernel, reference, truth = both(hidden(rows, k, dtype), head(v, k, dtype))
    assert kernel.tolist() == truth.tolist()
    assert reference.tolist() == truth.tolist()
    assert not split_counters(torch.device("cpu")).any()  # the last program zeroed its counter


def test_exact_ties_take_the_first_row(interpreter):
    """The argmax row copied to a lower index (in another program's block) and to a higher one: the lowest wins."""
    w, h = head(3000, 128), hidden(2, 128)
    top = ha.greedy_tokens_plain(h, w)
    w[5] = w[top[0]]
    w[2900] = w[top[0]]
    w[2000] = w[top[1]]
    w[1999] = w[top[1]]
    kernel, reference, truth = both(h, w)
    assert truth.tolist() == [5, min(1999, int(top[1]))]
    assert kernel.tolist() == truth.tolist() and reference.tolist() == truth.tolist()


def test_ties_made_by_the_heads_rounding_take_the_first_row(interpreter):
    """Row 7 is the top row with a tiny change: its fp32 logit is below the top one's, yet both round to the same
    bf16 value, so the head's argmax is row 7 (the lower index) although an fp32 argmax would say the top row."""
    k = 64
    h = torch.ones(1, k, dtype=torch.bfloat16)
    w = head(2000, k, seed=3, std=0.02)
    w[1500] = 0.25  # logit 16.0, exact
    w[7] = 0.25
    w[7, 0] = 0.25 - 2.0**-9  # logit 16 - 2^-9: below 16 in fp32, 16.0 in bf16 (a step is 2^-3 there)
    assert (h.double() @ w.double().T)[0, 7] < 16.0
    kernel, reference, truth = both(h, w)
    assert truth.tolist() == [7]
    assert kernel.tolist() == [7] and reference.tolist() == [7]
    w[7, 0] = 0.25 - 2.0**-4  # logit 15.9375: bf16 rounds it to 15.875 (ties to even): row 1500 is the argmax
    kernel, reference, truth = both(h, w)
    assert truth.tolist() == [1500] and kernel.tolist() == [1500] and reference.tolist() == [1500]


def test_a_flat_row_of_logits_makes_every_row_a_candidate(interpreter):
    """Every row nearly the same: every row is a candidate (more than CANDIDATES a program), and the answer is still
    the head's argmax."""
    k = 64
    base = head(1, k, seed=4)
    w = (base.float() + torch.randn(2500, k, generator=torch.Generator().manual_seed(5)) * 1e-3).to(torch.bfloat16)
    h = hidden(2, k)
    q = quantize_rows(w)
    approx = linear_int8_reference(h, q)
    assert ha._candidates(h, approx, q.scale).float().mean() > 0.5
    kernel, reference, truth = both(h, w)
    assert kernel.tolist() == truth.tolist() and reference.tolist() == truth.tolist()


def test_negative_logits_only(interpreter):
    w = -head(3000, 128).abs()
    h = hidden(3, 128).abs()
    kernel, reference, truth = both(h, w)
    assert kernel.tolist() == truth.tolist() and reference.tolist() == truth.tolist()


def test_rows_outside_the_candidates_are_never_read(two_pass, interpreter):
    """The head's rows that no program's bound leaves in reach (against the token's bound with TWO_PASS, else each
    block of BLOCK_V rows against its own, as the kernel does) are NaN (its int8 copy made before): a read of any of
    them would turn a token's maximum into NaN."""
    w, h = head(3000, 128), hidden(2, 128)
    q = quantize_rows(w)
    approx = linear_int8_reference(h, q)
    candidates = ha._candidates(h, approx, q.scale, block=None if two_pass else ha.BLOCK_V).any(0)
    assert candidates.float().mean() < 0.2
    assert (ha._candidates(h, approx, q.scale, block=ha.BLOCK_V) >= ha._candidates(h, approx, q.scale)).all()
    truth = ha.greedy_tokens_plain(h, w)
    poisoned = w.clone()
    poisoned[~candidates] = float("nan")
    assert ha.greedy_tokens(h, poisoned, q).tolist() == truth.tolist()


def test_nan_hidden_states_give_token_zero_as_the_reference(interpreter):
    w, h = head(1500, 64), hidden(1, 64)
    h[0, 3] = float("nan")
    q = quantize_rows(w)
    assert ha.greedy_tokens(h, w, q).tolist() == [0] == ha.greedy_tokens_reference(h, w, q).tolist()
    assert not split_counters(torch.device("cpu")).any()


def test_leading_dims_and_the_reference_path_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w, h = head(3000, 128, torch.float64), hidden(6, 128, torch.float64).view(2, 3, 128)
    q = quantize_rows(w)
    assert not ha.applies(h, w, q)  # CPU tensors, no interpreter: the torch rule
    tokens = ha.greedy_tokens(h, w, q)
    assert tokens.shape == (2, 3)
    assert tokens.view(-1).tolist() == ha.greedy_tokens_plain(h.view(6, 128), w).tolist()


def test_more_rows_than_the_kernel_takes_run_the_reference(interpreter):
    w, h = head(1000, 64), hidden(MAX_ROWS + 1, 64)
    q = quantize_rows(w)
    assert not ha.applies(h, w, q)
    assert ha.greedy_tokens(h, w, q).tolist() == ha.greedy_tokens_plain(h, w).tolist()


def test_mismatched_shapes_are_refused():
    w = head(100, 64)
    with pytest.raises(ValueError, match="int8 copy of the same shape"):
        ha.greedy_tokens(hidden(1, 32), w, quantize_rows(w))
    with pytest.raises(ValueError, match="int8 copy of the same shape"):
        ha.greedy_tokens(hidden(1, 64), w, quantize_rows(head(99, 64)))
