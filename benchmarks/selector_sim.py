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
first round drafts; a speculative round decides the next before it observes itself; a plain stretch is decided at its
first step by `plain_run`), each call starting the profile at another row (every 37th, as batch.py's repeated calls;
e2e.py starts every call at row 0, shown as "row 0"), with batch.py's C_N(w) and C_ar,N of each batch size as one
stream (--rows: the batch's rows, one shared w). Variants
of the draft decision's evidence (`trust_tokens`: 0 = the emitted tokens alone) and never plain (`allow_ar=False`).
× AR: the call's time of AR steps over its simulated time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_results  # noqa: E402
from e2e import length_choice_bound, profile_halves  # noqa: E402

from hybridspec_hf.selector.latency import LatencyModel  # noqa: E402
from hybridspec_hf.selector.length import batch_row_tokens  # noqa: E402
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


CALL_VARIANTS = {  # name: selector options
    "default (emitted tokens alone, trust_tokens 0)": {},
    "trust_tokens 4": {"trust_tokens": 4.0},
    "trust_tokens 8": {"trust_tokens": 8.0},
    "never plain": {"allow_ar": False},
}


def simulate_call(selector, latency: LatencyModel, replay, estimator, start_row: int, tokens: int,
                  rows: int = 1, progress: str = "spread") -> tuple:
    """One call of `rows` batch rows from the profile's row start_row (row b from start_row + b·R/rows, as the
    resident rounds replay it): (× AR, speculative rounds). A batch shares one w, chosen from the live rows' mean
    survival (RoundStrategy.choose_rows); each row makes its own progress, a row that has its `tokens` stops (it takes
    no profile rows) but the batch's rounds cost C_N(w) until the last row is done, as the resident rounds' inert
    rows. The selector observes per round `progress`: "spread" (the live rows' mean tokens discounted for their
    spread, selector.batch_row_tokens: the resident rounds' rule) or "mean" (the mean tokens per live row, the rule
    before run 56). A selector with evidence from the calls before (HybridSpec.restart) opens with a deciding plain
    step, as the resident rounds do."""
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
            weight = live.float().view(-1, 1)
            survival = (estimator.survival(signals) * weight).sum(0, keepdim=True) / weight.sum()
            w = int(selector.choose(survival, context, torch.tensor([block])).reshape(-1)[0])
            w = max(1, min(w, block))
            gained = torch.minimum((replay.accepted[i] + 1).clamp(max=w).float(), tokens - made) * live
            draft_next = bool(selector.should_draft(context).reshape(-1)[0])  # before it observes itself
            if progress == "mean":
                observed = float(gained.sum() / live.sum())
            else:
                observed = float(batch_row_tokens(gained, live.long(), tokens - made))
            made = made + gained
            selector.observe(torch.tensor([w]), torch.tensor([observed]), None, True)
            seconds, spec = seconds + float(cost[w - 1]), spec + 1
        else:
            plain_left = int(selector.plain_run(context).reshape(-1)[0]) if plain_left == 0 else plain_left - 1
            draft_next = plain_left <= 0
            seconds, made = seconds + cost_ar, made + live.float()
    return (tokens - 1) * cost_ar / seconds, spec


def main_calls(args) -> None:
    source = json.loads(Path(args.batch_latency).read_text())
    tables = source["latency_ms"]
    report = {"latency_source": args.batch_latency, "tokens": args.tokens, "calls": args.calls, "rows": args.rows,
              "results": {}}
    how = "its N rows, one shared w" if args.rows else "one stream"
    lines = [f"{args.calls} calls of {args.tokens} tokens per profile and batch size ({how} with the batch's "
             f"C_N(w)), from {args.batch_latency}; each cell: mean × AR over calls from every 37th row / at row 0 "
             "(3 calls), speculative rounds per call.", "",
             "| batch | profile | " + " | ".join(CALL_VARIANTS) + " |", "|---|---|" + "---|" * len(CALL_VARIANTS)]
    for batch, table in tables.items():
        latency = latency_from_ms(table["cost"], table["cost_ar"], source["context"])
        for name in args.profiles.split(","):
            _, replay, _, estimator = profile_halves(name)
            cells = {}
            for variant, options in CALL_VARIANTS.items():
                selector = make_selector("nominal", {"latency_model": latency, **options})
                selector.reset()
                rows = int(batch) if args.rows else 1
                spread = [simulate_call(selector, latency, replay, estimator, 37 * c, args.tokens, rows)
                          for c in range(args.calls)]
                row0 = [simulate_call(selector, latency, replay, estimator, 0, args.tokens, rows) for _ in range(3)]
                cells[variant] = {"x_ar": sum(r[0] for r in spread) / len(spread),
                                  "x_ar_min": min(r[0] for r in spread),
                                  "spec_rounds": sum(r[1] for r in spread) / len(spread),
                                  "x_ar_row0": sum(r[0] for r in row0) / len(row0)}
            report["results"][f"{batch} / {name}"] = cells
            lines.append(f"| {batch} | {name} | " + " | ".join(
                f"{c['x_ar']:.3f} / {c['x_ar_row0']:.3f} ({c['spec_rounds']:.1f})" for c in cells.values()) + " |")
    payload = {"title": "HybridSpec's draft decision over whole calls, simulated with measured C_N(w)",
               "environment": environment(), **report, "notes": __doc__.split("\n\n")[3]}
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", help="an e2e results JSON (its calibrated latency tables)")
    parser.add_argument("--batch-latency", help="calls mode: a batch.py results JSON (its C_N(w) tables)")
    parser.add_argument("--calls", type=int, default=0, help="calls mode: calls per profile and batch size")
    parser.add_argument("--tokens", type=int, default=128, help="calls mode: tokens per call")
    parser.add_argument("--rows", action="store_true",
                        help="calls mode: a batch size's calls run its rows (each its own profile rows, one shared w "
                             "from their mean survival, the mean tokens per row observed) instead of one stream")
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
    tables = json.loads(Path(args.latency).read_text())["latency"]
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
