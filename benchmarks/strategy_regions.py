"""Where HybridSpec steps plain, what a drafting strategy made at the same positions (tiny pair, CPU, one run).

    python benchmarks/strategy_regions.py --prompts 32              # HybridSpec against static, ≈ 4 min on 2 threads

Greedy decoding makes both strategies emit AR's text, so their rounds cover the same positions. Each prompt runs AR,
the drafting strategy (--against, default "static") and HybridSpec, interleaved; every round is kept with the
position it started at. HybridSpec's rounds are split into drafted rounds and plain steps, and the other strategy's
rounds by whether HybridSpec stepped plain at the position they started at. Per group: tokens, rounds, seconds, ms a
token and ms a round. Where HybridSpec's plain steps cost more per token than the other strategy's drafting at those
positions, its draft decision stepped plain where drafting paid; where its drafted rounds cost more per round than the
other's, its rounds carry work the other's do not. Trained weights, held-out stdlib prompts, real acceptance and
routing, greedy, batch 1; C(w) calibrated in the same run. Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from common import environment, tiny_pair_setup, write_results

import hybridspec_hf


def rounds_by_position(target) -> list[tuple[int, int, float, bool]]:
    """The last call's rounds: (position it started at, tokens emitted, seconds, drafted)."""
    rounds, position = [], 0
    for r in hybridspec_hf.get_telemetry(target).rounds:
        rounds.append((position, r.emitted, r.wall_s, r.drafted))
        position += r.emitted
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", default="static", help="the drafting strategy compared with HybridSpec")
    parser.add_argument("--name", default="strategy_regions_tiny_pair")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter, prompts, latency, settings = tiny_pair_setup(args.prompts)
    runs = {"ar": {}, args.against: dict(assistant_model=drafter, generation_strategy=args.against,
                                         hybridspec_config=settings),
            "hybridspec": dict(assistant_model=drafter, generation_strategy="hybridspec", hybridspec_config=settings)}
    for kwargs in runs.values():  # warm-up
        target.generate(prompts[0], do_sample=False, max_new_tokens=16, **kwargs)
    seconds = collections.Counter()
    groups = collections.defaultdict(lambda: [0, 0, 0.0])  # tokens, rounds, seconds

    def add(key: str, emitted: int, wall: float) -> None:
        group = groups[key]
        group[0], group[1], group[2] = group[0] + emitted, group[1] + 1, group[2] + wall

    for prompt in prompts:
        rounds, outputs = {}, {}
        for name, kwargs in runs.items():  # interleaved so drift hits every strategy alike
            start = time.perf_counter()
            outputs[name] = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens, **kwargs)
            seconds[name] += time.perf_counter() - start
            if name != "ar":
                rounds[name] = rounds_by_position(target)
        if not all(torch.equal(out, outputs["ar"]) for out in outputs.values()):
            raise RuntimeError("a strategy's text differs from AR's: the positions would not correspond")
        plain_at = {position for position, _, _, drafted in rounds["hybridspec"] if not drafted}
        for position, emitted, wall, drafted in rounds["hybridspec"]:
            add("hybridspec: drafted rounds" if drafted else "hybridspec: plain steps", emitted, wall)
        for position, emitted, wall, _ in rounds[args.against]:
            where = "stepped plain" if position in plain_at else "drafted"
            add(f"{args.against}: where hybridspec {where}", emitted, wall)
    speedups = {name: seconds["ar"] / s for name, s in seconds.items()}
    lines = ["Speedup over AR (total time, this run): " + ", ".join(f"{k} {v:.3f}×" for k, v in speedups.items()), "",
             "| group | tokens | rounds | seconds | ms a token | tokens a round | ms a round |",
             "|---|---|---|---|---|---|---|"]
    table = {}
    for key in sorted(groups):
        tokens, count, wall = groups[key]
        table[key] = {"tokens": tokens, "rounds": count, "seconds": wall}
        lines.append(f"| {key} | {tokens} | {count} | {wall:.2f} | {wall / max(tokens, 1) * 1e3:.2f} | "
                     f"{tokens / max(count, 1):.2f} | {wall / max(count, 1) * 1e3:.2f} |")
    payload = {"title": f"Where HybridSpec steps plain, what {args.against} made at the same positions (CPU)",
               "notes": ("Trained weights (shipped tiny pair), held-out stdlib prompts, real acceptance and routing, "
                         "greedy, batch 1; strategies interleaved per prompt, one timing each; C(w) calibrated in the "
                         "same run. Round times are the rounds' own wall times (telemetry)."),
               "environment": environment(), "settings": vars(args), "speedup_vs_ar": speedups, "groups": table}
    write_results(args.name, payload, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
