"""Calibrate a pair's round latency on this machine and cache it where generate() looks for it.

    python examples/calibrate_and_cache.py                      # the shipped tiny pair on the CPU (seconds)
    python examples/calibrate_and_cache.py --target Qwen/Qwen3.5-35B-A3B --drafter z-lab/Qwen3.5-35B-A3B-DFlash

The calibrated strategies ("hybridspec", "nominal", "ratio") choose w from C(w), the wall time of a whole round
verifying w tokens, and C_ar, one plain decoding step. generate() calibrates on first use by itself; calibrating
ahead keeps that pause out of the first request. `hybridspec calibrate` does the same with repeated passes and
refuses to replace a cached calibration by an implausible one.
"""
import argparse

from _pair import add_model_arguments, encode, load_pair

from hybridspec_hf import HybridSpecConfig, get_telemetry
from hybridspec_hf.generation.calibration import cache_key, cache_path, calibrate_latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--context", type=int, nargs="+", default=[64, 512], help="context lengths to measure at")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats of every shape")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing cached calibration")
    parser.add_argument("--plot", default=None, help="also save the C(w) curves to this PNG")
    args = parser.parse_args()

    target, drafter, tokenizer = load_pair(args)
    key = cache_key(target, drafter, HybridSpecConfig().kernel_backend)
    path = cache_path(key)
    if path.exists() and not args.overwrite:
        print(f"{path} already holds a calibration for this pair, dtype, device and versions; --overwrite replaces it.")
    else:
        latency = calibrate_latency(target, drafter, context_lens=tuple(args.context), repeats=args.repeats)
        latency.key = key
        latency.save(path)
        for row, context in enumerate(latency.context_lens.tolist()):
            ms = " ".join(f"{float(c) * 1e3:.1f}" for c in latency.cost[row])
            print(f"context {context}: C(w) [ms] {ms}; plain step {float(latency.cost_ar[row]) * 1e3:.1f} ms")
        print(f"saved {path}")
        if args.plot:
            import matplotlib.pyplot as plt

            from hybridspec_hf import plots

            plots.latency_curves(latency)
            plt.savefig(args.plot, dpi=120, bbox_inches="tight")

    # generate() now reads the cache; calibration="require" would raise instead of calibrating if it did not
    input_ids = encode(tokenizer, "def parse_args(argv):\n", target.device)
    target.generate(input_ids, assistant_model=drafter, generation_strategy="hybridspec", do_sample=False,
                    max_new_tokens=32, hybridspec_config=HybridSpecConfig(calibration="require"))
    print(get_telemetry(target).summary())


if __name__ == "__main__":
    main()
