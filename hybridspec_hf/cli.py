"""`hybridspec demo | calibrate | train-drafter | bench` — the command line. Uses the public API only.

Every subcommand has its own help: `hybridspec demo --help`. Exit status 0 on success, 1 when the demo's texts
differ, 2 for usage errors, 3 when `calibrate` refuses to overwrite a cached calibration (see --force).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridspec_hf.config import KERNEL_BACKENDS, STRATEGIES

EXIT_REFUSED = 3


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks and appends each option's default unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in help_text or unset or not action.option_strings:
            return help_text
        return help_text + " (default: %(default)s)"


def _random_pair(seed: int = 0):
    """A tiny random Qwen3.5-MoE target and a fresh drafter (used when the trained pair is not installed)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from hybridspec_hf import DFlashDrafter

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
    )
    target = Qwen3_5MoeForCausalLM(config).eval()
    drafter = DFlashDrafter.from_target(target, num_layers=1, block_size=8).eval()
    return target, drafter, None


def _load_pair(args):
    """(target, drafter, tokenizer or None): --target/--drafter if given, else --random, else the shipped tiny pair."""
    if getattr(args, "target", None):
        from hybridspec_hf import DFlashDrafter
        from hybridspec_hf.drafter.training import load_target

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = getattr(torch, args.dtype) if args.dtype else None
        target, tokenizer = load_target(args.target, None, dtype, device)
        drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=next(target.parameters()).dtype)
        return target, drafter.to(device).eval().bind_target(target), tokenizer
    if args.random:
        return _random_pair()
    from hybridspec_hf.tiny_pair import load_tiny_pair

    return load_tiny_pair()


def _settings(tokenizer):
    """The trained pair ships an acceptance estimator fitted on its traces (benchmarks/acceptance_traces.py)."""
    from hybridspec_hf import HybridSpecConfig

    if tokenizer is not None:
        from hybridspec_hf.tiny_pair import ASSETS_DIR

        fitted = ASSETS_DIR / "acceptance_estimator.json"
        if fitted.exists():
            return HybridSpecConfig(acceptance_estimator=str(fitted))
    return HybridSpecConfig()


def _timed_generate(target, prompt, **kwargs):
    start = time.perf_counter()
    out = target.generate(prompt, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def demo(args) -> int:
    """Prompt → AR and HybridSpec side by side on CPU: identical text, tokens/s, speedup, per-round summary."""
    import hybridspec_hf

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = _load_pair(args)
    if tokenizer is not None:
        from hybridspec_hf.tiny_pair import heldout_prompts

        prompt_text = heldout_prompts(args.prompt_index + 1)[args.prompt_index]  # a file never trained on
        prompt = tokenizer(prompt_text, return_tensors="pt").input_ids
    else:
        prompt_text, prompt = None, torch.randint(0, target.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    spec = dict(assistant_model=drafter, generation_strategy=args.strategy, hybridspec_config=_settings(tokenizer))
    for kwargs in ({}, spec):  # warm-up (first calls import and initialise lazily)
        target.generate(prompt, do_sample=False, max_new_tokens=8, **kwargs)
    ar, ar_s = _timed_generate(target, prompt, max_new_tokens=args.max_new_tokens)
    ours, ours_s = _timed_generate(target, prompt, max_new_tokens=args.max_new_tokens, **spec)
    telemetry = hybridspec_hf.get_telemetry(target)
    new = ar.shape[1] - prompt.shape[1]

    def text(ids):
        return tokenizer.decode(ids[0, prompt.shape[1] :]) if tokenizer is not None else str(ids[0, prompt.shape[1] :].tolist())

    if prompt_text is not None:
        print("=== prompt\n" + prompt_text)
    identical = torch.equal(ar, ours)
    print(f"=== continuation ({new} tokens; AR and HybridSpec {'identical' if identical else 'DIFFERENT'})")
    print(text(ar))
    if not identical:
        print("=== HybridSpec continuation\n" + text(ours))
    print("=== speed (CPU, batch 1, greedy)")
    print(f"AR:         {new / ar_s:8.1f} tokens/s")
    print(f"{args.strategy + ':':12s}{new / ours_s:8.1f} tokens/s   speedup {ar_s / ours_s:.2f}x")
    print(f"rounds: {len(telemetry.rounds)}, mean accepted drafts {telemetry.mean_accepted:.2f}, "
          f"τ (tokens/round) {telemetry.mean_emitted:.2f}, mean verified w {telemetry.mean_verified:.2f}")
    if telemetry.context_lookup:
        copied = sum(bool(r.lookup) for r in telemetry.rounds)
        print(f"context lookup: {copied} of {sum(r.drafted for r in telemetry.rounds)} drafted rounds verified the "
              "tokens that followed an earlier occurrence of the last ones instead of the drafts (marked *)")
    elif telemetry.context_lookup_off and args.strategy not in ("ar", "dflash", "static"):
        print(f"context lookup: off ({telemetry.context_lookup_off})")
    print("per round (w/accepted/emitted):",
          " ".join(f"{r.w}/{r.accepted}/{r.emitted}{'*' if r.lookup else ''}" for r in telemetry.rounds))
    return 0 if identical else 1


# ------------------------------------------------------------------------------------------------- calibrate
def median_of_passes(models: list):
    """One LatencyModel from several calibration passes: the median of every C(w), C_ar, s(w) and η.

    A pass hit by a stall of the machine is an outlier in every entry, so with 3 or more passes the median ignores
    it. The expert model (router statistics, not timings) is the first pass's.
    """
    import dataclasses

    def median(name):
        return torch.stack([getattr(m, name) for m in models]).median(dim=0).values

    batches = {} if models[0].batch_sizes is None else \
        dict(batch_cost=median("batch_cost"), batch_cost_ar=median("batch_cost_ar"))
    return dataclasses.replace(models[0], cost=median("cost"), cost_ar=median("cost_ar"), sunk=median("sunk"),
                               eta=statistics.median(m.eta for m in models), **batches)


def relative_spread(models: list, reference) -> float:
    """The largest |pass − reference| / reference over every C(w) and C_ar of every pass."""
    def table(m):
        return torch.cat([m.cost.flatten(), m.cost_ar.flatten()])

    ref = table(reference)
    return max(float(((table(m) - ref).abs() / ref).max()) for m in models)


def _plausibility_problems(model, previous, tolerance: float, spread: float, change_limit: float) -> list[str]:
    """Why `model` should not replace `previous` (a cached calibration or None): empty when it may."""
    problems = []
    if spread > tolerance:
        problems.append(f"the passes disagree by up to {spread:.0%} (more than --tolerance {tolerance:.0%}): "
                        "the machine was probably busy during some of them")
    if float((model.cost_ar > 1.25 * model.cost[:, -1]).any()):
        problems.append("a plain decoding step measured slower than a whole round verifying the full block")
    if previous is not None and previous.cost.shape == model.cost.shape and torch.equal(
            previous.context_lens, model.context_lens):
        change = relative_spread([model], previous)
        if change > change_limit:
            problems.append(f"it differs from the cached calibration by up to {change:.0%} (more than "
                            f"--max-change {change_limit:.0%})")
    return problems


def _describe(model) -> str:
    lines = []
    for row, context in enumerate(model.context_lens.tolist()):
        ms = " ".join(f"{float(c) * 1e3:.1f}" for c in model.cost[row])
        lines.append(f"  context {context}: C(w) for w = 1..{model.block_size} [ms]: {ms}; "
                     f"plain step C_ar {float(model.cost_ar[row]) * 1e3:.1f} ms")
    for index, batch in enumerate([] if model.batch_sizes is None else model.batch_sizes.tolist()[1:], start=1):
        ms = " ".join(f"{float(c) * 1e3:.1f}" for c in model.batch_cost[index, 0])
        lines.append(f"  batch {batch}, context {model.context_lens[0]}: C(w) [ms]: {ms}; plain step "
                     f"{float(model.batch_cost_ar[index, 0]) * 1e3:.1f} ms")
    lines.append(f"  η = {model.eta * 1e6:.1f} µs per extra distinct expert")
    return "\n".join(lines)


def _calibration_text(args, tokenizer) -> torch.Tensor | None:
    """Token ids [1, L] of real text for calibration prompts (real routing), or None for random tokens."""
    if args.text:
        if tokenizer is None:
            raise SystemExit("--text needs a tokenizer: it comes with --target (the --random pair has none).")
        return tokenizer(Path(args.text).read_text(encoding="utf-8"), return_tensors="pt").input_ids
    if tokenizer is not None and not args.target:
        from hybridspec_hf.tiny_pair import heldout_prompts

        return tokenizer("\n".join(heldout_prompts(64)), return_tensors="pt").input_ids
    return None


def calibrate(args) -> int:
    """Time whole rounds for every w, a plain step and the routers on this machine; cache them if plausible."""
    from hybridspec_hf.generation.calibration import cache_key, cache_path, calibrate_latency
    from hybridspec_hf.selector import LatencyModel

    if bool(args.target) != bool(args.drafter):
        raise SystemExit("Pass both --target and --drafter (or neither, for the shipped tiny pair).")
    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = _load_pair(args)
    key = cache_key(target, drafter, args.kernel_backend)
    path = Path(args.output) if args.output else cache_path(key)
    name = args.target or ("a tiny random pair" if args.random else "the shipped tiny pair")
    device = next(target.parameters()).device
    print(f"Calibrating {name} ({type(target).__name__}, {next(target.parameters()).dtype}, {device}; drafter block "
          f"size {drafter.config.block_size}): {args.passes} passes × {args.repeats} repeats of whole rounds at every "
          f"verified length w, and of a plain decoding step, at contexts {args.context}.")
    text = _calibration_text(args, tokenizer)
    passes = []
    for index in range(args.passes):
        print(f"pass {index + 1}/{args.passes}")
        passes.append(calibrate_latency(target, drafter, context_lens=tuple(args.context), repeats=args.repeats,
                                        kernel_backend=args.kernel_backend, prompt_ids=text,
                                        batch_sizes=tuple(args.batch_sizes)))
    model = median_of_passes(passes)
    model.key = key
    spread = relative_spread(passes, model)
    print(f"Median of the passes (they agree within {spread:.0%}):\n{_describe(model)}")
    previous = LatencyModel.load(path, key) if path.exists() else None
    problems = _plausibility_problems(model, previous, args.tolerance, spread, args.max_change)
    if problems and not args.force:
        rejected = path.with_name(path.stem + ".rejected.json")
        model.save(rejected)
        print(f"Not saved to {path}: " + "; ".join(problems) + f".\nThe new calibration is in {rejected}. Re-run "
              "when the machine is idle, or pass --force to save it anyway.", file=sys.stderr)
        if previous is not None:
            print(f"The cached calibration in use:\n{_describe(previous)}", file=sys.stderr)
        return EXIT_REFUSED
    for problem in problems:
        print(f"warning (saved anyway, --force): {problem}", file=sys.stderr)
    model.save(path)
    print(f"Saved {path}" + ("" if args.output else " (generate() reads it for this model, dtype, device and versions)"))
    return 0


def train_drafter(args) -> int:
    """`hybridspec train-drafter`: the drafter is saved to --output-dir; nothing to return on the command line."""
    from hybridspec_hf.drafter.training import run_train_drafter

    run_train_drafter(args)
    print(f"Drafter saved in {args.output_dir}")
    return 0


# ------------------------------------------------------------------------------------------------------ parser
DEMO = """AR and HybridSpec side by side on CPU with the shipped tiny trained pair (a 10 M-parameter Qwen3.5-MoE target
trained on the Python standard library + a 3.8 M-parameter DFlash drafter), on a held-out stdlib prompt: both
continuations (identical), tokens/s, speedup, τ and the per-round (w / accepted / emitted) summary. The first
calibrated run measures round latency on this machine and caches it (about 15 s). Exit status 1 if the texts differ."""

CALIBRATE = """Measures, on this machine, what the calibrated strategies (hybridspec, nominal, ratio) choose w from: the
wall time C(w) of a whole round that verifies w tokens (drafting, verification, acceptance, commit) for every w up
to the drafter's block size, the time C_ar of a plain decoding step, and the routers' expert reuse (η: seconds per
extra distinct expert), at each context length. Without --target/--drafter it calibrates the shipped tiny pair.

Timing is robust: each pass interleaves --repeats repeats over all shapes and takes medians; the saved calibration
is the median of --passes passes. The result replaces the cache generate() reads (or --output) only if the passes
agree within --tolerance and it differs from a cached one by at most --max-change; otherwise it is written beside
it as *.rejected.json and the command exits with status 3 (--force saves it anyway)."""

TRAIN = """Train a DFlash drafter for a target the DFlash way: the target answers every prompt (its own distribution), then
the drafter learns to predict blocks of those responses from the target's hidden states. Writes the drafter
(save_pretrained), training_log.json and, with --eval-prompts, eval.json (τ per block size) to --output-dir.
Progress bars with ETA for regeneration, training steps and evaluation. Needs the `train` extra (datasets)."""


BENCH = """Run benchmarks/e2e.py from a source checkout: every method side by side at full size with random weights,
acceptance replayed from the declared profiles in benchmarks/profiles/ (timing mode). All options go to the script;
`hybridspec bench --help` prints them. Results land in benchmarks/results/e2e_<model>.{json,md,png}."""


def bench(args) -> int:
    import runpy

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e.py"
    if not script.exists():
        print("hybridspec bench runs benchmarks/e2e.py from a source checkout (git clone the repository and "
              "pip install -e .); it is not part of the installed package.", file=sys.stderr)
        return 2
    argv = sys.argv
    try:
        sys.argv = [str(script), *args.args]
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:  # --help
        return int(done.code or 0)
    finally:
        sys.argv = argv
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__, formatter_class=_HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,calibrate,train-drafter,bench}")

    p = commands.add_parser("demo", help="AR vs HybridSpec on the shipped tiny pair (CPU)", description=DEMO,
                            formatter_class=_HelpFormatter)
    p.add_argument("--strategy", default="hybridspec", choices=list(STRATEGIES), help="length rule to compare with AR")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--prompt-index", type=int, default=12,
                   help="which held-out stdlib prompt (default 12: HybridSpec's speedup on it, 1.74x, rank 14 of 32 "
                        "(the 44th percentile) of the held-out prompts in "
                        "benchmarks/results/strategies_cpu_tiny_pair_dec07_lookup.md, whose median is 1.83x)")
    p.add_argument("--random", action="store_true", help="use a tiny random pair instead of the trained one")
    p.set_defaults(run=demo)

    p = commands.add_parser("calibrate", help="measure round latency C(w) on this machine and cache it",
                            description=CALIBRATE, formatter_class=_HelpFormatter)
    models = p.add_argument_group("models (default: the shipped tiny pair)")
    models.add_argument("--target", default=None, help="target model: local folder or hub id")
    models.add_argument("--drafter", default=None, help="its DFlash drafter: local folder or hub id")
    models.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="dtype of --target and --drafter (default: float32 on CPU, bfloat16 on GPU)")
    models.add_argument("--device", default=None, help="device of --target and --drafter (default: cuda if available)")
    models.add_argument("--random", action="store_true", help="a tiny random pair instead (seconds; for tests)")
    models.add_argument("--text", default=None,
                        help="text file whose tokens are the prompts (real routing); default: held-out stdlib code "
                             "for the tiny pair, random tokens otherwise")
    timing = p.add_argument_group("timing")
    timing.add_argument("--context", type=int, nargs="+", default=[64, 512], help="context-length buckets (tokens)")
    timing.add_argument("--batch-sizes", type=int, nargs="+", default=[1],
                        help="batch sizes timed (1 always): a batch of N prompts chooses its shared w from C_N(w)")
    timing.add_argument("--repeats", type=int, default=2, help="timed repeats of every shape per pass")
    timing.add_argument("--passes", type=int, default=3, help="independent passes; their median is saved")
    timing.add_argument("--tolerance", type=float, default=0.25,
                        help="largest relative disagreement between passes that is accepted")
    timing.add_argument("--max-change", type=float, default=0.5,
                        help="largest relative change against a cached calibration that is accepted")
    timing.add_argument("--kernel-backend", default="auto", choices=list(KERNEL_BACKENDS),
                        help="GDN kernels timed: auto = Triton on CUDA, torch elsewhere (HybridSpecConfig's knob)")
    timing.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    out = p.add_argument_group("output")
    out.add_argument("--output", default=None,
                     help="JSON path (default: the cache generate() reads, under $HYBRIDSPEC_CACHE or "
                          "~/.cache/hybridspec_hf/latency/)")
    out.add_argument("--force", action="store_true", help="save even when the result looks implausible")
    p.set_defaults(run=calibrate)

    from hybridspec_hf.drafter.training import add_train_drafter_arguments

    p = commands.add_parser("train-drafter", help="regenerate responses with a target and train a DFlash drafter",
                            description=TRAIN, formatter_class=_HelpFormatter)
    add_train_drafter_arguments(p)
    p.set_defaults(run=train_drafter)

    p = commands.add_parser("bench", help="the end-to-end benchmark at full size (benchmarks/e2e.py; a GPU)",
                            description=BENCH, formatter_class=_HelpFormatter, add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, default=[],
                   help="benchmarks/e2e.py's options (default: the script's own; `hybridspec bench --help` lists "
                        "them)")
    p.set_defaults(run=bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option belongs to benchmarks/e2e.py (argparse would claim --help)
        return bench(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
