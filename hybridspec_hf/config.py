"""HybridSpecConfig: the knobs of a HybridSpec generate() call, passed as `hybridspec_config=`."""
from __future__ import annotations

from dataclasses import asdict, dataclass

STRATEGIES = ("hybridspec", "dflash", "static")
KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass
class HybridSpecConfig:
    """Settings of one HybridSpec generation.

    static_length: w for the "static" strategy, i.e. tokens the target verifies per round (anchor + drafts),
        1 ≤ static_length ≤ the drafter's block size.
    kernel_backend: GDN verify/commit kernels: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton".
    """

    static_length: int = 7
    kernel_backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.static_length, int) or self.static_length < 1:
            raise ValueError(f"static_length must be an int ≥ 1 (tokens verified per round), got {self.static_length!r}.")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}.")

    def to_dict(self) -> dict:
        return asdict(self)
