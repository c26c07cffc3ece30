"""Where tensors live, on real GPUs (the CPU twin is tests/test_devices.py): a prompt on the CPU for a model on a
GPU, a drafter on another device than the target, and a target split over two GPUs by a device_map (accelerate's
hooks). Skipped without the GPUs each test needs; tensor parallelism over NCCL is tests/test_tensor_parallel.py."""
import pytest
import torch
from _tiny import VOCAB, _ATTN_LAST, _COMMON, _MOE, make_drafter, make_target
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs CUDA")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
STRATEGIES = ["ar", "dflash", "static", "confidence", "nominal", "hybridspec", "ratio"]


@pytest.fixture(autouse=True)
def _ieee_fp32():
    """fp32 comparisons: the GDN conv would otherwise run in TF32 on cuDNN."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


def _target(device):
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    target.set_experts_implementation("batched_mm")  # capturable in fp32
    return target.to(device)


@one_gpu
@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_a_cpu_prompt_is_taken_as_stock_generate_takes_it(cuda_graphs):
    target = _target("cuda")
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))  # on the CPU
    ar = target.generate(prompt, do_sample=False, max_new_tokens=24)
    assert ar.device.type == "cpu"
    drafter = make_drafter(target, 8, ar, error_rate=0.25).float().cuda().bind_target(target)
    for strategy in STRATEGIES:
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24,
                              assistant_model=None if strategy == "ar" else drafter, generation_strategy=strategy,
                              hybridspec_config=HybridSpecConfig(cuda_graphs=cuda_graphs))
        assert out.device.type == "cpu" and torch.equal(out, ar), strategy
        assert hybridspec_hf.get_telemetry(target).path == ("cuda_graphs" if cuda_graphs == "on" else "eager")
    scored = target.generate(prompt, do_sample=False, max_new_tokens=8, assistant_model=drafter,
                             generation_strategy="dflash", return_dict_in_generate=True, output_scores=True)
    assert scored.sequences.device.type == "cpu" and all(s.device.type == "cpu" for s in scored.scores)


@pytest.mark.parametrize("drafter_device", [pytest.param("cuda:1", marks=two_gpus), pytest.param("cpu", marks=one_gpu)])
def test_a_drafter_on_another_device_runs_the_eager_loop_and_says_why(drafter_device):
    target = _target("cuda:0")
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(1))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=24)
    drafter = make_drafter(target, 8, ar, error_rate=0.25).float().to(drafter_device).bind_target(target)
    for strategy in ("dflash", "hybridspec"):
        out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                              generation_strategy=strategy)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert torch.equal(out, ar) and telemetry.path == "eager" and "drafter" in telemetry.path_reason, strategy
    with pytest.raises(ValueError, match="the drafter is on"):
        target.generate(prompt, do_sample=False, max_new_tokens=8, assistant_model=drafter,
                        generation_strategy="dflash", hybridspec_config=HybridSpecConfig(cuda_graphs="on"))


@two_gpus
def test_a_target_split_over_two_gpus_by_a_device_map(tmp_path):
    """Layers 0-1 on cuda:0, 2-3 and the LM head on cuda:1 (accelerate's hooks move activations between them): the
    eager loop runs it, one GDN commit per device, and every strategy returns the same model's generate() output."""
    config = Qwen3_5MoeTextConfig(**_COMMON, **_MOE, layer_types=_ATTN_LAST)
    torch.manual_seed(0)
    Qwen3_5MoeForCausalLM(config).save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                  "model.layers.3": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1}
    target = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device_map=device_map)
    target.set_experts_implementation("batched_mm")
    assert {p.device.index for p in target.parameters()} == {0, 1}
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=24)
    drafter = make_drafter(target, 8, ar, error_rate=0.25).float().to("cuda:0").bind_target(target)
    for strategy in STRATEGIES:
        out = target.generate(prompt, do_sample=False, max_new_tokens=24,
                              assistant_model=None if strategy == "ar" else drafter, generation_strategy=strategy)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert out.device.type == "cpu" and torch.equal(out, ar), strategy
        assert telemetry.path == "eager" and "device_map" in telemetry.path_reason
        if strategy in ("dflash", "static", "confidence"):  # a calibrated one may choose plain decoding
            assert sum(r.accepted for r in telemetry.rounds) > 0
