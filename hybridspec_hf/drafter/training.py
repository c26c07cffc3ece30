"""Train a DFlash drafter for a target, the DFlash way (z-lab / SpecForge `OnlineDFlashModel`; notes dflash.md §2).

    drafter = train_drafter(target, prompts, "runs/drafter", num_layers=1, block_size=16, steps=2000)

1. Regenerate: the target answers every prompt (batched `generate`, greedy or sampled), so the drafter learns the
   target's own distribution. Responses are written in shards under `<output_dir>/regen/`; a rerun skips done shards.
2. Train: the frozen target runs over the (prompt + response) sequences (once up front when the features fit on the
   device, else once per batch); forward hooks on its decoder layers `target_layer_ids` take their OUTPUTS (z-lab's
   `hidden_states[i + 1]`) as context features. Random anchors are drawn inside the
   responses; each anchor p gives one block `[x_p, MASK × (B-1)]` and all blocks of a sequence run in ONE drafter
   forward under `block_attention_mask` (context keys strictly before the anchor + its own block, bidirectionally).
   Block position k (1..B-1) predicts x_{p+k}; cross-entropy weighted by exp(-(k-1)/γ). AdamW, warm-up + cosine,
   grad clip, bf16 autocast on GPU (`accelerate`).
3. Save: `save_pretrained(output_dir)` (the drafter's own weights; the target's embedding and LM head stay the target's).
4. Evaluate: acceptance length τ on held-out prompts, offline: the target's greedy continuation of each prompt is
   generated once; for every anchor position p of it, τ(p) = 1 + the longest prefix of the drafter's greedy block that
   equals the continuation (what greedy speculative decoding would accept, plus the bonus token), at each block size.

CLI: `add_train_drafter_arguments(parser)` + `run_train_drafter(args)` (wired as `hybridspec train-drafter`).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .modeling_dflash import DFlashDrafter, block_attention_mask, block_position_ids

# Loss decay γ per block size from the DFlash paper / ModelOpt (B=16 → 7, 10 → 5, 8 → 4); other sizes use B/2.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
PROMPT_FIELDS = ("prompt", "text", "question", "instruction")
NOVELTY_NGRAM = 8  # a block continuation is "novel" when its first 8 tokens occur nowhere earlier


# ------------------------------------------------------------------------------------------------------ data
@dataclass
class Sample:
    """One training / evaluation sequence: a prompt and the target's response to it (token ids)."""

    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def load_prompts(source, field: str | None = None) -> list[str]:
    """Prompts as strings from a list of strings, a `datasets.Dataset`, or paths.

    Paths: `.jsonl` (one JSON object per line; the field `field` or the first of prompt/text/question/instruction),
    a folder written by `Dataset.save_to_disk`, a text file (the whole file is one prompt), or a folder of text files
    (each `*.txt` / `*.py` file is one prompt, sorted by name). A list may mix paths.
    """
    if isinstance(source, (str, os.PathLike)):
        return _prompts_from_path(Path(source), field)
    if hasattr(source, "column_names"):  # datasets.Dataset
        column = field or next((c for c in PROMPT_FIELDS if c in source.column_names), None)
        if column is None:
            raise ValueError(f"The dataset has columns {source.column_names}; pass field= naming the prompt column.")
        return [str(x) for x in source[column]]
    prompts: list[str] = []
    for item in source:
        if isinstance(item, Path) or (isinstance(item, str) and _looks_like_path(item)):
            prompts.extend(_prompts_from_path(Path(item), field))
        else:
            prompts.append(str(item))
    return prompts


def _looks_like_path(text: str) -> bool:
    return "\n" not in text and len(text) < 4096 and Path(text).exists()


def _prompts_from_path(path: Path, field: str | None) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"Prompt source {path} does not exist (expected .jsonl, a text file or a folder).")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists():
            from datasets import load_from_disk

            return load_prompts(load_from_disk(str(path)), field)
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".py") and p.is_file())
        return [p.read_text(encoding="utf-8") for p in files]
    if path.suffix in (".jsonl", ".json"):
        prompts = []
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                key = field or next((k for k in PROMPT_FIELDS if k in row), None)
                if key is None or key not in row:
                    raise ValueError(f"{path}:{line_number} has keys {sorted(row)}; pass field= naming the prompt.")
                prompts.append(str(row[key]))
        return prompts
    return [path.read_text(encoding="utf-8")]


def _fingerprint(prompts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(p.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


def regenerate_responses(target, tokenizer, prompts: Sequence[str], out_dir: str | Path, *,
                         max_new_tokens: int = 256, max_prompt_tokens: int = 512, batch_size: int = 64,
                         temperature: float = 0.0, top_p: float = 1.0, shard_size: int = 1024, seed: int = 0,
                         accelerator=None, desc: str = "regenerate") -> list[Sample]:
    """The target's responses to `prompts` (batched `generate`), cached as shards in `out_dir`; resumable.

    Prompts are tokenized without special tokens and left-truncated to `max_prompt_tokens`; they run in order of
    decreasing length (left padding within a batch) and each response ends at the first eos (kept). temperature 0 is
    greedy. A rerun with the same prompts and settings skips the shards already written; other settings in the same
    folder are refused. Returns the samples in the order of `prompts`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"num_prompts": len(prompts), "prompts_sha256": _fingerprint(prompts), "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                "shard_size": shard_size}
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old != manifest:
            changed = {k: (old.get(k), v) for k, v in manifest.items() if old.get(k) != v}
            raise ValueError(f"{out_dir} holds responses made with other prompts or settings {changed} "
                             "(old, new); use another folder or delete it.")
    elif accelerator is None or accelerator.is_main_process:
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")

    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    encoded = [ids[-max_prompt_tokens:] for ids in encoded]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"{len(empty)} prompts tokenize to nothing (first index {empty[0]}); drop empty prompts.")
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i]), i))
    shards = [order[s:s + shard_size] for s in range(0, len(order), shard_size)]
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    device = next(target.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    done = sum(len(s) for i, s in enumerate(shards) if (out_dir / f"shard-{i:05d}.jsonl").exists())
    progress = tqdm(total=len(order), initial=done, desc=desc, unit="prompt", disable=rank != 0)
    was_training = target.training
    target.eval()
    for shard_index, shard in enumerate(shards):
        path = out_dir / f"shard-{shard_index:05d}.jsonl"
        if path.exists() or shard_index % world != rank:
            continue
        torch.manual_seed(seed + shard_index)
        rows = []
        for start in range(0, len(shard), batch_size):
            batch = shard[start:start + batch_size]
            width = max(len(encoded[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
                attention_mask[row, width - len(encoded[i]):] = 1
            sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {
                "do_sample": False}
            with torch.no_grad():
                out = target.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
                                      **sampling)
            for row, i in enumerate(batch):
                response = out[row, width:].tolist()
                if eos_id in response:
                    response = response[:response.index(eos_id) + 1]
                rows.append({"index": i, "prompt_ids": encoded[i], "response_ids": response})
            progress.update(len(batch))
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, path)  # a shard exists only once complete
    progress.close()
    target.train(was_training)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    samples: list[Sample | None] = [None] * len(prompts)
    for shard_index in range(len(shards)):
        with open(out_dir / f"shard-{shard_index:05d}.jsonl", encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                samples[r["index"]] = Sample(r["prompt_ids"], r["response_ids"])
    return samples


# ------------------------------------------------------------------------------------------------ features
def decoder_layers(target) -> torch.nn.ModuleList:
    """The target's decoder layers (`model.layers`, or `model.language_model.layers` for multimodal wrappers)."""
    base = target.model
    base = getattr(base, "language_model", base)
    return base.layers


@contextlib.contextmanager
def capture_layer_outputs(target, layer_ids: Sequence[int]):
    """Forward hooks that keep the OUTPUT of each decoder layer in `layer_ids`; yields the dict layer_id -> tensor.

    Hooks rather than `output_hidden_states`, whose indexing differs between transformers 5.17 and 5.2x.
    """
    layers = decoder_layers(target)
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
        def keep(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
        return keep

    handles = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, layer_ids: Sequence[int],
                    return_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Concatenated outputs of target layers `layer_ids` for `input_ids` [B, S] -> [B, S, len(layer_ids)*H].

    Right padding is harmless (causal: real positions never see it). With return_logits also the logits [B, S, V].
    """
    with capture_layer_outputs(target, layer_ids) as captured:
        if return_logits:
            logits = target(input_ids=input_ids, use_cache=False).logits
        else:
            target.model(input_ids=input_ids, use_cache=False)
    features = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return (features, logits) if return_logits else features


@torch.no_grad()
def precompute_features(target, samples: Sequence[Sample], layer_ids: Sequence[int], pad_id: int, device,
                        dtype: torch.dtype, batch_size: int = 64,
                        distill_topk: int = 0) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[SoftTargets]]:
    """Target features of every sample, [len(sample.ids), n_feat*H] each in `dtype` on `device` (one target pass).

    With distill_topk > 0 also each sample's `SoftTargets` (the target's top-k next-token probabilities at every
    position, from the same pass)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))  # similar lengths share a batch
    features: list[torch.Tensor | None] = [None] * len(samples)
    soft: list[SoftTargets | None] = [None] * len(samples)
    for start in tqdm(range(0, len(order), batch_size), desc="target features", unit="batch"):
        batch = order[start:start + batch_size]
        ids, _, lengths = pad_samples([samples[i] for i in batch], pad_id, device)
        if distill_topk:
            out, logits = target_features(target, ids, layer_ids, return_logits=True)
            top = SoftTargets.from_logits(logits, distill_topk)
        else:
            out = target_features(target, ids, layer_ids)
        out = out.to(dtype)
        for row, i in enumerate(batch):
            features[i] = out[row, :int(lengths[row])].clone()
            if distill_topk:
                soft[i] = top.row(row, int(lengths[row]))
    return (features, soft) if distill_topk else features


@dataclass
class SoftTargets:
    """The target's top-k next-token distribution at each position: probs [..., S, k] (renormalised over the k, float)
    and their token ids [..., S, k]; position t holds the distribution of token t+1."""

    probs: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int) -> SoftTargets:
        if not 1 <= k <= logits.shape[-1]:
            raise ValueError(f"distill_topk must be in 1..{logits.shape[-1]} (the vocabulary), got {k}.")
        values, ids = logits.float().topk(k, dim=-1)
        return cls(values.softmax(-1), ids)

    def row(self, row: int, length: int) -> SoftTargets:
        """Row `row`'s first `length` positions, stored compactly (probs bf16 on CUDA, ids int32)."""
        dtype = torch.bfloat16 if self.probs.is_cuda else torch.float32
        return SoftTargets(self.probs[row, :length].to(dtype).clone(), self.ids[row, :length].int().clone())

    @classmethod
    def pad(cls, rows: Sequence[SoftTargets]) -> SoftTargets:
        """Right-padded batch of per-sample rows (padding: probability 0 on token 0)."""
        return cls(torch.nn.utils.rnn.pad_sequence([r.probs for r in rows], batch_first=True),
                   torch.nn.utils.rnn.pad_sequence([r.ids for r in rows], batch_first=True))

    def at_blocks(self, anchors: torch.Tensor, block_size: int) -> SoftTargets:
        """The distributions of the labels of `block_labels`: block position k of anchor p predicts x_{p+k}, whose
        distribution the target gave at position p+k-1 -> [B, N, B-1, k]."""
        positions = (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device))  # p + k - 1
        index = positions.clamp(max=self.probs.shape[1] - 1).flatten(1)  # [B, N*(B-1)]
        k = self.probs.shape[-1]
        gather = index[:, :, None].expand(-1, -1, k)
        shape = (*positions.shape, k)
        return SoftTargets(self.probs.gather(1, gather).view(shape).float(),
                           self.ids.gather(1, gather).view(shape).long())


# --------------------------------------------------------------------------------------------------- loss
def pad_samples(samples: Sequence[Sample], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] and per-row response start and length [B]."""
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s.ids)] = torch.tensor(s.ids)
    starts = torch.tensor([len(s.prompt_ids) for s in samples])
    lengths = torch.tensor([len(s.ids) for s in samples])
    return ids.to(device), starts.to(device), lengths.to(device)


def sample_anchors(starts: torch.Tensor, lengths: torch.Tensor, width: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` distinct random anchors per row inside the response, with at least one label after them.

    Returns anchors [B, N] (sorted) and valid [B, N] bool; rows with fewer candidates are padded with invalid anchors.
    """
    positions = torch.arange(width, device=starts.device)
    allowed = (positions >= starts[:, None]) & (positions + 1 < lengths[:, None])
    scores = torch.rand(allowed.shape, generator=generator, device="cpu").to(starts.device)
    scores = torch.where(allowed, scores, torch.full_like(scores, -1.0))
    top = scores.topk(min(num_anchors, width), dim=1)
    anchors, order = top.indices.sort(dim=1)
    valid = top.values.gather(1, order) >= 0
    return anchors, valid


def block_labels(ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels x_{p+k} of block positions k = 1..B-1 [B, N, B-1] and where they exist (inside the sequence)."""
    offsets = torch.arange(1, block_size, device=ids.device)
    target_positions = anchors[:, :, None] + offsets  # [B, N, B-1]
    exists = (target_positions < lengths[:, None, None]) & valid[:, :, None]
    index = target_positions.clamp(max=ids.shape[1] - 1)
    labels = ids.gather(1, index.flatten(1)).view_as(index)
    return labels, exists


def draft_blocks(drafter: DFlashDrafter, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                 block_size: int, model=None) -> torch.Tensor:
    """Drafter logits of every anchor block in one forward: [B, N, block_size-1, V] (at least fp32).

    `model` is what to call for the forward (the accelerate-wrapped drafter while training; default `drafter`).
    """
    batch, num_blocks = anchors.shape
    block_ids = torch.full((batch, num_blocks, block_size), drafter.config.mask_token_id, dtype=ids.dtype,
                           device=ids.device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    noise = drafter.embed(block_ids.flatten(1))  # [B, N*bs, H]
    hidden = (model or drafter)(
        noise, context_hidden=features,
        position_ids=block_position_ids(anchors, block_size),
        context_position_ids=torch.arange(features.shape[1], device=ids.device),
        attention_mask=block_attention_mask(anchors, features.shape[1], block_size),
    ).last_hidden_state
    hidden = hidden.view(batch, num_blocks, block_size, -1)[:, :, 1:]
    return drafter.compute_logits(hidden)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, exists: torch.Tensor, gamma: float,
                soft: SoftTargets | None = None, distill_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Σ w_k·CE / Σ w_k over existing labels, w_k = exp(-(k-1)/γ) for block position k; plus accuracy metrics.

    With `soft` (the target's top-k distributions of the labels, `SoftTargets.at_blocks`) and distill_weight α the
    per-label term is (1 - α)·CE(label) + α·CE(target's top-k distribution), the same weights w_k."""
    block = logits.shape[2] + 1
    weights = torch.exp(-torch.arange(block - 1, device=logits.device, dtype=torch.float32) / gamma)  # k-1 = 0..B-2
    weights = weights.expand_as(labels) * exists
    log_probs = logits.float().log_softmax(-1)
    ce = -log_probs.gather(-1, labels[..., None])[..., 0]
    if distill_weight:
        if soft is None:
            raise ValueError("dflash_loss: distill_weight > 0 needs `soft`, the target's top-k distributions.")
        soft_ce = -(soft.probs * log_probs.gather(-1, soft.ids)).sum(-1)
        ce = (1 - distill_weight) * ce + distill_weight * soft_ce
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        match = (logits.argmax(-1) == labels) & exists
        full = exists.all(dim=2)  # blocks whose B-1 labels all exist
        accepted = match.long().cumprod(dim=2).sum(dim=2)
        metrics = {"loss": loss.item(), "top1": (match.sum() / exists.sum().clamp(min=1)).item(),
                   "tau": (1 + accepted[full].float()).mean().item() if full.any() else float("nan")}
    return loss, metrics


# ----------------------------------------------------------------------------------------------- evaluation
def greedy_consistent_length(sample: Sample, greedy_next: torch.Tensor) -> int:
    """Length of the longest prefix of `sample.ids` whose response tokens all equal the target's argmax.

    `greedy_next[t]` is the target's argmax after position t. Responses generated greedily agree everywhere except
    where batched/padded generation broke a near-tie differently; the sequence is cut there.
    """
    ids = sample.ids
    for t in range(len(sample.prompt_ids), len(ids)):
        if int(greedy_next[t - 1]) != ids[t]:
            return t
    return len(ids)


@torch.no_grad()
def acceptance_lengths(target, drafter: DFlashDrafter, samples: Sequence[Sample], block_sizes: Iterable[int] = (16, 8),
                       *, anchors_per_forward: int = 64, calibration_bins: int = 10) -> dict:
    """Offline greedy acceptance length τ of `drafter` on the target's greedy continuations `samples`.

    For every anchor p in a response with p + B - 1 inside it: τ(p) = 1 + the longest prefix of the drafter's argmax
    block that equals x_{p+1..p+B-1} (the bonus token counts 1). Anchors whose block would run past the end are left
    out, so τ is not capped by response ends. Also: mean τ, the per-position acceptance, and for the largest block a
    calibration table of the drafter's top-1 probability against how often that token matched (over all positions,
    and over positions the greedy verifier actually reaches, i.e. after an accepted prefix).
    `tau_novel` is τ over the anchors whose next 8 tokens do not occur earlier in the sequence: repetition loops
    and copies are trivial to draft, so this is the τ on text the target did not just repeat.
    """
    block_sizes = sorted(set(block_sizes), reverse=True)
    layer_ids = drafter.config.target_layer_ids
    device = drafter.device
    per_block = {b: [] for b in block_sizes}
    novel_block = {b: [] for b in block_sizes}
    probs, matched, reached = [], [], []
    cut = 0
    for sample in tqdm(samples, desc="evaluate τ", unit="sequence"):
        ids = torch.tensor([sample.ids], device=device)
        features, logits = target_features(target, ids, layer_ids, return_logits=True)
        length = greedy_consistent_length(sample, logits[0].argmax(-1))
        cut += length < len(sample.ids)
        lengths = torch.tensor([length], device=device)
        novel = novel_continuations(sample.ids[:length], NOVELTY_NGRAM)
        for b in block_sizes:
            first, end = len(sample.prompt_ids), length - b + 1  # anchors whose whole block fits
            if end <= first:  # response shorter than a block
                continue
            candidates = torch.arange(first, end, device=device)
            for chunk in candidates.split(anchors_per_forward):
                anchors = chunk[None]
                valid = torch.ones_like(anchors, dtype=torch.bool)
                block_logits = draft_blocks(drafter, features[:, :length], ids[:, :length], anchors, b)
                labels, _ = block_labels(ids[:, :length], lengths, anchors, valid, b)
                match = block_logits.argmax(-1) == labels  # [1, n, b-1]
                per_block[b].append(1 + match.long().cumprod(dim=2).sum(dim=2).flatten().cpu())
                novel_block[b].append(novel[chunk.cpu()])
                if b == block_sizes[0]:
                    probs.append(block_logits.softmax(-1).amax(-1).flatten().cpu())
                    matched.append(match.flatten().cpu())
                    prefix_ok = torch.cat([torch.ones_like(match[..., :1]), match[..., :-1]], dim=-1).cumprod(dim=-1)
                    reached.append(prefix_ok.bool().flatten().cpu())
    result = {"num_sequences": len(samples), "sequences_cut_at_greedy_mismatch": cut, "block_sizes": {}}
    for b in block_sizes:
        taus = torch.cat(per_block[b]) if per_block[b] else torch.zeros(0)
        result["block_sizes"][str(b)] = {
            "tau": taus.float().mean().item() if len(taus) else float("nan"), "num_anchors": len(taus),
            "tau_histogram": torch.bincount(taus, minlength=b + 1)[1:].tolist() if len(taus) else [],
        }
        is_novel = torch.cat(novel_block[b]) if novel_block[b] else torch.zeros(0, dtype=torch.bool)
        result["block_sizes"][str(b)]["novel_anchor_fraction"] = is_novel.float().mean().item() if len(taus) else None
        result["block_sizes"][str(b)]["tau_novel"] = taus[is_novel].float().mean().item() if is_novel.any() else None
        if b != block_sizes[0] and per_block[block_sizes[0]]:
            # The largest block's draft cut to b tokens (a verifier that checks only the first b-1 drafts).
            largest = torch.cat(per_block[block_sizes[0]])
            result["block_sizes"][str(b)]["tau_truncated_from_largest"] = largest.clamp(max=b).float().mean().item()
    if probs:
        result["calibration"] = calibration_table(torch.cat(probs), torch.cat(matched), torch.cat(reached),
                                                   calibration_bins)
        result["calibration_block_size"] = block_sizes[0]
    return result


def novel_continuations(ids: Sequence[int], n: int) -> torch.Tensor:
    """novel[p] = the n tokens after position p (ids[p+1:p+n+1]) occur nowhere earlier in `ids`. bool [len(ids)]."""
    first: dict[tuple, int] = {}
    for start in range(len(ids) - n + 1):
        first.setdefault(tuple(ids[start:start + n]), start)
    novel = torch.zeros(len(ids), dtype=torch.bool)
    for p in range(len(ids) - n):
        novel[p] = first[tuple(ids[p + 1:p + 1 + n])] == p + 1
    return novel


def calibration_table(probs: torch.Tensor, matched: torch.Tensor, reached: torch.Tensor, bins: int) -> list[dict]:
    """Rows per top-1 probability bin: count, mean probability, match rate (all positions and reached ones)."""
    edges = torch.linspace(0, 1, bins + 1)
    index = torch.bucketize(probs.float(), edges[1:-1], right=True)
    rows = []
    for i in range(bins):
        sel = index == i
        sel_reached = sel & reached
        rows.append({"bin": [round(edges[i].item(), 3), round(edges[i + 1].item(), 3)], "count": int(sel.sum()),
                     "mean_prob": probs[sel].float().mean().item() if sel.any() else None,
                     "match_rate": matched[sel].float().mean().item() if sel.any() else None,
                     "count_reached": int(sel_reached.sum()),
                     "match_rate_reached": matched[sel_reached].float().mean().item() if sel_reached.any() else None})
    return rows


def distinct_ngram_ratio(sequences: Iterable[Sequence[int]], n: int) -> float:
    """Mean over sequences of (distinct n-grams / n-grams): 1.0 = no repeats, near 0 = a repetition loop."""
    ratios = []
    for seq in sequences:
        grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios) if ratios else float("nan")


# ------------------------------------------------------------------------------------------------- training
def warmup_cosine_lr(step: int, total: int, warmup: int, floor_ratio: float = 0.1) -> float:
    """LR multiplier: linear warm-up over `warmup` steps, then cosine decay to `floor_ratio` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _is_moe(path: str) -> bool:
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(path).get_text_config()
    return bool(getattr(text, "num_experts", 0))


def load_target(target, tokenizer=None, dtype: torch.dtype | None = None, device="cpu"):
    """`(target, tokenizer)`: a frozen causal LM in eval mode on `device`, from a local path or hub id (or in memory).

    dtype defaults to fp32 on CPU and bf16 elsewhere; MoE targets on CPU use transformers' "eager" experts. The
    tokenizer comes from the target's folder unless given (required for an in-memory target).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(target, (str, os.PathLike)):
        path = str(target)
        on_cpu = torch.device(device).type == "cpu"
        if dtype is None:
            dtype = torch.float32 if on_cpu else torch.bfloat16
        # MoE targets: grouped_mm decodes ~25x slower than the per-expert loop on CPU (transformers 5.17-5.24)
        experts = {"experts_implementation": "eager"} if on_cpu and _is_moe(path) else {}
        target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **experts)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as e:
                raise ValueError(f"No tokenizer found with the target at {path}; pass tokenizer=.") from e
    elif dtype is not None:
        target = target.to(dtype)
    if tokenizer is None:
        raise ValueError("tokenizer= is required when the target is an in-memory model.")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    target = target.to(device).eval()
    target.requires_grad_(False)
    return target, tokenizer


def _rebuilt(drafter: DFlashDrafter, state: dict, new_weight, what: str, **config_changes) -> DFlashDrafter:
    """A new drafter with `config_changes`, in `drafter`'s dtype, device and mode, bound to the same target, holding
    `state`; the weights it does not hold must be new ones (`new_weight(key)`), or this is refused. Its acceptance
    estimator is dropped: it was fitted on the old drafter's traces (refit after training)."""
    config = drafter.config.__class__(**{**drafter.config.to_dict(), **config_changes})
    rebuilt = DFlashDrafter(config).to(device=drafter.device, dtype=drafter.dtype).train(drafter.training)
    missing, unexpected = rebuilt.load_state_dict(state, strict=False)
    if unexpected or not all(new_weight(key) for key in missing):
        raise RuntimeError(f"{what}: weights that do not map onto the new drafter (missing {missing}, "
                           f"unexpected {unexpected}).")
    rebuilt.acceptance_estimator = None
    if drafter._target_modules is not None:
        rebuilt._target_modules = drafter._target_modules
    return rebuilt


def grow_drafter(drafter: DFlashDrafter, num_layers: int) -> DFlashDrafter:
    """`drafter` with decoder layers appended up to `num_layers` that start as the identity: each new layer's output
    projections (attention o_proj and MLP down_proj) are zero, so the residual stream, and every draft, is the
    trained drafter's until training moves them (their inputs are not zero, so their gradients are not). The other
    weights are copied; the result is a new model in the drafter's dtype, device and mode, bound to the same target."""
    have = drafter.config.num_hidden_layers
    if num_layers < have:
        raise ValueError(f"grow_drafter: the drafter has {have} layers and cannot shrink to {num_layers}; pass "
                         f"num_layers >= {have} (or train a fresh drafter with fewer layers).")
    if num_layers == have:
        return drafter
    new = tuple(f"layers.{i}." for i in range(have, num_layers))
    layer_types = list(drafter.config.layer_types) + [drafter.config.layer_types[-1]] * (num_layers - have)
    grown = _rebuilt(drafter, drafter.state_dict(), lambda key: key.startswith(new), "grow_drafter",
                     num_hidden_layers=num_layers, layer_types=layer_types)
    with torch.no_grad():
        for layer in grown.layers[have:]:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
                if projection.bias is not None:
                    projection.bias.zero_()
    return grown


def widen_features(drafter: DFlashDrafter, target_layer_ids: Sequence[int]) -> DFlashDrafter:
    """`drafter` reading the outputs of `target_layer_ids`, a superset of its own layers (any order), with the new
    layers' columns of `fc` zero: the fused context, and every draft, is the trained drafter's until training moves
    them. The other weights are copied; the result is a new model in the drafter's dtype, device and mode, bound to the
    same target (the drafter itself where the layers are its own)."""
    old_ids = list(drafter.config.target_layer_ids)
    new_ids = [int(i) for i in target_layer_ids]
    missing = [i for i in old_ids if i not in new_ids]
    if missing or len(set(new_ids)) != len(new_ids):
        raise ValueError(f"widen_features: target_layer_ids {new_ids} must hold each of the drafter's layers "
                         f"{old_ids} once (missing {missing}); a drafter cannot stop reading a layer it was "
                         "trained on: train a fresh one for another set.")
    if new_ids == old_ids:
        return drafter
    state = drafter.state_dict()
    old_fc = state.pop("fc.weight")
    wide = _rebuilt(drafter, state, lambda key: key == "fc.weight", "widen_features", target_layer_ids=new_ids,
                    dflash_config={"target_layer_ids": new_ids})
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        wide.fc.weight.zero_()
        for j, layer in enumerate(old_ids):
            k = new_ids.index(layer)
            wide.fc.weight[:, k * hidden:(k + 1) * hidden] = old_fc[:, j * hidden:(j + 1) * hidden]
    return wide


def train_drafter(target, prompts, output_dir: str | Path, *, tokenizer=None, num_layers: int | None = None,
                  block_size: int = 16, steps: int = 1000, time_budget_s: float | None = None,
                  target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
                  drafter_overrides: dict | None = None, batch_size: int = 32, num_anchors: int = 64,
                  lr: float = 6e-4, warmup_ratio: float = 0.04, min_lr_ratio: float = 0.1, weight_decay: float = 0.01,
                  grad_clip: float = 1.0, gamma: float | None = None, max_new_tokens: int = 256,
                  max_prompt_tokens: int = 512, regen_batch_size: int = 64, temperature: float = 0.0,
                  eval_prompts=None, eval_block_sizes: Sequence[int] = (16, 8), prompt_field: str | None = None,
                  target_dtype: torch.dtype | None = None, save_dtype: torch.dtype | None = None,
                  mixed_precision: str | None = None, cache_features: bool | None = None,
                  feature_cache_gib: float = 16.0, init_drafter=None, distill_weight: float = 0.0,
                  distill_topk: int = 32, log_every: int = 50, seed: int = 0, accelerator=None) -> DFlashDrafter:
    """Regenerate responses with `target`, train a DFlash drafter on them, save it, and report τ.

    Args:
        target: a causal LM (in memory) or a local path; frozen throughout.
        prompts: list of strings, `datasets.Dataset`, or paths (see `load_prompts`).
        output_dir: gets the drafter (`save_pretrained`), `regen/` and `eval_regen/` response shards,
            `training_log.json` (loss curve, recipe) and `eval.json` (τ per block size, calibration).
        num_layers, block_size, target_layer_ids, mask_token_id, drafter_overrides: `DFlashDrafter.from_target`
            (num_layers default 1). With init_drafter, num_layers above its own appends layers that start as the
            identity (`grow_drafter`); below it is an error; target_layer_ids that add layers to its own widen its
            context input with zero weights (`widen_features`); dropping one of its layers is an error.
            mask_token_id defaults to the tokenizer's mask token, else the last vocabulary row.
        steps: optimizer steps. With `time_budget_s` the schedule runs on the clock instead (warm-up and cosine over
            the fraction of the budget used; training stops when it is spent), and steps is an upper bound: step
            times vary at the start (allocator, kernel heuristics for new shapes), so no step count fits a budget.
        batch_size: sequences per step; num_anchors: anchor blocks per sequence (all in one forward).
        gamma: loss decay; default 7 / 5 / 4 for block 16 / 10 / 8, else block_size / 2.
        max_new_tokens, max_prompt_tokens, regen_batch_size, temperature: regeneration (0 = greedy).
        eval_prompts: held-out prompts for τ (greedy continuations); None skips the evaluation.
        target_dtype: dtype of a target loaded from a path (default bf16 on CUDA, fp32 on CPU).
        save_dtype: dtype of the saved drafter weights (default: as trained, fp32).
        mixed_precision: accelerate's setting; default "bf16" on CUDA, "no" on CPU.
        cache_features: run the frozen target once over every sequence and keep its features on the device
            (bf16 on CUDA) instead of once per step; default: on CUDA when they fit in `feature_cache_gib`.
            Same features either way (the target is frozen, no dropout); the cache rounds them to bf16, which
            autocast does to the drafter's fc input anyway.
        init_drafter: a `DFlashDrafter` or a saved one's path to continue training from (its config wins over
            block_size / mask_token_id; num_layers and target_layer_ids may grow it); default: a fresh one.
        distill_weight: α of the loss (1 - α)·CE(response token) + α·CE(target's distribution), the target's
            next-token distribution at each label kept as its top `distill_topk` probabilities (renormalised), from
            the same target pass as the features; 0 (default): the response tokens alone, as DFlash trains.
    Returns the trained drafter in fp32, bound to the target. The evaluation uses the weights as saved and reloaded.
    """
    from accelerate import Accelerator

    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1] (the share of the loss on the target's distribution), "
                         f"got {distill_weight}.")
    if distill_weight and distill_topk < 1:
        raise ValueError(f"distill_topk must be >= 1 (probabilities kept per position), got {distill_topk}.")
    output_dir = Path(output_dir)
    if accelerator is None:
        if mixed_precision is None:
            mixed_precision = "bf16" if torch.cuda.is_available() else "no"
        accelerator = Accelerator(mixed_precision=mixed_precision)
    device = accelerator.device
    target, tokenizer = load_target(target, tokenizer, target_dtype, device)
    if mask_token_id is None:
        mask_token_id = getattr(tokenizer, "mask_token_id", None)
    torch.manual_seed(seed)

    started = time.perf_counter()
    prompt_texts = load_prompts(prompts, prompt_field)
    samples = regenerate_responses(target, tokenizer, prompt_texts, output_dir / "regen",
                                   max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                   batch_size=regen_batch_size, temperature=temperature, seed=seed,
                                   accelerator=accelerator, desc="regenerate (train)")
    samples = [s for s in samples if len(s.response_ids) >= 2]
    if not samples:
        raise ValueError("No response has 2 or more tokens; raise max_new_tokens or check the target's eos.")
    regen_seconds = time.perf_counter() - started

    if init_drafter is None:
        drafter = DFlashDrafter.from_target(target, num_layers=num_layers or 1, block_size=block_size,
                                            target_layer_ids=list(target_layer_ids) if target_layer_ids else None,
                                            mask_token_id=mask_token_id, **(drafter_overrides or {}))
    else:
        if isinstance(init_drafter, (str, os.PathLike)):
            init_drafter = DFlashDrafter.from_pretrained(str(init_drafter), dtype=torch.float32)
        drafter = init_drafter.to(device).bind_target(target)
        if num_layers is not None:
            drafter = grow_drafter(drafter, num_layers).bind_target(target)
        if target_layer_ids is not None:
            drafter = widen_features(drafter, target_layer_ids).bind_target(target)
        num_layers, block_size = drafter.config.num_hidden_layers, drafter.config.block_size
    gamma = gamma or DEFAULT_GAMMA.get(block_size, block_size / 2)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    layer_ids = drafter.config.target_layer_ids
    feature_bytes = sum(len(s.ids) for s in samples) * len(layer_ids) * drafter.config.hidden_size * 2
    if cache_features is None:
        cache_features = device.type == "cuda" and feature_bytes < feature_cache_gib * 2**30
    topk = distill_topk if distill_weight else 0
    cached, cached_soft = None, None
    if cache_features:
        cache_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cached = precompute_features(target, samples, layer_ids, pad_id, device, cache_dtype,
                                     batch_size=regen_batch_size, distill_topk=topk)
        if topk:
            cached, cached_soft = cached
    drafter = drafter.to(dtype=torch.float32)
    drafter.train()
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    model, optimizer = accelerator.prepare(drafter, optimizer)
    generator = torch.Generator().manual_seed(seed + accelerator.process_index)
    warmup = max(1, int(warmup_ratio * steps))
    curve, window = [], []  # window: metrics of the steps since the last log entry
    train_started = time.perf_counter()
    step, sequences_seen, anchors_seen = 0, 0, 0
    bar = tqdm(total=steps, desc="train drafter", unit="step", disable=not accelerator.is_main_process)

    def log_entry() -> dict:
        """Means of the metrics since the last entry (a NaN τ means no block had all its labels)."""
        entry = {"step": step, "lr": lr * scale, "grad_norm": float(grad_norm), "sequences": sequences_seen,
                 "anchors": anchors_seen, "elapsed_s": time.perf_counter() - train_started,
                 **{k: sum(m[k] for m in window) / len(window) for k in ("loss", "top1", "tau")}}
        window.clear()
        if accelerator.is_main_process:
            bar.write(json.dumps(entry))  # above the progress bar
        return entry
    while step < steps:
        if time_budget_s:
            used = (time.perf_counter() - train_started) / time_budget_s
            if used >= 1.0:
                break
            scale = warmup_cosine_lr(int(1000 * used), 1000, max(1, int(1000 * warmup_ratio)), min_lr_ratio)
        else:
            scale = warmup_cosine_lr(step, steps, warmup, min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        pick = torch.randint(0, len(samples), (batch_size,), generator=generator).tolist()
        ids, starts, lengths = pad_samples([samples[i] for i in pick], pad_id, device)
        soft = None
        if cached is None and topk:
            features, target_logits = target_features(target, ids, layer_ids, return_logits=True)
            soft = SoftTargets.from_logits(target_logits, topk)
            del target_logits
        elif cached is None:
            features = target_features(target, ids, layer_ids)
        else:
            features = torch.nn.utils.rnn.pad_sequence([cached[i] for i in pick], batch_first=True)
            if topk:
                soft = SoftTargets.pad([cached_soft[i] for i in pick])
        anchors, valid = sample_anchors(starts, lengths, ids.shape[1], num_anchors, generator)
        labels, exists = block_labels(ids, lengths, anchors, valid, block_size)
        if soft is not None:
            soft = soft.at_blocks(anchors, block_size)
        with accelerator.autocast():
            logits = draft_blocks(drafter, features, ids, anchors, block_size, model=model)
            loss, metrics = dflash_loss(logits, labels, exists, gamma, soft, distill_weight)
        accelerator.backward(loss)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        sequences_seen += batch_size
        anchors_seen += int(valid.sum())
        window.append(metrics)
        bar.update()
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}", refresh=False)
        if step % log_every == 0:
            curve.append(log_entry())
    bar.close()
    if window:
        curve.append(log_entry())
    train_seconds = time.perf_counter() - train_started

    drafter = accelerator.unwrap_model(model)
    drafter.eval()
    log = {"feature_cache": bool(cached is not None), "recipe": {"num_layers": num_layers, "block_size": block_size, "target_layer_ids": drafter.config.target_layer_ids,
                      "mask_token_id": drafter.config.mask_token_id, "steps": step, "batch_size": batch_size,
                      "num_anchors": num_anchors, "lr": lr, "warmup_ratio": warmup_ratio, "min_lr_ratio": min_lr_ratio,
                      "weight_decay": weight_decay, "grad_clip": grad_clip, "gamma": gamma,
                      "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                      "temperature": temperature, "mixed_precision": accelerator.mixed_precision, "seed": seed,
                      "distill_weight": distill_weight, "distill_topk": topk or None,
                      "drafter_overrides": drafter_overrides or {}},
           "parameters": sum(p.numel() for p in drafter.parameters()),
           "num_train_sequences": len(samples),
           "train_response_tokens": sum(len(s.response_ids) for s in samples),
           "sequences_seen": sequences_seen, "anchors_seen": anchors_seen,
           "regen_seconds": regen_seconds, "train_seconds": train_seconds, "loss_curve": curve,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        to_save = drafter if save_dtype is None else DFlashDrafter(drafter.config).to(save_dtype)
        if save_dtype is not None:
            to_save.load_state_dict(drafter.state_dict())
        to_save.save_pretrained(str(output_dir))
        (output_dir / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    accelerator.wait_for_everyone()

    if eval_prompts is not None and accelerator.is_main_process:
        saved = DFlashDrafter.from_pretrained(str(output_dir), dtype=torch.float32).to(device).eval()
        saved.bind_target(target)
        result = evaluate_drafter(target, saved, tokenizer, eval_prompts, output_dir / "eval_regen",
                                  block_sizes=eval_block_sizes, max_new_tokens=max_new_tokens,
                                  max_prompt_tokens=max_prompt_tokens, batch_size=regen_batch_size,
                                  prompt_field=prompt_field)
        (output_dir / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
        accelerator.print(json.dumps({b: r["tau"] for b, r in result["block_sizes"].items()}))
    drafter.float()
    return drafter


def evaluate_drafter(target, drafter: DFlashDrafter, tokenizer, prompts, out_dir: str | Path, *,
                     block_sizes: Sequence[int] = (16, 8), max_new_tokens: int = 256, max_prompt_tokens: int = 512,
                     batch_size: int = 64, prompt_field: str | None = None) -> dict:
    """τ per block size on the target's greedy continuations of `prompts`, plus their distinct-n-gram ratios.

    The continuations are cached in `out_dir` (resumable, like the training responses). distinct-n of the responses
    guards the τ: a target stuck in a repetition loop is easy to draft for and shows a low ratio.
    """
    samples = regenerate_responses(target, tokenizer, load_prompts(prompts, prompt_field), out_dir,
                                   max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                   batch_size=batch_size, temperature=0.0, desc="regenerate (eval, greedy)")
    result = acceptance_lengths(target, drafter, samples, block_sizes)
    responses = [s.response_ids for s in samples]
    result["response_tokens"] = sum(len(r) for r in responses)
    result["responses_ending_in_eos"] = sum(bool(r) and r[-1] == tokenizer.eos_token_id for r in responses)
    result["distinct_ngram_ratio"] = {str(n): distinct_ngram_ratio(responses, n) for n in (1, 2, 3, 4)}
    return result


# ------------------------------------------------------------------------------------------------------ CLI
def add_train_drafter_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `hybridspec train-drafter` (see `train_drafter` for their meaning)."""
    model = parser.add_argument_group("models")
    model.add_argument("--target", required=True, help="target model: local folder or hub id (from_pretrained)")
    model.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the target's)")
    model.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="dtype the target is loaded in (default: float32 on CPU, bfloat16 on GPU)")
    data = parser.add_argument_group("data")
    data.add_argument("--prompts", required=True, nargs="+",
                      help=".jsonl files, text files, folders of .txt/.py files or save_to_disk folders")
    data.add_argument("--prompt-field", default=None,
                      help="JSON / dataset field holding the prompt (default: prompt, text, question or instruction)")
    data.add_argument("--eval-prompts", nargs="+", default=None,
                      help="held-out prompts (same formats) for the acceptance length τ; default: no evaluation")
    data.add_argument("--eval-block-sizes", type=int, nargs="+", default=[16, 8],
                      help="block sizes at which τ is evaluated")
    data.add_argument("--max-new-tokens", type=int, default=256, help="tokens the target generates per prompt")
    data.add_argument("--max-prompt-tokens", type=int, default=512, help="prompts are left-truncated to this")
    data.add_argument("--regen-batch-size", type=int, default=64, help="prompts per batched generate() call")
    data.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (0 = greedy)")
    drafter = parser.add_argument_group("drafter")
    drafter.add_argument("--output-dir", required=True,
                         help="where the drafter, responses, training_log.json and eval.json are written")
    drafter.add_argument("--num-layers", type=int, default=None,
                         help="drafter decoder layers (default 1; with --init-drafter: its own, or more to grow it)")
    drafter.add_argument("--block-size", type=int, default=16, help="B: anchor + B-1 mask tokens per draft")
    drafter.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                         help="target layers whose outputs condition the drafter (default: spread over the depth; "
                              "with --init-drafter: more layers than its own widen it)")
    drafter.add_argument("--mask-token-id", type=int, default=None,
                         help="mask token id (default: the tokenizer's mask token, else the last vocabulary row)")
    drafter.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: 3 × hidden)")
    drafter.add_argument("--init-drafter", default=None, help="saved drafter to continue training from")
    drafter.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                         help="dtype of the saved weights (default: as trained, float32)")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=1000, help="optimizer steps (an upper bound with --time-budget-s)")
    train.add_argument("--time-budget-s", type=float, default=None,
                       help="train for this many seconds (the lr schedule follows the clock); --steps caps it")
    train.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    train.add_argument("--num-anchors", type=int, default=64, help="anchor blocks per sequence (one forward)")
    train.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    train.add_argument("--warmup-ratio", type=float, default=0.04, help="fraction of the steps in linear warm-up")
    train.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay of matrices")
    train.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    train.add_argument("--gamma", type=float, default=None,
                       help="loss decay over block positions (default: 7 / 5 / 4 for B = 16 / 10 / 8, else B/2)")
    train.add_argument("--distill-weight", type=float, default=0.0,
                       help="share of the loss on the target's next-token distribution (top-k) instead of the "
                            "response token (default 0: the response tokens alone)")
    train.add_argument("--distill-topk", type=int, default=32,
                       help="target probabilities kept per position for --distill-weight")
    train.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                       help="accelerate's mixed precision (default: bf16 on GPU, no on CPU)")
    train.add_argument("--cache-features", action=argparse.BooleanOptionalAction, default=None,
                       help="keep the target's features of all sequences in memory (default: on GPU if they fit)")
    train.add_argument("--log-every", type=int, default=50, help="steps between JSON log lines")
    train.add_argument("--seed", type=int, default=0, help="seed of sampling, anchors and initialisation")
    return parser


def run_train_drafter(args: argparse.Namespace) -> DFlashDrafter:
    """Run `train_drafter` from parsed `add_train_drafter_arguments` arguments."""
    def dtype(name):
        return getattr(torch, name) if name else None

    overrides = {"intermediate_size": args.intermediate_size} if args.intermediate_size else None
    return train_drafter(
        args.target, args.prompts, args.output_dir, tokenizer=args.tokenizer, num_layers=args.num_layers,
        block_size=args.block_size, steps=args.steps, time_budget_s=args.time_budget_s,
        target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id, drafter_overrides=overrides,
        batch_size=args.batch_size, num_anchors=args.num_anchors, lr=args.lr, warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, gamma=args.gamma,
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        regen_batch_size=args.regen_batch_size, temperature=args.temperature, eval_prompts=args.eval_prompts,
        eval_block_sizes=args.eval_block_sizes, prompt_field=args.prompt_field,
        target_dtype=dtype(args.target_dtype), save_dtype=dtype(args.save_dtype),
        mixed_precision=args.mixed_precision, cache_features=args.cache_features, init_drafter=args.init_drafter,
        distill_weight=args.distill_weight, distill_topk=args.distill_topk, log_every=args.log_every,
        seed=args.seed)


__all__ = [
    "Sample",
    "acceptance_lengths",
    "add_train_drafter_arguments",
    "load_target",
    "capture_layer_outputs",
    "distinct_ngram_ratio",
    "evaluate_drafter",
    "load_prompts",
    "regenerate_responses",
    "run_train_drafter",
    "target_features",
    "train_drafter",
    "widen_features",
]
