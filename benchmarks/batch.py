"""Batched decoding at full size: AR, vanilla DFlash and HybridSpec at batch 1, 2, 4, 8, 16 under four acceptance
profiles, all through generate().

    python benchmarks/batch.py                    # one H200, 35B-A3B shape (≈ 3.5 min calibration + ≈ 2 min a repeat)
    python benchmarks/batch.py --model tiny                      # the harness itself, on a CPU (< 1 minute)

The target and drafter are e2e.py's (`build`: random bf16 weights, random router, i.e. uniform routing, a random
5-layer DFlash drafter, B = 16). Acceptance is replayed from the declared profiles in benchmarks/profiles/ (timing
mode): "high" = dflash_like (mean accepted length 6.8 at B = 16), "medium" = medium (4.0), "tiny_pair" =
tiny_pair_heldout (the real tiny pair's held-out traces, 1.6: the lowest), "low" = low (2.0); each batch row replays
its own run of the profile's first-half rows, and HybridSpec's acceptance estimator is fitted on the other half
(e2e.profile_halves).
Every batch is N distinct random prompts of --context tokens (no padding), each row generating --tokens new
tokens (no EOS): the rows stay in the batch to the end, so tokens/s is N·tokens over the decode loop's wall time (the
sum of its rounds, prefill excluded). The rounds run GPU-resident in the CUDA graphs of the batch's bucket; at batch
> 1 one w is shared by the rows, chosen by HybridSpec from the live rows' mean survival against C_N(w), the latency
of a round over N rows, calibrated here for every batch size (uniform routing; `calibrate_latency(batch_sizes=)`).
The routing correction is off at batch > 1 (HybridSpec runs as "nominal" there). `expert union` is the expected
number of distinct experts per MoE layer a round's N·w tokens read under the random router, E·(1 − (1 − k/E)^(N·w)):
the part of a round's cost that batching and a longer w share. Peak GPU memory is torch.cuda.max_memory_allocated
over the timed call. Results are written after every batch size (a time limit keeps what was measured):
benchmarks/results/batch_<model>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_switches, apply_switches, environment, method_variant, profile_elsewhere,  # noqa: E402
                    read_json, results_path, switch_settings, variant_switches, write_results)
from e2e import build, profile_halves  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import HybridSpecConfig  # noqa: E402
from hybridspec_hf.generation import resident  # noqa: E402
from hybridspec_hf.generation.calibration import calibrate_latency  # noqa: E402

PROFILES = {"high": "dflash_like", "medium": "medium", "tiny_pair": "tiny_pair_heldout", "low": "low"}
METHODS = ["ar", "dflash", "hybridspec"]
BATCHES = [1, 2, 4, 8, 16]


def expert_union(target, tokens: float) -> float | None:
    """Expected distinct experts per MoE layer that `tokens` tokens read under a uniform router (None: no MoE)."""
    config = target.config.get_text_config()
    experts = getattr(config, "num_experts", None)
    if experts is None:
        return None
    return experts * (1 - (1 - config.num_experts_per_tok / experts) ** tokens)


def run_method(target, drafter, prompt: torch.Tensor, method: str, replay, estimator, latency, tokens: int,
               verify_shape: str = "auto") -> dict:
    """One (batch, profile, method): a warm-up call (captures the batch bucket's rounds), then a timed call. A method
    "BASE+FLAG" / "BASE-FLAG" runs BASE with that A/B switch on / off (common.method_variant)."""
    with method_variant(method, target, drafter) as base:
        return {**_run_method(target, drafter, prompt, base, replay, estimator, latency, tokens, verify_shape),
                "switches": variant_switches(method, drafter)}


def _run_method(target, drafter, prompt: torch.Tensor, method: str, replay, estimator, latency, tokens: int,
                verify_shape: str) -> dict:
    strategy = method
    timed = method != "ar"  # AR is plain decoding: no acceptance to replay
    # on a CPU (the tiny harness) every method runs the resident rounds' CPU twin, as the profiles' methods must
    settings = HybridSpecConfig(acceptance_profile=replay if timed else None, latency_model=latency,
                                acceptance_estimator=estimator if method == "hybridspec" else None,
                                cuda_graphs="auto" if prompt.is_cuda else "on", verify_shape=verify_shape)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=tokens,
                  eos_token_id=None, pad_token_id=0, generation_strategy=strategy, hybridspec_config=settings,
                  assistant_model=drafter if method != "ar" else None)
    cuda = prompt.is_cuda
    # warm-up: captures the bucket's graphs, compiles; fewer tokens fit the same static cache (capacity steps of 512)
    # (from another stretch of the profile than the timed call's)
    with profile_elsewhere(replay if timed else None):
        target.generate(prompt, **{**kwargs, "max_new_tokens": min(tokens, 16)})
    capture_s = hybridspec_hf.get_telemetry(target).capture_s
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = target.generate(prompt, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    telemetry = hybridspec_hf.get_telemetry(target)
    rounds = telemetry.rounds
    decode_s = sum(r.wall_s for r in rounds)
    emitted = sum(r.emitted for r in rounds)
    batch = prompt.shape[0]
    drafted = [r for r in rounds if r.drafted]
    return {
        "tokens_per_s": emitted / decode_s, "new_tokens_per_row": out.shape[1] - prompt.shape[1],
        "decode_s": decode_s, "call_s": wall, "path": telemetry.path, "path_reason": telemetry.path_reason,
        "capture_s": capture_s, "rounds": len(rounds), "plain_steps": len(rounds) - len(drafted),
        "mean_w": statistics.mean(r.w for r in rounds), "tau": emitted / max(1, sum(r.rows for r in rounds)),
        "round_ms": statistics.median(r.wall_s for r in rounds) * 1e3,
        # where a speculative method's time goes: its plain steps (against AR's step) and its speculative rounds
        "plain_ms": statistics.median(r.wall_s for r in rounds if not r.drafted) * 1e3
        if len(drafted) < len(rounds) else None,
        "plain_host_ms": statistics.median(r.host_s for r in rounds if not r.drafted) * 1e3
        if len(drafted) < len(rounds) and rounds[0].host_s is not None else None,
        "spec_ms": statistics.mean(r.wall_s for r in drafted) * 1e3 if drafted else None,
        "spec_tokens": statistics.mean(r.emitted for r in drafted) / batch if drafted else None,
        "expert_union": expert_union(target, batch * statistics.mean(r.w for r in rounds)),
        "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def merge(sources: list[str], name: str) -> dict:
    """One table from runs split over several device calls (e.g. `--batches 2,4,8` and `--batches 1,16`): their
    batch sizes in order, each from the last source that has it; the environment is the first source's (its GPU and
    versions: every source must have run on the same GPU, torch, transformers and switches), with the merge's command,
    and every source's file, date and command in the JSON and the markdown. Measures nothing."""
    reports = [read_json(path) for path in sources]
    keys = ("gpu", "torch", "transformers", "triton")
    for path, other in zip(sources[1:], reports[1:]):
        same = {k: (reports[0]["environment"].get(k), other["environment"].get(k)) for k in keys}
        if any(a != b for a, b in same.values()) or other.get("switches") != reports[0].get("switches"):
            raise SystemExit(f"--merge: {path} ran elsewhere or with other switches than {sources[0]} ({same}); "
                             "merge only runs of one machine and one code.")
    report = {k: v for k, v in reports[0].items() if k not in ("title", "environment", "notes")}
    batches = {b: row for r in reports for b, row in r["batches"].items()}
    latency = {b: row for r in reports for b, row in r.get("latency_ms", {}).items()}
    report["batches"] = {b: batches[b] for b in sorted(batches, key=int)}
    report["latency_ms"] = {b: latency[b] for b in sorted(latency, key=int)}
    report["elapsed_s"] = sum(r.get("elapsed_s", 0) for r in reports)
    report["calibration_s"] = sum(r.get("calibration_s", 0) for r in reports)
    report["merged_from"] = [{"file": path, "date": r["environment"]["date"], "command": r["environment"]["command"],
                              "batches": list(r["batches"])} for path, r in zip(sources, reports)]
    environment_ = dict(reports[0]["environment"])
    environment_["merged by"] = environment()["command"]
    environment_["command"] = "; ".join(f"{r['environment']['command']} ({r['environment']['date']})" for r in reports)
    payload = {"title": f"Batched decoding, timing mode ({report['model']}, {report['device']}; merged runs)",
               "environment": environment_, **report, "notes": __doc__.split("\n\n")[2]}
    write_results(name, payload, markdown(report))
    plot(report, results_path(name))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--merge", default=None,
                        help="comma-separated results JSONs of batch.py runs to merge into one table (--name), "
                             "measuring nothing: the batch sizes of runs split over device calls")
    parser.add_argument("--model", default="qwen35_35b_a3b", choices=["qwen35_35b_a3b", "tiny"])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes (comma-separated)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help=f"subset of {','.join(PROFILES)}")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"subset of {','.join(METHODS)}; METHOD+FLAG / METHOD-FLAG runs METHOD with an A/B "
                             "switch on / off (e.g. hybridspec+defer-appends)")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per row (default 128; tiny: 12)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 128; tiny: 16)")
    parser.add_argument("--verify-shape", default="auto", choices=["auto", "max", "exact"],
                        help="HybridSpecConfig.verify_shape of the speculative methods (auto: max on CUDA)")
    parser.add_argument("--name", default=None, help="results stem (default batch_<model>; tiny on a CPU: "
                                                     "batch_tiny_cpu)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per method, the methods interleaved; the table pools them (every call's "
                             "tokens over every call's time)")
    parser.add_argument("--row-stride", type=int, default=37,
                        help="call r of a method replays the profiles from row r × this (AcceptanceProfile.start_row; "
                             "0: every call from row 0, as runs up to 41)")
    add_switches(parser, "defer-appends", "moe-decode", "trust-drafts", "pdl", "early-reads", "gdn-norm-fold",
                 "wide-direct", "align-kernel", "short-verify")
    args = parser.parse_args(argv)
    if args.merge:
        if not args.name:
            raise SystemExit("--merge needs --name (the merged table's results stem).")
        return merge(args.merge.split(","), args.name)
    apply_switches(args)
    methods = args.methods.split(",")
    # every method's rounds stay captured between its interleaved calls (a variant's are kept beside its base's)
    resident.MAX_ROUNDS_PER_TARGET = max(resident.MAX_ROUNDS_PER_TARGET, len(methods))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.model == "tiny"
    tokens = args.tokens or (12 if tiny else 128)
    context = args.context or (16 if tiny else 128)
    batches = [int(n) for n in args.batches.split(",")]
    name = args.name or (f"batch_{args.model}" if device == "cuda" or not tiny else "batch_tiny_cpu")
    start = time.perf_counter()
    target, drafter = build(args.model, None, device)
    vocab = target.config.get_text_config().vocab_size
    # distinct rows: N copies of one prompt would route every row to the same experts (greedy, identical tokens), so
    # a plain step at batch 16 read 8 experts per layer instead of ≈ 102 and AR looked 2x cheaper (run 37)
    prompts = torch.randint(0, vocab, (max(batches), context), generator=torch.Generator().manual_seed(0)).to(device)
    report: dict = {"model": args.model, "layers": target.config.get_text_config().num_hidden_layers,
                    "parameters_b": sum(p.numel() for p in target.parameters()) / 1e9, "device": device,
                    "weights": "random", "routing": "uniform (random router)", "tokens_per_row": tokens,
                    "context": context, "verify_shape": args.verify_shape, "repeats": args.repeats,
                    "row_stride": args.row_stride,
                    "switches": switch_settings(), "build_s": time.perf_counter() - start,
                    "batches": {}}
    calibration_start = time.perf_counter()
    latency = calibrate_latency(target, drafter, context_lens=(context,), repeats=1, progress=False,
                                batch_sizes=tuple(batches), cuda_graphs="auto" if device == "cuda" else "on",
                                verify_shape=None if args.verify_shape == "auto" else args.verify_shape)
    report["calibration_s"] = time.perf_counter() - calibration_start
    report["latency_ms"] = {str(n): {"cost_ar": float(latency.for_batch(n).cost_ar[0]) * 1e3,
                                     "cost": [round(float(c) * 1e3, 3) for c in latency.for_batch(n).cost[0]]}
                            for n in batches}
    print("latency model (ms):", report["latency_ms"], flush=True)
    halves = {label: profile_halves(PROFILES[label]) for label in args.profiles.split(",")}
    for batch in batches:
        rows = prompts[:batch]
        table = report["batches"].setdefault(str(batch), {})
        for label, (profile, replay, _, estimator) in halves.items():
            entry = table.setdefault(label, {"profile": PROFILES[label],
                                             "mean_accepted_length": replay.mean_accepted_length, "methods": {}})
            runs: dict = {method: [] for method in methods}
            for repeat in range(args.repeats):  # the methods interleaved: drift between calls hits every method
                replay.start_row = repeat * args.row_stride  # each call its own stretch of the profile
                for method in methods:
                    result = run_method(target, drafter, rows, method, replay, estimator, latency, tokens,
                                        args.verify_shape)
                    runs[method].append(result)
                    print(f"batch {batch}, {label}, {method}, run {repeat + 1}:",
                          {k: v for k, v in result.items() if k != "path_reason"}, flush=True)
            for method, results in runs.items():
                entry["methods"][method] = pooled(results)
            hybridspec_hf.release_graphs(target)  # the next profile's rounds replace these
        report["elapsed_s"] = time.perf_counter() - start
        save(name, report)  # after every batch size: a run cut short keeps what it measured
    print(markdown(report))
    return report


def pooled(results: list[dict]) -> dict:
    """One method's calls as one: tokens/s = every call's tokens over every call's time; counts and round times
    averaged over the calls; every call's tokens/s kept."""
    row = dict(results[0])
    for key in row:
        values = [r[key] for r in results]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            row[key] = statistics.mean(values)
    row["tokens_per_s"] = sum(r["tokens_per_s"] * r["decode_s"] for r in results) / sum(r["decode_s"] for r in results)
    row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in results]
    return row


def save(name: str, report: dict) -> None:
    payload = {"title": f"Batched decoding, timing mode ({report['model']}, {report['device']})",
               "environment": environment(), **report, "notes": __doc__.split("\n\n")[2]}
    write_results(name, payload, markdown(report))
    plot(report, results_path(name))


def markdown(report: dict) -> str:
    lines = [f"{report['model']}, {report['layers']} layers, {report['parameters_b']:.2f} B parameters, random "
             f"weights, {report['routing']} routing, on {report['device']}; {report['tokens_per_row']} new tokens per "
             f"row after a {report['context']}-token prompt, verify shape {report.get('verify_shape', 'auto')} (auto: "
             "max on CUDA, exact on a CPU). tokens/s: every row's tokens over the decode loop's "
             "wall time (prefill excluded). × AR: over AR at the same batch size."
             + (f" Each method ran {report['repeats']} timed calls, the methods interleaved, call r replaying the "
                f"profiles from row r × {report.get('row_stride', 0)}; the row pools them (tokens/s: all tokens over "
                "all time; the other columns: means; every call's tokens/s in the JSON)."
                if report.get("repeats", 1) > 1 else "")]
    if report["device"] == "cpu":
        lines += ["", "**A CPU run of the harness**: the tiny float32 model, the resident rounds' CPU twin (no CUDA "
                      "graphs, no GPU kernels); its timings say nothing about a GPU."]
    lines += ["",
             f"C_N(w) calibrated at context {report['context']} in {report.get('calibration_s', 0):.0f} s (ms; w = 1, "
             "4, 16, and a plain step):", "",
             "| batch | C(1) | C(4) | C(16) | C_ar |", "|---|---|---|---|---|"]
    for batch, row in report.get("latency_ms", {}).items():
        cost = row["cost"]
        lines.append(f"| {batch} | {cost[0]:.2f} | {cost[min(3, len(cost) - 1)]:.2f} | {cost[-1]:.2f} | "
                     f"{row['cost_ar']:.2f} |")
    lines += ["", "| batch | profile (τ at B = 16) | method | tokens/s | × AR | mean w | τ | round ms | "
                  "plain steps | plain step ms | spec. round ms (tokens per row) | expert union | GPU GiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for batch, profiles in report["batches"].items():
        for label, entry in profiles.items():
            methods = entry["methods"]
            ar = methods.get("ar", {}).get("tokens_per_s")
            for method, row in methods.items():
                union, memory, spec = row.get("expert_union"), row.get("gpu_memory_gib"), row.get("spec_ms")
                spec = "–" if spec is None else f"{spec:.2f} ({row['spec_tokens']:.2f})"
                plain = "–" if row.get("plain_ms") is None else f"{row['plain_ms']:.2f}"
                lines.append(
                    f"| {batch} | {label} ({entry['mean_accepted_length']:.2f}) | {method} | "
                    f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / ar if ar else float('nan'):.2f} | "
                    f"{row['mean_w']:.2f} | {row['tau']:.2f} | {row['round_ms']:.2f} | {row['plain_steps']:.0f} | "
                    f"{plain} | {spec} | {'–' if union is None else format(union, '.0f')} | "
                    f"{'–' if memory is None else format(memory, '.1f')} |")
    summary = advantage(report)
    if summary:
        lines += ["", "HybridSpec over vanilla DFlash (tokens/s ratio): " + ", ".join(
            f"{label}: {', '.join(f'batch {b} {r:.2f}×' for b, r in ratios)}" for label, ratios in summary.items())]
        ranked = sorted(((r, b, label) for label, ratios in summary.items() for b, r in ratios))
        for word, (ratio, batch, label) in (("Largest", ranked[-1]), ("Smallest", ranked[0])):
            rows = report["batches"][str(batch)][label]["methods"]
            hs, df = rows["hybridspec"], rows["dflash"]  # the variants (hybridspec+FLAG) are in the table
            union = "" if hs["expert_union"] is None else (
                f", experts read per MoE layer ≈ {hs['expert_union']:.0f} against {df['expert_union']:.0f}")
            lines += ["", f"{word} advantage over DFlash: batch {batch}, {label} acceptance, {ratio:.2f}× (HybridSpec "
                          f"verifies w = {hs['mean_w']:.1f} per row against {df['mean_w']:.1f}{union}; rounds "
                          f"{hs['round_ms']:.2f} against {df['round_ms']:.2f} ms; τ {hs['tau']:.2f} against "
                          f"{df['tau']:.2f}; {hs['plain_steps']:.1f} plain steps per call)."]
    for variant in sorted({m for profiles in report["batches"].values() for row in profiles.values()
                           for m in row["methods"] if m.startswith("hybridspec")}):
        lines += ["", f"{variant} over AR (must be ≥ 0.97×): " + ", ".join(
            f"batch {b} {label} {row['methods'][variant]['tokens_per_s'] / row['methods']['ar']['tokens_per_s']:.2f}×"
            for b, profiles in report["batches"].items() for label, row in profiles.items()
            if {"ar", variant} <= set(row["methods"]))]
    lines += ["", f"Elapsed {report.get('elapsed_s', 0):.0f} s (model build {report['build_s']:.0f} s)."]
    return "\n".join(lines)


def advantage(report: dict) -> dict:
    """{profile: [(batch, HybridSpec tokens/s over DFlash's)]} where both ran."""
    out: dict = {}
    for batch, profiles in report["batches"].items():
        for label, entry in profiles.items():
            methods = entry["methods"]
            if {"dflash", "hybridspec"} <= set(methods):
                out.setdefault(label, []).append(
                    (int(batch), methods["hybridspec"]["tokens_per_s"] / methods["dflash"]["tokens_per_s"]))
    return out


def plot(report: dict, stem: Path) -> None:
    """Tokens/s against batch size per method (one panel per profile), and speedup over AR."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(next(iter(report["batches"].values()), {}))
    fig, axes = plt.subplots(2, max(1, len(labels)), figsize=(5 * max(1, len(labels)), 7), squeeze=False)
    for column, label in enumerate(labels):
        batches = [b for b in report["batches"] if label in report["batches"][b]]
        present = {m for b in batches for m in report["batches"][b][label]["methods"]}
        for method in [m for m in METHODS if m in present] + sorted(present - set(METHODS)):
            points = [(int(b), report["batches"][b][label]["methods"][method]) for b in batches
                      if method in report["batches"][b][label]["methods"]]
            if not points:
                continue
            xs = [b for b, _ in points]
            axes[0][column].plot(xs, [row["tokens_per_s"] for _, row in points], "o-", label=method)
            ar = [report["batches"][str(b)][label]["methods"].get("ar", {}).get("tokens_per_s") for b in xs]
            if all(ar):
                axes[1][column].plot(xs, [row["tokens_per_s"] / a for (_, row), a in zip(points, ar)], "o-",
                                     label=method)
        axes[0][column].set_title(f"{label} acceptance")
        axes[1][column].axhline(1.0, color="gray", lw=0.8)
        for row in (0, 1):
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].set_xlabel("batch size")
            axes[row][column].legend(fontsize=8)
        axes[0][column].set_ylabel("tokens/s (all rows)")
        axes[1][column].set_ylabel("× AR at the same batch")
    fig.suptitle(f"{report['model']} on {report['device']}: batched decoding, timing mode")
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
