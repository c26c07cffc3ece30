"""GPU-resident rounds on one GPU: ms/token and round cost C(w), side by side in one process.

    python benchmarks/gpu_rounds.py --part tiny   # shipped tiny pair: fp32 exactness, bf16 tokens/s per strategy
    python benchmarks/gpu_rounds.py --part big    # Qwen3.5-35B-A3B shape, random bf16 weights: AR and C(w)

Big part: random weights and a random router (uniform routing: about 8 → 102 distinct experts per layer from w = 1
to 16); a random DFlash drafter, so τ ≈ 1 and every round shows the cost of verifying w tokens. Acceptance is not
measured there. Tiny part: trained weights, held-out stdlib prompts, real acceptance and routing; the strategies that
choose w run with context lookup (HybridSpecConfig(context_lookup="auto"): the shipped pair's table), and
`hybridspec_lookup_off` is HybridSpec without it.
Writes benchmarks/results/gpu_rounds_{part}.json and .md (or --out DIR).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, results_path, write_results  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import DFlashDrafter, HybridSpecConfig, patches  # noqa: E402

STRATEGIES = ["ar", "dflash", "static", "hybridspec", "nominal", "ratio", "confidence"]


def qwen35_35b_a3b_config():
    from e2e import model_config  # one definition of the full-size shapes

    return model_config("qwen35_35b_a3b", None)


def median(values):
    return statistics.median(values) if values else float("nan")


LOOKUP_OFF = "_lookup_off"  # a method name's suffix: the strategy with HybridSpecConfig(context_lookup="off")


def run_generate(target, prompt, strategy, drafter, max_new, settings=None, **kwargs):
    if strategy.endswith(LOOKUP_OFF):
        strategy, settings = strategy[: -len(LOOKUP_OFF)], HybridSpecConfig(context_lookup="off")
    torch.cuda.synchronize()
    start = time.perf_counter()
    if strategy == "hf":
        out = target.generate(prompt, do_sample=False, max_new_tokens=max_new, **kwargs)
        telemetry = None
    else:
        out = target.generate(prompt, do_sample=False, max_new_tokens=max_new, assistant_model=drafter,
                              generation_strategy=strategy, hybridspec_config=settings or HybridSpecConfig(),
                              **kwargs)
        telemetry = hybridspec_hf.get_telemetry(target)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start, telemetry


# --------------------------------------------------------------------------------------------------- tiny pair
def tiny(args) -> tuple[dict, str]:
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    report: dict = {"exact_fp32": {}, "speed_bf16": {}}
    texts = heldout_prompts(args.prompts)
    target, drafter, tokenizer = load_tiny_pair(dtype=torch.float32, device="cuda")
    target.set_experts_implementation("batched_mm")  # capturable in fp32 (grouped_mm is a bf16 kernel)
    prompts = [tokenizer(t, return_tensors="pt").input_ids.cuda() for t in texts]
    hf_outputs = [run_generate(target, prompt, "hf", None, args.tokens)[0] for prompt in prompts]
    for strategy in ("ar", "dflash", "hybridspec"):
        same = 0
        for prompt, ar in zip(prompts, hf_outputs):
            out, _, tel = run_generate(target, prompt, strategy, drafter, args.tokens)
            same += int(torch.equal(ar, out))
        report["exact_fp32"][strategy] = {"identical": same, "prompts": len(prompts), "path": tel.path}
        print("fp32", strategy, same, "/", len(prompts), tel.path, flush=True)

    target, drafter, tokenizer = load_tiny_pair(dtype=torch.bfloat16, device="cuda")
    # the strategies that choose w run with context lookup (the shipped pair's table); HybridSpec without it beside
    methods = ["hf"] + STRATEGIES + ["hybridspec" + LOOKUP_OFF]
    for method in methods:  # warm-up: captures and calibrations happen here, not in the timed runs
        run_generate(target, prompts[0], method, drafter, 32)
    rows = {m: {"seconds": [], "tokens": [], "tau": [], "w": [], "identical": 0, "gaps": [], "decode_s": [],
                "decode_tokens": [], "host_ms": [], "prefill_ms": [], "capture_ms": [], "other_ms": []}
            for m in methods}
    references = [target.generate(prompt, do_sample=False, max_new_tokens=args.tokens, output_logits=True,
                                  return_dict_in_generate=True) for prompt in prompts]
    # methods outside, prompts inside: a method's calls reuse its graphs as a user's repeated calls with one
    # configuration do (a target keeps only a few captured sets: interleaving all methods per prompt would
    # re-capture on most calls and time the capture)
    longest = max(prompts, key=lambda p: p.shape[1])  # its static cache fits every prompt's call
    for method in methods:
        run_generate(target, longest, method, drafter, args.tokens)  # (re)captures this method's rounds, untimed
        for prompt, ar in zip(prompts, references):
            out, seconds, tel = run_generate(target, prompt, method, drafter, args.tokens)
            row = rows[method]
            row["seconds"].append(seconds)
            row["tokens"].append(out.shape[1] - prompt.shape[1])
            if tel is not None:  # the decode loop's own time (rounds and the host's work between them)
                row["decode_s"].append(sum(r.wall_s for r in tel.rounds))
                # a call's time outside its rounds: prefill, graph capture, and the rest (set-up, hand-backs)
                row["prefill_ms"].append(tel.prefill_s * 1e3)
                row["capture_ms"].append(tel.capture_s * 1e3)
                row["other_ms"].append((seconds - row["decode_s"][-1] - tel.prefill_s - tel.capture_s) * 1e3)
                row["decode_tokens"].append(sum(r.emitted for r in tel.rounds))
                row["host_ms"] += [r.host_s * 1e3 for r in tel.rounds if r.host_s is not None]
                row["tau"].append(tel.mean_emitted)
                row["w"].append(tel.mean_verified)
                row["path"] = tel.path
            if torch.equal(out, ar.sequences):
                row["identical"] += 1
            else:
                n = min(out.shape[1], ar.sequences.shape[1])
                first = int((out[0, :n] != ar.sequences[0, :n]).nonzero()[0])
                top2 = ar.logits[first - prompt.shape[1]][0].float().topk(2).values
                row["gaps"].append(float(top2[0] - top2[1]))
    for method, row in rows.items():
        row["tokens_per_s"] = sum(row["tokens"]) / sum(row["seconds"])
        row["decode_tokens_per_s"] = sum(row["decode_tokens"]) / sum(row["decode_s"]) if row["decode_s"] else None
        row["host_ms_per_round"] = median(row["host_ms"]) if row["host_ms"] else None
        for part in ("prefill_ms", "capture_ms", "other_ms"):
            row[f"{part}_per_call"] = median(row[part]) if row[part] else None
    # what the calibrated selector believed against what its rounds cost (last prompt's hybridspec call)
    run_generate(target, prompts[-1], "hybridspec", drafter, args.tokens)
    tel = hybridspec_hf.get_telemetry(target)
    selector = target.__dict__["_hybridspec_resident"].strategy.selector
    by_w: dict[int, list[float]] = {}
    for r in tel.rounds:
        by_w.setdefault(r.w if r.drafted else 0, []).append(r.wall_s * 1e3)
    report["selector_check"] = {
        "calibrated_C_ms": [round(float(c) * 1e3, 3) for c in selector.latency_model.cost_for(prompts[-1].shape[1])[0]],
        "calibrated_C_ar_ms": round(float(selector.latency_model.cost_ar_for(prompts[-1].shape[1])[0]) * 1e3, 3),
        "measured_round_ms_by_w (0 = plain step)": {w: round(median(v), 3) for w, v in sorted(by_w.items())},
        "plain_steps": sum(not r.drafted for r in tel.rounds), "rounds": len(tel.rounds),
    }
    print("selector check", report["selector_check"], flush=True)
    base, hf = rows["ar"]["tokens_per_s"], rows["hf"]["tokens_per_s"]
    decode_ar = rows["ar"]["decode_tokens_per_s"]
    lines = ["tokens/s: whole generate() calls (prefill and set-up included); decode tokens/s: the decode loop's own "
             "time (every round and the host's work between rounds), as benchmarks/e2e.py reports; host ms: per round, "
             "wall minus the wait for the hand-off. Each method runs all prompts in a row after one untimed call that "
             "captures its rounds (a target keeps the graphs of its 3 most recent settings). Per call (median): "
             "prefill, capture and other ms, the call's time outside its rounds.", "",
             "| method | path | tokens/s | decode tokens/s | decode × our AR | host ms/round | × our AR | × HF eager | τ | "
             "mean w | prefill / capture / other ms per call | identical to AR (bf16) | top-2 gaps at divergences |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, row in rows.items():
        decode, host = row["decode_tokens_per_s"], row["host_ms_per_round"]
        setup = "–" if row["other_ms_per_call"] is None else " / ".join(
            f"{row[f'{part}_ms_per_call']:.1f}" for part in ("prefill", "capture", "other"))
        lines.append(f"| {method} | {row.get('path', 'hf eager')} | {row['tokens_per_s']:.0f} | "
                     f"{'–' if decode is None else f'{decode:.0f}'} | "
                     f"{'–' if decode is None else f'{decode / decode_ar:.2f}'} | "
                     f"{'–' if host is None else f'{host:.3f}'} | "
                     f"{row['tokens_per_s'] / base:.2f} | {row['tokens_per_s'] / hf:.2f} | "
                     f"{median(row['tau']):.2f} | {median(row['w']):.2f} | {setup} | "
                     f"{row['identical']}/{len(prompts)} | "
                     f"{', '.join(f'{g:.3g}' for g in row['gaps'])} |")
    exact = ["", f"fp32 exactness (greedy, {len(prompts)} held-out prompts): " + ", ".join(
        f"{k} {v['identical']}/{v['prompts']} ({v['path']})" for k, v in report["exact_fp32"].items())]
    report["speed_bf16"] = rows
    return report, "\n".join(lines + exact)


# --------------------------------------------------------------------------------------------------- 35B shape
def big(args) -> tuple[dict, str]:
    from transformers import Qwen3_5MoeForCausalLM

    from hybridspec_hf.generation.calibration import ForcedLength

    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda"):
        target = Qwen3_5MoeForCausalLM._from_config(qwen35_35b_a3b_config(), dtype=torch.bfloat16).eval()
    target.set_experts_implementation(args.experts)
    drafter = DFlashDrafter.from_target(target, num_layers=5, block_size=16).to("cuda", torch.bfloat16).eval()
    drafter.bind_target(target)
    report: dict = {"init_s": time.perf_counter() - start, "experts": args.experts,
                    "parameters_b": sum(p.numel() for p in target.parameters()) / 1e9}
    prompt = torch.randint(0, target.config.vocab_size, (1, args.context), device="cuda")

    # HF eager AR: (T(n2) - T(n1)) / (n2 - n1) removes the prefill
    run_generate(target, prompt, "hf", None, 4)
    _, t1, _ = run_generate(target, prompt, "hf", None, 8)
    _, t2, _ = run_generate(target, prompt, "hf", None, 24)
    report["hf_eager_ms_per_token"] = (t2 - t1) / 16 * 1e3
    print("hf eager", report["hf_eager_ms_per_token"], flush=True)

    # our captured AR (the stock forward of one token in one graph, static cache)
    _, _, tel = run_generate(target, prompt, "ar", None, 16)
    report["ar_capture_s"] = tel.capture_s
    _, seconds, tel = run_generate(target, prompt, "ar", None, args.tokens)
    report["ar_ms_per_token_round_median"] = median([r.wall_s for r in tel.rounds]) * 1e3
    report["ar_ms_per_token_call"] = seconds / args.tokens * 1e3
    report["ar_path"] = tel.path
    print("ours ar", report["ar_ms_per_token_round_median"], tel.path, flush=True)

    # C(w): per-length graphs ("static", exact shape) and the max-shape graph with a forced length
    report["static_round_ms"], report["max_shape_round_ms"] = {}, {}
    forced = ForcedLength(1)
    for w in args.lengths:
        settings = HybridSpecConfig(static_length=w)
        run_generate(target, prompt, "static", drafter, 8, settings)
        _, _, tel = run_generate(target, prompt, "static", drafter, args.rounds, settings)
        report["static_round_ms"][w] = median([r.wall_s for r in tel.rounds[1:]]) * 1e3
        forced.set(w)
        settings = HybridSpecConfig(selector=forced, verify_shape="max")
        run_generate(target, prompt, "hybridspec", drafter, 8, settings)
        _, _, tel = run_generate(target, prompt, "hybridspec", drafter, args.rounds, settings)
        report["max_shape_round_ms"][w] = median([r.wall_s for r in tel.rounds[1:] if r.drafted]) * 1e3
        print("w", w, report["static_round_ms"][w], report["max_shape_round_ms"][w], tel.path, flush=True)

    # pieces of a max-shape round, GPU time by CUDA events over graph replays
    rounds = target.__dict__["_hybridspec_resident"]
    from hybridspec_hf.graphs.capture import Replay

    def draft_only_fn():
        with patches.fused_kernels():
            return drafter.draft_static(rounds.last_token, rounds.context)

    draft_only = Replay(draft_only_fn, torch.device("cuda"))
    report["pieces_ms"] = {
        "draft": _time_replays(draft_only),
        "round: spec graph (draft+choose+verify+accept+commit)": _time_replays(rounds.spec),
        "step_graph(AR)": _time_replays(rounds.step),
    }
    report["graph_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    report["step_kernels"] = _kernel_profile(rounds._step)
    report["draft_kernels"] = _kernel_profile(lambda: drafter.draft_static(rounds.last_token, rounds.context))
    report["round_kernels"] = _kernel_profile(rounds._spec)
    report["host_ms_per_round"] = median([r.host_s for r in tel.rounds[1:]]) * 1e3
    c4 = report["static_round_ms"].get(4)
    lines = [f"Random bf16 weights, uniform (random-router) routing, {report['parameters_b']:.2f} B parameters, "
             f"model experts setting `{args.experts}` (HF eager runs it; the resident graphs are captured with our experts kernel), {args.context}-token prompt.", "",
             "| method | ms/token |", "|---|---|",
             f"| HF eager generate() AR | {report['hf_eager_ms_per_token']:.1f} |",
             f"| ours, `generation_strategy=\"ar\"` (stock forward of 1 token in one CUDA graph) | "
             f"{report['ar_ms_per_token_round_median']:.2f} |", "",
             "| w | round, per-length graph (ms) | round, max-shape graph (ms) | C(w)/C(4) (per-length) |",
             "|---|---|---|---|"]
    for w in args.lengths:
        ratio = report["static_round_ms"][w] / c4 if c4 else float("nan")
        lines.append(f"| {w} | {report['static_round_ms'][w]:.2f} | {report['max_shape_round_ms'][w]:.2f} | "
                     f"{ratio:.2f} |")
    lines += ["", "Paper (real routing, SGLang): C(16)/C(4) = 1.71.", "", "| piece (GPU time of a graph replay) | ms |",
              "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in report["pieces_ms"].items()]
    lines += ["", f"Host time per round (wall minus the wait for the hand-off): {report['host_ms_per_round']:.3f} ms.",
              f"Kernels per plain step: {report['step_kernels']['kernels']} ({report['step_kernels']['gpu_ms']:.2f} ms "
              f"GPU, eager); per max-shape round: {report['round_kernels']['kernels']} "
              f"({report['round_kernels']['gpu_ms']:.2f} ms); per draft: {report['draft_kernels']['kernels']} "
              f"({report['draft_kernels']['gpu_ms']:.2f} ms)."]
    return report, "\n".join(lines)


def _kernel_profile(fn) -> dict:
    """Kernels one eager call of fn launches (what its graph replays): count, GPU ms, and the 12 biggest groups."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            key = event.name.split("<")[0][:60]
            groups.setdefault(key, []).append(event.device_time_total / 1e3)
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"kernels": sum(len(v) for v in groups.values()), "gpu_ms": sum(sum(v) for v in groups.values()),
            "top": {k: {"count": len(v), "ms": sum(v)} for k, v in top}}


def _time_replays(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["tiny", "big"], required=True)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (tiny part)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per call")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens (big part)")
    parser.add_argument("--rounds", type=int, default=24, help="tokens (≈ rounds at τ = 1) per C(w) call (big part)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--experts", default="grouped_mm", help="experts implementation (big part)")
    parser.add_argument("--out", default=None, help="also write the results here")
    parser.add_argument("--name", default=None, help="results file stem (default gpu_rounds_<part>)")
    parser.add_argument("--calibration-rounds", action="store_true",
                        help="log every calibration call's rounds in order (drafted, ms) and the median it keeps")
    args = parser.parse_args()
    if args.calibration_rounds:
        import logging

        logging.basicConfig(format="%(message)s")
        logging.getLogger("hybridspec_hf.generation.calibration").setLevel(logging.DEBUG)
    report, table = tiny(args) if args.part == "tiny" else big(args)
    payload = {"title": f"GPU-resident rounds ({args.part})", "environment": environment(), **report,
               "notes": __doc__.split("\n\n")[2]}  # weights, routing and where acceptance comes from
    name = args.name or f"gpu_rounds_{args.part}"
    write_results(name, payload, table)
    if args.out:
        import shutil

        Path(args.out).mkdir(parents=True, exist_ok=True)  # a folder: the .json and the .md both land in it
        stem = results_path(name)
        for suffix in ("json", "json.gz", "md"):  # write_results packs a large payload as .json.gz
            if stem.with_name(f"{stem.name}.{suffix}").exists():
                shutil.copy(stem.with_name(f"{stem.name}.{suffix}"), args.out)
    print(table)


if __name__ == "__main__":
    main()
