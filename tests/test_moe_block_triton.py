"""Fused MoE block (patches/_moe.py): `route_topk` (kernels/router_triton.py), the shared expert and the combine
(kernels/shared_expert_triton.py) against their torch references and transformers' modules, and the patched block
forward against transformers' on tiny models (CPU, Triton interpreter, the fused route forced onto CPU tensors):
in one pass (the shared expert as an experts slot, kernels/moe_triton.py `moe_block_triton`, T <= 16) and around
the experts module's call (more tokens, hooks on the experts, another shared width, the switch off).

Tolerances. Router scores, elementwise: fp32 1e-6 relative (only the fp32 sum order and Triton's exp differ), bf16
one rounding (2^-7 relative). Ids equal torch.topk's except at exact ties, where ours take the lowest expert id and
torch's order is unspecified: there the chosen experts must be exactly as probable as torch's.
Shared expert, combine and block, relative Frobenius error (GEMM outputs cancel, so elementwise relative errors are
meaningless near 0): fp32 1e-6 (measured ~1e-7), bf16 2e-2 (measured ~1e-2). The kernels keep transformers' bf16
roundings of silu(g), silu(g)·up, sigmoid, the gated product and the sum, but the interpreter truncates fp32 -> bf16
casts where torch (and the GPU) round to nearest: `silu_mul` equals a truncating emulation bit for bit here, and its
elementwise error against torch stays within two roundings (2^-6 relative).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _tiny import make_target  # noqa: E402
from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

import hybridspec_hf  # noqa: E402,F401  (installs the patches)
from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.generation.router_hooks import RoutingReplay, VerifyWindow  # noqa: E402
from hybridspec_hf.kernels import moe_triton, router_triton, shared_expert_triton  # noqa: E402
from hybridspec_hf.kernels.router_triton import route_topk, route_topk_reference  # noqa: E402
from hybridspec_hf.kernels.shared_expert_triton import (  # noqa: E402
    concat_shared_weights,
    gated_add,
    gated_add_reference,
    shared_expert,
    shared_expert_reference,
    silu_mul,
)
from hybridspec_hf.patches import _moe  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

SCORES_TOL = {torch.float32: dict(rtol=1e-6, atol=1e-7), torch.bfloat16: dict(rtol=2**-7, atol=0.0)}
BLOCK_TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Relative Frobenius error within BLOCK_TOL of the dtype; same shape and dtype."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    error = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error < BLOCK_TOL[expected.dtype], f"relative error {error:.3g} in {expected.dtype}"


def fused_forward(module: torch.nn.Module, *args):
    """A call as a resident forward makes it: `fused_kernels()` active, grad off."""
    with torch.no_grad(), patches.fused_kernels():
        return module(*args)


def plain_forward(module: torch.nn.Module, *args):
    """A call as generate() makes it: transformers' code throughout."""
    with torch.no_grad():
        return module(*args)


@pytest.fixture
def calls(monkeypatch):
    """The fused route allowed on CPU tensors (the internal switch), with launch counters of its kernels."""
    counts = {"route_topk": 0, "gated_add": 0, "mask_invalid_routes": 0, "moe_block_triton": 0}
    for module, name in ((router_triton, "route_topk"), (shared_expert_triton, "gated_add"),
                         (router_triton, "mask_invalid_routes"), (moe_triton, "moe_block_triton")):
        def counted(*args, _fn=getattr(module, name), _name=name):
            counts[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(_moe, "_ON_CPU", True)
    return counts


def assert_routing_matches(logits, scores, ids, top_k, normalize):
    """Scores as the reference's; ids torch.topk's, or at ties equally probable experts, equal logits lowest id
    first."""
    ref_scores, ref_ids = route_topk_reference(logits, top_k, normalize)
    torch.testing.assert_close(scores, ref_scores, **SCORES_TOL[logits.dtype])
    assert ids.dtype == torch.long and ids.shape == ref_ids.shape
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))  # the same probabilities, in order
    chosen = logits.gather(1, ids)
    tied = chosen[:, 1:] == chosen[:, :-1]
    assert bool((ids[:, 1:] > ids[:, :-1])[tied].all()), "equal logits: lowest expert id first"
    unchosen = torch.ones_like(probs, dtype=torch.bool).scatter(1, ids, False)
    rivals = unchosen & (logits == chosen[:, -1:])  # left out, as large as the last chosen: a higher id
    assert bool((torch.arange(logits.shape[1]) > ids[:, -1:])[rivals].all())
    distinct = torch.topk(probs, top_k + 1).values.diff(dim=-1).ne(0).all(-1)  # no tie within the top k + 1
    assert torch.equal(ids[distinct], ref_ids[distinct])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 256, 8), (5, 512, 10), (17, 200, 8), (3, 4, 2)])
def test_route_topk_matches_reference(tokens, experts, top_k, normalize, dtype):
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    scores, ids = route_topk(logits, top_k, normalize)
    assert scores.dtype == dtype
    assert_routing_matches(logits, scores, ids, top_k, normalize)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_topk_ties_take_the_lowest_expert_id(normalize):
    logits = torch.zeros(5, 40)
    logits[1, [30, 5, 17, 22]] = 2.0  # 4 equal winners for k = 3, in no id order
    logits[2, [9, 3]] = 3.0
    logits[2, [31, 7, 12]] = 1.0  # the third slot: three equally probable experts
    logits[3] = -1.5  # every logit negative: ties among negatives
    logits[3, [33, 8]] = -0.25
    logits[4] = -3.0
    logits[4, [6, 2]] = -0.0  # -0.0 and +0.0 are one logit: the lower id first
    logits[4, [1, 20]] = 0.0
    scores, ids = route_topk(logits, 3, normalize)
    assert ids.tolist() == [[0, 1, 2], [5, 17, 22], [3, 9, 7], [8, 33, 0], [1, 2, 6]]
    assert_routing_matches(logits, scores, ids, 3, normalize)


def test_the_router_programs_follow_the_switches(monkeypatch):
    """(router rows, warps) of an add_norm_route program: ROUTE_ONE_WARP's at every token count, and 4 rows and 4
    warps past 2 tokens with ROUTE_WIDE_ROUNDS (both configurations' results: the test below)."""
    for one_warp, wide, expected in [(True, False, [(2, 1)] * 4), (False, False, [(4, 4)] * 4),
                                     (True, True, [(2, 1), (2, 1), (4, 4), (4, 4)]), (False, True, [(4, 4)] * 4)]:
        monkeypatch.setattr(router_triton, "ROUTE_ONE_WARP", one_warp)
        monkeypatch.setattr(router_triton, "ROUTE_WIDE_ROUNDS", wide)
        assert [router_triton.route_program(t) for t in (1, 2, 3, 16)] == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, experts, top_k, normalize", [(1, 64, 256, 8, True), (3, 48, 60, 4, False),
                                                                      (5, 96, 7, 2, True)])
@pytest.mark.parametrize("one_warp", [True, False], ids=["2-rows-1-warp", "4-rows-4-warps"])
def test_add_norm_route_equals_the_add_the_norm_and_the_router(tokens, hidden, experts, top_k, normalize, dtype,
                                                               one_warp, monkeypatch):
    """One launch for the residual add, the RMSNorm, the router GEMM and its top-k: h and the normed rows as
    `add_rms_norm` (fp32 sums in another order: one rounding), the logits as F.linear's, and the routing of those
    logits exactly as `route_topk`'s (the same kernel code on the stored logits). Odd H and E mask every block; the
    counters are zero again after the launch (and a second launch gives the same result)."""
    from hybridspec_hf.kernels import gemv_triton, norm_triton

    monkeypatch.setattr(router_triton, "ROUTE_ONE_WARP", one_warp)
    gen = torch.Generator().manual_seed(tokens * hidden + experts)
    x = torch.randn(1, tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(1, tokens, hidden, generator=gen).to(dtype)
    norm_weight = (torch.randn(hidden, generator=gen) * 0.2).to(dtype)
    router_weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    h, normed, logits, scores, ids = router_triton.add_norm_route(x, residual, norm_weight, 1e-6, router_weight, top_k,
                                                                  normalize)
    ref_h, ref_normed = norm_triton.add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(h, ref_h) and h.shape == x.shape
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(normed, ref_normed, **tol)
    exact = F.linear(normed.reshape(tokens, hidden).double(), router_weight.double())
    assert logits.shape == (tokens, experts) and logits.dtype == dtype
    torch.testing.assert_close(logits.double(), exact, **tol)
    own_scores, own_ids = route_topk(logits, top_k, normalize)
    assert torch.equal(scores, own_scores) and torch.equal(ids, own_ids)
    assert_routing_matches(logits, scores, ids, top_k, normalize)
    # transformers' steps (the interpreter truncates fp32 -> bf16 casts where torch rounds: one rounding)
    ref = router_triton.add_norm_route_reference(x, residual, norm_weight, 1e-6, router_weight, top_k, normalize)
    torch.testing.assert_close(h, ref[0], **tol)
    torch.testing.assert_close(normed, ref[1], rtol=2 * tol["rtol"], atol=2 * tol["atol"])
    assert (gemv_triton.split_counters(x.device) == 0).all()
    again = router_triton.add_norm_route(x, residual, norm_weight, 1e-6, router_weight, top_k, normalize)
    assert all(torch.equal(a, b) for a, b in zip(again, (h, normed, logits, scores, ids)))


def test_add_norm_route_refuses_what_it_cannot_take():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="router weight"):
        router_triton.add_norm_route(x, x, torch.ones(16), 1e-6, torch.randn(8, 12), 2, True)
    with pytest.raises(ValueError, match="top_k=9"):
        router_triton.add_norm_route(x, x, torch.ones(16), 1e-6, torch.randn(8, 16), 9, True)


def router_configs():
    return [
        (modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter, Qwen3_5MoeTextConfig(hidden_size=48, num_experts=256,
                                                                          num_experts_per_tok=8), True),
        (modeling_qwen3_next.Qwen3NextTopKRouter, Qwen3NextConfig(hidden_size=48, num_experts=512,
                                                                  num_experts_per_tok=10, norm_topk_prob=True), True),
        (modeling_qwen3_next.Qwen3NextTopKRouter, Qwen3NextConfig(hidden_size=48, num_experts=60,
                                                                  num_experts_per_tok=4, norm_topk_prob=False), False),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router_cls, config, normalize", router_configs())
def test_patched_router_returns_what_transformers_returns(router_cls, config, normalize, dtype, calls):
    gen = torch.Generator().manual_seed(config.num_experts)
    router = router_cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    router = router.to(dtype)
    for tokens in (1, 5, 17):
        hidden = torch.randn(1, tokens, config.hidden_size, generator=gen).to(dtype)
        logits, scores, ids = fused_forward(router, hidden)
        ref_logits, ref_scores, ref_ids = plain_forward(router, hidden)
        assert torch.equal(logits, ref_logits) and logits.dtype == ref_logits.dtype == dtype
        assert scores.dtype == ref_scores.dtype and ids.dtype == ref_ids.dtype == torch.long
        assert_routing_matches(logits, scores, ids, config.num_experts_per_tok, normalize)
    assert calls["route_topk"] == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_shared_expert_and_combine_match_transformers(tokens, dtype):
    hidden_size, inter = 40, 20  # neither a power of two nor a multiple of the blocks
    gen = torch.Generator().manual_seed(tokens)
    config = Qwen3_5MoeTextConfig(hidden_size=hidden_size, shared_expert_intermediate_size=inter)
    mlp = modeling_qwen3_5_moe.Qwen3_5MoeMLP(config, intermediate_size=inter)
    gate = torch.nn.Linear(hidden_size, 1, bias=False)
    with torch.no_grad():
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, gate):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * linear.in_features**-0.5 * 2)
    mlp, gate = mlp.to(dtype), gate.to(dtype)
    x = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    routed = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weights = concat_shared_weights(mlp.gate_proj.weight, mlp.up_proj.weight, gate.weight)
    assert weights.shape == (48, hidden_size) and not weights[41:].any()  # 2I + 1 rows padded to 8
    with torch.no_grad():
        shared, logit = shared_expert(x, weights, mlp.down_proj.weight, inter)
        ref_shared, ref_logit = shared_expert_reference(x, mlp.gate_proj.weight, mlp.up_proj.weight,
                                                        mlp.down_proj.weight, gate.weight)
        out = gated_add(routed, logit, shared)
        block_ref = routed + torch.sigmoid(gate(x)) * mlp(x)  # SparseMoeBlock.forward's last lines
    assert_near(shared, ref_shared)
    assert_near(shared, mlp(x))
    assert_near(logit, ref_logit)
    assert_near(gated_add(routed, ref_logit, ref_shared), gated_add_reference(routed, ref_logit, ref_shared))
    assert_near(out, block_ref)
    gate_up = torch.randn(tokens, 2 * inter + 3, generator=gen).mul(3).to(dtype)  # + a gate logit and padding
    act = silu_mul(gate_up, inter)
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter : 2 * inter]
    torch.testing.assert_close(act, expected, rtol=1e-6 if dtype == torch.float32 else 2**-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_patched_block_equals_transformers(name, dtype, calls):
    model = make_target(name, seed=3, dtype=dtype)
    blocks = patches.moe_blocks(model)
    patches.prepare_fused_moe(blocks)
    gen = torch.Generator().manual_seed(7)
    limit = moe_triton.direct_limit()  # in one pass up to the direct rows' limit, around the experts call above
    inputs = [torch.randn(1, tokens, model.config.hidden_size, generator=gen).to(dtype)
              for tokens in (1, 5, limit + 1)]
    inputs.append(inputs[-1][:, :limit])
    for x in inputs:
        for block in blocks:
            # a token whose k-th and (k+1)-th router logits are equal may take either expert (route_topk: the lower
            # id; torch.topk: unspecified), equally probable: compared where the routing is unambiguous
            logits = F.linear(x.reshape(-1, x.shape[-1]), block.gate.weight).float()
            top = logits.topk(block.gate.top_k + 1, dim=-1).values
            clear = top[:, -2] != top[:, -1]
            assert clear.sum() >= len(clear) - 2
            assert_near(fused_forward(block, x)[0, clear], plain_forward(block, x)[0, clear])
    assert calls == {"route_topk": 4 * len(blocks), "gated_add": len(blocks), "mask_invalid_routes": 0,
                     "moe_block_triton": 3 * len(blocks)}


def test_hooks_on_router_and_experts_fire_and_hooks_on_the_shared_expert_keep_transformers(calls):
    model = make_target("qwen3_5_moe", seed=4, dtype=torch.float32)
    blocks = patches.moe_blocks(model)
    patches.prepare_fused_moe(blocks)
    block = blocks[0]
    x = torch.randn(1, 3, model.config.hidden_size)
    bank = torch.tensor([[[[3, 1], [0, 2], [2, 3]]] * len(blocks)])  # [rounds, layers, B, k]
    replay = RoutingReplay(blocks, bank)
    replay.armed = True
    seen = []
    handles = [block.gate.register_forward_hook(lambda m, a, out: seen.append(("gate", out[2].clone()))),
               block.experts.register_forward_pre_hook(lambda m, a: seen.append(("experts", a[1].clone())))]
    out = fused_forward(block, x)
    assert [kind for kind, _ in seen] == ["gate", "experts"]
    assert torch.equal(seen[1][1], bank[0, 0])  # the experts got RoutingReplay's ids
    # a user's hook on the experts: their module call, not the one-pass block
    assert calls == {"route_topk": 1, "gated_add": 1, "mask_invalid_routes": 0, "moe_block_triton": 0}
    assert_near(out, plain_forward(block, x))  # the replayed routing, in transformers' forward too
    replay.remove()
    handles.append(block.shared_expert.up_proj.register_forward_hook(lambda m, a, out: seen.append(("up", None))))
    assert_near(fused_forward(block, x), plain_forward(block, x))
    assert seen.count(("up", None)) == 2 and calls["gated_add"] == 1  # a hooked shared expert: transformers' forward
    for handle in handles:
        handle.remove()


def test_inert_outside_the_flag_on_cpu_with_grad_and_without_prepare(calls, monkeypatch):
    model = make_target("qwen3_next", seed=5, dtype=torch.float32)
    blocks = patches.moe_blocks(model)
    x = torch.randn(1, 2, model.config.hidden_size)
    monkeypatch.setattr(_moe, "_ON_CPU", False)
    patches.prepare_fused_moe(blocks)
    assert _moe._CACHE not in blocks[0].__dict__  # CPU weights: nothing copied
    with torch.no_grad(), patches.fused_kernels():
        blocks[0](x)  # CPU tensors
    monkeypatch.setattr(_moe, "_ON_CPU", True)
    with torch.no_grad():
        blocks[0](x)  # flag off
    with patches.fused_kernels():
        blocks[0](x)  # grad on
    assert calls == {"route_topk": 0, "gated_add": 0, "mask_invalid_routes": 0, "moe_block_triton": 0}
    assert_near(fused_forward(blocks[0], x), plain_forward(blocks[0], x))
    # not prepared: fused router, transformers' shared expert
    assert calls == {"route_topk": 1, "gated_add": 0, "mask_invalid_routes": 0, "moe_block_triton": 0}


def test_wrapped_shared_experts_get_no_copy(calls):
    """Tensor parallelism replaces the sharded shared expert's forwards on the instances (their weights are shards):
    no concatenated copy is made for such a block, which keeps transformers' forward; the others are fused."""
    model = make_target("qwen3_5_moe", seed=8, dtype=torch.float32)
    blocks = patches.moe_blocks(model)
    wrapped = blocks[0].shared_expert.gate_proj
    wrapped.forward = wrapped.forward  # an instance-level forward, as transformers' tensor parallelism installs
    patches.prepare_fused_moe(blocks)
    assert _moe._CACHE not in blocks[0].__dict__ and _moe._CACHE in blocks[1].__dict__
    x = torch.randn(1, 3, model.config.hidden_size)
    assert_near(fused_forward(blocks[0], x), plain_forward(blocks[0], x))
    assert calls["gated_add"] == calls["moe_block_triton"] == 0


def test_concatenated_weights_follow_in_place_updates_at_the_same_address_and_are_released(calls):
    model = make_target("qwen3_5_moe", seed=6, dtype=torch.float32)
    blocks = patches.moe_blocks(model)
    patches.prepare_fused_moe(blocks)
    block = blocks[1]
    weight = block.__dict__[_moe._CACHE].weight
    address = weight.data_ptr()
    x = torch.randn(1, 4, model.config.hidden_size)
    with torch.no_grad():
        block.shared_expert.up_proj.weight.mul_(-2.0)
        block.shared_expert_gate.weight.add_(1.0)
    assert_near(fused_forward(block, x), plain_forward(block, x))  # a stale copy is not used ...
    assert calls["gated_add"] == calls["moe_block_triton"] == 0  # ... transformers' shared expert runs
    patches.prepare_fused_moe(blocks)  # what every generate() call's start does
    assert block.__dict__[_moe._CACHE].weight.data_ptr() == address
    inter = block.shared_expert.gate_proj.out_features
    assert torch.equal(weight[inter : 2 * inter], block.shared_expert.up_proj.weight)
    assert torch.equal(weight[2 * inter], block.shared_expert_gate.weight[0])
    assert_near(fused_forward(block, x), plain_forward(block, x))
    assert calls["moe_block_triton"] == 1
    patches.release_fused_moe(blocks)
    assert all(_moe._CACHE not in b.__dict__ for b in blocks)


@pytest.mark.parametrize("strategy", ["dflash", "confidence"])
def test_resident_rounds_run_the_fused_blocks_and_release_them(calls, strategy):
    from test_exactness import run

    from _tiny import VOCAB, make_drafter

    target = make_target("qwen3_5_moe", seed=8, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ar = target.generate(prompt, do_sample=False, max_new_tokens=6)
    drafter = make_drafter(target, 4, ar, error_rate=0.3).to(torch.float32)
    settings = hybridspec_hf.HybridSpecConfig(cuda_graphs="on")
    out = run(target, prompt, drafter, strategy, 6, hybridspec_config=settings)
    assert torch.equal(out, ar)
    assert calls["moe_block_triton"] > 0 and calls["route_topk"] > 0  # in one pass: every call has <= 32 tokens
    assert (calls["mask_invalid_routes"] > 0) == (strategy != "dflash")  # stage 1 of a chosen length
    blocks = patches.moe_blocks(target)
    assert all(_moe._CACHE in b.__dict__ for b in blocks)
    hybridspec_hf.release_graphs(target)
    assert all(_moe._CACHE not in b.__dict__ for b in blocks)


def tiny_block(family: str, dtype: torch.dtype, shared_inter: int = 24) -> torch.nn.Module:
    """One sparse MoE block of the family, H = 40 and routed I = 24 (not powers of two), 6 experts, top-3, random
    weights, its concatenated copy made."""
    widths = dict(hidden_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=shared_inter,
                  num_experts=6, num_experts_per_tok=3)
    if family == "qwen3_5_moe":
        block = modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**widths))
    else:
        block = modeling_qwen3_next.Qwen3NextSparseMoeBlock(Qwen3NextConfig(**widths, norm_topk_prob=True))
    gen = torch.Generator().manual_seed(shared_inter)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    block = block.to(dtype)
    patches.prepare_fused_moe([block])
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_moe_block_add_folds_the_residual_into_the_one_pass_block(family, dtype, calls, monkeypatch):
    """Also through the decode kernels (1 and 2 tokens: `moe_triton.DECODE_MAX_TOKENS`) when DECODE_PATH is on."""
    monkeypatch.setattr(moe_triton, "DECODE_PATH", True)
    decoded = []
    launch_decode = moe_triton._launch_decode
    monkeypatch.setattr(moe_triton, "_launch_decode", lambda *args: decoded.append(1) or launch_decode(*args))
    block = tiny_block(family, dtype)
    gen = torch.Generator().manual_seed(11)
    for tokens in (1, 2, 7, 16):
        x = torch.randn(1, tokens, 40, generator=gen).to(dtype)
        residual = torch.randn(1, tokens, 40, generator=gen).mul(4).to(dtype)
        with torch.no_grad(), patches.fused_kernels():
            out = patches.moe_block_add(block, x, residual)
        assert_near(out, residual + plain_forward(block, x))
    assert calls["moe_block_triton"] == 4 and calls["gated_add"] == 0 and len(decoded) == 2
    seen = []
    handle = block.register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad(), patches.fused_kernels():
        out = patches.moe_block_add(block, x, residual)  # a hook on the block: the plain expression, it fires
    handle.remove()
    assert len(seen) == 1 and torch.equal(out, residual + seen[0])
    assert calls["moe_block_triton"] == 5  # the block's own (fused) forward inside
    with torch.no_grad():
        assert torch.equal(patches.moe_block_add(block, x, residual), residual + block(x))  # outside: plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_norm_route_block_add_equals_the_add_the_norm_and_the_block(family, dtype, calls, monkeypatch):
    """The decoder layer's add, post_attention_layernorm and MoE block with the add, the norm and the router in one
    launch: h + block(norm(h)) at 1-16 tokens; more tokens, a pre-hook on the router or the switch off give way
    (None); the router's forward hooks fire on the normed rows and what they return is the routing used."""
    launched = []
    fused = router_triton.add_norm_route
    monkeypatch.setattr(router_triton, "add_norm_route", lambda *a: launched.append(1) or fused(*a))
    block = tiny_block(family, dtype)
    norm_cls = (modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm if family == "qwen3_5_moe"
                else modeling_qwen3_next.Qwen3NextRMSNorm)
    norm = norm_cls(40, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=torch.Generator().manual_seed(3)) * 0.3)
    gen = torch.Generator().manual_seed(12)

    def both(tokens):
        x = torch.randn(1, tokens, 40, generator=gen).to(dtype)
        residual = torch.randn(1, tokens, 40, generator=gen).mul(4).to(dtype)
        with torch.no_grad(), patches.fused_kernels():
            out = _moe.norm_route_block_add(block, x, residual, norm)
        h = residual + x
        return out, h + plain_forward(block, plain_forward(norm, h))

    for tokens in (1, 2, 7, 16):
        out, expected = both(tokens)
        assert_near(out, expected)
    assert len(launched) == 4 and calls["route_topk"] == 0
    assert both(17)[0] is None  # past the direct rows
    seen = []

    def first_expert(module, args, output):  # a forward hook that rewrites the routing
        seen.append(args[0].shape)
        return output[0], output[1], torch.zeros_like(output[2])

    handle = block.gate.register_forward_hook(first_expert)
    out, expected = both(3)  # the plain block's router call runs the same hook
    handle.remove()
    assert_near(out, expected)
    assert seen == [torch.Size([3, 40])] * 2
    handle = block.gate.register_forward_pre_hook(lambda m, a: None)
    assert both(3)[0] is None
    handle.remove()
    monkeypatch.setattr(_moe, "FUSED_ROUTE", False)
    assert both(3)[0] is None and len(launched) == 5


def test_the_verify_window_masks_routes_in_the_one_pass_block(calls):
    """Stage 1 of a verification: VerifyWindow's pre-hook on the experts (tokens at or past `valid` get token 0's
    experts with weight 0) runs inside the one-pass block, which stays fused; RoutingReplay's ids reach it."""
    block = tiny_block("qwen3_5_moe", torch.float32)
    x = torch.randn(1, 5, 40)
    unmasked = fused_forward(block, x)
    window = VerifyWindow([block])
    window.arm(type("Choice", (), dict(valid=torch.tensor([2]), corrects=False))())
    out = fused_forward(block, x)
    assert calls["moe_block_triton"] == 2 and calls["mask_invalid_routes"] == 1 and calls["gated_add"] == 0
    assert_near(out, plain_forward(block, x))  # transformers' forward, the hook on its experts call
    assert torch.equal(out[:, :2], unmasked[:, :2]) and not torch.allclose(out[:, 2:], unmasked[:, 2:])
    window.remove()
    replay = RoutingReplay([block], torch.tensor([[[[5, 1, 0], [2, 4, 3], [0, 1, 2], [3, 3, 4], [5, 4, 3]]]]))
    replay.armed = True
    out = fused_forward(block, x)
    assert calls["moe_block_triton"] == 3 and not torch.allclose(out, unmasked)
    assert_near(out, plain_forward(block, x))
    replay.remove()


def test_the_one_pass_block_gives_way(calls, monkeypatch):
    """A shared expert of another width, the switch off, a user's hook on the experts: the shared expert's own
    kernels around the experts call, with the same result."""
    block = tiny_block("qwen3_next", torch.float32, shared_inter=20)
    x = torch.randn(1, 3, 40)
    assert_near(fused_forward(block, x), plain_forward(block, x))
    assert calls["moe_block_triton"] == 0 and calls["gated_add"] == 1
    block = tiny_block("qwen3_next", torch.float32)
    monkeypatch.setattr(_moe, "SHARED_EXPERT_SLOT", False)
    assert_near(fused_forward(block, x), plain_forward(block, x))
    assert calls["moe_block_triton"] == 0 and calls["gated_add"] == 2
    monkeypatch.setattr(_moe, "SHARED_EXPERT_SLOT", True)
    handle = block.experts.register_forward_hook(lambda m, a, out: out * 2)
    assert_near(fused_forward(block, x), plain_forward(block, x))  # the hook doubled the routed part in both
    assert calls["moe_block_triton"] == 0 and calls["gated_add"] == 3
    handle.remove()
    fused_forward(block, x)
    assert calls["moe_block_triton"] == 1


@pytest.mark.parametrize("valid", [0, 1, 3, 5, 9])
def test_mask_invalid_routes_matches_reference(valid):
    """Stage 1's masking in one launch: tokens at or past `valid` take token 0's experts with weight 0 (exact)."""
    torch.manual_seed(valid)
    ids = torch.randint(0, 256, (5, 8))
    weights = torch.rand(5, 8, dtype=torch.bfloat16) + 0.1
    limit = torch.tensor([valid])
    got_ids, got_weights = router_triton.mask_invalid_routes(ids, weights, limit)
    ref_ids, ref_weights = router_triton.mask_invalid_routes_reference(ids, weights, limit)
    assert torch.equal(got_ids, ref_ids) and torch.equal(got_weights, ref_weights)
    assert (got_weights[valid:] == 0).all() and torch.equal(got_ids[valid:], ids[:1].expand(max(5 - valid, 0), 8))


def test_mask_invalid_routes_per_batch_row():
    """Batched rounds: ids [R·T, k] row-major, valid [R]: row r's tokens at or past valid[r] take token 0's experts
    with weight 0; the others keep theirs."""
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (3 * 4, 8))
    weights = torch.rand(3 * 4, 8, dtype=torch.bfloat16) + 0.1
    valid = torch.tensor([4, 1, 2])
    got_ids, got_weights = router_triton.mask_invalid_routes(ids, weights, valid)
    ref_ids, ref_weights = router_triton.mask_invalid_routes_reference(ids, weights, valid)
    assert torch.equal(got_ids, ref_ids) and torch.equal(got_weights, ref_weights)
    invalid = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    assert (got_weights[invalid] == 0).all() and (got_weights[~invalid] > 0).all()
    assert torch.equal(got_ids[invalid], ids[:1].expand(int(invalid.sum()), 8))
    assert torch.equal(got_ids[~invalid], ids[~invalid])


def test_moe_block_benchmark_smoke_run_writes_results(tmp_path, benchmarks, cpu_only):
    """benchmarks/moe_block.py on the CPU (tiny shape, the interpreter): the three routes and the kernels alone per
    T, the decode route agreeing with transformers' block, the decode kernels with the direct ones, bit for bit
    reproducible; the results written; the routing switches restored."""
    import importlib
    import sys

    defaults = (_moe.SHARED_EXPERT_SLOT, moe_triton.DECODE_PATH)
    benchmark = importlib.import_module("moe_block")
    report = benchmark.main(["--smoke", "--name", str(tmp_path / "moe_block")])
    sys.modules.pop("moe_block", None)
    assert [row["T"] for row in report["rows"]] == list(benchmark.TOKENS)
    for row in report["rows"]:
        assert set(row["routes"]) == {"separate", "one pass", "decode"}
        assert all(route["rel_err"] < BLOCK_TOL[torch.bfloat16] for route in row["routes"].values())
        decode = row["kernels"].get("decode")
        assert (decode is not None) == (row["T"] <= moe_triton.DECODE_KERNEL_MAX_TOKENS)
        assert decode is None or (decode["same_bits"] and decode["rel_err"] < BLOCK_TOL[torch.bfloat16])
    assert "| decode µs" in (tmp_path / "moe_block.md").read_text()
    assert (_moe.SHARED_EXPERT_SLOT, moe_triton.DECODE_PATH) == defaults and not _moe._ON_CPU
