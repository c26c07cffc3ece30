"""The torch block verify/commit (CPU path, kernel reference) against a float64 token-by-token recurrence."""
import pytest
import torch

from hybridspec_hf.kernels import commit_conv_state, conv_verify, gdn_commit, gdn_recurrence, gdn_verify


def random_inputs(batch, tokens, heads, value_heads, dk, dv, decay, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dk, generator=g, dtype=dtype)
    k = torch.randn(batch, tokens, heads, dk, generator=g, dtype=dtype)
    v = torch.randn(batch, tokens, value_heads, dv, generator=g, dtype=dtype)
    log_decay = -decay * torch.rand(batch, tokens, value_heads, generator=g, dtype=torch.float32)
    beta = torch.rand(batch, tokens, value_heads, generator=g, dtype=dtype)
    state = torch.randn(batch, value_heads, dk, dv, generator=g, dtype=torch.float32)
    return q, k, v, log_decay, beta, state


@pytest.mark.parametrize("decay", [1e-3, 1.0, 20.0])
@pytest.mark.parametrize("shape", [(1, 16, 2, 4, 8, 8), (2, 5, 3, 6, 6, 10), (3, 1, 1, 1, 12, 5), (1, 11, 2, 2, 24, 40)])
def test_verify_and_every_commit_length_match_the_float64_recurrence(shape, decay):
    batch, tokens, heads, value_heads, dk, dv = shape
    q, k, v, g, beta, state = random_inputs(batch, tokens, heads, value_heads, dk, dv, decay, torch.float32, seed=tokens)
    verified = gdn_verify(q, k, v, g, beta, state)
    outputs, states = gdn_recurrence(q, k, v, g, beta, state)  # float64 oracle, a state per token
    assert verified.out.dtype == torch.float32 and verified.z.dtype == torch.float32
    scale = outputs.abs().max()
    assert (verified.out.double() - outputs).abs().max() / scale < 1e-5  # fp32 compute, relative to the largest output
    for m in range(tokens + 1):
        committed = state.clone()
        per_request = torch.tensor([(m + i) % (tokens + 1) for i in range(batch)])
        gdn_commit(committed, k, verified, per_request)
        for i, mi in enumerate(per_request.tolist()):
            expected = state[i].double() if mi == 0 else states[i, mi - 1]
            error = (committed[i].double() - expected).abs().max() / expected.abs().max()
            assert error < 1e-5, f"request {i}, m = {mi}: relative error {error:.2e}"
        # one int m for every request (the eager loop): sums over the m committed tokens only, the same S_m
        same_m = state.clone()
        gdn_commit(same_m, k, verified, m)
        expected = state.double() if m == 0 else states[:, m - 1]
        assert (same_m.double() - expected).abs().max() / expected.abs().max() < 1e-5, f"int m = {m}"


def test_int_commit_count_is_checked():
    q, k, v, g, beta, state = random_inputs(1, 4, 2, 4, 8, 8, 1.0, torch.float32, seed=2)
    verified = gdn_verify(q, k, v, g, beta, state)
    with pytest.raises(ValueError, match=r"num_committed must be in \[0, 4\]"):
        gdn_commit(state.clone(), k, verified, 5)


def test_commit_of_zero_tokens_leaves_the_state_bit_identical():
    q, k, v, g, beta, state = random_inputs(2, 7, 2, 4, 8, 8, 1.0, torch.float32, seed=1)
    committed = state.clone()
    gdn_commit(committed, k, gdn_verify(q, k, v, g, beta, state), torch.zeros(2, dtype=torch.long))
    assert torch.equal(committed, state)


def test_many_verify_commit_rounds_do_not_drift():
    """600 rounds of verify (w ≤ 16) → commit (random m) against the sequential float64 recurrence: ≤ 1e-5 relative."""
    gen = torch.Generator().manual_seed(7)
    state = torch.randn(1, 4, 16, 16, generator=gen)
    reference = state.double()
    worst = 0.0
    for round_index in range(600):
        tokens = int(torch.randint(1, 17, (1,), generator=gen))
        q, k, v, g, beta, _ = random_inputs(1, tokens, 2, 4, 16, 16, 0.05, torch.float32, seed=round_index)
        m = int(torch.randint(0, tokens + 1, (1,), generator=gen))
        verified = gdn_verify(q, k, v, g, beta, state)
        gdn_commit(state, k, verified, torch.tensor([m]))
        if m:
            reference = gdn_recurrence(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], reference)[1][:, -1]
        worst = max(worst, float((state.double() - reference).abs().max() / reference.abs().max()))
    assert worst < 1e-5, f"drift {worst:.2e}"


def test_conv_verify_and_commit_match_sequential_updates():
    gen = torch.Generator().manual_seed(3)
    batch, channels, kernel, tokens = 2, 6, 4, 7
    conv_state = torch.randn(batch, channels, kernel, generator=gen, dtype=torch.float64)
    x = torch.randn(batch, channels, tokens, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, kernel, generator=gen, dtype=torch.float64)
    out = conv_verify(conv_state, x, weight, None, torch.nn.functional.silu)
    window = conv_state.clone()
    for t in range(tokens):  # the decode-time update: shift in one input, convolve the window
        window = torch.cat([window[..., 1:], x[..., t : t + 1]], dim=-1)
        expected = torch.nn.functional.silu((window * weight).sum(-1))
        torch.testing.assert_close(out[..., t], expected, rtol=1e-12, atol=1e-12)
    for m in range(tokens + 1):
        state = conv_state.clone()
        commit_conv_state(state, x, torch.tensor([m, tokens - m]))
        full = torch.cat([conv_state, x], dim=-1)
        assert torch.equal(state[0], full[0, :, m : m + kernel])
        assert torch.equal(state[1], full[1, :, tokens - m : tokens - m + kernel])
        same_m = conv_state.clone()
        commit_conv_state(same_m, x, m)  # one int for every request
        assert torch.equal(same_m, full[..., m : m + kernel])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_conv_verify_matches_transformers_conv(dtype, tolerance, tokens):
    """The K-tap sum equals transformers' depthwise F.conv1d (with bias) up to its summation order."""
    gen = torch.Generator().manual_seed(tokens)
    channels, kernel = 40, 4
    conv_state = torch.randn(2, channels, kernel, generator=gen, dtype=dtype)
    x = torch.randn(2, channels, tokens, generator=gen, dtype=dtype)
    weight = torch.randn(channels, kernel, generator=gen, dtype=dtype)
    bias = torch.randn(channels, generator=gen, dtype=dtype)
    full = torch.cat([conv_state, x], dim=-1)
    conv = torch.nn.functional.conv1d(full, weight.unsqueeze(1), bias, groups=channels)[..., -tokens:]
    out = conv_verify(conv_state, x, weight, bias, torch.nn.functional.silu)
    assert out.dtype == dtype and out.shape == (2, channels, tokens)
    torch.testing.assert_close(out, torch.nn.functional.silu(conv), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_one_token_verify_is_the_general_formula_bit_for_bit(dtype):
    """A plain step (T = 1) skips the triangular solve and the decay matrix (A is empty, the decay 1): the same bits
    as the general path gives its first token (a verification of two tokens: the second cannot change the first),
    and the commit of that token matches the float64 recurrence."""
    gen = torch.Generator().manual_seed(5)
    b, h, hv, dk, dv = 3, 2, 4, 16, 8
    q, k = (torch.randn(b, 1, h, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(b, 1, hv, dv, generator=gen).to(dtype)
    g = (-torch.rand(b, 1, hv, generator=gen)).to(dtype)
    beta = torch.rand(b, 1, hv, generator=gen).to(dtype)
    state = torch.randn(b, hv, dk, dv, generator=gen).to(dtype)
    one = gdn_verify(q, k, v, g, beta, state)
    two = gdn_verify(*(torch.cat([x, x.flip(0)], 1) for x in (q, k, v, g, beta)), state)
    assert torch.equal(one.out, two.out[:, :1]) and torch.equal(one.z, two.z[..., :1, :])
    _, expected = gdn_recurrence(q.double(), k.double(), v.double(), g.double(), beta.double(), state.double())
    committed = state.clone()
    gdn_commit(committed, k, one, torch.ones(b, dtype=torch.long))
    assert torch.allclose(committed.double(), expected[:, 0], atol={torch.float64: 1e-12, torch.float32: 1e-5,
                                                               torch.bfloat16: 0.1}[dtype])
