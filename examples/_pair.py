"""Shared by the example scripts: which target/drafter pair to load.

Without --target every example uses the tiny trained pair shipped in the package (CPU, offline). With --target and
--drafter (local folders or hub ids) it loads real checkpoints, e.g. Qwen/Qwen3.5-35B-A3B with
z-lab/Qwen3.5-35B-A3B-DFlash, on the GPU in bfloat16.
"""
from __future__ import annotations

import argparse

import torch

from hybridspec_hf import DFlashDrafter
from hybridspec_hf.drafter.training import load_target
from hybridspec_hf.tiny_pair import load_tiny_pair


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models (default: the shipped tiny pair on the CPU)")
    group.add_argument("--target", default=None, help="target: local folder or hub id")
    group.add_argument("--drafter", default=None, help="its DFlash drafter: local folder or hub id")
    group.add_argument("--tokenizer", default=None, help="tokenizer (default: the target's)")
    group.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    group.add_argument("--threads", type=int, default=2, help="CPU threads")


def load_pair(args: argparse.Namespace, *, with_drafter: bool = True):
    """(target, drafter, tokenizer); real checkpoints in bfloat16 on a GPU, float32 on the CPU.

    with_drafter=False: (target, None, tokenizer), for training a drafter.
    """
    torch.set_num_threads(args.threads)
    if args.target is None:
        target, drafter, tokenizer = load_tiny_pair()
        return target, drafter if with_drafter else None, tokenizer
    if with_drafter and args.drafter is None:
        raise SystemExit("--target needs --drafter (a DFlash drafter trained for it; see train_drafter.py).")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, args.tokenizer, None, device)
    if not with_drafter:
        return target, None, tokenizer
    drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=next(target.parameters()).dtype)
    return target, drafter.to(device).eval().bind_target(target), tokenizer


def encode(tokenizer, text: str, device) -> torch.Tensor:
    """Prompt ids [1, L]: through the chat template when the tokenizer has one (instruction models)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt").input_ids
    return ids.to(device)
