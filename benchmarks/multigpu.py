"""HybridSpec with the target sharded over GPUs by transformers' tensor parallelism: AR vs vanilla DFlash vs
HybridSpec (timing mode), and greedy outputs of every strategy against stock generate() (correctness mode).

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 benchmarks/multigpu.py --out DIR      # 2× H200
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 benchmarks/multigpu.py --modes correctness --out DIR
    CUDA_VISIBLE_DEVICES= torchrun --standalone --nproc_per_node 2 benchmarks/multigpu.py --model tiny --device cpu \
        --out DIR                                                                      # CPU ranks over gloo (CI)
    torchrun --standalone --nproc_per_node 1 benchmarks/multigpu.py --model qwen35_35b_a3b --modes correctness \
        --out DIR                      # one H200, no tensor parallelism: the 35B-A3B shape's correctness mode

The target: the Qwen3.5-122B-A10B shape (`--model qwen35_122b_a10b`, 48 layers, 244 GB in bf16; `--layers` fewer)
with random weights, loaded by from_pretrained(tp_plan="auto") from a checkpoint that holds only its config and one
norm weight. Every other weight is "missing", so transformers initialises it on each rank's GPU, shard by shard, as
it would any missing weight: nothing of 244 GB is written or read. The replicated weights (and the random 5-layer
DFlash drafter, replicated) are then broadcast from rank 0, so that every rank holds the same replicas, computes the
same logits and takes the same decisions.
Timing mode, as benchmarks/e2e.py on one GPU: acceptance replayed from the declared profiles in benchmarks/profiles/
(first half of the rows; the calibrated strategies' acceptance estimator fitted on the other half), routing
"calibrated" (router choices replaced by ids sampled from the reuse fitted on the real tiny pair) or "uniform" (the
random router), verification and commit run for real; the text is not the model's. Methods: hf_eager (stock
generate(), eager, fewer tokens), ar (ours, GPU-resident), dflash, hybridspec, and static7/ratio/nominal if asked.
ms/token is rank 0's decode loop (the ranks run in lock step); memory is each GPU's peak during the timed call.
Correctness mode: prompts given on the CPU, as stock generate() takes them; each strategy's greedy output (real
acceptance of the random drafter, τ ≈ 1) against stock generate() on the same sharded model. In bf16 a w-token
verification can round differently from one-token steps, so a text may part from AR at a near-tie: the AR top-2
logit gap at the first divergence is reported.
Rank 0 writes DIR/multigpu_<name>.{json,md} after every method, so a cut-short run keeps what it measured;
`--budget-s` stops starting methods that would not finish in time (the GPU calls are limited).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, write_results  # noqa: E402
from e2e import (  # noqa: E402 - one definition of shapes, profiles, latency models, a timed method, the table
    QWEN35_MOE_SHAPES,
    build as e2e_build,
    ceiling_tokens_per_s,
    latency_for,
    markdown,
    model_config,
    profile_halves,
    routing_profile,
    run_method,
)

import hybridspec_hf  # noqa: E402
from hybridspec_hf import DFlashDrafter, HybridSpecConfig  # noqa: E402
from hybridspec_hf.generation.calibration import calibrate_latency  # noqa: E402

TIMING_METHODS = ["hf_eager", "ar", "dflash", "hybridspec", "static7", "ratio", "nominal"]
STRATEGIES = ["ar", "dflash", "static", "confidence", "nominal", "hybridspec", "ratio"]
HF_EAGER_TOKENS = 32  # stock generate() decodes eagerly: ~10² ms per token at this size


def log(*parts) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ------------------------------------------------------------------------------------------------------ the model
def build(model: str, layers: int | None, device: torch.device, scratch: Path):
    """The sharded random-weight target and a replicated random drafter (see the module docstring). One rank: the
    target whole on its device, built as benchmarks/e2e.py builds it (no tensor parallelism)."""
    if dist.get_world_size() == 1:
        return e2e_build(model, layers, device.type)
    import transformers
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    config = model_config(model, layers)
    if model == "tiny":  # colwise q/k/v shard whole heads: two KV heads for two ranks
        config.num_attention_heads, config.num_key_value_heads = 4, 2
    cls = Qwen3NextForCausalLM if config.model_type == "qwen3_next" else Qwen3_5MoeForCausalLM
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stub = scratch / f"hybridspec_config_only_{model}_{config.num_hidden_layers}"
    if dist.get_rank() == 0:
        config.save_pretrained(stub)
        # one real tensor (from_pretrained wants a weights file): the final norm as transformers initialises it
        # (Qwen3.5/Qwen3-Next norms scale by 1 + weight)
        save_file({"model.norm.weight": torch.zeros(config.hidden_size)}, str(stub / "model.safetensors"))
    dist.barrier()
    torch.manual_seed(0)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # thousands of "missing" weights: initialised, as intended
    try:
        target = cls.from_pretrained(stub, tp_plan="auto", dtype=dtype).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    if device.type == "cpu":
        target.set_experts_implementation("eager")  # as benchmarks/e2e.py: grouped_mm has no CPU float32 kernel
    with torch.device(device):  # made where it runs (a CPU copy of 0.7 B parameters takes a while)
        drafter = DFlashDrafter.from_target(target, num_layers=1 if model == "tiny" else 5, block_size=16)
    drafter = drafter.to(dtype).eval().bind_target(target)
    for module in (target, drafter):
        broadcast_replicas(module)
    return target, drafter


def broadcast_replicas(module: torch.nn.Module) -> None:
    """Rank 0's values for every parameter that is not sharded: ranks initialised them on their own."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in module.parameters():
            if isinstance(param, DTensor):
                if all(p.is_replicate() for p in param.placements):
                    dist.broadcast(param.to_local(), src=0)
            else:
                dist.broadcast(param.data, src=0)


def parameters_b(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e9  # a DTensor counts its global shape


# ------------------------------------------------------------------------------------------------------ helpers
class Budget:
    """Whether the next step fits the time left: rank 0 decides for all (ranks must run the same steps)."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds
        self.longest = 0.0

    def allows(self, guess_s: float = 30.0) -> bool:
        go = [time.perf_counter() + max(self.longest, guess_s) * 1.2 < self.end]
        dist.broadcast_object_list(go, src=0)
        return bool(go[0])

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


def memory_per_gpu_local() -> dict | None:
    """This rank's peak allocated by torch since the last reset, and its GPU's used memory (NCCL buffers, context)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "device_used_gib": round((total - free) / 2**30, 2), "device_total_gib": round(total / 2**30, 2)}


def memory_per_gpu() -> list[dict] | None:
    """`memory_per_gpu_local` of every rank (a collective)."""
    mine = memory_per_gpu_local()
    if mine is None:
        return None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def prompt_ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    """Random token ids on the CPU, the same on every rank."""
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------ timing mode
def timing(args, target, drafter, device, report: dict, save, budget: Budget) -> None:
    vocab = target.config.get_text_config().vocab_size
    prompt = prompt_ids(vocab, args.context, 0).to(device)
    methods = args.methods.split(",")
    report.update(profiles={}, latency={}, not_run=report.get("not_run", {}))
    plain: dict = {}
    for method in [m for m in methods if m in ("hf_eager", "ar")]:
        tokens = min(args.tokens, HF_EAGER_TOKENS) if method == "hf_eager" else args.tokens
        plain[method] = measure(target, drafter, prompt, method, None, tokens, budget, report, args)
    speculative = [m for m in methods if m not in ("hf_eager", "ar")]
    # vanilla DFlash and HybridSpec under every profile first, the other baselines after: a cut-short run keeps
    # the comparison the benchmark is for
    passes = [[m for m in speculative if m in ("dflash", "hybridspec")],
              [m for m in speculative if m not in ("dflash", "hybridspec")]]
    settings = []  # (label, routing, latency model, replayed rows, estimator, rows of the table)
    for routing_name in args.routing.split(","):
        routing = routing_profile(routing_name)
        latency = latency_for(target, drafter, routing, routing_name, report, args.cuda_graphs)
        for name in args.profiles.split(","):
            profile, replay, held, estimator = profile_halves(name)
            rows = {m: row for m, row in plain.items() if row is not None}
            ceiling = ceiling_tokens_per_s(target, replay.mean_accepted_length, profile.block_size, routing)
            report["profiles"][f"{name} / {routing_name} routing"] = {
                "mean_accepted_length": replay.mean_accepted_length, "routing": routing_name,
                "replayed_rows": replay.accepted.shape[0], "estimator_fit_rows": held.accepted.shape[0],
                # one GPU's bytes ceiling (e2e.py) with the sharded bytes split over the GPUs: an approximation
                "bytes_ceiling_tokens_per_s": ceiling * dist.get_world_size() if ceiling else None, "methods": rows}
            settings.append((f"{name} / {routing_name}", routing, latency, replay, estimator, rows))
    for methods_of_pass in passes:
        for label, routing, latency, replay, estimator, rows in settings:
            for method in methods_of_pass:
                row = measure(target, drafter, prompt, method, replay, args.tokens, budget, report, args,
                              routing, latency, estimator, label=label)
                if row is not None:
                    rows[method] = row
                save()


def measure(target, drafter, prompt, method, profile, tokens, budget, report, args, routing=None, latency=None,
            estimator=None, label="plain") -> dict | None:
    """One method through e2e.run_method, with every GPU's memory; None if the time budget does not allow it."""
    if not budget.allows():
        report["not_run"][f"{method} ({label})"] = f"time budget (--budget-s {args.budget_s:.0f}) spent"
        log("skipped (time budget):", method, label)
        return None
    log("running", method, label)
    start = time.perf_counter()
    try:
        row = run_method(target, drafter, prompt, method, profile, tokens, routing, latency, estimator,
                         cuda_graphs=args.cuda_graphs)
    except Exception as error:  # noqa: BLE001 - written down; the next methods say whether it was sticky
        row = {"error": f"{type(error).__name__}: {error}"}
        report.setdefault("errors", {})[f"{method} ({label})"] = row["error"] + "\n" + traceback.format_exc()[-2000:]
        log("FAILED", method, label, row["error"])
    row["memory_per_gpu"] = memory_per_gpu()
    row["method_s"] = round(time.perf_counter() - start, 1)
    budget.took(time.perf_counter() - start)
    log(method, label, {k: v for k, v in row.items() if k not in ("chosen_w", "round_ms_by_w")})
    return row


# ------------------------------------------------------------------------------------------------------ correctness
def correctness(args, target, drafter, device, report: dict, save, budget: Budget) -> None:
    vocab = target.config.get_text_config().vocab_size
    latency = None
    if any(s in ("nominal", "hybridspec", "ratio") for s in args.strategies.split(",")):
        start = time.perf_counter()
        latency = calibrate_latency(target, drafter, progress=False, cuda_graphs=args.cuda_graphs)
        report["correctness_calibration_s"] = round(time.perf_counter() - start, 1)
    cases = report.setdefault("correctness", [])
    prompts = [prompt_ids(vocab, length, 100 + seed) for seed, length in enumerate(args.correctness_prompts)]  # CPU
    references = [target.generate(prompt, do_sample=False, max_new_tokens=args.correctness_tokens)
                  for prompt in prompts]  # stock generate(), eager
    noise_floor(target, prompts, references, args.correctness_tokens, report, save, budget)
    ours_ar = {}  # our captured AR's text per prompt: a speculative strategy should match it (same kernels)
    for strategy in args.strategies.split(","):  # strategy-major: the later prompts replay the captured rounds
        for seed, (prompt, reference) in enumerate(zip(prompts, references)):
            length = prompt.shape[1]
            if not budget.allows(guess_s=20.0):
                report["not_run"][f"correctness {strategy} (prompt {seed})"] = "time budget spent"
                continue
            start = time.perf_counter()
            case = {"prompt": seed, "prompt_tokens": length, "strategy": strategy}
            try:
                out = target.generate(prompt, do_sample=False, max_new_tokens=args.correctness_tokens,
                                      assistant_model=None if strategy == "ar" else drafter,
                                      generation_strategy=strategy, hybridspec_config=HybridSpecConfig(
                                          latency_model=latency, cuda_graphs=args.cuda_graphs))
                telemetry = hybridspec_hf.get_telemetry(target)
                case.update(output_device=str(out.device), equal=torch.equal(out, reference), path=telemetry.path,
                            path_reason=telemetry.path_reason, rounds=len(telemetry.rounds), tau=telemetry.mean_emitted,
                            **divergence(target, reference, out, length))
                if strategy == "ar":
                    ours_ar[seed] = out
                elif seed in ours_ar:  # where it parts from our AR, and stock's top-2 gap at that prefix
                    apart = divergence(target, ours_ar[seed], out, length)
                    case.update(equal_to_our_ar=apart["first_divergence"] is None,
                                first_divergence_from_our_ar=apart["first_divergence"],
                                top2_gap_there=apart.get("ar_top2_gap"))
            except Exception as error:  # noqa: BLE001 - written down; the next cases say whether it was sticky
                case.update(equal=False, error=f"{type(error).__name__}: {error}",
                            traceback=traceback.format_exc()[-2000:])
            budget.took(time.perf_counter() - start)
            cases.append(case)
            log("correctness", case)
            save()


def noise_floor(target, prompts, references, tokens: int, report: dict, save, budget: Budget) -> None:
    """Stock generate() again with eager attention instead of SDPA: the same maths through other kernels. Where it
    parts from stock's SDPA text, and by how much there, is the bf16 noise floor our strategies are judged against
    (random weights give flat logits: ties at the first decoded tokens are common)."""
    cases = report.setdefault("correctness", [])
    saved = target.config.get_text_config()._attn_implementation
    try:
        target.set_attn_implementation("eager")
        for seed, (prompt, reference) in enumerate(zip(prompts, references)):
            if not budget.allows(guess_s=20.0):
                report["not_run"][f"noise floor (prompt {seed})"] = "time budget spent"
                continue
            start = time.perf_counter()
            out = target.generate(prompt, do_sample=False, max_new_tokens=tokens)
            case = {"prompt": seed, "prompt_tokens": prompt.shape[1], "strategy": "stock, eager attention",
                    "equal": torch.equal(out, reference), "path": "hf eager", "rounds": tokens, "tau": 1.0,
                    **divergence(target, reference, out, prompt.shape[1])}
            budget.took(time.perf_counter() - start)
            cases.append(case)
            log("correctness", case)
            save()
    except Exception as error:  # noqa: BLE001 - a reference only: written down, the strategies still run
        report.setdefault("errors", {})["noise floor"] = f"{type(error).__name__}: {error}"
    finally:
        target.set_attn_implementation(saved)


def divergence(target, reference: torch.Tensor, out: torch.Tensor, prompt_len: int) -> dict:
    """Where `out` first parts from AR's `reference` (generated-token index), and AR's top-2 logit gap there."""
    n = min(out.shape[1], reference.shape[1])
    differ = (out[0, :n] != reference[0, :n]).nonzero()
    if len(differ) == 0:
        return {"first_divergence": None}
    at = int(differ[0])
    with torch.no_grad():  # a collective forward: every rank computes the same prefix
        logits = target(input_ids=reference[:, :at].to(target.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return {"first_divergence": at - prompt_len, "ar_top2_gap": float(top[0] - top[1]),
            "ar_top_logit": float(top[0]), "ours_logit_gap": float(top[0] - logits[int(out[0, at])])}


def correctness_markdown(report: dict) -> str:
    cases = report.get("correctness", [])
    if not cases:
        return ""
    lines = ["", "", f"### Correctness: greedy outputs vs stock generate() on the sharded model (prompts on the CPU, "
                 f"{report['correctness_tokens']} new tokens)", "",
             "| prompt | strategy | equal | first divergence | AR top-2 gap there | AR's logit of ours there, below its top "
             "| path | rounds | τ | equal to our AR (first divergence; top-2 gap there) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        if "error" in c:
            lines.append(f"| {c['prompt']} ({c['prompt_tokens']} tok) | {c['strategy']} | failed: {c['error'][:150]} |"
                         + " |" * 7)
            continue
        gap = "–" if c.get("ar_top2_gap") is None else f"{c['ar_top2_gap']:.4f} (top {c['ar_top_logit']:.3f})"
        first = "–" if c["first_divergence"] is None else c["first_divergence"]
        below = "–" if c.get("ours_logit_gap") is None else f"{c['ours_logit_gap']:.4f}"
        ours = "–" if "equal_to_our_ar" not in c else "True" if c["equal_to_our_ar"] else (
            f"False ({c['first_divergence_from_our_ar']}" + ("" if c.get("top2_gap_there") is None
                                                              else f"; gap {c['top2_gap_there']:.4f}") + ")")
        lines.append(f"| {c['prompt']} ({c['prompt_tokens']} tok) | {c['strategy']} | {c['equal']} | {first} | {gap} | "
                     f"{below} | {c['path']} | {c['rounds']} | {c['tau']:.2f} | {ours} |")
    ours = [c for c in cases if not c["strategy"].startswith("stock")]
    equal = sum(c["equal"] for c in ours)
    lines += ["", f"{equal}/{len(ours)} outputs of our strategies equal to stock generate() (the \"stock, eager "
                  "attention\" rows are the bf16 noise floor: stock's own text through other attention kernels)."]
    speculative = [c for c in ours if "equal_to_our_ar" in c]
    if speculative:
        lines.append(f"{sum(c['equal_to_our_ar'] for c in speculative)}/{len(speculative)} outputs of the speculative "
                     "strategies equal to our captured AR's (the same kernels, one token per step).")
    return "\n".join(lines)


def memory_markdown(report: dict) -> str:
    lines = ["", "", "### Memory per GPU (peak allocated by torch during the timed call / used on the device, GiB)", "",
             "| method | " + " | ".join(f"GPU {r}" for r in range(report["world_size"])) + " |",
             "|---|" + "---|" * report["world_size"]]
    seen = set()
    for data in report.get("profiles", {}).values():
        for method, row in data["methods"].items():
            if method in seen or not row.get("memory_per_gpu"):
                continue
            seen.add(method)
            lines.append(f"| {method} | " + " | ".join(f"{m['peak_allocated_gib']:.1f} / {m['device_used_gib']:.1f}"
                                                        for m in row["memory_per_gpu"]) + " |")
    return "\n".join(lines) if seen else ""


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_122b_a10b", choices=[*QWEN35_MOE_SHAPES, "tiny"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: all 48)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: NCCL, a GPU per rank; cpu: gloo")
    parser.add_argument("--modes", default="timing", help="timing and/or correctness, comma-separated")
    parser.add_argument("--methods", default="hf_eager,ar,dflash,hybridspec,static7,ratio",
                        help="timing methods, comma-separated subset of " + ",".join(TIMING_METHODS))
    parser.add_argument("--profiles", default="dflash_like,low", help="acceptance profiles in benchmarks/profiles/")
    parser.add_argument("--routing", default="calibrated", help="calibrated and/or uniform (the random router)")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per timed call (hf_eager: at most 32)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of the timed calls (random ids)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="correctness mode's strategies")
    parser.add_argument("--correctness-tokens", type=int, default=64, help="new tokens per correctness call")
    parser.add_argument("--correctness-prompts", type=lambda s: [int(x) for x in s.split(",")], default=[64, 200],
                        help="prompt lengths of the correctness calls, comma-separated")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "uncaptured"],
                        help="HybridSpecConfig.cuda_graphs of our methods (uncaptured: resident rounds, no capture)")
    parser.add_argument("--budget-s", type=float, default=500.0, help="start no method that would end later than "
                        "this many seconds after the start (the model's build included)")
    parser.add_argument("--out", default=str(RESULTS), help="results folder (rank 0 writes multigpu_<name>.*)")
    parser.add_argument("--name", default=None, help="results stem (default <model>_tp<ranks>[_<modes>])")
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the config-only checkpoint is written")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if args.device == "cuda":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world or gpus == 0:
            print(f"multigpu.py: needs a GPU per rank (found {gpus}, {world} ranks); skipped. Run under torchrun "
                  "--nproc_per_node 2 on a 2-GPU machine, --nproc_per_node 1 for one GPU without tensor "
                  "parallelism, or --device cpu.", flush=True)
            return 0
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (lent machines)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    name = args.name or f"{args.model}_tp{world}" + ("" if modes == ["timing"] else "_" + "_".join(modes))
    stem = Path(args.out) / f"multigpu_{name}"
    title = (f"Tensor parallelism over {world} ranks ({args.model})" if world > 1
             else f"One {args.device} device, no tensor parallelism ({args.model})")
    if dist.get_rank() == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    budget = Budget(args.budget_s)  # from the start: building the model counts
    log(f"building {args.model} ({args.layers or 'all'} layers) over {world} ranks on {device.type}")
    try:
        target, drafter = build(args.model, args.layers, device, Path(args.scratch))
    except Exception as error:  # e.g. out of memory: say so in the results folder too (then --layers fewer)
        if dist.get_rank() == 0:
            write_results(str(stem), {"title": title,
                                      "environment": environment(), "build_error": f"{type(error).__name__}: {error}",
                                      "memory_per_gpu": memory_per_gpu_local()},
                          f"Building the model failed: {type(error).__name__}: {error}")
        raise
    build_s = time.perf_counter() - started
    report: dict = {
        "model": args.model, "layers": target.config.get_text_config().num_hidden_layers,
        "parameters_b": parameters_b(target), "drafter_parameters_b": parameters_b(drafter),
        "device": (f"{world} × {device.type} (tensor parallelism, tp_plan='auto')" if world > 1
                   else f"one {device.type} device (no tensor parallelism)"), "world_size": world,
        "weights": ("random (config-only checkpoint; missing weights initialised by transformers on each rank)"
                    if world > 1 else "random (built whole on one device as benchmarks/e2e.py builds it, seed 0)"),
        "acceptance": "timing mode: replayed from benchmarks/profiles/ (" + args.profiles + "); correctness mode: "
                      "real acceptance of a random drafter",
        "cuda_graphs": args.cuda_graphs, "build_s": round(build_s, 1), "memory_after_build": memory_per_gpu(),
        "not_run": {}, "profiles": {}, "correctness_tokens": args.correctness_tokens,
    }
    log(f"built in {build_s:.0f} s: {report['parameters_b']:.1f} B parameters; memory {report['memory_after_build']}")

    def save() -> None:
        if dist.get_rank() != 0:
            return
        env = environment()
        env.update(world_size=world, nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda"
                   else None, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"),
                   gpus=[torch.cuda.get_device_name(i) for i in range(world)] if device.type == "cuda" else None)
        one_rank = ("One rank: no tensor parallelism; the target is built whole on one device as benchmarks/e2e.py "
                    "builds it (random weights, seed 0), not from the config-only checkpoint described below.\n\n")
        payload = {"title": title, "environment": env, **report,
                   "notes": (one_rank if world == 1 else "") + "\n\n".join(__doc__.split("\n\n")[2:])}
        table = markdown(report) + memory_markdown(report) + correctness_markdown(report) if report["profiles"] \
            else correctness_markdown(report)
        write_results(str(stem), payload, table)

    if "correctness" in modes:
        correctness(args, target, drafter, device, report, save, budget)
    if "timing" in modes:
        timing(args, target, drafter, device, report, save, budget)
    report["total_s"] = round(time.perf_counter() - started, 1)
    save()
    failed = [c for c in report.get("correctness", []) if "error" in c] + list(report.get("errors", {}))
    log(f"done in {report['total_s']:.0f} s; results in {stem}.json/.md", f"({len(failed)} failed)" if failed else "")
    # run 23 hung here after its results: graphs that captured NCCL collectives still held the communicators, so
    # free them (and let every rank finish its work) before the barrier and the process group's teardown
    hybridspec_hf.release_graphs(target)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
