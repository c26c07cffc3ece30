"""Train the tiny pair end to end in one process (one GPU call): target → responses → drafter → evaluation.

    # on the H200 (the working tree travels; .data/tiny_pair is carried):
    python scripts/tiny_pair/run_pipeline.py --work /tmp/tiny_pair --out $OUT --deadline-s 480
    # drafter only, for a target trained earlier (carried in .data/tiny_pair/target):
    python scripts/tiny_pair/run_pipeline.py --work /tmp/tiny_pair --out $OUT --target-dir .data/tiny_pair/target \
        --deadline-s 175 --regen-budget-s 40 --eval-reserve-s 30
    # CPU smoke test of the same code path, seconds per stage:
    python scripts/tiny_pair/run_pipeline.py --work /tmp/tp --out /tmp/tp/out --smoke
    # drafter variants side by side: one response stage, then one training process per variant, all at once on
    # the same device and clock (the tiny drafters leave the GPU mostly idle), each evaluated on the same prompts:
    python scripts/tiny_pair/run_pipeline.py ... --init-drafter hybridspec_hf/assets/tiny_pair/drafter \
        --variant 'ce={}' --variant 'kd={"distill_weight": 0.5}' \
        --variant 'kd_l7={"distill_weight": 0.5, "target_layer_ids": [1, 3, 5, 7]}'

Stages, each bounded by the wall-clock deadline (measured from the start of this script):
1. target: `train_target.py` for --target-budget-s, saved in bf16; held-out perplexity of the SAVED weights in fp32.
2. responses: greedy continuations of the held-out prompts (evaluation set) first, which also times one generate
   batch; from that, as many training prompts as fit --regen-budget-s are answered by the target.
3. drafter: `hybridspec_hf.drafter.training.train_drafter` for the time left minus a reserve for the evaluation
   (its learning-rate schedule follows the clock).
4. evaluation: τ per block size on the held-out continuations, calibration, distinct-n (`evaluate_drafter`), with
   the weights as saved (bf16) loaded in fp32.
Everything lands in --out as at most 8 files: target/ (config and ≤ 14 MB shards), drafter.tar, results.json, logs
(with --variant: drafter_<name>.tar each, at most 5 variants, and their logs in variant_logs.tar).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import shutil
import tarfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_target as tt  # noqa: E402

from hybridspec_hf.drafter import DFlashDrafter  # noqa: E402
from hybridspec_hf.drafter.training import (  # noqa: E402
    evaluate_drafter,
    load_prompts,
    regenerate_responses,
    train_drafter,
)
from hybridspec_hf.tiny_pair import ASSETS_DIR  # noqa: E402

START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def stage(name: str) -> None:
    print(f"=== {name} at {elapsed():.0f} s", flush=True)


def versions() -> dict:
    import accelerate
    import tokenizers
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "tokenizers": tokenizers.__version__,
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


@torch.no_grad()
def saved_target_perplexity(target_dir: Path, data: Path, seq_len: int, device, max_windows: int | None) -> dict:
    """Held-out loss of the weights as shipped (bf16 on disk, upcast to fp32, no autocast)."""
    from contextlib import nullcontext

    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device)
    loss, scored = tt.heldout_loss(model, load_file(str(data))["heldout"], seq_len, 64, device, nullcontext, max_windows)
    return {"heldout_loss_nats": loss, "heldout_perplexity": math.exp(loss), "heldout_tokens_scored": scored,
            "dtype": "float32 from bf16 weights"}


VARIANT_KEYS = {"distill_weight", "distill_topk", "target_layer_ids", "lr", "gamma", "num_anchors", "batch_size"}
MAX_VARIANTS = 5  # drafter_<name>.tar each, beside results.json and variant_logs.tar: the 8 files a call returns


def parse_variant(text: str) -> tuple[str, dict]:
    """'name={"distill_weight": 0.5}' -> ("name", {...}); names are file-name safe, keys train_drafter's."""
    name, sep, spec = text.partition("=")
    if not sep or not name.replace("_", "").isalnum():
        raise ValueError(f"--variant {text!r}: write NAME=JSON with a name of letters, digits and _ "
                         "(e.g. kd={\"distill_weight\": 0.5})")
    try:
        options = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--variant {name}: {spec!r} is not JSON ({e})") from None
    if not isinstance(options, dict) or set(options) - VARIANT_KEYS:
        raise ValueError(f"--variant {name}: keys must be among {sorted(VARIANT_KEYS)}, got {spec!r}")
    return name, options


def drafter_options(args, overrides: dict | None = None) -> dict:
    """train_drafter keywords of one drafter run: the command line's, then a variant's."""
    options = {"lr": args.drafter_lr, "batch_size": 2 if args.smoke else args.drafter_batch_size,
               "num_anchors": 8 if args.smoke else 64, "distill_weight": args.distill_weight,
               "distill_topk": args.distill_topk, "target_layer_ids": args.target_layer_ids}
    return {**options, **(overrides or {})}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="scratch folder (models, response shards)")
    parser.add_argument("--out", required=True, help="folder for what comes back (≤ 8 files)")
    parser.add_argument("--data-dir", default=str(REPO / ".data" / "tiny_pair"))
    parser.add_argument("--deadline-s", type=float, default=480.0)
    parser.add_argument("--target-budget-s", type=float, default=200.0)
    parser.add_argument("--regen-budget-s", type=float, default=75.0)
    parser.add_argument("--eval-reserve-s", type=float, default=45.0)
    parser.add_argument("--drafter-layers", type=int, default=None,
                        help="drafter decoder layers (default 3; with --init-drafter: its own, or more to grow it)")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--regen-batch-size", type=int, default=512)
    parser.add_argument("--max-train-prompts", type=int, default=8192)
    parser.add_argument("--drafter-batch-size", type=int, default=32)
    parser.add_argument("--drafter-lr", type=float, default=1e-3)
    parser.add_argument("--target-dir", default=None, help="use this trained target and skip stage 1")
    parser.add_argument("--init-target", default=None,
                        help="stage 1 continues this trained target (a saved folder) with the unlikelihood stage "
                             "alone (--ul-budget-s), no pre-training; the drafter stages follow unless --target-only")
    parser.add_argument("--init-drafter", default=None, help="continue training this drafter (a saved folder)")
    parser.add_argument("--target-only", action="store_true", help="stop after stage 1 (the target comes back)")
    parser.add_argument("--ul-budget-s", type=float, default=120.0,
                        help="the target's unlikelihood fine-tuning after pre-training (train_target.py --ul-*)")
    parser.add_argument("--ul-lr", type=float, default=3e-4)
    parser.add_argument("--ul-alpha", type=float, default=1.0)
    parser.add_argument("--ul-distinct-goal", type=float, default=0.72)
    parser.add_argument("--ul-steps-per-round", type=int, default=4,
                        help="updates per round of greedy continuations (train_target.py --ul-steps-per-round)")
    parser.add_argument("--distill-weight", type=float, default=0.0,
                        help="share of the drafter's loss on the target's top-k distribution (train_drafter)")
    parser.add_argument("--distill-topk", type=int, default=32)
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                        help="target layers the drafter reads (with --init-drafter: more than its own widen it)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="train this drafter variant beside the others (train_drafter keywords: "
                             f"{', '.join(sorted(VARIANT_KEYS))}); repeatable, at most {MAX_VARIANTS}")
    parser.add_argument("--variant-worker", default=None, help=argparse.SUPPRESS)  # NAME=JSON, run by the parent
    parser.add_argument("--variant-until", type=float, default=None, help=argparse.SUPPRESS)  # epoch seconds
    parser.add_argument("--smoke", action="store_true", help="toy sizes for a CPU dry run")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what variant workers are started with
    if args.target_dir and args.init_target:
        parser.error("--target-dir (use a target as it is) and --init-target (train it further) exclude each other")
    try:
        args.variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        parser.error(str(e))
    if len(args.variants) > MAX_VARIANTS or len({n for n, _ in args.variants}) != len(args.variants):
        parser.error(f"--variant: at most {MAX_VARIANTS}, each with its own name (got "
                     f"{[n for n, _ in args.variants]})")
    if args.variants and args.target_only:
        parser.error("--variant trains drafters; --target-only stops before them")
    if args.variant_worker:
        return variant_worker(args)
    work, out, data_dir = Path(args.work), Path(args.out), Path(args.data_dir)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "versions": versions(), "argv": args.argv, "stages_s": {}}

    try:
        run_stages(args, work, out, data_dir, device, results)
    except BaseException as e:
        import traceback

        results["error"] = traceback.format_exc()
        raise e
    finally:  # whatever finished comes back, also after a failure
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def run_stages(args, work: Path, out: Path, data_dir: Path, device, results: dict) -> None:
    if args.target_dir:
        target_dir = Path(args.target_dir)
        results["target"] = {"from": str(target_dir)}
    else:
        target_dir = work / "target"
        train_target_stage(args, target_dir, work, out, data_dir, device, results)
        if args.target_only:
            return
    drafter_stages(args, target_dir, work, out, data_dir, device, results)


def train_target_stage(args, target_dir: Path, work: Path, out: Path, data_dir: Path, device, results: dict) -> None:
    stage("target")
    target_args = argparse.ArgumentParser()
    tt.add_arguments(target_args)
    cli = ["--data", str(data_dir / "corpus.safetensors"), "--out", str(target_dir),
           "--log", str(work / "target_log.json"), "--time-budget-s", str(args.target_budget_s),
           "--ul-budget-s", str(args.ul_budget_s), "--ul-lr", str(args.ul_lr), "--ul-alpha", str(args.ul_alpha),
           "--ul-distinct-goal", str(args.ul_distinct_goal), "--ul-steps-per-round", str(args.ul_steps_per_round)]
    if args.init_target:
        cli += ["--init-from", args.init_target, "--skip-pretraining"]
    if args.smoke:
        cli += ["--steps", "3", "--batch-size", "2", "--seq-len", "64", "--eval-every", "2", "--eval-windows", "2",
                "--heldout-max-windows", "4", "--warmup-steps", "1", "--log-every", "1", "--ul-prompts", "4",
                "--ul-new-tokens", "16", "--ul-steps-per-round", "2", "--ul-monitor-prompts", "2"]
    target_result = tt.train_target(target_args.parse_args(cli))
    curves = ("loss_curve", "heldout_curve", "unlikelihood_log")
    results["target"] = {k: v for k, v in target_result.items() if k not in curves}
    results["target"]["shipped_weights"] = saved_target_perplexity(
        target_dir, data_dir / "corpus.safetensors", 64 if args.smoke else 512, device, 4 if args.smoke else None)
    print(json.dumps(results["target"]["shipped_weights"]), flush=True)
    results["target"]["loss_curve"] = target_result["loss_curve"]
    results["target"]["heldout_curve"] = target_result["heldout_curve"]
    results["target"]["unlikelihood_log"] = target_result["unlikelihood_log"]
    results["stages_s"]["target"] = elapsed()
    shutil.copytree(target_dir, out / "target")  # shards under the 16 MiB a returned file may have


def drafter_stages(args, target_dir: Path, work: Path, out: Path, data_dir: Path, device, results: dict) -> None:
    stage("responses")
    from transformers import AutoTokenizer, Qwen3_5MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS_DIR / "tokenizer"))
    target = Qwen3_5MoeForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    drafter_dir = work / "drafter"
    max_new = 16 if args.smoke else args.max_new_tokens
    regen_batch = 4 if args.smoke else args.regen_batch_size
    eval_prompts = load_prompts(data_dir / "heldout_prompts.jsonl")[: 4 if args.smoke else None]
    train_prompts = load_prompts(data_dir / "train_prompts.jsonl")
    common = dict(max_new_tokens=max_new, max_prompt_tokens=512, batch_size=regen_batch)
    t0 = time.perf_counter()
    eval_samples = regenerate_responses(target, tokenizer, eval_prompts, drafter_dir / "eval_regen", temperature=0.0,
                                        desc="regenerate (eval, greedy)", **common)
    per_prompt = (time.perf_counter() - t0) / max(1, math.ceil(len(eval_prompts) / regen_batch)) / regen_batch
    budget = min(args.regen_budget_s, args.deadline_s - elapsed() - args.eval_reserve_s - 60)
    n_train = max(regen_batch, min(args.max_train_prompts, int(budget / (1.15 * per_prompt)) // regen_batch * regen_batch))
    if args.smoke:
        n_train = 8
    train_prompts = train_prompts[:n_train]
    (work / "train_prompts_used.json").write_text(json.dumps(train_prompts))  # what variant workers train on
    print(f"{per_prompt * 1e3:.1f} ms per prompt -> {n_train} training prompts", flush=True)
    regenerate_responses(target, tokenizer, train_prompts, drafter_dir / "regen", temperature=0.0,
                         desc="regenerate (train)", **common)
    results["responses"] = {"eval_prompts": len(eval_prompts), "train_prompts": n_train,
                            "seconds_per_prompt_estimate": per_prompt,
                            "examples": [{"prompt": tokenizer.decode(s.prompt_ids),
                                          "response": tokenizer.decode(s.response_ids)} for s in eval_samples[:6]]}
    results["stages_s"]["responses"] = elapsed()

    if args.variants:
        del target
        return run_variants(args, work, out, drafter_dir, results)

    stage("drafter")
    budget = args.deadline_s - elapsed() - args.eval_reserve_s
    print(f"drafter training budget {budget:.0f} s", flush=True)
    train_one_drafter(args, target, tokenizer, train_prompts, drafter_dir, budget, drafter_options(args))
    results["drafter"] = json.loads((drafter_dir / "training_log.json").read_text())
    results["stages_s"]["drafter"] = elapsed()
    with tarfile.open(out / "drafter.tar", "w") as tar:
        for name in ("config.json", "model.safetensors"):
            tar.add(drafter_dir / name, arcname=f"drafter/{name}")

    stage("evaluation")  # the weights as shipped: bf16 on disk, fp32 here, like the CPU demo
    drafter = DFlashDrafter.from_pretrained(str(drafter_dir), dtype=torch.float32).to(device).eval()
    drafter.bind_target(target)
    results["drafter_eval"] = evaluate_drafter(target, drafter, tokenizer, eval_prompts, drafter_dir / "eval_regen",
                                               block_sizes=(16, 8), **common)
    results["stages_s"]["evaluation"] = elapsed()
    print(json.dumps({"tau": {b: r["tau"] for b, r in results["drafter_eval"]["block_sizes"].items()},
                      "ppl": results["target"].get("shipped_weights", {}).get("heldout_perplexity"),
                      "distinct": results["drafter_eval"]["distinct_ngram_ratio"], "elapsed_s": elapsed()}), flush=True)


def train_one_drafter(args, target, tokenizer, train_prompts, drafter_dir: Path, budget: float, options: dict) -> None:
    layers = args.drafter_layers if args.init_drafter else args.drafter_layers or 3  # None: the init's own
    train_drafter(target, train_prompts, drafter_dir, tokenizer=tokenizer, num_layers=layers,
                  block_size=16, steps=4 if args.smoke else 100_000, time_budget_s=min(budget, 60) if args.smoke
                  else budget, warmup_ratio=0.04, weight_decay=0.01, grad_clip=1.0,
                  max_new_tokens=16 if args.smoke else args.max_new_tokens, max_prompt_tokens=512,
                  regen_batch_size=4 if args.smoke else args.regen_batch_size, temperature=0.0,
                  save_dtype=torch.bfloat16, log_every=1 if args.smoke else 50, init_drafter=args.init_drafter,
                  **options)


def run_variants(args, work: Path, out: Path, drafter_dir: Path, results: dict) -> None:
    """One process per variant, all at once, each on a copy of the response shards, to the same deadline."""
    stage(f"drafter variants {[name for name, _ in args.variants]}")
    until = time.time() + args.deadline_s - elapsed()
    procs = {}
    for name, options in args.variants:
        own = work / "variants" / name
        for shards in ("regen", "eval_regen"):
            shutil.copytree(drafter_dir / shards, own / shards, dirs_exist_ok=True)
        log = open(work / f"variant_{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, __file__, *strip_variants(args.argv),
                                         "--variant-worker", f"{name}={json.dumps(options)}",
                                         "--variant-until", str(until)],
                                        stdout=log, stderr=subprocess.STDOUT), log)
    for name, (proc, log) in procs.items():
        proc.wait()
        log.close()
    results["variants"] = {}
    for name, (proc, _) in procs.items():
        path = work / "variants" / name / "variant_result.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        results["variants"][name] = result | {"returncode": proc.returncode}
        if (work / "variants" / name / "model.safetensors").exists():
            with tarfile.open(out / f"drafter_{name}.tar", "w") as tar:
                for file in ("config.json", "model.safetensors"):
                    tar.add(work / "variants" / name / file, arcname=f"drafter_{name}/{file}")
    with tarfile.open(out / "variant_logs.tar", "w") as tar:
        for name in procs:
            tar.add(work / f"variant_{name}.log", arcname=f"variant_{name}.log")
    results["stages_s"]["variants"] = elapsed()
    print(json.dumps({name: {"tau": {b: r["tau"] for b, r in v.get("eval", {}).get("block_sizes", {}).items()},
                             "returncode": v["returncode"]} for name, v in results["variants"].items()}), flush=True)
    failed = [name for name, v in results["variants"].items() if v["returncode"]]
    if failed:
        raise RuntimeError(f"drafter variants {failed} failed: see variant_logs.tar")


def strip_variants(argv: list[str]) -> list[str]:
    """The command line without its --variant options (a worker trains one variant, named on its own line)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--variant":
            skip = True
        elif not a.startswith("--variant="):
            kept.append(a)
    return kept


def variant_worker(args) -> None:
    """One variant (run by `run_variants`): train on the copied responses until the parent's deadline less the
    evaluation reserve, then evaluate the weights as saved; result in <work>/variants/<name>/variant_result.json."""
    from transformers import AutoTokenizer, Qwen3_5MoeForCausalLM

    name, overrides = parse_variant(args.variant_worker)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    own = Path(args.work) / "variants" / name
    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS_DIR / "tokenizer"))
    target = Qwen3_5MoeForCausalLM.from_pretrained(str(args.target_dir or Path(args.work) / "target"),
                                                   dtype=torch.float32).to(device).eval()
    train_prompts = json.loads((Path(args.work) / "train_prompts_used.json").read_text())
    eval_prompts = load_prompts(Path(args.data_dir) / "heldout_prompts.jsonl")[: 4 if args.smoke else None]
    budget = args.variant_until - time.time() - args.eval_reserve_s
    print(f"variant {name} {overrides}: training budget {budget:.0f} s", flush=True)
    if budget < 5:
        raise SystemExit(f"variant {name}: {budget:.0f} s left for training before the evaluation reserve; raise "
                         "--deadline-s or lower --regen-budget-s / --eval-reserve-s")
    train_one_drafter(args, target, tokenizer, train_prompts, own, budget, drafter_options(args, overrides))
    drafter = DFlashDrafter.from_pretrained(str(own), dtype=torch.float32).to(device).eval()
    drafter.bind_target(target)
    common = dict(max_new_tokens=16 if args.smoke else args.max_new_tokens, max_prompt_tokens=512,
                  batch_size=4 if args.smoke else args.regen_batch_size)
    result = {"options": drafter_options(args, overrides),
              "training_log": json.loads((own / "training_log.json").read_text()),
              "eval": evaluate_drafter(target, drafter, tokenizer, eval_prompts, own / "eval_regen",
                                       block_sizes=(16, 8), **common)}
    (own / "variant_result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"variant": name, "tau": {b: r["tau"] for b, r in result["eval"]["block_sizes"].items()}}),
          flush=True)


if __name__ == "__main__":
    main()
