"""RoPE inside GPU-resident forwards only: the fused rotation (kernels/rope_triton.py) and cos/sin by table lookup.

transformers' attention forwards call their module's `apply_rotary_pos_emb` by its global name; the patch replaces
that name with a function that takes the fused path for CUDA tensors while the resident forwards' flag is on
(`fused_kernels()`), and calls transformers' own function otherwise (plain generate(), training, every CPU path).

The text model computes cos and sin once per forward (its rotary embedding: ≈ 14 small kernels at one token in
transformers 5.17's mRoPE, ≈ 30 µs of the captured AR step on the H200). A static target fills a `RopeTable` of
every slot of its cache once per generate() call, outside capture, with the module's own forward; inside its
resident forwards the patched rotary embedding gathers its tokens' rows instead (one launch).
"""
from __future__ import annotations

import contextlib
import functools
from types import ModuleType

import torch

from hybridspec_hf.kernels import fused_kernels_active
from hybridspec_hf.kernels.rope_triton import rope_qk, supported

from ._weight_copies import hooked


def patch_rope(modeling: ModuleType) -> None:
    """Install the fused path on a family's `apply_rotary_pos_emb` (idempotent; no-op if the module has none)."""
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None or getattr(original, "_hybridspec_original", None) is not None:
        return

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and q.is_cuda and fused_kernels_active() and supported(q, k, cos, sin):
            return rope_qk(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._hybridspec_original = original
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


# ---------------------------------------------------------------------------------------------------------------
# cos/sin of a static cache's slots, looked up (GPU-resident forwards)

TABLE = True  # False: resident forwards run the rotary embedding's own forward (A/B: `--variants plain,-rope-table`)
_ON_CPU = False  # tests only: the lookup on CPU tensors too
_announced: tuple[RopeTable, torch.Tensor] | None = None  # the static target's table and slots, while it forwards


def rotary_input(rotary: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """The position ids the text model hands its rotary embedding for `position_ids` ([N, T], or [R, N, T] for
    mRoPE): the Qwen3.5 text models expand [N, T] to the three mRoPE rows and drop a leading text row of four;
    Qwen3-Next passes [N, T] on."""
    if not hasattr(rotary, "mrope_section"):
        return position_ids
    if position_ids.dim() == 2:
        return position_ids[None].expand(3, *position_ids.shape)
    return position_ids[1:] if position_ids.shape[0] == 4 else position_ids


class RopeTable:
    """The rotary embedding's (cos, sin) of every slot of a static cache, per batch row: `values` [2, N, S, R] in the
    model dtype, filled by the module's own forward (`fill`, eager) and read by one gather per resident forward.

    Slot s of row n holds the token at position id next_position - length + s (per mRoPE row): positions and
    lengths advance together, so a call's table stays right until the next `fill` (`StaticTarget.load` and `reset`).
    Indexed by slot, a lookup never leaves the table: the T new tokens' slots length .. length+T-1 are the ones the
    attention layers write in the static cache of S slots. cos and sin are elementwise in the position ids (the
    one-term product position · inv_freq rounds alike in any kernel while TF32 is off, then cos, sin, the
    attention scaling and the cast), so a row of the table equals the forward at that position bit for bit
    (tests/test_rope_table.py). Built for the "default" rope type only: dynamic types change inv_freq with the
    sequence length."""

    def __init__(self, rotary: torch.nn.Module, form: torch.Size, rows: int, slots: int, width: int,
                 dtype: torch.dtype, device: torch.device):
        self.rotary = rotary
        self.form = form  # the rotary input's shape but its last dim (tokens): [N] or [3, N]
        self.values = torch.zeros(2, rows, slots, width, dtype=dtype, device=device)

    @classmethod
    def build(cls, rotary: torch.nn.Module, offsets: torch.Tensor, slots: int, dtype: torch.dtype) -> RopeTable | None:
        """An empty table of `slots` slots for `rotary` in `dtype`, or None where no table is exact (see the class
        docstring). offsets: [N, 1], or [R, N, 1] for mRoPE: the static target's form of one token's position ids."""
        if getattr(rotary, "rope_type", None) != "default" or not _exact_products(offsets.device):
            return None
        if not hasattr(rotary, "mrope_section") and offsets.dim() != 2:
            return None
        x = torch.empty(0, dtype=dtype, device=offsets.device)
        cos, _ = _rotary_forward(rotary, x, offsets[..., :1, :])
        return cls(rotary, rotary_input(rotary, offsets).shape[:-1], offsets.shape[-2], slots, cos.shape[-1],
                   cos.dtype, offsets.device)

    def fill(self, offsets: torch.Tensor) -> None:
        """Recompute every slot (eager): offsets [N, 1] or [R, N, 1], the position id of each row's slot 0."""
        x = torch.empty(0, dtype=self.values.dtype, device=self.values.device)
        slots = torch.arange(self.values.shape[2], device=self.values.device)
        for row in range(self.values.shape[1]):  # one row at a time: the fp32 intermediates of one row only
            cos, sin = _rotary_forward(self.rotary, x, offsets[..., row: row + 1, :] + slots)
            self.values[0, row].copy_(cos[0])
            self.values[1, row].copy_(sin[0])

    def lookup(self, rotary: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor):
        """(cos, sin) [N, T, R] of the T tokens at `slots` [N, T], or None when this call is not the one the table
        was built for (another module, dtype or shape of ids, hooks, TF32 turned on since)."""
        rows, tokens = slots.shape
        if (rotary is not self.rotary or x.dtype != self.values.dtype or x.device != self.values.device
                or position_ids.shape != (*self.form, tokens) or hooked([rotary])
                or not _exact_products(x.device)):
            return None
        index = slots.view(1, rows, tokens, 1).expand(2, rows, tokens, self.values.shape[-1])
        cos, sin = torch.gather(self.values, 2, index)  # one launch: [2, N, T, R]
        return cos, sin


def _exact_products(device: torch.device) -> bool:
    """Whether the 5.17 forward's inv_freq @ position_ids (one term per output) rounds alike in any GEMM kernel:
    not with TF32, which rounds the inputs in some kernels and not in others."""
    if device.type != "cuda":
        return True
    matmul = torch.backends.cuda.matmul
    # torch ≥ 2.9 says "tf32" whichever API turned it on (reading `allow_tf32` then raises where the new one did)
    precision = getattr(matmul, "fp32_precision", None)
    return precision != "tf32" if precision is not None else not matmul.allow_tf32


def _rotary_forward(rotary: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    forward = type(rotary).__dict__.get("_hybridspec_original_forward", type(rotary).forward)
    with torch.no_grad():
        return forward(rotary, x, rotary_input(rotary, position_ids))


@contextlib.contextmanager
def rope_slots(table: RopeTable | None, slots: torch.Tensor):
    """Announce a resident forward's table and the slots [N, T] long (device) of its tokens to the rotary embedding
    (no table: nothing announced)."""
    global _announced
    previous, _announced = _announced, (None if table is None else (table, slots))
    try:
        yield
    finally:
        _announced = previous


def patch_rotary_embedding(rotary_cls: type) -> None:
    """Install the table lookup on a family's rotary embedding (idempotent): taken inside resident forwards that
    announced a table, for CUDA tensors with grad off; transformers' forward otherwise."""
    if "_hybridspec_original_forward" in rotary_cls.__dict__:
        return
    original = rotary_cls.forward

    @functools.wraps(original)
    def forward(self, x, position_ids):
        if (_announced is not None and TABLE and (x.is_cuda or _ON_CPU) and fused_kernels_active()
                and not torch.is_grad_enabled()):
            found = _announced[0].lookup(self, x, position_ids, _announced[1])
            if found is not None:
                return found
        return original(self, x, position_ids)

    rotary_cls._hybridspec_original_forward = original
    rotary_cls.forward = forward
