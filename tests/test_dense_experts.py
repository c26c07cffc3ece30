"""The CPU experts path of verifications: `dense_experts` (kernels/moe_triton.py) against the reference loop, its size
rule, and the verify forward's dispatch to it (patches.cpu_verification_blocks) without touching the user's choice."""
from __future__ import annotations

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target

import hybridspec_hf
from hybridspec_hf import patches
from hybridspec_hf.kernels import moe_triton
from hybridspec_hf.kernels.moe_triton import dense_experts, dense_fits, fused_experts, fused_experts_reference


def layer_inputs(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype):
    """One experts call: top-k distinct experts per token, as a router gives."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return dict(
        hidden=randn(tokens, hidden),
        top_k_index=torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices,
        top_k_weights=torch.rand(tokens, top_k, generator=gen, dtype=torch.float64).to(dtype),
        gate_up_proj=randn(experts, 2 * inter, hidden, scale=hidden**-0.5),
        down_proj=randn(experts, hidden, inter, scale=inter**-0.5),
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k",
                         [(1, 40, 24, 4, 2), (16, 64, 32, 16, 4), (5, 33, 20, 3, 3)])
def test_dense_experts_equal_the_reference_loop(tokens, hidden, inter, experts, top_k, dtype, tolerance):
    x = layer_inputs(tokens, tokens, hidden, inter, experts, top_k, dtype)
    out = dense_experts(**x)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert rel(out, fused_experts_reference(**x)) < tolerance


def test_sentinels_zero_weights_and_repeats_count_as_in_the_reference():
    """Ids outside [0, E) add nothing, a zero weight gives exact zeros, an expert named twice counts twice, and the
    order in which the router listed distinct experts does not change a bit of the result."""
    x = layer_inputs(3, 6, 40, 24, 4, 3, torch.float64)
    x["top_k_index"][1] = torch.tensor([3, 3, 0])
    x["top_k_index"][2, 2] = 4
    x["top_k_index"][3, 0] = -1
    x["top_k_weights"][4] = 0.0
    out = dense_experts(**x)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert rel(out, fused_experts_reference(**x)) < 1e-14
    distinct = layer_inputs(5, 6, 40, 24, 8, 3, torch.float64)
    flipped = {k: v.flip(-1) if k.startswith("top_k") else v for k, v in distinct.items()}
    assert torch.equal(dense_experts(**flipped), dense_experts(**distinct))


def test_dense_fits_small_layers_only():
    """Dense while its extra rows cost about what the loop's per-expert overhead does: the tiny pair's layer up to 56
    tokens, never a Qwen3.5-35B-A3B-sized one (shapes only, no allocation)."""
    tiny = torch.empty(16, 64, 256, device="meta")
    assert dense_fits(16, 4, tiny) and dense_fits(56, 4, tiny) and not dense_fits(57, 4, tiny)
    assert not dense_fits(1, 8, torch.empty(256, 1024, 2048, device="meta"))


def test_fused_experts_on_the_cpu_takes_dense_where_it_fits(monkeypatch):
    x = layer_inputs(4, 3, 40, 24, 4, 2, torch.float32)
    assert torch.equal(fused_experts(**x, kernel_backend="torch"), dense_experts(**x))
    monkeypatch.setattr(moe_triton, "DENSE_EXTRA_MACS_PER_EXPERT", 0)
    assert torch.equal(fused_experts(**x, kernel_backend="torch"), fused_experts_reference(**x))


def test_cpu_verifications_run_dense_experts_and_leave_the_users_choice(fp64_gdn, monkeypatch):
    """A CPU target set to "eager": every verification's experts go through dense_experts (one call per MoE block and
    round), the prefill and plain generate() keep "eager", the output equals AR, and the setting is restored."""
    target = make_target("qwen3_5_moe")
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=20)
    drafter = make_drafter(target, 8, ar, error_rate=0.2)
    calls = []
    monkeypatch.setattr(moe_triton, "dense_experts", lambda *args: calls.append(args[0].shape[0]) or
                        fused_experts_reference(*args))
    out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                          generation_strategy="dflash")
    rounds = hybridspec_hf.get_telemetry(target).rounds
    assert torch.equal(out, ar)
    assert len(calls) == len(rounds) * len(patches.moe_blocks(target))
    assert sorted(set(calls)) == sorted({r.w for r in rounds})
    assert target.config._experts_implementation == "eager"


def test_a_custom_experts_implementation_is_kept(monkeypatch):
    from transformers.integrations import moe

    target = make_target("qwen3_5_moe")
    blocks = patches.moe_blocks(target)
    assert patches.cpu_verification_blocks(blocks, 16) == blocks
    mapping = moe.ExpertsInterface._global_mapping
    monkeypatch.setitem(mapping, "custom_for_test", mapping["batched_mm"])
    target.set_experts_implementation("custom_for_test")
    assert patches.cpu_verification_blocks(blocks, 16) == []
    target.set_experts_implementation("grouped_mm")  # transformers' own: the same maths, dense on the CPU
    assert patches.cpu_verification_blocks(blocks, 16) == blocks
