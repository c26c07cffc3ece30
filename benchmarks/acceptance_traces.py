"""Record traces of the tiny trained pair and report the acceptance estimator's calibration on held-out traces.

Fits `selector.AcceptanceEstimator` on traces from training-split stdlib prompts and evaluates survival calibration
(expected calibration error) on traces from held-out files, next to the uncalibrated D-Cut default (prefix product
of top-1 probabilities). Saves the held-out traces as the versioned profile the scale benchmark replays
(benchmarks/profiles/tiny_pair_heldout.safetensors) and, in hybridspec_hf/assets/tiny_pair/, whichever estimator has
the lower held-out ECE (the fitted one, or the default when a fit on the few training rounds calibrates worse).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import environment, write_results

from hybridspec_hf.generation.traces import record_traces, save_traces
from hybridspec_hf.selector import AcceptanceEstimator, expected_calibration_error, survival_outcomes
from hybridspec_hf.tiny_pair import ASSETS_DIR, code_prompts, heldout_prompts, load_tiny_pair, stdlib_files

PROFILES = Path(__file__).resolve().parent / "profiles"


def survival_ece(estimator, traces) -> float:
    signals = {k: traces[k] for k in ("top1", "margin", "entropy")}
    outcome, observed = survival_outcomes(traces["accepted"], traces["verified"], traces["top1"].shape[1])
    return float(expected_calibration_error(estimator.survival(signals), outcome, observed))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-prompts", type=int, default=48)
    parser.add_argument("--heldout-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, drafter, tokenizer = load_tiny_pair()

    def encode(texts):
        return [tokenizer(t, return_tensors="pt").input_ids for t in texts]

    train = record_traces(target, drafter, encode(code_prompts(stdlib_files("train"), args.train_prompts, seed=1)),
                          args.max_new_tokens)
    held = record_traces(target, drafter, encode(heldout_prompts(args.heldout_prompts)), args.max_new_tokens)
    block = drafter.config.block_size
    default = AcceptanceEstimator.default(block)
    fitted = AcceptanceEstimator.default(block).fit(train)
    result = {"default_ece_heldout": survival_ece(default, held), "fitted_ece_heldout": survival_ece(fitted, held),
              "fitted_ece_train": survival_ece(fitted, train), "rounds_train": int(train["accepted"].numel()),
              "rounds_heldout": int(held["accepted"].numel()),
              "tau_heldout": float(held["accepted"].float().mean() + 1),
              "expert_reuse_heldout_per_layer": torch.nanmean(held["expert_reuse"][:, :, 1:], dim=(0, 2)).tolist()
              if "expert_reuse" in held else None}
    PROFILES.mkdir(exist_ok=True)
    save_traces(held, PROFILES / "tiny_pair_heldout.safetensors",
                {"source": "tiny trained pair, held-out stdlib prompts, dflash strategy", "block_size": block})
    # the package ships whichever is better calibrated on the held-out traces (a fit on few rounds can lose)
    result["shipped"] = "fitted" if result["fitted_ece_heldout"] < result["default_ece_heldout"] else "default"
    (fitted if result["shipped"] == "fitted" else default).save(ASSETS_DIR / "acceptance_estimator.json")
    table = "\n".join(["| estimator | survival ECE (held-out) | shipped |", "|---|---|---|",
                       f"| D-Cut default (top-1 prefix product) | {result['default_ece_heldout']:.4f} | "
                       f"{result['shipped'] == 'default'} |",
                       f"| fitted logistic (train-split traces) | {result['fitted_ece_heldout']:.4f} | "
                       f"{result['shipped'] == 'fitted'} |"])
    write_results("acceptance_calibration_tiny_pair", {
        "title": "Acceptance estimator calibration on held-out traces (tiny trained pair)",
        "notes": "Trained weights; traces recorded with the dflash strategy (full block verified) on CPU.",
        "environment": environment(), "settings": vars(args), "result": result}, table)
    print(table)
    print(result)


if __name__ == "__main__":
    main()
