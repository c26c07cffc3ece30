"""Where a resident round's kernels come from: aten ops (≈ kernels on CUDA) per module of one plain step and of one
max-shape speculative round, counted eagerly (what the graphs replay), views excluded. Guides the fusion work
(issue 12): every op counted here outside a GEMM is a small kernel the graph launches.

    python benchmarks/op_census.py --model qwen35_35b_a3b --layers 4     # on the H200 (bf16, our kernels)
    python benchmarks/op_census.py --model tiny                          # CPU (torch paths: other kernels)
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import build  # noqa: E402

from hybridspec_hf import HybridSpecConfig  # noqa: E402

VIEWS = {"view", "_unsafe_view", "t", "unsqueeze", "squeeze", "expand", "slice", "select", "transpose", "permute",
         "reshape", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind", "empty", "empty_like",
         "lift_fresh", "promote_types", "_reshape_alias", "empty_strided"}


class Census(TorchDispatchMode):
    """Counts non-view aten ops under the innermost module on `stack`."""

    def __init__(self, stack):
        super().__init__()
        self.stack, self.ops = stack, collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[self.stack[-1]][name] += 1
        return func(*args, **(kwargs or {}))


def census(model, drafter, fn) -> dict:
    stack, handles = ["(round code)"], []
    # not the shared expert's modules: a hook there makes the fused MoE block run transformers' forward
    # (patches/_moe.py), so its ops count under N.mlp. Triton launches are no aten ops: they are not counted.
    modules = [(name, m) for name, m in model.named_modules()
               if "layers." in name and name.count(".") <= 5 and "shared_expert" not in name]
    if drafter is not None:
        modules += [(f"drafter.{name}", m) for name, m in drafter.named_modules() if name and name.count(".") <= 1]
    for name, module in modules:
        parts = name.split(".")
        short = ".".join("N" if p.isdigit() else p for p in (parts[2:] if parts[0] == "model" else parts))
        handles.append(module.register_forward_pre_hook(lambda m, a, s=short: stack.append(s) and None))
        handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    mode = Census(stack)
    try:
        with mode:
            fn()
    finally:
        for handle in handles:
            handle.remove()
    rows = {k: {"ops": sum(v.values()), "top": dict(v.most_common(10))} for k, v in mode.ops.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ops"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = build(args.model, args.layers, device)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, 64), device=device)
    report = {}
    for strategy, graph in (("ar", "_step"), ("hybridspec", "_spec")):
        target.generate(prompt, max_new_tokens=24, do_sample=False, generation_strategy=strategy,
                        assistant_model=drafter if strategy != "ar" else None,
                        hybridspec_config=HybridSpecConfig(cuda_graphs="on", static_length=4))
        rounds = target.__dict__["_hybridspec_resident"]
        report[strategy] = census(target, drafter, getattr(rounds, graph))
        total = sum(v["ops"] for v in report[strategy].values())
        print(f"== {strategy} ({graph}): {total} ops, {args.layers} layers")
        for module, row in report[strategy].items():
            print(f"{row['ops']:6d}  {module:45s} {row['top']}")
    if args.out:
        from common import environment

        payload = {"environment": environment(), "weights": "random", "layers": args.layers, "census": report}
        Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
