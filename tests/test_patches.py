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
