"""The verification strategies replayed position by position on the tiny pair's held-out text (CPU, no timing noise).

    python benchmarks/position_sim.py --record          # once: the pair's drafts at every position (≈ 5 min, CPU)
    python benchmarks/position_sim.py                   # the strategies and selector variants, simulated
    python benchmarks/position_sim.py --sequence 6      # calls in sequence through one selector (resident carry)

Greedy decoding makes a round's outcome a function of where it starts: the drafter drafts from the committed text
and the target's features of it, so the drafts a round starting after t tokens makes, and how many of them the target
accepts (the leading drafts equal to AR's next tokens), are the same whatever rounds came before. `--record` runs
every held-out prompt once with AR (its tokens, and the target's top-1 probability of each) and once with a drafted
round at every position (`ForcedLength(1)`: the drafter drafts a whole block, the anchor alone is verified) and keeps
each position's draft signals and accepted length a(t) (benchmarks/profiles/tiny_pair_positions.safetensors).

The simulation then walks each prompt's text as the eager round loop does (loop.py: a drafted round chooses w from
its drafts' survival, emits min(a(t), w − 1) + 1 tokens and decides the next round's drafting before it observes
itself; a plain step's `plain_run` decides the stretch of plain steps to come), each round costing a measured C(w)
(a drafted round: draft + verify) or C_ar (a plain step), taken from a strategies_cpu results file, and observed as
that round's time. So a strategy's speedup here is what it would make if every round cost its calibrated price:
no timing noise, which on this CPU moves a single prompt's speedup by ± 20–40 % between runs. The routing
correction is not simulated ("hybridspec" runs as "nominal"). Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, read_json, write_results  # noqa: E402

POSITIONS = Path(__file__).resolve().parent / "profiles" / "tiny_pair_positions.safetensors"
LATENCY_SOURCE = Path(__file__).resolve().parent / "results" / "strategies_cpu_tiny_pair.json"

VARIANTS = {  # name: (strategy, selector options)
    "dflash": ("dflash", {}),
    "static": ("static", {}),
    "ratio": ("ratio", {}),
    "hybridspec (default)": ("nominal", {}),
    "hybridspec, never plain": ("nominal", {"allow_ar": False}),
    "hybridspec, trust_tokens 4": ("nominal", {"trust_tokens": 4.0}),
    "hybridspec, hopeful_share 0.15": ("nominal", {"hopeful_share": 0.15}),
    "hybridspec, probe_share 0.05": ("nominal", {"probe_share": 0.05}),
    "hybridspec, probe_share 0.1": ("nominal", {"probe_share": 0.1}),
    "hybridspec, draft_forgetting 0.8": ("nominal", {"draft_forgetting": 0.8}),
    "hybridspec, explore 0.1": ("nominal", {"explore": 0.1}),
    "hybridspec, explore 0.25": ("nominal", {"explore": 0.25}),
    "hybridspec, explore 0.5": ("nominal", {"explore": 0.5}),
    "hybridspec, explore 1": ("nominal", {"explore": 1.0}),
    "hybridspec, probe_price gross": ("nominal", {"probe_price": "gross"}),
    "hybridspec, probe_price gross, explore 0.5": ("nominal", {"probe_price": "gross", "explore": 0.5}),
}


def record(args) -> None:
    """Every held-out prompt: AR's tokens and the target's top-1 probability of each; the drafts' signals and the
    accepted length of a round starting at every position."""
    from safetensors.torch import save_file

    import hybridspec_hf  # noqa: F401  (registers the strategies)
    from hybridspec_hf import HybridSpecConfig
    from hybridspec_hf.generation.calibration import ForcedLength
    from hybridspec_hf.selector import draft_signals
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_tiny_pair()
    block = drafter.config.block_size
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in heldout_prompts(args.prompts)]
    captured: list[torch.Tensor] = []
    original = drafter.draft

    def draft(*a, **k):
        logits = original(*a, **k)
        captured.append(logits.detach().float())
        return logits

    out = {k: [] for k in ("top1", "margin", "entropy", "accepted", "target_top1", "target_entropy")}
    lengths, prompt_lens = [], []
    drafter.draft = draft
    try:
        for index, prompt in enumerate(prompts):
            ar = target.generate(prompt, do_sample=False, max_new_tokens=args.tokens, output_logits=True,
                                 return_dict_in_generate=True)
            text = ar.sequences[0, prompt.shape[1]:]
            n = text.shape[0]
            logp = torch.stack(ar.logits)[:, 0].float().log_softmax(-1)  # [n, V]
            out["target_top1"].append(logp.max(-1).values.exp())
            out["target_entropy"].append(torch.special.entr(logp.exp()).sum(-1))
            captured.clear()
            forced = target.generate(prompt, do_sample=False, max_new_tokens=args.tokens, assistant_model=drafter,
                                     generation_strategy="hybridspec",
                                     hybridspec_config=HybridSpecConfig(selector=ForcedLength(1)))
            if not torch.equal(forced[0, prompt.shape[1]:], text):
                raise RuntimeError(f"prompt {index}: the forced-length run's text differs from AR's")
            rounds = target.hybridspec_telemetry.rounds
            made = 1  # the prefill's token
            signals = {k: torch.zeros(max(n - 1, 0), block - 1) for k in ("top1", "margin", "entropy")}
            accepted = torch.full((max(n - 1, 0),), -1, dtype=torch.long)
            calls = iter(captured)
            for r in rounds:
                if r.drafted:  # drafts text[made : made + block - 1] from the anchor text[made - 1]
                    logits = next(calls)
                    for k, v in draft_signals(logits).items():
                        signals[k][made - 1] = v[0]
                    drafts = logits[0].argmax(-1)
                    room = min(block - 1, n - made)
                    same = (drafts[:room] == text[made: made + room]).long()
                    accepted[made - 1] = int(same.cumprod(0).sum())
                made += r.committed
            if n > 2 and bool((accepted[: n - 2] < 0).any()):  # the last token is a plain step's (loop.py)
                raise RuntimeError(f"prompt {index}: positions without a drafted round: {(accepted < 0).nonzero()}")
            for k, v in signals.items():
                out[k].append(v)
            out["accepted"].append(accepted)
            lengths.append(n)
            prompt_lens.append(prompt.shape[1])
            print(f"prompt {index}: {n} tokens, mean a {accepted.float().mean():.2f}", flush=True)
    finally:
        drafter.__dict__.pop("draft", None)
    tensors = {k: torch.cat(v).contiguous() for k, v in out.items()}
    tensors["length"] = torch.tensor(lengths)
    tensors["prompt_len"] = torch.tensor(prompt_lens)
    meta = {"prompts": args.prompts, "tokens": args.tokens, "block_size": block, "environment": environment(),
            "command": " ".join(sys.argv)}
    POSITIONS.parent.mkdir(exist_ok=True)
    save_file(tensors, str(POSITIONS), metadata={"json": json.dumps(meta)})
    print(f"wrote {POSITIONS}")


def load_positions(path: Path = POSITIONS) -> list[dict]:
    """Per prompt: n (tokens), prompt_len, a [n-1], signals {top1, margin, entropy} [n-1, B-1], target_top1 [n]."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    prompts, start, tstart = [], 0, 0
    for n, plen in zip(t["length"].tolist(), t["prompt_len"].tolist()):
        rows = max(n - 1, 0)
        prompts.append({"n": n, "prompt_len": plen, "a": t["accepted"][start: start + rows],
                        "signals": {k: t[k][start: start + rows] for k in ("top1", "margin", "entropy")},
                        "target_top1": t["target_top1"][tstart: tstart + n]})
        start, tstart = start + rows, tstart + n
    return prompts


def walk(strategy: str, options: dict, latency, estimator, prompt: dict, warm=None, clock: list | None = None,
         clock_ar: float | None = None, opens_plain: bool = False) -> dict:
    """One call along a prompt's text as loop.py's eager rounds take it; returns its simulated seconds, rounds.

    warm: a selector to use as it stands (else a new one of `strategy`); clock, clock_ar: what a drafted round of
    each w and a plain step take (default: the latency model's prices, which every round is observed at);
    opens_plain: the call opens with a deciding plain step (resident rounds whose streams are `informed`)."""
    from hybridspec_hf.selector.length_rules import LengthSelector, make_selector

    cost, cost_ar = latency.cost[0].double().tolist(), float(latency.cost_ar[0])
    clock = cost if clock is None else clock
    clock_ar = cost_ar if clock_ar is None else clock_ar
    block = latency.block_size
    selector = warm if warm is not None else make_selector(
        strategy, {"latency_model": latency, **options} if strategy not in ("dflash", "static") else options)
    if warm is None:
        selector.reset()
    context = torch.tensor([prompt["prompt_len"]])
    takes_plain = type(selector).should_draft is not LengthSelector.should_draft  # RoundStrategy's test
    n, made, seconds, drafted_rounds, rounds = prompt["n"], 1, 0.0, 0, 0
    draft_next, plain_left = not opens_plain, 0
    ws = []
    while made < n:
        left = n - made
        rounds += 1
        if draft_next and left > 1:
            row = made - 1
            signals = {k: v[row: row + 1] for k, v in prompt["signals"].items()}
            survival = estimator.survival(signals)
            w = int(selector.choose(survival, context, torch.tensor([min(block, left)])).reshape(-1)[0])
            w = max(1, min(w, block, left))
            emitted = min(int(prompt["a"][row]), w - 1) + 1
            nxt = bool(selector.should_draft(context).reshape(-1)[0]) if takes_plain else True
            selector.observe(torch.tensor([w]), torch.tensor([float(emitted)]), torch.tensor([cost[w - 1]]), True)
            made, seconds, drafted_rounds, draft_next = made + emitted, seconds + clock[w - 1], drafted_rounds + 1, nxt
            ws.append(w)
        else:
            if takes_plain:
                if plain_left == 0:
                    plain_left = int(selector.plain_run(context).reshape(-1)[0])
                else:
                    plain_left -= 1
                draft_next = plain_left == 0
            else:
                draft_next = True
            made, seconds = made + 1, seconds + clock_ar
            ws.append(1)
    return {"seconds": seconds, "rounds": rounds, "drafted": drafted_rounds, "mean_w": statistics.fmean(ws or [1]),
            "ar_seconds": (n - 1) * clock_ar, "tokens": n}


def oracle(latency, prompt: dict) -> dict:
    """The fastest walk along a prompt's text for a selector that knew every round's outcome beforehand: at each
    position a plain step or a drafted round of the best w (dynamic programming over positions, the same costs and
    rules as `walk`). No selector can beat it with these round costs and this pair's acceptance: an upper bound."""
    cost, cost_ar = latency.cost[0].double().tolist(), float(latency.cost_ar[0])
    block, n = latency.block_size, prompt["n"]
    best = [0.0] * (n + 1)  # best[m]: least seconds from m tokens made to n
    drafted = [0] * (n + 1)
    for made in range(n - 1, 0, -1):
        best[made], drafted[made] = cost_ar + best[made + 1], drafted[made + 1]
        a = int(prompt["a"][made - 1]) if n - made > 1 else 0
        for w in range(2, min(block, n - made) + 1) if n - made > 1 else ():
            emitted = min(a, w - 1) + 1
            if cost[w - 1] + best[made + emitted] < best[made]:
                best[made], drafted[made] = cost[w - 1] + best[made + emitted], drafted[made + emitted] + 1
    return {"seconds": best[1], "drafted": drafted[1], "ar_seconds": (n - 1) * cost_ar, "tokens": n}


def simulate(args) -> None:
    from hybridspec_hf import HybridSpecConfig
    from hybridspec_hf.generation.strategy import _estimator
    from hybridspec_hf.selector.latency import LatencyModel
    from hybridspec_hf.tiny_pair import ASSETS_DIR

    source = read_json(args.latency)
    ar = source["per_prompt"]["ar"]
    cost_ar = sum(ar["seconds"]) / sum(ar["tokens"])  # AR's measured time per token (prefill included)
    cost = torch.tensor(source["latency_ms"]) * 1e-3
    latency = LatencyModel(cost=cost[None], cost_ar=torch.tensor([cost_ar]), context_lens=torch.tensor([256]))
    fitted = ASSETS_DIR / "acceptance_estimator.json"  # as strategies_cpu.py
    settings = HybridSpecConfig(latency_model=latency, acceptance_estimator=str(fitted) if fitted.exists() else None)
    estimator = _estimator(settings.acceptance_estimator, latency.block_size)
    prompts = [p for p in load_positions() if p["n"] > 1][: args.prompts]
    report, lines = {}, []
    lines += [f"Simulated on a CPU from recorded positions ({POSITIONS.name}: the shipped tiny pair's drafts and "
              f"accepted lengths at every position of {len(prompts)} held-out prompts' greedy text); round costs "
              f"C(w) and C_ar from {Path(args.latency).name} (C_ar = {cost_ar * 1e3:.1f} ms, C(1) = "
              f"{float(cost[0]) * 1e3:.1f} ms, C(16) = {float(cost[-1]) * 1e3:.1f} ms). Predictions, not timings.", "",
              "| variant | × AR (total time) | per prompt: mean / median / min / below 0.97× "
              "| τ (tokens/drafted round) | drafted rounds / all |", "|---|---|---|---|---|"]
    for name, (strategy, options) in VARIANTS.items():
        runs = [walk(strategy, options, latency, estimator, p) for p in prompts]
        ratios = [r["ar_seconds"] / r["seconds"] for r in runs]
        total = sum(r["ar_seconds"] for r in runs) / sum(r["seconds"] for r in runs)
        drafted = sum(r["drafted"] for r in runs)
        plain = sum(r["rounds"] - r["drafted"] for r in runs)
        tau = (sum(r["tokens"] - 1 for r in runs) - plain) / max(drafted, 1)
        report[name] = {"x_ar": total, "per_prompt": ratios, "tau": tau, "drafted": drafted,
                        "rounds": sum(r["rounds"] for r in runs)}
        lines.append(f"| {name} | {total:.3f} | {statistics.fmean(ratios):.3f} / {statistics.median(ratios):.3f} / "
                     f"{min(ratios):.3f} / {sum(x < 0.97 for x in ratios)} | {tau:.2f} | {drafted} / "
                     f"{report[name]['rounds']} |")
        print(lines[-1], flush=True)
    runs = [oracle(latency, p) for p in prompts]
    ratios = [r["ar_seconds"] / r["seconds"] for r in runs]
    total = sum(r["ar_seconds"] for r in runs) / sum(r["seconds"] for r in runs)
    report["oracle"] = {"x_ar": total, "per_prompt": ratios, "drafted": sum(r["drafted"] for r in runs)}
    lines.append(f"| oracle (knows each round's outcome: the bound for any selector) | {total:.3f} | "
                 f"{statistics.fmean(ratios):.3f} / {statistics.median(ratios):.3f} / {min(ratios):.3f} / "
                 f"{sum(x < 0.97 for x in ratios)} | - | {report['oracle']['drafted']} drafted |")
    print(lines[-1], flush=True)
    payload = {"title": "Verification strategies replayed position by position on the tiny pair (simulated)",
               "environment": environment(), "latency_source": str(args.latency), "results": report}
    write_results(args.name, payload, "\n".join(lines))


def _restart_streak_per_call(selector) -> None:
    """The rule before 2026-12-04 (night) on `selector`: a new call of the resident rounds restarts the probe's
    streak, whatever evidence it carries (DinkelbachThroughput.restart then zeroed it)."""
    throughput = selector.throughput
    restart = throughput.restart

    def restart_zeroing(cost_ar, carry=0.0, informed_rounds=1):
        restart(cost_ar, carry, informed_rounds)
        throughput.ar_streak.zero_()

    throughput.restart = restart_zeroing


def sequence(args) -> None:
    """Calls in sequence through one selector, as GPU-resident rounds run a user's successive generate() calls: the
    streams restart between calls keeping `carry_rounds` of evidence, and a call whose streams hold enough evidence
    opens with a deciding plain step (`HybridSpec.informed`), else with a drafted round. Decisions are priced with the
    calibration of a gpu_rounds.py results file (its selector check; --prices: another's); the clock runs on that
    file's measured rounds (C(w) of the nearest measured w, a plain step at its measured time).
    Every order of the prompts (--sequence of them, seeded) is one sequence of calls."""
    from hybridspec_hf.generation.strategy import _estimator
    from hybridspec_hf.selector import LatencyModel, make_selector
    from hybridspec_hf.tiny_pair import ASSETS_DIR

    check = read_json(args.gpu_rounds)["selector_check"]
    priced = read_json(args.prices)["selector_check"] if args.prices else check
    decide_ar = priced["calibrated_C_ar_ms"] * 1e-3
    latency = LatencyModel(cost=torch.tensor(priced["calibrated_C_ms"])[None] * 1e-3,
                           cost_ar=torch.tensor([decide_ar]), context_lens=torch.tensor([256]))
    measured = {int(w): ms * 1e-3 for w, ms in check["measured_round_ms_by_w (0 = plain step)"].items()}
    known = sorted(w for w in measured if w > 0)
    clock = [measured[w] if w in measured else measured[min(known, key=lambda k: (abs(k - w), k))]
             for w in range(1, latency.block_size + 1)]  # unmeasured w: the nearest measured (ties: the shorter)
    clock_ar = measured[0]
    estimator = _estimator(str(ASSETS_DIR / "acceptance_estimator.json"), latency.block_size)
    prompts = [p for p in load_positions() if p["n"] > 1][: args.prompts]
    variants = {"hybridspec (default)": False, "hybridspec, streak restarted per call (before)": True}
    lines = [f"Calls in sequence through one selector (resident rounds' carry), {len(prompts)} held-out prompts in "
             f"{args.sequence} seeded orders; decisions priced with {Path(args.prices or args.gpu_rounds).name}'s "
             f"calibration (C(1) = {priced['calibrated_C_ms'][0]:.3f} ms, C(16) = {priced['calibrated_C_ms'][-1]:.3f} "
             f"ms, C_ar = {decide_ar * 1e3:.3f} ms), the clock on {Path(args.gpu_rounds).name}'s measured rounds (a "
             f"plain step {clock_ar * 1e3:.3f} ms). "
             "Predictions, not timings.", "",
             "| variant | × AR, each order | calls that drafted, each order |", "|---|---|---|"]
    report = {}
    for name, per_call in variants.items():
        speedups, drafting = [], []
        for seed in range(args.sequence):
            selector = make_selector("nominal", {"latency_model": latency})
            if per_call:
                _restart_streak_per_call(selector)
            order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
            seconds = ar_seconds = 0.0
            calls_drafting = 0
            for index in order:
                run = _call(selector, latency, estimator, prompts[index], clock, clock_ar)
                seconds, ar_seconds = seconds + run["seconds"], ar_seconds + run["ar_seconds"]
                calls_drafting += run["drafted"] > 0
            speedups.append(ar_seconds / seconds)
            drafting.append(calls_drafting)
        report[name] = {"x_ar": speedups, "calls_drafting": drafting}
        lines.append(f"| {name} | {' / '.join(f'{x:.3f}' for x in speedups)} | "
                     f"{' / '.join(f'{d}' for d in drafting)} of {len(prompts)} |")
        print(lines[-1], flush=True)
    payload = {"title": "Calls in sequence through one selector on the tiny pair's held-out text (simulated)",
               "notes": (f"Simulated on a CPU. Trained weights (the shipped tiny pair); acceptance, draft signals and "
                         f"text from its recorded held-out positions ({POSITIONS.name}); prices and clock from H200 "
                         "runs of gpu_rounds.py (their JSON files named below). Predictions, not timings."),
               "environment": environment(), "clock": str(args.gpu_rounds), "prices": str(args.prices or args.gpu_rounds),
               "results": report}
    write_results(args.name, payload, "\n".join(lines))


def _call(selector, latency, estimator, prompt: dict, clock: list, clock_ar: float) -> dict:
    """One generate() call of the resident rounds along a prompt's text (`walk`'s result): the streams restart keeping
    their carry, and a call whose streams are `informed` opens with a deciding plain step."""
    selector.restart(torch.tensor([prompt["prompt_len"]]))
    return walk("nominal", {}, latency, estimator, prompt, warm=selector, clock=clock, clock_ar=clock_ar,
                opens_plain=bool(selector.informed()[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the positions (runs the pair on the CPU)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--latency", default=str(LATENCY_SOURCE), help="a strategies_cpu results JSON")
    parser.add_argument("--name", default="position_sim_tiny_pair")
    parser.add_argument("--sequence", type=int, default=0,
                        help="calls in sequence through one selector, this many prompt orders (see `sequence`)")
    parser.add_argument("--gpu-rounds", default=str(Path(__file__).resolve().parent / "results" /
                                                    "gpu_rounds_tiny_pair10.json"),
                        help="--sequence: a gpu_rounds.py results JSON (its selector check prices and clocks)")
    parser.add_argument("--prices", default=None,
                        help="--sequence: price the decisions with this gpu_rounds.py JSON's calibration instead")
    args = parser.parse_args()
    if args.record:
        record(args)
    elif args.sequence:
        sequence(args)
    else:
        simulate(args)


if __name__ == "__main__":
    main()
