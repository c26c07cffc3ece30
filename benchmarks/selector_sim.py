"""The length selectors on a declared profile with a given round cost C(w), simulated on the CPU (no model).

    python benchmarks/selector_sim.py --latency benchmarks/results/e2e_qwen35_35b_a3b_run22.json

Each round replays the next profile row, as e2e.py's timing mode does: the selector sees the row's draft signals (its
acceptance estimator fitted on the profile's other half), chooses w, and min(a, w - 1) + 1 tokens are emitted, where
a is the row's accepted length with the whole block verified; the round costs C(w) of the latency model (a plain step
C_ar), and that cost is what the selector observes as the round's time. No routing correction (no experts here), so
"hybridspec" runs as "nominal". Variants of the plain-decoding rule (`draft_forgetting`, `probe_every`, `allow_ar`)
show how often it steps plain where drafting pays. Also the length-choice bound of e2e.py (an oracle that verifies
exactly a + 1 tokens). Writes benchmarks/results/<name>.{json,md}. Simulated: no GPU, no model; the C(w) are measured
ones (named in the output).

    python benchmarks/selector_sim.py --calls 40 --batch-latency benchmarks/results/batch_qwen35_35b_a3b_run40.json

Calls mode: whole generate() calls of --tokens tokens as the GPU-resident rounds take their decisions (the call's
first round drafts unless the evidence carried from the calls before decides it; a speculative round decides the
next before it observes itself; a plain stretch is decided at its first step by `plain_run`), in --calls cells as
batch.py runs them (fresh rounds, 3 timed calls from every 37th row, each after a 16-token warm-up call on another
stretch of the profile), with batch.py's C_N(w) and C_ar,N of each batch size as one stream (--rows: the batch's
rows, each with its own progress, one shared w; the call waits for its last row). Variants of the draft decision:
the carried evidence off, the rule before run 56 (mean tokens per row, no carry), the rows' spread discounted at the
round (runs 57-64), trust in the drafts' G(w), never plain (`allow_ar=False`); all of them decide at the plain step's
rate (the current rule). × AR: the call's time of AR steps over its simulated time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, read_json, write_results  # noqa: E402
from e2e import length_choice_bound, profile_halves  # noqa: E402

from hybridspec_hf.selector.latency import LatencyModel  # noqa: E402
from hybridspec_hf.selector.length import batch_row_stats, batch_row_tokens, batch_rows_left  # noqa: E402
from hybridspec_hf.selector.length_rules import make_selector  # noqa: E402

VARIANTS = {  # name: (strategy, selector options)
    "dflash": ("dflash", {}),
    "ratio": ("ratio", {}),
    "nominal (default: draft_forgetting 0.95, probe every 16)": ("nominal", {}),
    "nominal, draft_forgetting 0.9 (the default before)": ("nominal", {"draft_forgetting": 0.9}),
    "nominal, draft_forgetting 0.9, probe every 4": ("nominal", {"draft_forgetting": 0.9, "probe_every": 4}),
    "nominal, probe every 4": ("nominal", {"probe_every": 4}),
    "nominal, never plain": ("nominal", {"allow_ar": False}),
}


def simulate(strategy: str, options: dict, latency: LatencyModel, replay, estimator, rounds: int) -> dict:
    block = latency.block_size
    cost, cost_ar = latency.cost[0].double(), float(latency.cost_ar[0])
    selector = None if strategy == "dflash" else make_selector(strategy, {"latency_model": latency, **options})
    if selector is not None:
        selector.reset()
    context = int(latency.context_lens[0])
    tokens = seconds = 0.0
    plain = row = 0
    draft = True
    for _ in range(rounds):
        if selector is not None and hasattr(selector, "should_draft"):
            draft = bool(selector.should_draft(context).reshape(-1)[0])
        if draft:
            i = row % replay.accepted.shape[0]
            row += 1
            signals = {k: getattr(replay, k)[i : i + 1] for k in ("top1", "margin", "entropy")}
            if selector is None:
                w = block
            else:
                w = int(selector.choose(estimator.survival(signals), context, block).reshape(-1)[0])
                w = max(1, min(w, block))
            emitted = min(int(replay.accepted[i]), w - 1) + 1
            spent = float(cost[w - 1])
        else:
            w, emitted, spent = 1, 1, cost_ar
            plain += 1
        if selector is not None and hasattr(selector, "observe"):
            selector.observe(torch.tensor([w]), torch.tensor([emitted]), spent, draft)
        tokens += emitted
        seconds += spent
        context += emitted
    return {"tokens_per_s": tokens / seconds, "tau": tokens / rounds, "plain_steps": plain, "rounds": rounds}


def latency_from_ms(cost_ms: list[float], cost_ar_ms: float, context: int) -> LatencyModel:
    """A one-context latency model from a results file's C(w) and C_ar in milliseconds."""
    return LatencyModel(cost=torch.tensor(cost_ms)[None] * 1e-3, cost_ar=torch.tensor([cost_ar_ms]) * 1e-3,
                        context_lens=torch.tensor([context]))


CALL_VARIANTS = {  # name: (selector options, what a batch round observes: simulate_call's `progress`)
    "default": ({}, "spread"),
    "no carry (carry_rounds 0)": ({"carry_rounds": 0.0}, "spread"),
    "before run 56 (mean per row, no carry, probe share 1 %)": ({"carry_rounds": 0.0, "hopeful_share": 0.01}, "mean"),
    "discount at the round (runs 57-64)": ({}, "spread at the round"),
    "trust_tokens 4": ({"trust_tokens": 4.0}, "spread"),
    "never plain": ({"allow_ar": False}, "spread"),
    "explore 0.25": ({"explore": 0.25}, "spread"),
    "explore 0.5": ({"explore": 0.5}, "spread"),
    "probe_price gross (before 2026-12-04 evening)": ({"probe_price": "gross"}, "spread"),
}
WARMUP_TOKENS = 16  # batch.py's warm-up call before each timed call
REPEATS = 3  # batch.py --repeats 3: timed calls per cell


def simulate_call(selector, latency: LatencyModel, replay, estimator, start_row: int, tokens: int,
                  rows: int = 1, progress: str = "spread") -> tuple:
    """One call of `rows` batch rows from the profile's row start_row (row b from start_row + b·R/rows, as the
    resident rounds replay it): (× AR, speculative rounds). A batch shares one w, chosen from the live rows' mean
    survival (RoundStrategy.choose_rows); each row makes its own progress, a row that has its `tokens` stops (it takes
    no profile rows) but the batch's rounds cost C_N(w) until the last row is done, as the resident rounds' inert
    rows. The selector observes per round `progress`: "spread" (the live rows' mean tokens discounted for their
    spread: selector.batch_row_stats and batch_state, the resident rounds' rule: the selector discounts for the
    spread at each decision's batch), "spread at the round" (the tokens discounted at the round's own batch and
    carried so, the rule of runs 57-64, with G(w) undiscounted as in runs 57-61) or "mean" (the mean tokens per live
    row, the rule before run 56). A selector with evidence from the calls before (HybridSpec.restart) opens with a
    deciding plain step, as the resident rounds do."""
    cost, cost_ar, block = latency.cost[0].double(), float(latency.cost_ar[0]), latency.block_size
    context = latency.context_lens[:1].long()
    selector.restart(context)
    stride = max(1, replay.accepted.shape[0] // rows)
    row = torch.arange(rows) * stride + start_row
    made = torch.ones(rows)  # each row's tokens so far (the prefill's first)
    # as the resident rounds: with evidence kept from the calls before, a deciding plain step opens the call
    draft_next = not bool(selector.informed().all())
    seconds, spec, plain_left = 0.0, 0, 0
    while bool((made < tokens).any()):
        live = made < tokens
        if draft_next:
            i = row % replay.accepted.shape[0]
            row = row + live.long()
            signals = {k: getattr(replay, k)[i] for k in ("top1", "margin", "entropy")}
            if progress == "spread":  # as the resident rounds' _draft: the batch the round's decisions are for
                selector.batch_state(*batch_rows_left(live.long(), tokens - made))
            weight = live.float().view(-1, 1)
            survival = (estimator.survival(signals) * weight).sum(0, keepdim=True) / weight.sum()
            w = int(selector.choose(survival, context, torch.tensor([block])).reshape(-1)[0])
            w = max(1, min(w, block))
            gained = torch.minimum((replay.accepted[i] + 1).clamp(max=w).float(), tokens - made) * live
            draft_next = bool(selector.should_draft(context).reshape(-1)[0])  # before it observes itself
            mean, spread = batch_row_stats(gained, live.long())
            if progress == "spread":
                selector.observe(torch.tensor([w]), mean, None, True, spread)
            elif progress == "mean":
                selector.observe(torch.tensor([w]), mean, None, True)
            else:  # "spread at the round": discounted at the round's own batch, the rule of runs 57-64
                selector.observe(torch.tensor([w]), batch_row_tokens(gained, live.long(), tokens - made), None, True)
            made = made + gained
            seconds, spec = seconds + float(cost[w - 1]), spec + 1
        else:
            if plain_left == 0:
                if progress == "spread":  # the deciding plain step's batch, before its token
                    selector.batch_state(*batch_rows_left(live.long(), tokens - made))
                plain_left = int(selector.plain_run(context).reshape(-1)[0])
            else:
                plain_left -= 1
            draft_next = plain_left <= 0
            seconds, made = seconds + cost_ar, made + live.float()
    return (tokens - 1) * cost_ar / seconds, spec


def simulate_cell(options: dict, progress: str, latency: LatencyModel, replay, estimator, first_row: int,
                  tokens: int, rows: int) -> list[tuple]:
    """One batch.py cell: fresh rounds (a new selector), then REPEATS timed calls r from rows first_row + 37·r, each
    after a WARMUP_TOKENS warm-up call half the profile further on (common.profile_elsewhere): the evidence HybridSpec
    carries between calls. Returns each timed call's (× AR, speculative rounds)."""
    selector = make_selector("nominal", {"latency_model": latency, **options})
    selector.reset()
    half = replay.accepted.shape[0] // 2
    calls = []
    for r in range(REPEATS):
        start = first_row + 37 * r
        simulate_call(selector, latency, replay, estimator, start + half, WARMUP_TOKENS, rows, progress)
        calls.append(simulate_call(selector, latency, replay, estimator, start, tokens, rows, progress))
    return calls


def main_calls(args) -> None:
    source = read_json(args.batch_latency)
    tables = source["latency_ms"]
    report = {"latency_source": args.batch_latency, "tokens": args.tokens, "cells": args.calls, "rows": args.rows,
              "results": {}}
    how = "its N rows, one shared w" if args.rows else "one stream"
    measured = (f"measured on the {source.get('environment', {}).get('gpu', 'GPU')} ({args.batch_latency}: "
                f"{source.get('weights', '?')} weights, {source.get('routing', '?')} routing)")
    lines = [f"Simulated on a CPU: no model, no GPU. Acceptance: the declared profiles' rows replayed (the estimator "
             f"fitted on each profile's other half); round costs: C_N(w) and C_ar,N {measured}; HybridSpec's plain "
             "step priced as AR's. Predictions for the batch table, not measurements.", "",
             f"{args.calls} cells of {REPEATS} calls of {args.tokens} tokens per profile and batch size ({how} with "
             f"the batch's C_N(w)), from {args.batch_latency}; each call after a {WARMUP_TOKENS}-token warm-up call on "
             "another stretch of the profile, as batch.py; each entry: mean × AR over the timed calls / the cells' "
             "first calls (min over calls), speculative rounds per call.", "",
             "| batch | profile | " + " | ".join(CALL_VARIANTS) + " |", "|---|---|" + "---|" * len(CALL_VARIANTS)]
    for batch, table in tables.items():
        latency = latency_from_ms(table["cost"], table["cost_ar"], source["context"])
        rows = int(batch) if args.rows else 1
        for name in args.profiles.split(","):
            _, replay, _, estimator = profile_halves(name)
            cells = {}
            for variant, (options, progress) in CALL_VARIANTS.items():
                runs = [simulate_cell(options, progress, latency, replay, estimator, 37 * REPEATS * c, args.tokens,
                                      rows) for c in range(args.calls)]
                calls = [call for run in runs for call in run]
                cells[variant] = {"x_ar": sum(x for x, _ in calls) / len(calls),
                                  "x_ar_first": sum(run[0][0] for run in runs) / len(runs),
                                  "x_ar_min": min(x for x, _ in calls),
                                  "spec_rounds": sum(n for _, n in calls) / len(calls)}
            report["results"][f"{batch} / {name}"] = cells
            lines.append(f"| {batch} | {name} | " + " | ".join(
                f"{c['x_ar']:.3f} / {c['x_ar_first']:.3f} (min {c['x_ar_min']:.2f}; {c['spec_rounds']:.1f})"
                for c in cells.values()) + " |")
            print(lines[-1], flush=True)
    payload = {"title": "HybridSpec's draft decision over whole calls, simulated with measured C_N(w)",
               "environment": environment(), **report, "notes": __doc__.split("\n\n")[4]}
    write_results(args.name, payload, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", help="an e2e results JSON (its calibrated latency tables)")
    parser.add_argument("--batch-latency", help="calls mode: a batch.py results JSON (its C_N(w) tables)")
    parser.add_argument("--calls", type=int, default=0,
                        help="calls mode: cells (of 3 timed calls each) per profile and batch size")
    parser.add_argument("--tokens", type=int, default=128, help="calls mode: tokens per call")
    parser.add_argument("--rows", action="store_true",
                        help="calls mode: a batch size's calls run its rows (each its own profile rows and progress, "
                             "one shared w from their mean survival) instead of one stream")
    parser.add_argument("--profiles", default="dflash_like,low,tiny_pair_heldout")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--name", default="selector_sim")
    args = parser.parse_args()
    if args.calls:
        if not args.batch_latency:
            parser.error("--calls needs --batch-latency (a batch.py results JSON)")
        return main_calls(args)
    if not args.latency:
        parser.error("--latency is required (or --calls with --batch-latency)")
    tables = read_json(args.latency)["latency"]
    report = {"latency_source": args.latency, "results": {}}
    lines = []
    for label, table in tables.items():
        latency = latency_from_ms(table["cost_ms"], table["cost_ar_ms"], table["context"])
        for name in args.profiles.split(","):
            _, replay, _, estimator = profile_halves(name)
            key = f"{name} / {label}"
            rows = {v: simulate(s, o, latency, replay, estimator, args.rounds) for v, (s, o) in VARIANTS.items()}
            ar = 1.0 / (table["cost_ar_ms"] * 1e-3)
            bound = length_choice_bound(latency.cost[0], float(latency.cost_ar[0]), replay.accepted)
            report["results"][key] = {"rows": rows, "ar_tokens_per_s": ar, "length_choice_bound": bound}
            lines += ["", f"### {key} (our AR {ar:.0f} tokens/s; length-choice bound {bound:.2f}× DFlash)", "",
                      "| variant | tokens/s | × AR | × DFlash | × ratio | τ | plain steps |", "|---|---|---|---|---|---|---|"]
            for variant, row in rows.items():
                lines.append(f"| {variant} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / ar:.2f} | "
                             f"{row['tokens_per_s'] / rows['dflash']['tokens_per_s']:.2f} | "
                             f"{row['tokens_per_s'] / rows['ratio']['tokens_per_s']:.2f} | {row['tau']:.2f} | "
                             f"{row['plain_steps']} / {row['rounds']} |")
    payload = {"title": "Length selectors on declared profiles, simulated with measured C(w)",
               "environment": environment(), **report, "notes": __doc__.split("\n\n")[2]}
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
