"""Trace recorder: what the drafter believed and what the target did, per round and draft position.

Runs the pair with the "dflash" strategy (the whole block is verified, so every round shows the acceptance a full
block would have had) and records, per round: the drafter's per-position top-1 probability, margin and entropy, which
drafts matched (the accepted prefix), a, w, the context length, and the expert ids every MoE layer chose for the
verified tokens (→ expert-reuse statistics: how often a token's experts were already used by earlier tokens of the
same block). The selector fits its acceptance estimator and expert model on these without re-recording; the scale
benchmark replays them as acceptance and routing profiles.

Schema "hybridspec-trace/1" (safetensors tensors + JSON metadata in the same file):
  top1, margin, entropy  [N, B-1] fp32     drafter signals of draft positions 1..B-1
  matched                [N, B-1] bool     draft i accepted (i ≤ a); beyond the verified length: False
  accepted               [N] long          a
  verified               [N] long          w - 1 drafts verified
  context_len            [N] long          tokens in the target's cache before the round
  prompt_index           [N] long          which prompt the round belongs to
  router_ids             [N, L, B, k] long expert ids per MoE layer and verified token (-1 past w); absent if dense
  expert_reuse           [N, L, B] fp32    fraction of the token's experts used by earlier tokens of the block (NaN past w)
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridspec_hf import patches
from hybridspec_hf.generation.router_hooks import RouterRecorder
from hybridspec_hf.selector import draft_signals

SCHEMA = "hybridspec-trace/1"


def expert_reuse(router_ids: torch.Tensor) -> torch.Tensor:
    """[L, w, k] expert ids -> [L, w] fraction of each token's experts already chosen by earlier tokens (layer-wise)."""
    same = router_ids.unsqueeze(2).unsqueeze(-1) == router_ids.unsqueeze(1).unsqueeze(-2)  # [L, w, w, k, k]
    earlier = torch.ones(router_ids.shape[1], router_ids.shape[1], dtype=torch.bool).tril(-1)  # [w(token), w(prev)]
    used = (same & earlier.view(1, *earlier.shape, 1, 1)).any(-1).any(2)  # [L, w, k]
    return used.float().mean(-1)


def record_traces(target, drafter, prompts: Iterable[torch.Tensor], max_new_tokens: int = 128, **generate_kwargs) -> dict:
    """Run every prompt ([1, L] ids) greedily with the "dflash" strategy and return the trace tensors (see schema)."""
    blocks = patches.moe_blocks(target)
    draft_calls: list[torch.Tensor] = []
    original_draft = drafter.draft

    def draft(*args, **kwargs):
        logits = original_draft(*args, **kwargs)
        draft_calls.append(logits.detach().float().cpu())
        return logits

    recorder = RouterRecorder(blocks)
    drafter.draft = draft
    rows: dict[str, list] = {k: [] for k in ("top1", "margin", "entropy", "accepted", "verified", "context_len",
                                             "prompt_index", "router_ids")}
    block_size = drafter.config.block_size
    try:
        for index, prompt in enumerate(prompts):
            recorder.clear()
            draft_calls.clear()
            target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter,
                            generation_strategy="dflash", **generate_kwargs)
            telemetry = target.hybridspec_telemetry
            context = prompt.shape[1]
            calls = iter(draft_calls)
            verifications = iter(recorder.forwards[1:])  # forward 0 is the prefill; each [L, T, k]
            for r in telemetry.rounds:
                routing = next(verifications) if blocks else None
                if r.drafted:
                    signals = draft_signals(next(calls))
                    for key in ("top1", "margin", "entropy"):
                        rows[key].append(signals[key][0])
                    rows["accepted"].append(r.accepted)
                    rows["verified"].append(r.w - 1)
                    rows["context_len"].append(context)
                    rows["prompt_index"].append(index)
                    if blocks:
                        ids = torch.full((len(blocks), block_size, routing[0].shape[-1]), -1, dtype=torch.long)
                        ids[:, : r.w] = routing[:, : r.w]
                        rows["router_ids"].append(ids)
                context += r.committed
    finally:
        drafter.__dict__.pop("draft", None)
        recorder.remove()
    traces = {k: torch.stack(rows[k]) for k in ("top1", "margin", "entropy")}
    for key in ("accepted", "verified", "context_len", "prompt_index"):
        traces[key] = torch.tensor(rows[key], dtype=torch.long)
    positions = torch.arange(1, block_size)
    traces["matched"] = positions.unsqueeze(0) <= traces["accepted"].unsqueeze(1)
    if blocks:
        traces["router_ids"] = torch.stack(rows["router_ids"])
        reuse = [expert_reuse(ids[:, : v + 1]) for ids, v in zip(traces["router_ids"], traces["verified"].tolist())]
        traces["expert_reuse"] = torch.stack(
            [torch.nn.functional.pad(x, (0, block_size - x.shape[1]), value=float("nan")) for x in reuse]
        )
    return traces


def save_traces(traces: dict, path: str | Path, metadata: dict | None = None) -> None:
    meta = {"schema": SCHEMA, **(metadata or {})}
    save_file({k: v.contiguous() for k, v in traces.items()}, str(path), metadata={"json": json.dumps(meta)})


def load_traces(path: str | Path) -> tuple[dict, dict]:
    """(tensors, metadata); raises if the schema is not one this version reads."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        meta = json.loads(handle.metadata()["json"])
    if meta.get("schema") != SCHEMA:
        raise ValueError(f"{path} has trace schema {meta.get('schema')!r}; this version reads {SCHEMA!r}.")
    return load_file(str(path)), meta
