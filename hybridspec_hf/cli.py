"""`hybridspec demo | calibrate | train-drafter` — the command line. Uses the public API only."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from hybridspec_hf.config import STRATEGIES


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
    if args.random:
        return _random_pair()
    try:
        from hybridspec_hf.tiny_pair import load_tiny_pair
    except ImportError:
        print("(the trained tiny pair is not installed: using a tiny random pair)")
        return _random_pair()
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
    print("per round (w/accepted/emitted):", " ".join(f"{r.w}/{r.accepted}/{r.emitted}" for r in telemetry.rounds))
    return 0 if identical else 1


def calibrate(args) -> int:
    """Measure C(w), C_ar, the expert model and η for the tiny pair (or --random) on this machine and cache them."""
    from hybridspec_hf.generation.calibration import cache_key, cache_path, calibrate_latency

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = _load_pair(args)
    model = calibrate_latency(target, drafter, context_lens=tuple(args.context), repeats=args.repeats,
                              kernel_backend=args.kernel_backend)
    model.key = cache_key(target, drafter, args.kernel_backend)
    path = args.output or cache_path(model.key)
    model.save(path)
    ms = ", ".join(f"{float(c) * 1e3:.1f}" for c in model.cost[0])
    print(f"C(w) [ms] at context {int(model.context_lens[0])}: {ms}; plain step {float(model.cost_ar[0]) * 1e3:.1f} ms")
    print(f"η = {model.eta * 1e6:.1f} µs per distinct expert; saved {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridspec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("demo", help="AR vs HybridSpec on the shipped tiny pair (CPU)")
    p.add_argument("--strategy", default="hybridspec", choices=list(STRATEGIES))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-index", type=int, default=0, help="which held-out stdlib prompt")
    p.add_argument("--random", action="store_true", help="use a tiny random pair instead of the trained one")
    p.set_defaults(run=demo)
    p = commands.add_parser("calibrate", help="measure round latency C(w) on this device and cache it")
    p.add_argument("--context", type=int, nargs="+", default=[64, 512], help="context-length buckets")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--output", default=None, help="JSON path (default: the cache used by generate())")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--random", action="store_true", help="use a tiny random pair instead of the trained one")
    p.set_defaults(run=calibrate)
    try:
        from hybridspec_hf.drafter.training import add_train_drafter_arguments, run_train_drafter
    except ImportError:
        pass
    else:
        p = commands.add_parser("train-drafter", help="regenerate responses with a target and train a DFlash drafter")
        add_train_drafter_arguments(p)
        p.set_defaults(run=run_train_drafter)
    args = parser.parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
