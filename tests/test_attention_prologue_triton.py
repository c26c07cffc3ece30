"""The attention layer's fused front (kernels/attention_prologue_triton.py: q/k RMSNorm + RoPE + the cache write) and
the gated output of `static_attention`, against transformers' ops, under the Triton interpreter.

Tolerances: fp32 1e-5 relative (only the order of the norm's fp32 sum of squares differs; measured ~1e-7). bf16: the
interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, and the chain norm -> product -> sum rounds four
times, so values may be a few ulps off: checked to 4 ulps of the row's magnitude. Cache slots outside
length .. length+T-1 must keep every bit.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridspec_hf.kernels.attention_prologue_triton import (  # noqa: E402
    qk_prologue,
    qk_prologue_reference,
    supported,
)
from hybridspec_hf.kernels.attention_triton import attention_reference, static_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        ulp = 2.0**-7 * want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3)
        assert bool(((got.float() - want.float()).abs() <= 4 * ulp).all())


def _inputs(batch, q_heads, kv_heads, tokens, dim, rotary, slots, length, dtype, seed):
    """q/k/v as strided views of one projection output [B, T, Hq·2D + 2·Hk·D] (q beside its gate), cos/sin,
    a cache holding garbage, the device length."""
    gen = torch.Generator().manual_seed(seed)
    width = q_heads * 2 * dim + 2 * kv_heads * dim
    proj = (torch.randn(batch, tokens, width, generator=gen) * 3).to(dtype)
    q_gate = proj[..., : q_heads * 2 * dim].view(batch, tokens, q_heads, 2 * dim)
    q = q_gate[..., :dim].transpose(1, 2)  # [B, Hq, T, D], strided
    gate = q_gate[..., dim:]  # [B, T, Hq, D], strided
    k = proj[..., q_heads * 2 * dim: q_heads * 2 * dim + kv_heads * dim].view(batch, tokens, kv_heads, dim)
    v = proj[..., q_heads * 2 * dim + kv_heads * dim:].view(batch, tokens, kv_heads, dim)
    angles = torch.rand(batch, tokens, rotary // 2, generator=gen) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    q_weight = (torch.randn(dim, generator=gen) * 0.3).to(dtype)
    k_weight = (torch.randn(dim, generator=gen) * 0.3).to(dtype)
    keys = (torch.randn(batch, kv_heads, slots, dim, generator=gen) * 100).to(dtype)
    values = (torch.randn(batch, kv_heads, slots, dim, generator=gen) * 100).to(dtype)
    return dict(q=q, k=k.transpose(1, 2), v=v.transpose(1, 2), gate=gate, cos=cos, sin=sin, q_weight=q_weight,
                k_weight=k_weight, keys=keys, values=values, length=torch.tensor([length]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    dict(batch=1, q_heads=4, kv_heads=2, tokens=1, dim=64, rotary=16),  # partial rotary (Qwen3.5: 64 of 256)
    dict(batch=2, q_heads=6, kv_heads=2, tokens=5, dim=48, rotary=48),  # dim not a power of two, full rotary
])
@pytest.mark.parametrize("offset", [True, False])
def test_prologue_equals_transformers_ops(shape, dtype, offset):
    slots, length = 40, 17
    x = _inputs(**shape, slots=slots, length=length, dtype=dtype, seed=3)
    want_keys, want_values = x["keys"].clone(), x["values"].clone()
    want_q = qk_prologue_reference(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"], x["sin"],
                                   want_keys, want_values, x["length"], offset)
    keys, values = x["keys"].clone(), x["values"].clone()
    assert supported(x["q"], x["k"], x["v"], x["cos"], keys, values)
    q = qk_prologue(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"], x["sin"], keys, values,
                    x["length"], offset)
    assert q.shape == want_q.shape and q.is_contiguous()
    _close(q, want_q, dtype)
    new = slice(length, length + shape["tokens"])
    _close(keys[:, :, new], want_keys[:, :, new], dtype)
    assert torch.equal(values[:, :, new], want_values[:, :, new])  # a copy: every bit
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[new] = False
    assert torch.equal(keys[:, :, untouched], x["keys"][:, :, untouched])
    assert torch.equal(values[:, :, untouched], x["values"][:, :, untouched])
    # the written keys are the normed and rotated ones, not the raw projection
    assert not torch.allclose(keys[:, :, new].float(), x["k"].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prologue_writes_each_row_at_its_own_length(dtype):
    """Batched resident rounds: length [B], row b's T keys and values at its own slots length[b] .. length[b]+T-1,
    every other slot of that row untouched."""
    shape = dict(batch=3, q_heads=4, kv_heads=2, tokens=4, dim=64, rotary=16)
    x = _inputs(**shape, slots=40, length=0, dtype=dtype, seed=8)
    lengths = torch.tensor([0, 17, 33])
    want_keys, want_values = x["keys"].clone(), x["values"].clone()
    want_q = qk_prologue_reference(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"], x["sin"],
                                   want_keys, want_values, lengths)
    keys, values = x["keys"].clone(), x["values"].clone()
    q = qk_prologue(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"], x["sin"], keys, values,
                    lengths)
    _close(q, want_q, dtype)
    for row, start in enumerate(lengths.tolist()):
        new = slice(start, start + 4)
        _close(keys[row, :, new], want_keys[row, :, new], dtype)
        assert torch.equal(values[row, :, new], x["v"][row])
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[new] = False
        assert torch.equal(keys[row][:, untouched], x["keys"][row][:, untouched])
        assert torch.equal(values[row][:, untouched], x["values"][row][:, untouched])
    with pytest.raises(ValueError, match="1 or B=3"):
        qk_prologue(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"], x["sin"], keys, values,
                    torch.tensor([1, 2]))


def test_prologue_rejects_what_it_cannot_take():
    x = _inputs(1, 4, 2, 2, 32, 16, 20, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match="qk_prologue wants"):
        qk_prologue(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"][..., :15],
                    x["sin"][..., :15], x["keys"], x["values"], x["length"])
    with pytest.raises(ValueError, match="qk_prologue wants"):
        qk_prologue(x["q"], x["k"], x["v"], x["q_weight"], x["k_weight"], 1e-6, x["cos"], x["sin"],
                    x["keys"].double(), x["values"].double(), x["length"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 6])
def test_gated_output_equals_transformers_gate(dtype, tokens):
    """static_attention(gate=...) = transformers' attn_output · sigmoid(gate), each in the dtype."""
    x = _inputs(1, 4, 2, tokens, 32, 16, 64, 21, dtype, seed=5)
    keys, values, length = x["keys"], x["values"], x["length"]
    q = x["q"].contiguous()
    plain = static_attention(q, keys, values, length, 0.2)
    gated = static_attention(q, keys, values, length, 0.2, gate=x["gate"])
    want = (plain * torch.sigmoid(x["gate"])).to(dtype)  # the same attention kernel, transformers' gate ops
    _close(gated, want, dtype)
    if dtype == torch.float32:  # and against the reference attention in float64. Scores reach ~10³ here (keys
        # ×100): fp32 rounds each by ~10³·2⁻²⁴ and exp amplifies it, so an fp32 kernel is ~2e-4 from the truth
        # (measured 2.3e-4 at one element); an fp32 reference agreed with it or not by the CPU BLAS's summation
        # order (the GPU image's did not), so the reference is float64 and the tolerance 1e-3
        reference = attention_reference(q.double(), keys.double(), values.double(), length, 0.2)
        want = (reference * torch.sigmoid(x["gate"].double())).float()
        torch.testing.assert_close(gated, want, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="gate must be"):
        static_attention(q, keys, values, length, 0.2, gate=x["gate"][..., :16])
