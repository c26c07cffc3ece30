"""Stage 0 / routing correction / stage 1 inside one max-shape verification.

The verification runs min(B, room) tokens. A device-side valid length says how many of them count. At the first MoE
router (the end of stage 0) a hook sees the extra token's experts and sets valid = w0 + keep; every experts call
from there on (stage 1) gives tokens beyond `valid` no experts of their own (they reuse token 0's, with weight 0),
so no new expert weights are read for them. Causality makes the valid tokens' outputs independent of the rest.
No host sync anywhere.
"""
from __future__ import annotations

import torch

from hybridspec_hf import patches


class VerifyWindow:
    """Hooks on the target's MoE blocks for one generate() call; inert while disarmed (prefill).

    Armed with the round's `Choice` (strategy.py), the owner of the valid length: the hooks read `choice.valid`
    each time they run and never keep a copy of it (see Choice's contract).
    """

    def __init__(self, moe_blocks: list[torch.nn.Module]):
        self.choice = None  # the armed round's Choice
        self._handles = []
        if moe_blocks:
            self._handles.append(moe_blocks[0].gate.register_forward_hook(self._router_hook))
        for block in moe_blocks:
            self._handles.append(block.experts.register_forward_pre_hook(self._experts_hook))

    def arm(self, choice) -> None:
        self.choice = choice

    def disarm(self) -> None:
        self.choice = None

    def _router_hook(self, module, args, output) -> None:
        if self.choice is not None and self.choice.corrects:
            self.choice.correct(output[2])  # [T, k] expert ids of the first MoE layer

    @patches.routing_pre_hook  # only rewrites the routing: the one-pass MoE block runs it and stays fused
    def _experts_hook(self, module, args):
        if self.choice is None:
            return None
        hidden, ids, weights = args[:3]
        valid = self.choice.valid.to(ids.device)  # a no-op unless a device_map put this layer on another device
        ids, weights = patches.mask_invalid_routes(ids, weights, valid)
        return (hidden, ids, weights, *args[3:])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RouterRecorder:
    """Every MoE layer's router choices, per forward: `forwards[i]` is [layers, T, k] long on the CPU (calibration's
    expert model, traces). Host copies: not for use inside a sync-free round."""

    def __init__(self, moe_blocks: list[torch.nn.Module]):
        self.current: list[torch.Tensor] = []
        self.forwards: list[torch.Tensor] = []
        self.num_layers = len(moe_blocks)
        self._handles = [block.gate.register_forward_hook(self._hook) for block in moe_blocks]

    def _hook(self, module, args, output) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # a graph capture runs no kernels: nothing to record (GPU-resident calibration records eagerly)
        self.current.append(output[2].detach().cpu())
        if len(self.current) == self.num_layers:
            self.forwards.append(torch.stack(self.current))
            self.current = []

    def clear(self) -> None:
        self.current, self.forwards = [], []

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RoutingReplay:
    """Timing mode's calibrated routing: while armed, every MoE router's expert ids are replaced by a bank's
    (the routing weights stay the router's). bank: [rounds, layers, B, k] long on the device; `row` [N] long on the
    device picks the bank row of each of the N batch rows, so a captured graph replays different rows each round."""

    def __init__(self, moe_blocks: list[torch.nn.Module], bank: torch.Tensor, rows: int = 1):
        self.bank = bank
        self.row = torch.zeros(rows, dtype=torch.long, device=bank.device)
        self.armed = False
        self._handles = [block.gate.register_forward_hook(self._hook(i)) for i, block in enumerate(moe_blocks)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            ids = output[2]  # [N·T, k], row-major over the batch rows
            tokens = ids.shape[0] // self.row.numel()
            if not self.armed or tokens > self.bank.shape[2] or tokens * self.row.numel() != ids.shape[0]:
                return None
            rows = self.bank.index_select(0, self.row % self.bank.shape[0])  # [N, layers, B, k]
            return (*output[:2], rows[:, layer, :tokens].reshape(ids.shape).to(ids.dtype), *output[3:])

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
