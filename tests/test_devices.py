"""Where tensors live: a prompt on another device than the model (moved beside the model, the output returned where
the prompt was, as stock generate() does), accelerate's dispatch hooks (device_map), and a model split over devices
(the eager loop, with the reason). The same on real GPUs: tests/test_devices_cuda.py."""
import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from accelerate import dispatch_model
from accelerate.hooks import AlignDevicesHook, add_hook_to_module
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig, patches
from hybridspec_hf.generation.integration import place_inputs, return_to


def test_place_inputs_moves_every_prompt_tensor_and_nothing_else():
    ids, mask = torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "assistant_model": None}
    args = place_inputs((ids, None), kwargs, torch.device("meta"))
    assert args[0].device.type == "meta" and args[1] is None
    assert kwargs["attention_mask"].device.type == "meta" and kwargs["max_new_tokens"] == 5
    assert place_inputs((ids,), {}, torch.device("cpu"))[0] is ids  # already there: untouched


def test_return_to_moves_sequences_scores_and_logits():
    rows = (torch.zeros(1, VOCAB), torch.zeros(1, VOCAB))
    output = GenerateDecoderOnlyOutput(sequences=torch.ones(1, 6, dtype=torch.long), scores=rows, logits=rows)
    moved = return_to(output, torch.device("meta"))
    assert moved.sequences.device.type == "meta"
    assert all(row.device.type == "meta" for row in (*moved.scores, *moved.logits))
    assert return_to(torch.ones(2), torch.device("meta")).device.type == "meta"


def _hooked_pair():
    """A float32 tiny target behind accelerate's AlignDevicesHook on every module (one device: the CPU), an AR
    reference and a drafter steered to it."""
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    names = ["model.embed_tokens", *[f"model.layers.{i}" for i in range(4)], "model.norm", "model.rotary_emb",
             "lm_head"]
    dispatch_model(target, device_map={name: "cpu" for name in names}, force_hooks=True)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=20)
    return target, make_drafter(target, 8, ar, error_rate=0.25).float(), prompt, ar


@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_accelerate_dispatch_hooks_keep_every_strategy_exact(cuda_graphs):
    target, drafter, prompt, ar = _hooked_pair()
    assert hasattr(target.model.layers[0].linear_attn, "_hf_hook")  # hooks down to the GDN modules
    for strategy in ("dflash", "hybridspec", "confidence"):
        out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                              generation_strategy=strategy, hybridspec_config=HybridSpecConfig(cuda_graphs=cuda_graphs))
        telemetry = hybridspec_hf.get_telemetry(target)
        assert torch.equal(out, ar), strategy
        assert telemetry.path == ("static_eager" if cuda_graphs == "on" else "eager")
        if strategy != "hybridspec":  # (a calibrated strategy may find plain decoding pays on a CPU)
            assert sum(r.accepted for r in telemetry.rounds) > 0


def test_gdn_layers_hooked_before_the_patch_are_refused_not_run_wrong():
    """accelerate keeps the forward it found when it hooked a module: a GDN layer hooked before hybridspec_hf
    patched its class would run transformers' forward in verification (advancing its state by every drafted
    token); HybridSpec notices and says what to do instead of returning a wrong text."""
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    gdn_class = type(target.model.layers[0].linear_attn)
    patched = gdn_class.forward
    gdn_class.forward = gdn_class._hybridspec_original_forward  # as before `import hybridspec_hf`
    try:
        for layer in patches.gdn_layers(target):  # as device_map entries at the GDN modules' level would
            add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu"))
    finally:
        gdn_class.forward = patched
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    drafter = make_drafter(target, 8).float()
    with pytest.raises(RuntimeError, match="ran HybridSpec's verify mode"):
        target.generate(prompt, do_sample=False, max_new_tokens=8, assistant_model=drafter,
                        generation_strategy="dflash", hybridspec_config=HybridSpecConfig(cuda_graphs="off"))


def test_a_model_split_over_devices_runs_the_eager_loop_and_says_why():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    target.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=12)
    drafter = make_drafter(target, 8, ar).float()
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafter,
                          generation_strategy="dflash")
    telemetry = hybridspec_hf.get_telemetry(target)
    assert torch.equal(out, ar) and telemetry.path == "eager" and "device_map" in telemetry.path_reason
    with pytest.raises(ValueError, match="split over devices"):
        target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=drafter,
                        generation_strategy="dflash", hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
