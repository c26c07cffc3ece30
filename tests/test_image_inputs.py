"""Qwen3.5 vision-language targets (ConditionalGeneration) with image and video inputs: the prompt's vision tokens
enter at the prefill, and every later position follows the multimodal RoPE offsets generate() computed there, so
greedy HybridSpec output equals generate()'s — eager, on the resident rounds' CPU twin, and in a left-padded batch
of prompts with different images."""
import pytest
import torch
from _tiny import _ATTN_LAST, _COMMON, _MOE, _vision, make_drafter, prepare
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig

IMAGE, VIDEO, START, END = 90, 91, 92, 93  # inside the tiny vocabulary


def vision_target(family: str, dtype=torch.float64):
    torch.manual_seed(0)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "moe":
        config = Qwen3_5MoeConfig(text_config=dict(**_COMMON, **_MOE, layer_types=_ATTN_LAST), vision_config=_vision(), **ids)
        return prepare(Qwen3_5MoeForConditionalGeneration(config), dtype)
    config = Qwen3_5Config(text_config=dict(**_COMMON, layer_types=_ATTN_LAST), vision_config=_vision(), **ids)
    return prepare(Qwen3_5ForConditionalGeneration(config), dtype)


def visual_prompt(model, grid, before, after, token=IMAGE, seed=0):
    """input_ids with one image (or video) of `grid` = (t, h, w) patches between text tokens, and its pixels (CPU,
    in the model's dtype)."""
    v = model.config.vision_config
    patches = grid[0] * grid[1] * grid[2]
    pixels = torch.randn(patches, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, dtype=model.dtype,
                         generator=torch.Generator().manual_seed(seed))
    count = patches // v.spatial_merge_size ** 2
    ids = torch.tensor([before + [START] + [token] * count + [END] + after])
    return ids, pixels, torch.tensor([grid])


@pytest.mark.parametrize("family", ["moe", "dense"])
def test_image_and_video_prompts_decode_as_generate(family, fp64_gdn):
    model = vision_target(family)
    ids, pixels, grid = visual_prompt(model, (1, 8, 12), [5], [7, 8, 9, 10, 11])
    image = dict(pixel_values=pixels, image_grid_thw=grid)
    ar = model.generate(ids, do_sample=False, max_new_tokens=40, **image)
    assert not torch.equal(ar, model.generate(ids, do_sample=False, max_new_tokens=40)), "the image must matter"
    drafter = make_drafter(model, 8, ar, error_rate=0.3)
    for strategy, cuda_graphs in [("dflash", "off"), ("static", "off"), ("dflash", "on"), ("ar", "on")]:
        out = model.generate(ids, do_sample=False, max_new_tokens=40, assistant_model=None if strategy == "ar" else drafter,
                             generation_strategy=strategy, hybridspec_config=HybridSpecConfig(cuda_graphs=cuda_graphs),
                             **image)
        assert torch.equal(out, ar), (strategy, cuda_graphs)

    ids_v, frames, grid_v = visual_prompt(model, (2, 4, 4), [6], [7, 8], token=VIDEO, seed=1)
    video = dict(pixel_values_videos=frames, video_grid_thw=grid_v)
    ar_v = model.generate(ids_v, do_sample=False, max_new_tokens=30, **video)
    out = model.generate(ids_v, do_sample=False, max_new_tokens=30, assistant_model=make_drafter(model, 8, ar_v),
                         generation_strategy="dflash", **video)
    assert torch.equal(out, ar_v)


@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_a_left_padded_batch_with_different_images_decodes_as_batched_generate(cuda_graphs, fp64_gdn):
    model = vision_target("moe")
    long, pixels, grid = visual_prompt(model, (1, 8, 12), [5], [7, 8, 9, 10, 11])
    short, pixels2, grid2 = visual_prompt(model, (1, 4, 4), [], [7, 8], seed=2)
    pad = torch.zeros(1, long.shape[1] - short.shape[1], dtype=torch.long)
    batch = torch.cat([long, torch.cat([pad, short], 1)])
    mask = torch.cat([torch.ones_like(long), torch.cat([pad, torch.ones_like(short)], 1)])
    images = dict(pixel_values=torch.cat([pixels, pixels2]), image_grid_thw=torch.cat([grid, grid2]))
    stock = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0, **images)
    drafter = make_drafter(model, 8, stock[:1], error_rate=0.3)
    out = model.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=0,
                         assistant_model=drafter, generation_strategy="dflash",
                         hybridspec_config=HybridSpecConfig(cuda_graphs=cuda_graphs), **images)
    assert torch.equal(out, stock)
    assert hybridspec_hf.get_telemetry(model).path == ("static_eager" if cuda_graphs == "on" else "eager")


def resident_image_calls(device: str) -> None:
    """fp32 on `device`: an image prompt through the resident rounds (captured on CUDA, their eager twin elsewhere),
    twice (the second call replays), equal to generate()'s greedy output. tests/test_resident_cuda.py runs it on the
    GPU."""
    model = vision_target("moe", torch.float32)
    model.set_experts_implementation("batched_mm")
    ids, pixels, grid = visual_prompt(model, (1, 8, 12), [5], [7, 8, 9, 10, 11])
    image = dict(pixel_values=pixels.to(device), image_grid_thw=grid.to(device))
    drafter = make_drafter(model, 8, model.generate(ids, do_sample=False, max_new_tokens=33,
                                                    pixel_values=pixels, image_grid_thw=grid), error_rate=0.25).float()
    model.to(device)
    drafter.to(device).bind_target(model)
    ar = model.generate(ids.to(device), do_sample=False, max_new_tokens=33, **image)
    for strategy in ("dflash", "hybridspec", "ar"):
        for _ in range(2):
            out = model.generate(ids.to(device), do_sample=False, max_new_tokens=33, generation_strategy=strategy,
                                 assistant_model=None if strategy == "ar" else drafter,
                                 hybridspec_config=HybridSpecConfig(cuda_graphs="on"), **image)
            assert torch.equal(out, ar), strategy
        path = hybridspec_hf.get_telemetry(model).path
        assert path == ("cuda_graphs" if device == "cuda" else "static_eager"), path


def test_image_prompts_on_the_resident_rounds_cpu_twin():
    resident_image_calls("cpu")
