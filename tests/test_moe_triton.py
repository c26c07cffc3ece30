"""Triton routed experts (kernels/moe_triton.py) against the torch reference, transformers' eager experts and a tiny
Qwen3.5-MoE model set to experts_implementation="hybridspec" (CPU, Triton interpreter).

Also the one-pass MoE block (`moe_block_triton`: the shared expert as one more experts slot, the gated combine and
the residual in the sum kernel) against `moe_block_reference` (transformers' torch steps).

Tolerances (relative Frobenius error): fp32 <= 1e-5 (fp32 dots and sums; measured ~2e-7 against float64);
bf16 <= 2e-2 (one bf16 rounding of the SiLU·up activations before the down dot and one of the output; the interpreter
truncates those casts where the GPU rounds to nearest, measured ~7e-3 here; the one-pass block ~1e-2: the shared
expert's gate and up stay fp32 up to SiLU·up where transformers rounds both to bf16).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts  # noqa: E402

from hybridspec_hf.kernels import gemv_triton, moe_triton  # noqa: E402
from hybridspec_hf.kernels.moe_triton import (  # noqa: E402
    DECODE_KERNEL_MAX_TOKENS,
    DECODE_MAX_TOKENS,
    DIRECT_MAX_TOKENS,
    Tiles,
    align_pairs,
    fused_experts,
    fused_experts_reference,
    fused_experts_triton,
    moe_block_reference,
    moe_block_triton,
)
from hybridspec_hf.kernels.router_triton import mask_invalid_routes_reference  # noqa: E402
from hybridspec_hf.kernels.shared_expert_triton import concat_shared_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_layer(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype=torch.float32):
    """Random inputs of one experts call: distinct experts per token (as top-k gives), shared across tokens."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    return dict(
        hidden=torch.randn(tokens, hidden, generator=gen).to(dtype),
        top_k_index=scores.topk(top_k, dim=-1).indices,
        top_k_weights=torch.rand(tokens, top_k, generator=gen).to(dtype),
        gate_up_proj=(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype),
        down_proj=(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype),
    )


def float64_truth(x: dict) -> torch.Tensor:
    return fused_experts_reference(*(t.double() if t.is_floating_point() else t for t in x.values()))


@pytest.mark.parametrize(
    "seed, tokens, hidden, inter, experts, top_k, dtype, mode",
    [
        (1, 1, 40, 24, 4, 2, torch.float32, "auto"),  # decode, one token
        (2, 5, 33, 20, 3, 2, torch.float32, "auto"),  # H, I not powers of two, E = 3
        (3, 16, 48, 24, 4, 1, torch.float32, "auto"),  # 16 tokens (the direct path's limit), k = 1
        (4, 16, 40, 24, 4, 2, torch.bfloat16, "auto"),
        (5, 5, 33, 20, 3, 2, torch.bfloat16, "auto"),
        (6, 5, 33, 20, 3, 2, torch.float32, "sorted"),  # the prefill path at a decode size
        (7, 40, 33, 20, 5, 3, torch.float32, "sorted"),  # > 16 tokens sorted: several blocks per expert
        (8, 40, 40, 24, 4, 2, torch.bfloat16, "direct"),  # 33-64 tokens: the direct rows in one 64-row tile
        (9, 33, 33, 20, 5, 3, torch.float32, "direct"),  # a 64-row tile, H and I not powers of two
        (10, 24, 48, 24, 4, 2, torch.float32, "auto"),  # 17-32 tokens: "auto" takes a 32-row tile
        (11, 64, 40, 24, 6, 2, torch.float32, "direct"),  # the direct rows' limit
        (12, 33, 40, 24, 6, 2, torch.float32, "auto"),  # past "auto"'s limit: sorted
    ],
)
def test_matches_reference(seed, tokens, hidden, inter, experts, top_k, dtype, mode):
    x = make_layer(seed, tokens, hidden, inter, experts, top_k, dtype)
    out = fused_experts_triton(**x, mode=mode)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert rel(out, float64_truth(x)) < TOL[dtype]
    assert rel(out, fused_experts_reference(**x)) < TOL[dtype]


@pytest.mark.parametrize("mode", ["direct", "sorted"])
def test_zero_weights_duplicates_and_sentinels(mode):
    """Tokens whose routing weights are 0 get exactly 0; an expert listed twice by one token counts twice; ids outside
    [0, E) (expert-parallel sentinels) count nothing; one program column serves every token sharing an expert."""
    x = make_layer(9, 6, 40, 24, 4, 3)
    x["top_k_index"][:] = torch.tensor([2, 0, 1])  # every token: the same three experts
    x["top_k_index"][1] = torch.tensor([3, 3, 0])  # twice the same expert
    x["top_k_index"][2, 2] = 4  # sentinel (E = 4)
    x["top_k_index"][3, 0] = -1
    x["top_k_weights"][4] = 0.0
    out = fused_experts_triton(**x, mode=mode)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert rel(out, float64_truth(x)) < TOL[torch.float32]
    # the reference's meaning of a repeated expert: one use with the summed weight
    merged = dict(x, hidden=x["hidden"][1:2], top_k_index=torch.tensor([[3, 0]]),
                  top_k_weights=torch.stack([x["top_k_weights"][1, :2].sum(), x["top_k_weights"][1, 2]])[None])
    assert rel(fused_experts_reference(**merged), float64_truth(x)[1:2]) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_eager_experts(dtype):
    config = Qwen3_5MoeTextConfig(hidden_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    torch.manual_seed(10)
    experts = Qwen3_5MoeExperts(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 40**-0.5)
        experts.down_proj.normal_(0.0, 24**-0.5)
    x = make_layer(10, 5, 40, 24, 4, 2, dtype)
    with torch.no_grad():
        eager = experts(x["hidden"], x["top_k_index"], x["top_k_weights"])
    out = fused_experts(x["hidden"], x["top_k_index"], x["top_k_weights"], experts.gate_up_proj, experts.down_proj)
    assert rel(out, eager) < TOL[dtype]


def make_block(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype=torch.float32):
    """`make_layer` plus a shared expert of the same width (its concatenated [gate; up; gate row] copy, its down
    weight) and a residual."""
    x = make_layer(seed, tokens, hidden, inter, experts, top_k, dtype)
    gen = torch.Generator().manual_seed(seed + 1000)
    gate, up, gate_row = (torch.randn(rows, hidden, generator=gen) * hidden**-0.5 for rows in (inter, inter, 1))
    x["shared_gate_up"] = concat_shared_weights(gate.to(dtype), up.to(dtype), (gate_row * 4).to(dtype))
    x["shared_down"] = (torch.randn(hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    x["residual"] = torch.randn(tokens, hidden, generator=gen).to(dtype)
    return x


@pytest.mark.parametrize(
    "seed, tokens, hidden, inter, experts, top_k, dtype",
    [
        (21, 1, 40, 24, 4, 2, torch.float32),  # decode
        (22, 5, 33, 20, 5, 3, torch.float32),  # H, I not powers of two (the logit GEMV's and the tiles' masks)
        (23, 16, 48, 24, 6, 4, torch.float32),  # one 16-row tile
        (24, 1, 40, 24, 4, 2, torch.bfloat16),
        (25, 16, 40, 24, 6, 3, torch.bfloat16),
        (29, 48, 40, 24, 6, 2, torch.float32),  # a 64-row tile (mode "auto": direct up to 64 in moe_block_triton)
        (30, 32, 33, 20, 5, 3, torch.bfloat16),  # a 32-row tile (a batch of 2 rows verifying 16 tokens)
    ],
)
@pytest.mark.parametrize("with_residual", [True, False])
def test_moe_block_matches_reference(seed, tokens, hidden, inter, experts, top_k, dtype, with_residual):
    x = make_block(seed, tokens, hidden, inter, experts, top_k, dtype)
    if not with_residual:
        x["residual"] = None
    out = moe_block_triton(**x)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert rel(out, moe_block_reference(**x)) < TOL[dtype]
    if dtype == torch.float32:
        truth = moe_block_reference(**{k: v.double() if v is not None and v.is_floating_point() else v
                                       for k, v in x.items()})
        assert rel(out, truth) < TOL[dtype]


def test_moe_block_shared_expert_and_residual_do_not_depend_on_the_routing():
    """Zero routing weights, sentinels and an expert listed twice: the routed part is what the reference makes of
    them (0 for the zero-weight token), the shared expert, its gate and the residual reach every token."""
    x = make_block(26, 6, 40, 24, 4, 3)
    x["top_k_index"][1] = torch.tensor([3, 3, 0])
    x["top_k_index"][2, 2] = 4
    x["top_k_index"][3, 0] = -1
    x["top_k_weights"][4] = 0.0
    out = moe_block_triton(**x)
    truth = moe_block_reference(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()})
    assert rel(out, truth) < TOL[torch.float32]
    only_shared = moe_block_reference(**dict(x, top_k_weights=torch.zeros_like(x["top_k_weights"])))
    assert rel(out[4], only_shared[4]) < TOL[torch.float32] and rel(out[4], x["residual"][4]) > 1e-2


def test_moe_block_errors_name_the_problem():
    x = make_block(27, 3, 40, 24, 4, 2)
    with pytest.raises(ValueError, match="routed experts' layout"):
        moe_block_triton(**dict(x, shared_down=x["shared_down"][:, :16]))  # a shared expert of another I
    big = make_block(27, DIRECT_MAX_TOKENS + 1, 40, 24, 4, 2)
    with pytest.raises(ValueError, match=f"at most {DIRECT_MAX_TOKENS} tokens"):
        moe_block_triton(**big)


# ----------------------------------------------------------------------------------------------------------------
# decode kernels (T <= DECODE_MAX_TOKENS)

# (hidden, inter, experts, top_k, gate_up tiles, down tiles): the default tiles fitted to H, I not powers of two
# (masked columns and rows); K in two uneven slices and I in two masked steps; K in four even slices
DECODE_CASES = [
    (40, 24, 4, 3, None, None),
    (40, 24, 4, 3, Tiles(8, 16, 4, 1, split_k=2), Tiles(8, 16, 4, 1)),
    (64, 32, 8, 2, Tiles(16, 16, 4, 1, split_k=4), Tiles(32, 32, 4, 1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("hidden, inter, experts, top_k, gate_up_tiles, down_tiles", DECODE_CASES)
def test_decode_matches_reference(hidden, inter, experts, top_k, gate_up_tiles, down_tiles, tokens, dtype):
    """The decode kernels (one launch of split-K gate_up, one of down + the weighted sum + the gated shared expert +
    the residual) against the torch steps: experts shared across tokens, non-uniform routing weights, and the last
    token invalid (a device-side valid length: stage 1's masking gives it token 0's experts with weight 0)."""
    x = make_block(40 + tokens, tokens, hidden, inter, experts, top_k, dtype)
    valid = torch.tensor([max(tokens - 1, 1)])
    x["top_k_index"], x["top_k_weights"] = mask_invalid_routes_reference(x["top_k_index"], x["top_k_weights"], valid)
    assert tokens == 1 or x["top_k_index"].unique().numel() < x["top_k_index"].numel()  # experts shared
    assert x["top_k_weights"][0].unique().numel() == top_k  # not uniform
    tiles = dict(gate_up_tiles=gate_up_tiles, down_tiles=down_tiles)
    out = moe_block_triton(**x, mode="decode", **tiles)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert rel(out, moe_block_reference(**x)) < TOL[dtype]
    if dtype == torch.float32:
        truth = moe_block_reference(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()})
        assert rel(out, truth) < TOL[dtype]
    if tokens > 1:  # the invalid token: the shared expert and the residual only
        only_shared = moe_block_reference(**dict(x, top_k_weights=torch.zeros_like(x["top_k_weights"])))
        assert rel(out[-1], only_shared[-1]) < TOL[dtype]
    routed = {k: v for k, v in x.items() if k not in ("shared_gate_up", "shared_down", "residual")}
    assert rel(fused_experts_triton(**routed, mode="decode", **tiles), fused_experts_reference(**routed)) < TOL[dtype]


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("hidden, inter, experts, top_k, gate_up_tiles, down_tiles", DECODE_CASES[1:])
def test_decode_shared_expert_first_gives_the_same_bits(hidden, inter, experts, top_k, gate_up_tiles, down_tiles,
                                                        tokens, monkeypatch):
    """SHARED_FIRST (the shared expert's gate_up programs first in the grid, their first tiles loaded before the PDL
    wait) moves programs, not sums: the same bits as the shared expert's programs last (uneven K slices: the early
    tiles' masked tail; several K steps: only the first tile loaded early)."""
    x = make_block(50 + tokens, tokens, hidden, inter, experts, top_k, torch.bfloat16)
    tiles = dict(gate_up_tiles=gate_up_tiles, down_tiles=down_tiles)
    outs = []
    for first in (True, False):
        monkeypatch.setattr(moe_triton, "SHARED_FIRST", first)
        outs.append(moe_block_triton(**x, mode="decode", **tiles))
    assert torch.equal(outs[0], outs[1])
    assert rel(outs[0], moe_block_reference(**x)) < TOL[torch.bfloat16]


def test_decode_duplicates_sentinels_and_zero_weights():
    """An expert listed twice by one token counts twice, ids outside [0, E) count nothing, zero weights give exactly
    the shared expert + residual; the same as the direct rows make of them."""
    x = make_block(46, 4, 40, 24, 4, 3)
    x["top_k_index"][1] = torch.tensor([3, 3, 0])
    x["top_k_index"][2, 2] = 4
    x["top_k_index"][3, 0] = -1
    x["top_k_weights"][0] = 0.0
    out = moe_block_triton(**x, mode="decode")
    truth = moe_block_reference(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()})
    assert rel(out, truth) < TOL[torch.float32]
    assert rel(out, moe_block_triton(**x, mode="direct")) < TOL[torch.float32]
    only_shared = moe_block_triton(**dict(x, top_k_weights=torch.zeros_like(x["top_k_weights"])), mode="decode")
    assert torch.equal(out[0], only_shared[0])


@pytest.mark.parametrize("tokens", [1, 2])
def test_decode_is_bitwise_reproducible_and_leaves_the_counters_zero(tokens, monkeypatch):
    """Split-K partials and the slots' outputs are summed in a fixed order by the last program to arrive (integer
    counters, no float atomics): the same bits on every call, and every counter back at 0 for the next launch."""
    x = make_block(47, tokens, 64, 32, 8, 2, torch.bfloat16)
    tiles = dict(gate_up_tiles=Tiles(16, 16, 4, 1, split_k=4), down_tiles=Tiles(32, 32, 4, 1))
    first = moe_block_triton(**x, mode="decode", **tiles)
    assert not gemv_triton._COUNTERS[torch.device("cpu")].any()
    assert torch.equal(moe_block_triton(**x, mode="decode", **tiles), first)
    monkeypatch.setattr(moe_triton, "DECODE_PATH", True)
    assert torch.equal(moe_block_triton(**x, **tiles), first)  # "auto" takes them up to DECODE_MAX_TOKENS tokens


def test_decode_flag_and_auto_dispatch(monkeypatch):
    """DECODE_PATH switches "auto" between the decode kernels and the direct rows (A/B), with the same result;
    above DECODE_MAX_TOKENS "auto" takes the direct rows (the H200 sweep's choice), while mode="decode" still takes
    up to DECODE_KERNEL_MAX_TOKENS."""
    monkeypatch.setattr(moe_triton, "DECODE_PATH", True)
    launches = []
    decode = moe_triton._launch_decode
    monkeypatch.setattr(moe_triton, "_launch_decode", lambda *args: launches.append(1) or decode(*args))
    x = make_block(48, DECODE_MAX_TOKENS, 40, 24, 4, 3)
    out = moe_block_triton(**x)
    assert launches == [1]
    monkeypatch.setattr(moe_triton, "DECODE_PATH", False)
    assert rel(moe_block_triton(**x), out) < TOL[torch.float32] and launches == [1]
    monkeypatch.setattr(moe_triton, "DECODE_PATH", True)
    above = make_block(48, DECODE_MAX_TOKENS + 1, 40, 24, 4, 3)
    out = moe_block_triton(**above)
    assert launches == [1]
    assert rel(moe_block_triton(**above, mode="decode"), out) < TOL[torch.float32] and launches == [1, 1]


def test_decode_errors_name_the_problem():
    x = make_block(49, DECODE_KERNEL_MAX_TOKENS + 1, 40, 24, 4, 2)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        moe_block_triton(**x, mode="decode")
    with pytest.raises(ValueError, match="decode"):
        moe_block_triton(**x, mode="direct", gate_up_tiles=Tiles(16, 16, split_k=2))


def test_align_pairs_blocks():
    """Every valid pair sits in exactly one block of its expert; padding holds S; unused blocks carry expert -1."""
    ids = torch.tensor([[3, 1], [1, 0], [3, 9], [1, 3]])  # 9: sentinel, E = 4
    block_pairs, block_expert = align_pairs(ids, num_experts=4, block_m=2)
    pairs = ids.numel()
    assert block_expert.numel() == 4 + 4 and block_pairs.numel() == 2 * 8
    seen = []
    for block, expert in enumerate(block_expert.tolist()):
        rows = block_pairs[2 * block: 2 * block + 2].tolist()
        if expert < 0:
            assert rows == [pairs, pairs]
            continue
        for pair in rows:
            if pair < pairs:
                assert ids.view(-1)[pair] == expert
                seen.append(pair)
    assert sorted(seen) == [p for p in range(pairs) if ids.view(-1)[p] < 4]
    assert (block_expert >= 0).sum() == 5  # expert 0: 1 pair -> 1 block; experts 1 and 3: 3 pairs -> 2 blocks each


def test_cpu_falls_back_to_the_torch_path(monkeypatch):
    """CPU tensors, and float64 anywhere: the torch path (`dense_experts` at these sizes, tests/test_dense_experts.py
    covers its rule and its agreement with the reference)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    x = make_layer(11, 3, 40, 24, 4, 2)
    assert torch.equal(fused_experts(**x), moe_triton.dense_experts(**x))
    x64 = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert torch.equal(fused_experts(**x64), moe_triton.dense_experts(**x64))  # float64: the torch path everywhere


def test_errors_name_the_problem():
    x = make_layer(12, 3, 40, 24, 4, 2)
    with pytest.raises(ValueError, match="down_proj"):
        fused_experts_triton(**dict(x, down_proj=x["down_proj"][:, :, :8]))
    big = make_layer(12, DIRECT_MAX_TOKENS + 1, 40, 24, 4, 2)
    with pytest.raises(ValueError, match="sorted"):
        fused_experts_triton(**big, mode="direct")
    with pytest.raises(TypeError, match="kernel_backend='torch'"):
        fused_experts(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()}, kernel_backend="triton")


# ----------------------------------------------------------------------------------------------------------------
# experts_implementation="hybridspec"


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_model_set_to_hybridspec_matches_eager(name, monkeypatch):
    """set_experts_implementation("hybridspec") on a tiny model: same logits and greedy tokens as "eager", and the
    experts really went through fused_experts (prefill of 2 x 7 tokens, then decode steps of 2 x 1)."""
    from _tiny import VOCAB, make_target

    from hybridspec_hf.patches import experts as glue

    glue.register_experts_implementation()
    calls = []
    monkeypatch.setattr(glue, "fused_experts", lambda *args: calls.append(args[0].shape[0]) or fused_experts(*args))
    model = make_target(name, seed=1, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        eager_logits = model(prompt).logits
    eager_tokens = model.generate(prompt, do_sample=False, max_new_tokens=3)
    model.set_experts_implementation("hybridspec")
    with torch.no_grad():
        logits = model(prompt).logits
    assert calls and set(calls) == {14}
    assert rel(logits, eager_logits) < TOL[torch.float32]
    assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=3), eager_tokens)
    assert 2 in calls  # decode steps: batch 2 x 1 token


def test_unsupported_experts_layout_is_refused():
    from hybridspec_hf.patches.experts import hybridspec_experts_forward

    config = Qwen3_5MoeTextConfig(hidden_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    experts = Qwen3_5MoeExperts(config)
    experts.has_bias = True
    x = make_layer(13, 2, 40, 24, 4, 2)
    with pytest.raises(ValueError, match="grouped_mm"):
        hybridspec_experts_forward(experts, x["hidden"], x["top_k_index"], x["top_k_weights"])


@pytest.mark.parametrize("wide", [True, False])
def test_auto_takes_the_direct_rows_up_to_the_limit_of_the_switch(wide, monkeypatch):
    """WIDE_DIRECT: "auto" gives 17-32 tokens to the direct rows (no sort: neither alignment runs), else to the
    sorted blocks (the one-launch alignment with ALIGN_KERNEL on, the default, the torch one without); the same
    outputs either way."""
    monkeypatch.setattr(moe_triton, "WIDE_DIRECT", wide)
    calls = []
    kernel = moe_triton.align_pairs_triton
    monkeypatch.setattr(moe_triton, "align_pairs", lambda *a: calls.append("torch") or align_pairs(*a))
    monkeypatch.setattr(moe_triton, "align_pairs_triton", lambda *a: calls.append("kernel") or kernel(*a))
    x = make_layer(13, 32, 40, 24, 6, 2)
    out = fused_experts_triton(**x)
    assert calls == ([] if wide else ["kernel" if moe_triton.ALIGN_KERNEL else "torch"])
    assert moe_triton.direct_limit() == (32 if wide else 16)
    assert rel(out, float64_truth(x)) < TOL[torch.float32]



@pytest.mark.parametrize("tokens", [1, 2])
def test_the_early_reads_of_the_decode_down_kernel_change_no_bit(tokens, monkeypatch):
    """pdl.EARLY_READS moves the down kernel's routing and first weight tile before the PDL wait (the interpreter
    has no wait: the same arithmetic either way), with the shared expert, a duplicate expert and a sentinel."""
    from hybridspec_hf.kernels import pdl

    x = make_block(31, tokens, 40, 24, 6, 3)
    x["top_k_index"][0, 1] = x["top_k_index"][0, 0]  # the same expert twice: the second slot has no work
    x["top_k_index"][-1, 2] = 6  # a sentinel (E = 6)
    outs = []
    for early in (True, False):
        monkeypatch.setattr(pdl, "EARLY_READS", early)
        outs.append(moe_block_triton(**x, mode="decode"))
    assert torch.equal(outs[0], outs[1])
    assert rel(outs[0], moe_block_reference(**x)) < TOL[torch.float32]


@pytest.mark.parametrize("tokens, valid", [(16, 1), (16, 4), (16, 16), (7, 3), (32, 9)])
def test_the_direct_rows_with_the_shared_slot_first_change_no_bit(tokens, valid, monkeypatch):
    """DIRECT_SHARED_FIRST (the shared expert's programs first in the grid, dead slots leaving before their row
    loads) against the old order, as a max-shape round runs them: the tokens past the valid length routed to -1
    (`mask_invalid_routes`), a duplicate expert and a sentinel among the valid ones."""
    x = make_block(32, tokens, 40, 24, 6, 3)
    x["top_k_index"][0, 1] = x["top_k_index"][0, 0]
    x["top_k_index"][min(1, valid - 1), 2] = 6
    x["top_k_index"][valid:] = -1
    outs = []
    for first in (True, False):
        monkeypatch.setattr(moe_triton, "DIRECT_SHARED_FIRST", first)
        outs.append(moe_block_triton(**x, mode="direct"))
    assert torch.equal(outs[0], outs[1])
    truth = moe_block_reference(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()})
    assert rel(outs[0], truth) < TOL[torch.float32]


@pytest.mark.parametrize("deep", [True, False])
def test_the_direct_rows_deep_k_tiles_match_the_reference(deep, monkeypatch):
    """DIRECT_DEEP_K (256-deep K steps in 3 stages at 5-16 tokens) at H = 512, so that the 256-deep step is not
    clamped to a small test shape, with the round's tokens past the valid length routed to -1."""
    monkeypatch.setattr(moe_triton, "DIRECT_DEEP_K", deep)
    assert moe_triton.default_tiles(16, "direct")[1].block_k == (256 if deep else 128)
    x = make_block(33, 16, 512, 64, 6, 3)
    x["top_k_index"][11:] = -1
    truth = moe_block_reference(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()})
    assert rel(moe_block_triton(**x, mode="direct"), truth) < TOL[torch.float32]


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 2, 4, 16), (5, 3, 6, 16), (40, 3, 5, 16),
                                                             (33, 8, 256, 16), (256, 8, 256, 64), (512, 8, 256, 16)])
def test_the_align_kernel_equals_align_pairs(tokens, top_k, experts, block_m):
    """align_pairs_triton (one launch) gives align_pairs' two tensors bit for bit: ids with sentinels (-1 and E),
    experts repeated across tokens and within one, up to the kernel's 4,096 pairs."""
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    ids = torch.randint(-1, experts + 1, (tokens, top_k), generator=gen)
    ids[0, -1] = ids[0, 0]  # one token naming an expert twice
    expected = align_pairs(ids, experts, block_m)
    got = moe_triton.align_pairs_triton(ids, experts, block_m)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_the_sorted_blocks_with_the_align_kernel_equal_those_without(monkeypatch):
    x = make_layer(14, 70, 40, 24, 6, 3)
    x["top_k_index"][3, 1] = -1  # a sentinel
    without = fused_experts_triton(**x, mode="sorted")
    monkeypatch.setattr(moe_triton, "ALIGN_KERNEL", True)
    calls = []
    monkeypatch.setattr(moe_triton, "align_pairs", lambda *a: calls.append(a) or align_pairs(*a))
    assert torch.equal(fused_experts_triton(**x, mode="sorted"), without) and not calls
    with pytest.raises(ValueError, match="4096 token–expert pairs"):
        moe_triton.align_pairs_triton(torch.zeros(513, 8, dtype=torch.long), 256, 16)
