"""Drop transformers' advice to install causal_conv1d / flash-linear-attention on machines without CUDA.

Both packages are CUDA kernels, so on a CPU-only machine "install `causal_conv1d` for the optimized kernel" is wrong
advice (the torch fallback is the only path there). On machines with CUDA the advice is kept.
"""
from __future__ import annotations

import logging

import torch

_KERNEL_LOGGER = "transformers.integrations.hub_kernels"  # transformers 5.17 .. 5.25
_CUDA_ONLY_PACKAGES = ("`causal_conv1d`", "`causal-conv1d`", "`flash-linear-attention`", "`fla`")


class _CudaKernelAdviceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("falling back to its reference PyTorch implementation" in message
                    and any(package in message for package in _CUDA_ONLY_PACKAGES))


def silence_cuda_kernel_advice_without_cuda() -> None:
    """Install the filter once, only when this machine has no CUDA device."""
    if torch.cuda.is_available():
        return
    logger = logging.getLogger(_KERNEL_LOGGER)
    if not any(isinstance(f, _CudaKernelAdviceFilter) for f in logger.filters):
        logger.addFilter(_CudaKernelAdviceFilter())
