"""AR vs every verification strategy on the shipped tiny trained pair, CPU, batch 1, greedy, side by side.

Trained weights (hybridspec_hf.load_tiny_pair), held-out stdlib prompts (files never trained on), real acceptance
and real routing. Reports tokens/s, speedup over AR, τ, mean w, and whether the text equals AR's.

The strategies that choose w from estimates run with context lookup (HybridSpecConfig(context_lookup="auto"), the
shipped pair's table); `hybridspec_lookup_off` is HybridSpec without it, beside them, and `hybridspec_table_only`
HybridSpec rating each copy by its table alone (λ = 1: without the drafter's rating of the copied tokens) where the
shipped table mixes the two.

`--strategies ...,prompt_lookup` adds transformers' own speculative decoding that needs no drafter (prompt lookup,
`prompt_lookup_num_tokens=--lookup-tokens`), which runs on these targets from transformers 5.25 on (it keeps a GDN
state per drafted token); on older versions, which refuse it, the row is left out with a note.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import transformers
from common import environment, tiny_pair_setup, write_results

import hybridspec_hf
from hybridspec_hf.selector import make_selector
from hybridspec_hf.selector.lookup import LookupEstimator

STRATEGIES = ["dflash", "static", "confidence", "ratio", "nominal", "hybridspec"]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=None, help="override the drafter's block size")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every (prompt, strategy), interleaved; per-prompt seconds are their median")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated, besides AR (and 'prompt_lookup': transformers' own, no drafter)")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of 'prompt_lookup'")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="also HybridSpec with these selector options (an A/B), e.g. "
                             "'calibrated={\"draft_price\": \"calibrated\"}'; repeatable")
    parser.add_argument("--name", default="strategies_cpu_tiny_pair")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, prompts, latency, settings = tiny_pair_setup(args.prompts, args.block_size)
    names = args.strategies.split(",")
    stock = {}  # transformers' own speculative decoding: no telemetry, and only where it runs on these targets
    left_out = {}  # strategy asked for -> why it has no row (in the results file too)
    if "prompt_lookup" in names:
        names.remove("prompt_lookup")
        if getattr(type(target), "_is_stateful", False):
            left_out["prompt_lookup"] = (f"transformers {transformers.__version__} refuses assisted decoding for "
                                         "stateful targets (5.25 and later run it)")
            print(f"prompt_lookup left out: {left_out['prompt_lookup']}")
        else:
            stock["prompt_lookup"] = dict(prompt_lookup_num_tokens=args.lookup_tokens)
    runs = {"ar": {}} | {s: dict(assistant_model=drafter, generation_strategy=s, hybridspec_config=settings)
                         for s in names} | stock
    if "hybridspec" in names and drafter.lookup_estimator is not None:  # context lookup's share, side by side
        runs["hybridspec_lookup_off"] = dict(assistant_model=drafter, generation_strategy="hybridspec",
                                             hybridspec_config=dataclasses.replace(settings, context_lookup="off"))
        table = drafter.lookup_estimator
        if table.table_weight < 1.0:  # the copy rated by its table alone (the drafter's rating of it left out)
            alone = LookupEstimator(table.table, table.min_ngram, table.max_ngram, table_weight=1.0)
            runs["hybridspec_table_only"] = dict(assistant_model=drafter, generation_strategy="hybridspec",
                                                 hybridspec_config=dataclasses.replace(settings,
                                                                                       lookup_estimator=alone))
    for spec in args.variant:  # HybridSpec with other selector options (its own selector object)
        name, _, options = spec.partition("=")
        selector = make_selector("hybridspec", {"latency_model": latency, **json.loads(options)})
        runs[f"hybridspec_{name}"] = dict(assistant_model=drafter, generation_strategy="hybridspec",
                                          hybridspec_config=dataclasses.replace(settings, selector=selector))
    for kwargs in runs.values():  # warm-up
        target.generate(prompts[0], do_sample=False, max_new_tokens=16, **kwargs)
    rows = {name: {"seconds": [], "tokens": [], "tau": [], "w": [], "identical": [], "runs_s": []} for name in runs}
    reference = {}
    for index, prompt in enumerate(prompts):
        runs_s, first = {name: [] for name in runs}, {}
        for repeat in range(args.repeats):
            for name, kwargs in runs.items():  # interleaved so drift hits every strategy alike
                start = time.perf_counter()
                out = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens, **kwargs)
                runs_s[name].append(time.perf_counter() - start)
                if repeat:  # the timing only (greedy: the same tokens every time)
                    if not torch.equal(out, first[name]):
                        raise RuntimeError(f"{name}: prompt {index} gave other tokens in repeat {repeat}")
                    continue
                first[name] = out
                row = rows[name]
                row["tokens"].append(out.shape[1] - prompt.shape[1])
                if name == "ar":
                    reference[index] = out
                    continue
                row["identical"].append(bool(torch.equal(out, reference[index])))
                if name not in stock:  # transformers' own decoding keeps no telemetry
                    telemetry = hybridspec_hf.get_telemetry(target)
                    row["tau"].append(telemetry.mean_emitted)
                    row["w"].append(telemetry.mean_verified)
                    copied = [r.lookup for r in telemetry.rounds if r.lookup is not None]
                    row.setdefault("lookup_share", []).append(sum(copied) / len(copied) if copied else 0.0)
        for name, seconds in runs_s.items():
            rows[name]["seconds"].append(statistics.median(seconds))
            rows[name]["runs_s"].append(seconds)
    ar_rate = sum(rows["ar"]["tokens"]) / sum(rows["ar"]["seconds"])
    summary = {}
    for name, row in rows.items():
        rate = sum(row["tokens"]) / sum(row["seconds"])
        summary[name] = {
            "tokens_per_s": rate,
            "speedup_vs_ar": rate / ar_rate,
            "tau": statistics.mean(row["tau"]) if row["tau"] else None if name in stock else 1.0,  # stock: unknown
            "mean_w": statistics.mean(row["w"]) if row["w"] else None if name in stock else 1.0,
            "identical_to_ar": all(row["identical"]) if row["identical"] else True,
            # drafted rounds that verified the context-lookup proposal (mean over prompts); None: no lookup
            "lookup_share": statistics.mean(row["lookup_share"]) if row.get("lookup_share") else None,
        }
        ratios = [ar / seconds for ar, seconds in zip(rows["ar"]["seconds"], row["seconds"], strict=True)]
        summary[name] |= {"per_prompt_median": statistics.median(ratios), "per_prompt_min": min(ratios),
                          "prompts_below_0.97": sum(r < 0.97 for r in ratios)}
    lines = ["| strategy | tokens/s | speedup vs AR | per prompt: median / min / below 0.97× | τ (tokens/round) | "
             "mean w | rounds verifying a copy | identical to AR |", "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {s['speedup_vs_ar']:.2f}× | "
                     f"{s['per_prompt_median']:.2f}× / {s['per_prompt_min']:.2f}× / {s['prompts_below_0.97']} | "
                     f"{_cell(s['tau'])} | {_cell(s['mean_w'])} | {_cell(s['lookup_share'])} | "
                     f"{s['identical_to_ar']} |")
    payload = {
        "title": "Verification strategies on the tiny trained pair (CPU)",
        "notes": ("Trained weights (shipped tiny qwen3_5_moe target + DFlash drafter); held-out stdlib prompts; "
                  "real acceptance and routing; greedy; batch 1; one process, strategies interleaved per prompt. "
                  "C(w) calibrated in the same run; each (prompt, strategy) timed --repeats times, interleaved, its median "
                  "kept (runs_s: every time); per-prompt seconds, tokens, τ and w (first run) in the JSON."),
        "environment": environment(),
        "settings": vars(args),
        "latency_ms": [float(c) * 1e3 for c in latency.cost[0]],
        "latency_ar_ms": float(latency.cost_ar.reshape(-1)[0]) * 1e3,
        "summary": summary,
        "per_prompt": rows,
    }
    lines += [f"\n{name} left out: {why}." for name, why in left_out.items()]
    payload["left_out"] = left_out
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
