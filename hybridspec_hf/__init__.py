"""HybridSpec for Hugging Face: exact, fast speculative decoding for hybrid Gated-DeltaNet + MoE models.

    import hybridspec_hf
    out = target.generate(input_ids, assistant_model=drafter, generation_strategy="hybridspec", max_new_tokens=256)

Importing the package installs the generate() integration on the supported Qwen hybrid classes (idempotent);
every generate() call without `generation_strategy` behaves exactly as before.
"""
from .config import HybridSpecConfig, STRATEGIES
from .drafter import DFlashConfig, DFlashDrafter
from .generation.integration import enable, get_telemetry
from .generation.resident import release_resident_rounds as release_graphs
from .generation.telemetry import GenerationTelemetry, RoundRecord
from ._quiet import silence_cuda_kernel_advice_without_cuda

enable()
silence_cuda_kernel_advice_without_cuda()

__version__ = "0.1.0"

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "GenerationTelemetry",
    "HybridSpecConfig",
    "RoundRecord",
    "STRATEGIES",
    "enable",
    "get_telemetry",
    "release_graphs",
]
