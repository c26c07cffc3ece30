"""Model-family patches: CPU tensors never reach GPU-only kernels that transformers may have bound (fla)."""
import functools
import inspect

import torch
from _tiny import VOCAB, make_target
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

from hybridspec_hf.patches import GDN_KERNEL_FUNCTIONS, route_cpu_to_torch


def test_cpu_tensors_take_the_torch_reference_when_a_gpu_kernel_is_bound(monkeypatch):
    """As with fla installed: transformers' wrappers pick the Triton kernel for every device; CPU models crashed."""
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 9))
    expected = target.generate(prompt, do_sample=False, max_new_tokens=6)
    for name in GDN_KERNEL_FUNCTIONS:
        reference = inspect.unwrap(getattr(modeling, name))  # transformers' torch function

        @functools.wraps(reference)
        def gpu_only(*args, **kwargs):
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

        monkeypatch.setattr(modeling, name, gpu_only)
    route_cpu_to_torch(modeling)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=6), expected)


def test_the_module_lists_follow_a_replaced_block():
    """moe_blocks / gdn_layers answer from the layout they last walked, and walk again when a decoder layer's
    block was replaced (the lists are new objects: a caller may change its own)."""
    import copy

    from hybridspec_hf import patches

    target = make_target("qwen3_5_moe", seed=3, dtype=torch.float32)
    layers = patches.text_model(target).layers
    blocks, gdn = patches.moe_blocks(target), patches.gdn_layers(target)
    assert blocks == [layer.mlp for layer in layers] and len(gdn) == sum(hasattr(l, "linear_attn") for l in layers)
    blocks.clear()
    assert len(patches.moe_blocks(target)) == len(layers)
    replacement = copy.deepcopy(layers[1].mlp)
    layers[1].mlp = replacement
    assert patches.moe_blocks(target)[1] is replacement
    first = next(l for l in layers if hasattr(l, "linear_attn"))
    first.linear_attn = copy.deepcopy(first.linear_attn)
    assert patches.gdn_layers(target)[0] is first.linear_attn
