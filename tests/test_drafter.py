"""DFlash drafter: z-lab checkpoint compatibility, shared target tables, context cache and attention pattern."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from _tiny import TARGETS, VOCAB, make_target
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from hybridspec_hf.drafter import (
    DFlashConfig,
    DFlashDrafter,
    StaticDraftContext,
    block_attention_mask,
    block_position_ids,
    build_target_layer_ids,
)

HIDDEN = 32  # tests/_tiny.py targets


def _drafter(target, seed=1, **kwargs) -> DFlashDrafter:
    """A float64 eval drafter with non-trivial norm weights (random init leaves them at 1)."""
    torch.manual_seed(seed)
    kwargs.setdefault("num_layers", 2)
    kwargs.setdefault("target_layer_ids", [0, 2, 3])
    kwargs.setdefault("block_size", 6)
    drafter = DFlashDrafter.from_target(target, **kwargs).eval()
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return drafter


def _features(length, seed=2, batch=1, n_feat=3) -> torch.Tensor:
    return torch.randn(batch, length, n_feat * HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3_5_moe")


# ------------------------------------------------------------------------------------------- construction / binding
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_from_target_matches_each_target_family(name):
    target = make_target(name)
    drafter = DFlashDrafter.from_target(target, num_layers=1, block_size=8)
    text = target.config.get_text_config()
    assert (drafter.config.hidden_size, drafter.config.vocab_size) == (text.hidden_size, text.vocab_size)
    assert drafter.config.target_layer_ids == [text.num_hidden_layers // 2]  # z-lab rule for one draft layer
    assert drafter.config.num_target_layers == text.num_hidden_layers
    assert drafter.config.mask_token_id == text.vocab_size - 1
    assert drafter.dtype == torch.float64
    logits = drafter.draft(torch.tensor([[5], [7]]), _features(4, batch=2, n_feat=1), drafter.new_context_cache())
    assert logits.shape == (2, 7, text.vocab_size) and logits.dtype == torch.float64
    assert torch.isfinite(logits).all()


def test_build_target_layer_ids_follows_zlab_rule():
    assert build_target_layer_ids(24, 1) == [12]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-8B-DFlash
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]  # z-lab Qwen3.5-35B-A3B-DFlash
    with pytest.raises(ValueError, match="num_draft_layers"):
        build_target_layer_ids(40, 0)


def test_target_tables_are_shared_not_owned(target, tmp_path):
    drafter = _drafter(target)
    embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
    own = {id(p) for p in drafter.parameters()}
    assert id(embedding.weight) not in own and id(head.weight) not in own
    assert not any("embed" in k or "lm_head" in k for k in drafter.state_dict())
    drafter.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(drafter.state_dict())
    drafter.to(torch.float32)  # moving the drafter leaves the target's tables alone
    assert embedding.weight.dtype == torch.float64 and head.weight.dtype == torch.float64


def test_training_gradients_reach_only_the_drafter(target):
    drafter = _drafter(target).train()
    getattr(drafter, "activation_checkpointing_enable", drafter.gradient_checkpointing_enable)()  # 5.24 | 5.17
    anchors = torch.tensor([[1, 4]])
    noise = drafter.embed(torch.full((1, 12), VOCAB - 1))
    hidden = drafter(noise, _features(8), position_ids=block_position_ids(anchors, 6),
                     attention_mask=block_attention_mask(anchors, 8, 6)).last_hidden_state
    drafter.compute_logits(hidden).logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert target.get_input_embeddings().weight.grad is None and target.get_output_embeddings().weight.grad is None


# ------------------------------------------------------------------------------------------- persistence
def test_save_and_load_give_identical_logits(target, tmp_path):
    drafter = _drafter(target)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "dflash_drafter" and saved["block_size"] == 6
    assert saved["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2, 3]}  # z-lab's keys
    loaded = DFlashDrafter.from_pretrained(tmp_path, dtype=torch.float64).bind_target(target).eval()
    assert isinstance(AutoModel.from_pretrained(tmp_path), DFlashDrafter)
    anchor, context = torch.tensor([[9]]), _features(5)
    expected = drafter.draft(anchor, context, drafter.new_context_cache())
    # equal weights; float64 BLAS may sum in another order for other memory alignment (seen: 8e-17 absolute)
    torch.testing.assert_close(loaded.draft(anchor, context, loaded.new_context_cache()), expected, rtol=1e-12,
                               atol=1e-12)


# Weight names of z-lab's DFlashDraftModel (z-lab/dflash dflash/model.py: Qwen3DFlashDecoderLayer, fc, hidden_norm,
# norm; matches the published checkpoints' safetensors headers).
_ZLAB_LAYER_WEIGHTS = {
    "input_layernorm.weight": lambda c: (c["hidden_size"],),
    "post_attention_layernorm.weight": lambda c: (c["hidden_size"],),
    "self_attn.q_proj.weight": lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.k_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.v_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "self_attn.q_norm.weight": lambda c: (c["head_dim"],),
    "self_attn.k_norm.weight": lambda c: (c["head_dim"],),
    "mlp.gate_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.up_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj.weight": lambda c: (c["hidden_size"], c["intermediate_size"]),
}


def _write_zlab_checkpoint(path, **changes):
    """config.json in z-lab's layout (Qwen3 config + DFlash keys) and a bf16 model.safetensors with z-lab's names."""
    config = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": 8, "num_target_layers": 4,
        "dflash_config": {"mask_token_id": VOCAB - 3, "target_layer_ids": [1, 3]},
        "hidden_size": HIDDEN, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 512, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "layer_types": ["full_attention", "full_attention"], "sliding_window": None,
        "use_sliding_window": False, "max_window_layers": 2, "tie_word_embeddings": False, "dtype": "bfloat16",
        **changes,
    }
    config = {k: v for k, v in config.items() if v is not None or k not in changes}  # None in changes: drop the key
    torch.manual_seed(3)
    n_feat = len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (HIDDEN, n_feat * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{name}": shape(config) for name, shape in _ZLAB_LAYER_WEIGHTS.items()})
    save_file({k: (torch.randn(s) * 0.1 + (len(s) == 1)).to(torch.bfloat16) for k, s in shapes.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return config, shapes


# RoPE as written by transformers < 5 (rope_theta + rope_scaling) and by 5.x (rope_parameters).
_ROPE_LAYOUTS = {
    "legacy": {},
    "rope_parameters": {"rope_theta": None, "rope_scaling": None,
                        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
}


def test_a_drafter_carries_its_acceptance_estimator(target, tmp_path):
    """save_pretrained writes the fitted estimator beside the weights, from_pretrained reads it back, and the
    calibrated strategies use it when HybridSpecConfig names none (an estimator passed in the config wins; one
    fitted for another block size is refused)."""
    from hybridspec_hf import HybridSpecConfig
    from hybridspec_hf.generation.strategy import RoundStrategy
    from hybridspec_hf.selector import AcceptanceEstimator

    drafter = _drafter(target)
    assert drafter.acceptance_estimator is None
    weight = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))  # block 6: 5 draft positions
    drafter.acceptance_estimator = AcceptanceEstimator(weight)
    drafter.save_pretrained(tmp_path)
    assert (tmp_path / "acceptance_estimator.json").is_file()
    loaded = DFlashDrafter.from_pretrained(tmp_path, dtype=torch.float64).bind_target(target).eval()
    torch.testing.assert_close(loaded.acceptance_estimator.weight, weight)
    settings = HybridSpecConfig(latency_model=_flat_latency(6))
    carried = RoundStrategy.build("nominal", settings, target, loaded, has_router=True)
    torch.testing.assert_close(carried.estimator.weight, weight)
    plain = RoundStrategy.build("nominal", settings, target, _drafter(target), has_router=True)
    assert not torch.equal(plain.estimator.weight, weight) and carried.identity() != plain.identity()
    given = AcceptanceEstimator.default(6)
    chosen = RoundStrategy.build("nominal", HybridSpecConfig(latency_model=_flat_latency(6), acceptance_estimator=given),
                                 target, loaded, has_router=True)
    assert chosen.estimator is given
    loaded.acceptance_estimator = AcceptanceEstimator.default(8)
    with pytest.raises(ValueError, match="fitted for block_size=8"):
        RoundStrategy.build("nominal", settings, target, loaded, has_router=True)


def _flat_latency(block_size):
    from test_properties import latency_model

    return latency_model(block_size, 0.0)


@pytest.mark.parametrize("rope", sorted(_ROPE_LAYOUTS))
def test_zlab_checkpoint_loads_without_missing_or_unexpected_keys(target, tmp_path, rope):
    _, shapes = _write_zlab_checkpoint(tmp_path, **_ROPE_LAYOUTS[rope])
    config = DFlashConfig.from_pretrained(tmp_path)
    assert (config.mask_token_id, config.target_layer_ids, config.block_size) == (VOCAB - 3, [1, 3], 8)
    assert config.rope_parameters["rope_theta"] == 1000000 and config.num_target_layers == 4
    drafter, info = DFlashDrafter.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert set(drafter.state_dict()) == set(shapes)
    reference = load_file(tmp_path / "model.safetensors")
    assert torch.equal(drafter.state_dict()["layers.1.self_attn.k_proj.weight"], reference["layers.1.self_attn.k_proj.weight"])
    drafter = drafter.to(torch.float64).bind_target(target)
    logits = drafter.draft(torch.tensor([[4]]), _features(3, n_feat=2), drafter.new_context_cache())
    assert logits.shape == (1, 7, VOCAB) and torch.isfinite(logits).all()


def test_specforge_config_without_layer_ids_uses_zlab_rule():
    config = DFlashConfig(architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=5,
                          num_target_layers=36, layer_types=["full_attention"] * 5)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]  # SpecForge configs/qwen3-8b-dflash.json has no ids


def test_dflash2_checkpoint_is_refused_clearly(tmp_path):
    _write_zlab_checkpoint(tmp_path, architectures=["DFlash2DraftModel"])
    with pytest.raises(ValueError, match="not a DFlash \\(v1\\) drafter"):
        DFlashConfig.from_pretrained(tmp_path)


def test_auto_config_reads_our_layout(target, tmp_path):
    _drafter(target).config.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DFlashConfig)


# ------------------------------------------------------------------------------------------- architecture
def _reference_logits(drafter, target, anchor_id, context):
    """z-lab's DFlashDraftModel written out plainly for one sequence: [block_size-1, V].

    Every layer's context K/V come from the same fused context hidden_norm(fc(features)) (KV injection); queries only
    from the block; no mask (the whole context precedes the anchor, the block is bidirectional).
    """
    cfg, sd, dim = drafter.config, drafter.state_dict(), drafter.config.head_dim
    num_context, size = context.shape[1], cfg.block_size

    def norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(x, positions):  # x [T, heads, dim]
        inv_freq = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angle = (positions[:, None] * inv_freq).repeat(1, 2)[:, None]
        return x * angle.cos() + torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1) * angle.sin()

    x = target.get_input_embeddings().weight[torch.tensor([anchor_id] + [cfg.mask_token_id] * (size - 1))]
    fused = norm(context[0] @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    positions = torch.arange(num_context + size, dtype=torch.float64)
    for i in range(cfg.num_hidden_layers):
        w = {name[len(f"layers.{i}."):-len(".weight")]: t for name, t in sd.items() if name.startswith(f"layers.{i}.")}
        h = norm(x, w["input_layernorm"])
        q = rope(norm((h @ w["self_attn.q_proj"].T).view(size, -1, dim), w["self_attn.q_norm"]), positions[num_context:])
        rows = torch.cat([fused, h])  # context rows, then block rows
        k = rope(norm((rows @ w["self_attn.k_proj"].T).view(len(rows), -1, dim), w["self_attn.k_norm"]), positions)
        v = (rows @ w["self_attn.v_proj"].T).view(len(rows), -1, dim)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        attention = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / dim**0.5, dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", attention, v).reshape(size, -1) @ w["self_attn.o_proj"].T
        h = norm(x, w["post_attention_layernorm"])
        x = x + (F.silu(h @ w["mlp.gate_proj"].T) * (h @ w["mlp.up_proj"].T)) @ w["mlp.down_proj"].T
    return (norm(x, sd["norm.weight"]) @ target.get_output_embeddings().weight.T)[1:]


def test_draft_matches_a_plain_reference_of_zlab_architecture(target):
    drafter = _drafter(target, num_layers=3)
    context = _features(9)
    cache = drafter.new_context_cache()
    drafter.draft(torch.tensor([[2]]), context[:, :4], cache)  # the cached path must give the same answer
    logits = drafter.draft(torch.tensor([[17]]), context[:, 4:], cache)
    torch.testing.assert_close(logits[0], _reference_logits(drafter, target, 17, context), rtol=0, atol=1e-10)


# ------------------------------------------------------------------------------------------- context cache
def test_incremental_context_equals_whole_context(target):
    drafter = _drafter(target)
    context = _features(17, batch=2)
    anchor = torch.tensor([[11], [12]])
    cache = drafter.new_context_cache(capacity=4)  # forces the buffers to grow
    for start, end in [(0, 7), (7, 7), (7, 8), (8, 13), (13, 17)]:  # includes a call with no new context
        drafter.draft(torch.tensor([[3], [4]]), context[:, start:end], cache)
    incremental, hidden = drafter.draft(anchor, None, cache, return_hidden=True)
    whole = drafter.draft(anchor, context, drafter.new_context_cache())
    assert cache.length == 17 and hidden.shape == (2, 5, HIDDEN)
    torch.testing.assert_close(incremental, whole, rtol=0, atol=1e-10)


def test_crop_rolls_the_context_back(target):
    drafter = _drafter(target)
    context, anchor = _features(9), torch.tensor([[20]])
    cache = drafter.new_context_cache()
    drafter.draft(anchor, context, cache)
    cache.crop(6)
    rolled_back = drafter.draft(anchor, torch.zeros(1, 0, 3 * HIDDEN, dtype=torch.float64), cache)
    fresh = drafter.draft(anchor, context[:, :6], drafter.new_context_cache())
    torch.testing.assert_close(rolled_back, fresh, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="outside the cached range"):
        cache.crop(7)


# ------------------------------------------------------------------------------------------- attention pattern
def _block_outputs(drafter, context, anchor_position, noise):
    """Final hidden states of one block at `anchor_position`, run through the training path (mask + positions)."""
    anchors = torch.tensor([[anchor_position]])
    return drafter(noise, context, position_ids=block_position_ids(anchors, 6),
                   attention_mask=block_attention_mask(anchors, context.shape[1], 6)).last_hidden_state[0]


def test_block_sees_context_strictly_before_anchor_and_itself_bidirectionally(target):
    drafter = _drafter(target)
    context, noise = _features(12), drafter.embed(torch.tensor([[5] + [VOCAB - 1] * 5]))
    base = _block_outputs(drafter, context, 7, noise)

    def changed(context=context, noise=noise):
        return (_block_outputs(drafter, context, 7, noise) - base).abs().amax(-1) > 1e-12  # per block row

    for position in (7, 8, 11):  # the anchor's own and later positions are invisible
        moved = context.clone()
        moved[:, position] += 1.0
        assert not changed(context=moved).any()
    moved = context.clone()
    moved[:, 6] += 1.0  # the position just before the anchor reaches every row
    assert changed(context=moved).all()
    moved = noise.clone()
    moved[:, 5] += 1.0  # the last block token reaches every row, the earlier ones included
    assert changed(noise=moved).all()


def test_many_blocks_in_one_forward_equal_separate_drafts(target):
    drafter = _drafter(target)
    context = _features(14)
    tokens = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([[0, 3, 9, 13]])
    blocks = torch.cat([tokens[:, anchors[0]].T, torch.full((4, 5), VOCAB - 1)], dim=1).reshape(1, -1)  # [1, 4*6]
    hidden = drafter(drafter.embed(blocks), context, position_ids=block_position_ids(anchors, 6),
                     attention_mask=block_attention_mask(anchors, 14, 6)).last_hidden_state
    together = drafter.compute_logits(hidden).view(4, 6, VOCAB)[:, 1:]
    for j, p in enumerate(anchors[0].tolist()):
        alone = drafter.draft(tokens[:, p:p + 1], context[:, :p], drafter.new_context_cache())
        torch.testing.assert_close(together[j:j + 1], alone, rtol=0, atol=1e-10)


def test_sliding_layers_are_causal_and_windowed_like_zlab(target):
    drafter = _drafter(target, num_layers=1, layer_types=["sliding_attention"], use_sliding_window=True,
                       sliding_window=4)
    assert drafter.layers[0].self_attn.is_causal and drafter.layers[0].self_attn.sliding_window == 4
    context, noise = _features(12), drafter.embed(torch.tensor([[5] + [VOCAB - 1] * 5]))
    base = _block_outputs(drafter, context, 8, noise)

    def changed_rows(context=context, noise=noise):
        return ((_block_outputs(drafter, context, 8, noise) - base).abs().amax(-1) > 1e-12).tolist()

    # Row k sits at position 8 + k and sees context positions p < 8 with (8 + k) - p < 4.
    for position, rows in [(4, [False] * 6), (5, [True] + [False] * 5), (7, [True] * 3 + [False] * 3)]:
        moved = context.clone()
        moved[:, position] += 1.0
        assert changed_rows(context=moved) == rows
    moved = noise.clone()
    moved[:, 3] += 1.0  # causal inside the block: block token 3 reaches rows 3.. only
    assert changed_rows(noise=moved) == [False] * 3 + [True] * 3


# ------------------------------------------------------------------------------------------- static (graph) path
# Static vs eager drafting: the same maths, but attention runs over all capacity + block_size slots with a boolean
# mask instead of over the exact keys, so sums run in another order. Tolerance relative to the largest logit.
_STATIC_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}

# (rows given n, rows counted per batch row, draft afterwards): a prompt-sized first append whose junk reaches past
# the block, block-sized appends with every count 0..6, and two appends without a draft between (a round that did
# not draft). Row 1 ends exactly at capacity 24, so its last block sits in the spare slots.
_SCHEDULE = [
    (12, (3, 7), True),
    (6, (6, 2), True),
    (6, (0, 0), True),
    (6, (2, 6), False),
    (6, (5, 1), True),
    (6, (1, 3), True),
    (6, (4, 5), True),
]
_STATIC_LAYERS = {  # DFlashConfig overrides: full bidirectional, sliding (causal + window < block), causal full
    "full": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=4),
    "causal": dict(is_causal=True),
}


def _static_drafter(dtype, layers="full") -> DFlashDrafter:
    return _drafter(make_target("qwen3_5_moe", dtype=dtype), **_STATIC_LAYERS[layers])


def _round_inputs(drafter, batch, junk):
    """Per step of _SCHEDULE: (features [B, n, F] whose rows past each row's count hold `junk`, count, anchors)."""
    generator = torch.Generator().manual_seed(5)
    width = drafter.fc.in_features
    steps = []
    for step, (n, counts, _) in enumerate(_SCHEDULE):
        features = torch.randn(batch, n, width, generator=generator, dtype=drafter.dtype)
        for row in range(batch):
            features[row, counts[row]:] = junk(n - counts[row], width)
        counts = counts[:batch]
        count = counts[0] if step % 2 == 0 and len(set(counts)) == 1 else torch.tensor(counts)  # host int / device
        steps.append((features, count, torch.randint(0, VOCAB - 1, (batch, 1), generator=generator)))
    return steps


def _static_rounds(drafter, steps, batch, before_draft=None, ctx=None) -> list[torch.Tensor]:
    """Logits of every draft of _SCHEDULE through StaticDraftContext.append + draft_static."""
    ctx = ctx if ctx is not None else StaticDraftContext(drafter, 24, drafter.device, drafter.dtype, batch_size=batch)
    addresses = [t.data_ptr() for t in ctx.keys + ctx.values + [ctx.length]]
    drafts = []
    for (features, count, anchors), (_, _, draft) in zip(steps, _SCHEDULE):
        ctx.append(features, count)
        if draft:
            if before_draft is not None:
                before_draft(ctx)
            drafts.append(drafter.draft_static(anchors, ctx))
    assert [t.data_ptr() for t in ctx.keys + ctx.values + [ctx.length]] == addresses  # nothing reallocated
    return drafts


def _eager_rounds(drafter, steps, batch) -> list[torch.Tensor]:
    """The same drafts through draft() and DFlashContextCache, one batch-1 cache per row (its length is shared)."""
    drafts = [[] for _ in range(batch)]
    for row in range(batch):
        cache, pending = drafter.new_context_cache(), []
        for (features, _, anchors), (_, counts, draft) in zip(steps, _SCHEDULE):
            pending.append(features[row:row + 1, : counts[row]])
            if draft:
                drafts[row].append(drafter.draft(anchors[row:row + 1], torch.cat(pending, dim=1), cache))
                pending = []
    return [torch.cat(rows) for rows in zip(*drafts)]


def _nan_inf_and_huge(rows, width):
    return torch.tensor([float("nan"), float("inf"), -1e30])[torch.arange(rows * width) % 3].view(rows, width)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("layers", sorted(_STATIC_LAYERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_static_drafting_equals_eager_drafting(dtype, layers, batch):
    drafter = _static_drafter(dtype, layers)
    steps = _round_inputs(drafter, batch, junk=lambda rows, width: 1e3 * torch.randn(rows, width))
    tolerance = _STATIC_TOLERANCE[dtype]
    for static, eager in zip(_static_rounds(drafter, steps, batch), _eager_rounds(drafter, steps, batch), strict=True):
        assert static.shape == (batch, 5, VOCAB)
        torch.testing.assert_close(static, eager, rtol=tolerance, atol=tolerance * eager.abs().max().item())


def test_rows_past_the_count_never_reach_the_drafts():
    """Junk features (NaN, inf, huge) and junk K/V in every slot past the length leave the logits bit for bit."""
    drafter = _static_drafter(torch.float64, "sliding")
    clean = _static_rounds(drafter, _round_inputs(drafter, 2, junk=lambda rows, width: torch.zeros(rows, width)), 2)

    def poison(ctx):  # finite: a NaN key would be masked, but its value still meets a 0 weight (0 * NaN = NaN)
        beyond = ctx.positions[None, None, :, None] >= ctx.length[:, None, None, None]  # [B, 1, S, 1]
        for buffer in ctx.keys + ctx.values:
            buffer.copy_(torch.where(beyond, 1e6 * torch.randn_like(buffer), buffer))

    poisoned = _static_rounds(drafter, _round_inputs(drafter, 2, junk=_nan_inf_and_huge), 2, before_draft=poison)
    for a, b in zip(clean, poisoned, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reset_starts_a_new_generation_in_the_same_buffers():
    drafter = _static_drafter(torch.float64)
    steps = _round_inputs(drafter, 2, junk=lambda rows, width: torch.randn(rows, width))
    ctx = StaticDraftContext(drafter, 24, drafter.device, drafter.dtype, batch_size=2)
    first = _static_rounds(drafter, steps, 2, ctx=ctx)
    ctx.reset()
    assert ctx.length.tolist() == [0, 0]
    for a, b in zip(first, _static_rounds(drafter, steps, 2, ctx=ctx), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@contextlib.contextmanager
def _no_host_reads():
    """Make Python-level device->host reads and data-dependent shapes raise (boolean-mask indexing included).

    The CPU stand-in for torch.cuda.set_sync_debug_mode("error"), which the CUDA test below uses.
    """
    names = ["item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero", "__getitem__"]
    originals = {name: getattr(torch.Tensor, name) for name in names}
    original_tensor = torch.tensor

    def refuse(name):
        def method(self, *args, **kwargs):
            index = args[0] if args else None
            indices = index if isinstance(index, tuple) else (index,)
            masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if name == "__getitem__" and not masks:  # plain slicing and integer indexing stay on the device
                return originals[name](self, *args, **kwargs)
            raise RuntimeError(f"host read Tensor.{name} in the static drafting path")
        return method

    def refuse_tensor(*args, **kwargs):
        raise RuntimeError("torch.tensor(...) in the static drafting path (a host->device copy from a Python list)")

    for name in names:
        setattr(torch.Tensor, name, refuse(name))
    torch.tensor = refuse_tensor
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.tensor = original_tensor


def test_static_drafting_makes_no_host_read():
    drafter = _static_drafter(torch.float32, "sliding")
    steps = _round_inputs(drafter, 2, junk=lambda rows, width: torch.randn(rows, width))
    expected = _eager_rounds(drafter, steps, 2)
    ctx = StaticDraftContext(drafter, 24, drafter.device, drafter.dtype, batch_size=2)
    drafts = []
    for (features, count, anchors), (_, counts, draft) in zip(steps, _SCHEDULE):
        count = count if isinstance(count, torch.Tensor) else torch.tensor(counts[:2])
        with _no_host_reads():
            ctx.append(features, count)
            drafts.append(drafter.draft_static(anchors, ctx) if draft else None)
    for static, eager in zip([d for d in drafts if d is not None], expected, strict=True):
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


@pytest.mark.parametrize("case", ["count_above_rows", "past_capacity", "rows_above_slots", "batch", "float_count",
                                  "dtype", "other_batch_draft"])
def test_static_context_misuse_is_explained(case):
    drafter = _static_drafter(torch.float64)
    ctx = StaticDraftContext(drafter, 10, drafter.device, drafter.dtype)
    width = drafter.fc.in_features
    checks = {
        "count_above_rows": (lambda: ctx.append(torch.zeros(1, 4, width), 5), "count=5 must be in \\[0, 4\\]"),
        "past_capacity": (lambda: ctx.append(torch.zeros(1, 12, width), 11), "exceeds the static context's capacity"),
        "rows_above_slots": (lambda: ctx.append(torch.zeros(1, 17, width), torch.tensor([0])), "cannot fit"),
        "batch": (lambda: ctx.append(torch.zeros(2, 4, width), 1), "batch size 2, the static context holds 1"),
        "float_count": (lambda: ctx.append(torch.zeros(1, 4, width), torch.tensor([1.0])), "integer tensor"),
        "dtype": (lambda: StaticDraftContext(drafter, 10, "cpu", torch.float32), "Pass drafter.device and .dtype"),
        "other_batch_draft": (lambda: drafter.draft_static(torch.tensor([[1], [2]]), ctx), "batch size 2"),
    }
    action, message = checks[case]
    with pytest.raises(ValueError, match=message):
        action()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_append_and_draft_static_replay_as_one_cuda_graph(dtype):
    """append + draft_static captured once, replayed with new inputs under sync-debug "error", equal eager drafts.

    Tolerance fp32: 1e-4 relative to the largest logit (eager attends without a mask, the graph with one: CUDA
    picks different attention kernels); fp64: 1e-10 (math kernel both ways).
    """
    drafter = _drafter(make_target("qwen3_5_moe", dtype=dtype).cuda())
    block, width = drafter.config.block_size, drafter.fc.in_features
    generator = torch.Generator().manual_seed(6)
    prompt = torch.randn(1, 12, width, generator=generator, dtype=dtype).cuda()
    counts = [6, 0, 3, 6, 1, 2]
    rounds = [(torch.randn(1, block, width, generator=generator, dtype=dtype).cuda(), torch.tensor([c]).cuda(),
               torch.randint(0, VOCAB - 1, (1, 1), generator=generator).cuda()) for c in counts]
    ctx = StaticDraftContext(drafter, 64, drafter.device, dtype)
    ctx.append(prompt, 12)  # the prompt-sized append runs eagerly
    features, count, anchor = (torch.zeros_like(x) for x in rounds[0])  # the graph's static inputs; count 0:
    side = torch.cuda.Stream()  # the warm-up leaves the length alone
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ctx.append(features, count)
        drafter.draft_static(anchor, ctx)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctx.append(features, count)
        logits = drafter.draft_static(anchor, ctx)
    replayed = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for new_features, new_count, new_anchor in rounds:
            features.copy_(new_features)
            count.copy_(new_count)
            anchor.copy_(new_anchor)
            graph.replay()
            replayed.append(logits.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cache = drafter.new_context_cache()
    context = prompt
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-4}[dtype]
    for (new_features, _, new_anchor), n, static in zip(rounds, counts, replayed, strict=True):
        eager = drafter.draft(new_anchor, torch.cat([context, new_features[:, :n]], dim=1), cache)
        context = new_features[:, :0]
        torch.testing.assert_close(static, eager, rtol=tolerance, atol=tolerance * eager.abs().max().item())
    assert int(ctx.length) == 12 + sum(counts)


# ------------------------------------------------------------------------------------------- validation
def _mismatch(kind, target):
    def unvalidated(**changes):  # from_target would refuse these already
        fields = dict(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      intermediate_size=64, vocab_size=VOCAB, target_layer_ids=[2], mask_token_id=VOCAB - 1)
        return DFlashDrafter(DFlashConfig(**{**fields, **changes})).bind_target(target, validate=False)

    if kind == "vocab":
        return unvalidated(vocab_size=VOCAB + 4), "Vocabulary mismatch: drafter vocab_size=100"
    if kind == "hidden":
        return unvalidated(hidden_size=48), "Hidden size mismatch: drafter hidden_size=48"
    drafter = DFlashDrafter.from_target(target)
    if kind == "layer_id":
        drafter.config.target_layer_ids = [2, 4]
        return drafter, "outside the 4 decoder layers"
    if kind == "mask":
        drafter.config.mask_token_id = VOCAB
        return drafter, "not a row"
    if kind == "unbound":
        drafter._target_modules = None
        return drafter, r"not bound to a target .*bind_target\(target\)"
    return drafter.bind_target(make_target("qwen3_5_dense"), validate=False), "another model"


@pytest.mark.parametrize("kind", ["vocab", "hidden", "layer_id", "mask", "unbound", "other_target"])
def test_validate_target_names_the_problem(target, kind):
    drafter, message = _mismatch(kind, target)
    with pytest.raises(ValueError, match=message):
        drafter.validate_target(target)


def test_wrong_feature_width_is_explained(target):
    drafter = _drafter(target)
    with pytest.raises(ValueError, match="expected 96 = 3 target layers"):
        drafter.draft(torch.tensor([[1]]), _features(2, n_feat=2), drafter.new_context_cache())


def test_a_grown_drafter_drafts_as_before_and_its_new_layers_learn(target):
    """grow_drafter (train_drafter(init_drafter=..., num_layers=more)): the appended layers start as the identity,
    so every draft equals the trained drafter's; their output projections get gradients, so training moves them;
    shrinking is refused with the way out."""
    from hybridspec_hf.drafter.training import grow_drafter

    drafter = _drafter(target)
    grown = grow_drafter(drafter, 4)
    assert grown.config.num_hidden_layers == 4 and len(grown.config.layer_types) == 4 and not grown.training
    anchor, context = torch.tensor([[9], [3]]), _features(7, batch=2)
    torch.testing.assert_close(grown.draft(anchor, context, grown.new_context_cache()),
                               drafter.draft(anchor, context, drafter.new_context_cache()), rtol=1e-12, atol=1e-12)
    for name, weight in drafter.state_dict().items():  # the trained weights copied, not shared
        assert torch.equal(grown.state_dict()[name], weight) and grown.state_dict()[name] is not weight
    grown.train()
    anchors = torch.tensor([[1, 4]])
    noise = grown.embed(torch.full((1, 12), VOCAB - 1))
    hidden = grown(noise, _features(8), position_ids=block_position_ids(anchors, 6),
                   attention_mask=block_attention_mask(anchors, 8, 6)).last_hidden_state
    grown.compute_logits(hidden).logsumexp(-1).sum().backward()
    for layer in grown.layers[2:]:
        assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and layer.mlp.down_proj.weight.grad.abs().sum() > 0
    assert grow_drafter(drafter, 2) is drafter
    with pytest.raises(ValueError, match="cannot shrink to 1"):
        grow_drafter(drafter, 1)


def test_a_widened_drafter_drafts_as_before_and_its_new_columns_learn(target):
    """widen_features (train_drafter(init_drafter=..., target_layer_ids=more)): the new layer's fc columns start at
    zero, so every draft equals the trained drafter's whatever the new layer's features hold; those columns get
    gradients; the config (and its z-lab mirror) names the new layers; dropping a layer is refused with the way out."""
    from hybridspec_hf.drafter.training import widen_features

    drafter = _drafter(target)  # reads target layers [0, 2, 3]
    wide = widen_features(drafter, [0, 1, 2, 3])
    assert wide.config.target_layer_ids == [0, 1, 2, 3] and not wide.training
    assert wide.config.to_dict()["dflash_config"]["target_layer_ids"] == [0, 1, 2, 3]
    assert wide.fc.in_features == 4 * HIDDEN
    wide_features = _features(7, batch=2, n_feat=4)  # blocks: layers 0, 1, 2, 3; layer 1's is not zero
    blocks = wide_features.split(HIDDEN, dim=-1)
    narrow_features = torch.cat([blocks[0], blocks[2], blocks[3]], dim=-1)
    anchor = torch.tensor([[9], [3]])
    torch.testing.assert_close(wide.draft(anchor, wide_features, wide.new_context_cache()),
                               drafter.draft(anchor, narrow_features, drafter.new_context_cache()),
                               rtol=1e-12, atol=1e-12)
    for name, weight in drafter.state_dict().items():
        if name != "fc.weight":
            assert torch.equal(wide.state_dict()[name], weight) and wide.state_dict()[name] is not weight
    wide.train()
    anchors = torch.tensor([[1, 4]])
    noise = wide.embed(torch.full((1, 12), VOCAB - 1))
    hidden = wide(noise, _features(8, n_feat=4), position_ids=block_position_ids(anchors, 6),
                  attention_mask=block_attention_mask(anchors, 8, 6)).last_hidden_state
    wide.compute_logits(hidden).logsumexp(-1).sum().backward()
    assert wide.fc.weight.grad[:, HIDDEN:2 * HIDDEN].abs().sum() > 0  # the new layer's columns learn
    assert widen_features(drafter, [0, 2, 3]) is drafter
    with pytest.raises(ValueError, match="must hold each of the drafter's layers"):
        widen_features(drafter, [0, 1, 3])
    with pytest.raises(ValueError, match="must hold each of the drafter's layers"):
        widen_features(drafter, [0, 2, 3, 3])


@pytest.mark.parametrize("multiplier, softcap", [(1.0, None), (2.0, None), (1.0, 5.0)])
def test_head_dtype_logits_only_where_nothing_follows_the_head(multiplier, softcap):
    """`upcast=False` (the resident rounds' drafts and signals read the logits in fp32 themselves): the head's own
    dtype when neither output_multiplier nor softcapping applies, else the fp32 logits as `upcast=True` gives."""
    target = make_target("qwen3_5_moe").to(torch.bfloat16)
    drafter = _drafter(target).to(torch.bfloat16)
    drafter.config.output_multiplier, drafter.config.final_logit_softcapping = multiplier, softcap
    hidden = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    full, own = drafter.compute_logits(hidden), drafter.compute_logits(hidden, upcast=False)
    assert full.dtype == torch.float32
    if multiplier == 1.0 and softcap is None:
        assert own.dtype == torch.bfloat16 and torch.equal(own.float(), full)
        assert torch.equal(own.argmax(-1), full.argmax(-1))
    else:
        assert own.dtype == torch.float32 and torch.equal(own, full)
