"""What a GPU-resident call's rounds launch, kernel by kernel, per strategy: where HybridSpec's drafted round spends
the time vanilla DFlash's does not (issue 11: on the tiny pair its rounds cost ≈ 0.59 ms against DFlash's 0.52).

    python benchmarks/round_kernels.py                       # on the H200 (≈ 150 s): the shipped tiny pair in bf16
    python benchmarks/round_kernels.py --strategies dflash,hybridspec,hybridspec-round-end,nominal --prompts 4

Each strategy runs one untimed call (captures its graphs; HybridSpec calibrates once), then --prompts calls under
torch.profiler (CUDA activity: the kernels its graphs replay). Per call: rounds (drafted / plain), kernels and their
GPU-busy µs, by kernel name. Each call's prefill and set-up are taken out (the kernels of a 1-token
call of the same prompt subtracted). A strategy's drafted round is its call less its plain steps, each priced as AR's
step (AR's call per plain step): (call − plain × AR step) / drafted rounds. The decide-step's own work (the first plain
step after a drafted round chooses how many follow) lands in the drafted rounds' share. Trained weights (the
shipped tiny pair), held-out stdlib prompts, real acceptance and routing, greedy. Under the profiler the rounds
run slower and their kernels read longer (run 92: DFlash's drafted round 0.89 ms of wall against 0.52 unprofiled):
compare counts and µs between strategies of one run, not with unprofiled timings.
Writes benchmarks/results/round_kernels.{json,md} (or --name).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, method_variant, traced_kernels, variant_switches, write_results  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import HybridSpecConfig  # noqa: E402


def kernel_groups(kernels: list[dict]) -> dict[str, list[float]]:
    """`common.traced_kernels`' records by name (template arguments cut): µs each."""
    groups: dict[str, list[float]] = {}
    for kernel in kernels:
        groups.setdefault(kernel["name"].split("<")[0][:70], []).append(kernel["us"])
    return groups


def per_round(call: dict[str, dict], ar_step: dict[str, dict], plain: float, drafted: float) -> dict[str, dict]:
    """A drafted round's kernels by name: (call − plain × AR's step) / drafted (counts and µs)."""
    names = set(call) | set(ar_step)
    out = {}
    for name in names:
        have = call.get(name, {"count": 0.0, "us": 0.0})
        step = ar_step.get(name, {"count": 0.0, "us": 0.0})
        count = (have["count"] - plain * step["count"]) / drafted
        us = (have["us"] - plain * step["us"]) / drafted
        if abs(count) > 1e-6 or abs(us) > 1e-3:
            out[name] = {"count": count, "us": us}
    return out


def profile_calls(target, drafter, strategy: str, prompts: list[torch.Tensor], tokens: int) -> dict:
    """Mean per call over the prompts, its prefill and set-up taken out (a 1-token call's kernels subtracted): rounds,
    kernels by name (count, µs), the decode loop's wall ms."""
    settings = dict(do_sample=False, max_new_tokens=tokens, assistant_model=drafter, generation_strategy=strategy,
                    hybridspec_config=HybridSpecConfig())
    target.generate(prompts[0], **settings)  # captures (and calibrates) outside the profile
    totals: dict[str, dict] = {}
    drafted = plain = tokens_out = decode_ms = 0.0
    for prompt in prompts:
        for new_tokens, sign in ((tokens, 1.0), (1, -1.0)):  # the call less its prefill and set-up (a 1-token call)
            outputs = []
            kernels = traced_kernels(lambda: outputs.append(target.generate(prompt, **{**settings,
                                                                                    "max_new_tokens": new_tokens})), 1)
            out = outputs[0]
            for name, times in kernel_groups(kernels).items():
                entry = totals.setdefault(name, {"count": 0.0, "us": 0.0})
                entry["count"] += sign * len(times)
                entry["us"] += sign * sum(times)
            if sign > 0:
                tel = hybridspec_hf.get_telemetry(target)
                drafted += sum(r.drafted for r in tel.rounds)
                plain += sum(not r.drafted for r in tel.rounds)
                tokens_out += out.shape[1] - prompt.shape[1]
                decode_ms += sum(r.wall_s for r in tel.rounds) * 1e3
    n = len(prompts)
    kernels = {k: {"count": v["count"] / n, "us": v["us"] / n} for k, v in totals.items()}
    return {"drafted": drafted / n, "plain": plain / n, "tokens": tokens_out / n, "decode_ms": decode_ms / n,
            "kernels": kernels, "kernel_count": sum(v["count"] for v in kernels.values()),
            "gpu_us": sum(v["us"] for v in kernels.values())}


def full_length_prompts(target, tokenizer, texts: list[str], count: int, tokens: int) -> list[torch.Tensor]:
    """The first `count` prompts whose greedy continuation runs `tokens` long (no EOS before): every profiled call
    has the same number of tokens to spread over its rounds."""
    device = next(target.parameters()).device
    chosen = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
        if target.generate(ids, do_sample=False, max_new_tokens=tokens).shape[1] - ids.shape[1] == tokens:
            chosen.append(ids)
        if len(chosen) == count:
            return chosen
    raise SystemExit(f"only {len(chosen)} of {len(texts)} held-out prompts continue for {tokens} tokens without "
                     f"EOS; ask for fewer --prompts or --tokens.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="ar,dflash,hybridspec,nominal",
                        help="comma-separated; ar is always run (it prices the plain steps); a name may carry "
                             "A/B switches of common.SWITCHES, e.g. hybridspec-round-end")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts profiled per strategy")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25, help="kernel names listed per drafted round")
    parser.add_argument("--name", default="round_kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("round_kernels.py profiles CUDA kernels of GPU-resident rounds: it needs a CUDA device.")
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    target, drafter, tokenizer = load_tiny_pair(dtype=torch.bfloat16, device="cuda")
    prompts = full_length_prompts(target, tokenizer, heldout_prompts(8 * args.prompts), args.prompts, args.tokens)
    strategies = ["ar"] + [s for s in args.strategies.split(",") if s and s != "ar"]
    calls = {}
    for name in strategies:  # "hybridspec-round-end": a strategy with A/B switches (common.SWITCHES) set
        with method_variant(name, target) as strategy:
            calls[name] = profile_calls(target, drafter, strategy, prompts, args.tokens)
            calls[name]["switches"] = variant_switches(name)
    ar = calls["ar"]
    ar_step = {k: {"count": v["count"] / ar["plain"], "us": v["us"] / ar["plain"]} for k, v in ar["kernels"].items()}
    lines = ["| strategy | drafted rounds / plain steps per call | tokens | decode ms | kernels per call (no prefill) | "
             "GPU-busy µs per call | per drafted round: kernels | GPU-busy µs | decode wall µs (rounds' wall less plain × AR's) |",
             "|---|---|---|---|---|---|---|---|---|"]
    rounds: dict[str, dict] = {}
    ar_wall_us = ar["decode_ms"] * 1e3 / ar["plain"]
    for s, c in calls.items():
        if s == "ar":
            lines.append(f"| ar | 0 / {c['plain']:.1f} | {c['tokens']:.0f} | {c['decode_ms']:.2f} | "
                         f"{c['kernel_count']:.0f} | {c['gpu_us']:.0f} | per step: {c['kernel_count'] / c['plain']:.1f}"
                         f" | {c['gpu_us'] / c['plain']:.1f} | {ar_wall_us:.1f} |")
            continue
        if c["drafted"] == 0:
            lines.append(f"| {s} | 0 / {c['plain']:.1f} | {c['tokens']:.0f} | {c['decode_ms']:.2f} | "
                         f"{c['kernel_count']:.0f} | {c['gpu_us']:.0f} | – | – | – |")
            continue
        rounds[s] = per_round(c["kernels"], ar_step, c["plain"], c["drafted"])
        wall = (c["decode_ms"] * 1e3 - c["plain"] * ar_wall_us) / c["drafted"]
        lines.append(f"| {s} | {c['drafted']:.1f} / {c['plain']:.1f} | {c['tokens']:.0f} | {c['decode_ms']:.2f} | "
                     f"{c['kernel_count']:.0f} | {c['gpu_us']:.0f} | "
                     f"{sum(v['count'] for v in rounds[s].values()):.1f} | {sum(v['us'] for v in rounds[s].values()):.1f}"
                     f" | {wall:.1f} |")
    base = "dflash" if "dflash" in rounds else None
    for s, kernels in rounds.items():
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[: args.top]
        lines += ["", f"{s}: a drafted round's kernels by GPU-busy µs (top {args.top})"
                  + (f", against {base}'s" if base and s != base else ""), ""]
        if base and s != base:
            lines += ["| kernel | count | µs | dflash count | dflash µs |", "|---|---|---|---|---|"]
            for name, v in ranked:
                d = rounds[base].get(name, {"count": 0.0, "us": 0.0})
                lines.append(f"| {name} | {v['count']:.2f} | {v['us']:.1f} | {d['count']:.2f} | {d['us']:.1f} |")
            extra = {k: v for k, v in kernels.items() if k not in rounds[base]}
            lines.append(f"\nNames {s}'s rounds launch and {base}'s do not: {len(extra)}, "
                         f"{sum(v['count'] for v in extra.values()):.1f} launches, "
                         f"{sum(v['us'] for v in extra.values()):.1f} µs per drafted round.")
        else:
            lines += ["| kernel | count | µs |", "|---|---|---|"]
            lines += [f"| {name} | {v['count']:.2f} | {v['us']:.1f} |" for name, v in ranked]
    table = "\n".join(lines)
    payload = {"title": "Kernels of GPU-resident rounds per strategy (tiny pair, bf16)", "environment": environment(),
               "calls": calls, "drafted_round": rounds,
               "ar_step": ar_step, "notes": __doc__.split("\n\n")[2].replace("\n", " ")}
    write_results(args.name, payload, table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
