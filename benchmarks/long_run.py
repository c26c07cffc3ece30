"""Reliability figures on the shipped tiny pair (CPU, float32): one long generation and many consecutive calls.

- long: `--tokens` new tokens (default 10,000) greedily, with AR (`generate()`, token-by-token decoding) and with
  HybridSpec. Reports whether the texts are identical (else the first divergence and AR's top-2 logit gap there) and
  the relative error of every GDN layer's recurrent and conv state against the token-by-token state: AR's own cache
  when the texts agree, else the target decoding HybridSpec's tokens one at a time.
- calls: `--calls` consecutive HybridSpec generate() calls (default 200); resident memory (RSS) after each, its
  growth after a warm-up, and how many times the latency calibration ran (it is cached: once at most).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python benchmarks/long_run.py            # both, ~15 min on 2 cores
    .venv/bin/python benchmarks/long_run.py --tokens 2000 --calls 0                         # a quick look

The tiny target was trained with 2,048 positions; past them RoPE extrapolates and the text degrades, which does not
matter for exactness (both sides compute the same model).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from common import environment, write_results

import hybridspec_hf
from hybridspec_hf import patches
from hybridspec_hf.generation import calibration
from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def gdn_states(cache, model) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer index, recurrent state, conv state) of every GDN layer."""
    return [(layer.layer_idx, cache.layers[layer.layer_idx].recurrent_states[0].clone(),
             cache.layers[layer.layer_idx].conv_states[0].clone()) for layer in patches.gdn_layers(model)]


def output_cache(output):
    return output.cache if getattr(output, "cache", None) is not None else output.past_key_values


def token_by_token_states(target, sequence: torch.Tensor, prompt_len: int):
    """The target's cache after prefilling the prompt and decoding sequence[prompt_len:-1] one token at a time (the
    last emitted token is never in the cache, as in AR)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(sequence[:, :prompt_len], past_key_values=cache, use_cache=True)
        for i in range(prompt_len, sequence.shape[1] - 1):
            target(sequence[:, i : i + 1], past_key_values=cache, use_cache=True,
                   position_ids=torch.tensor([[i]]))
    return cache


def relative_error(mine: torch.Tensor, reference: torch.Tensor) -> float:
    return float((mine.double() - reference.double()).norm() / reference.double().norm().clamp(min=1e-30))


def long_generation(target, drafter, prompt: torch.Tensor, tokens: int) -> dict:
    options = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, return_dict_in_generate=True,
                   output_logits=True, attention_mask=torch.ones_like(prompt))
    target.config.max_position_embeddings = max(target.config.max_position_embeddings, prompt.shape[1] + tokens + 1)
    start = time.perf_counter()
    ar = target.generate(prompt, **options)
    ar_s = time.perf_counter() - start
    options.pop("output_logits")
    start = time.perf_counter()
    ours = target.generate(prompt, assistant_model=drafter, generation_strategy="hybridspec", **options)
    ours_s = time.perf_counter() - start
    telemetry = hybridspec_hf.get_telemetry(target)
    identical = torch.equal(ours.sequences, ar.sequences)
    result = {"new_tokens": tokens, "prompt_tokens": prompt.shape[1], "identical_to_ar": identical,
              "ar_s": round(ar_s, 1), "hybridspec_s": round(ours_s, 1), "rounds": len(telemetry.rounds),
              "mean_emitted_per_round": round(telemetry.mean_emitted, 3)}
    if identical:
        reference = output_cache(ar)
    else:
        first = int((ours.sequences[0] != ar.sequences[0]).nonzero()[0])
        top2 = ar.logits[first - prompt.shape[1]][0].topk(2).values
        result["first_divergence"] = {"token": first - prompt.shape[1], "ar_top2_gap": float(top2[0] - top2[1])}
        reference = token_by_token_states(target, ours.sequences, prompt.shape[1])
    errors = {}
    for (index, state, conv), (_, ref_state, ref_conv) in zip(gdn_states(output_cache(ours), target),
                                                              gdn_states(reference, target), strict=True):
        errors[f"layer {index}"] = {"recurrent": relative_error(state, ref_state), "conv": relative_error(conv, ref_conv)}
    result["gdn_state_relative_error"] = errors
    result["max_gdn_state_relative_error"] = max(max(e.values()) for e in errors.values())
    return result


def many_calls(target, drafter, prompts: list[torch.Tensor], calls: int, tokens: int) -> dict:
    calibrations = []
    original = calibration.calibrate_latency

    def counted(*args, **kwargs):
        calibrations.append(1)
        return original(*args, **kwargs)

    calibration.calibrate_latency = counted
    rss, first_call = [], 0
    try:
        for i in range(calls):
            prompt = prompts[i % len(prompts)]
            target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=tokens,
                            assistant_model=drafter, generation_strategy="hybridspec")
            rss.append(rss_mib())
            if i == 0:
                first_call = len(calibrations)
    finally:
        calibration.calibrate_latency = original
    warm = max(1, min(20, calls // 4))
    return {"calls": calls, "new_tokens_per_call": tokens, "calibrations_first_call": first_call,
            "calibrations_later_calls": len(calibrations) - first_call,
            "rss_mib_after_call": {"1": round(rss[0], 1), str(warm): round(rss[warm - 1], 1),
                                   str(calls): round(rss[-1], 1)},
            "rss_growth_mib_after_warmup": round(rss[-1] - rss[warm - 1], 1),
            "rss_max_mib": round(max(rss), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--call-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the usual calibration cache (default: a fresh one, so the first call calibrates)")
    args = parser.parse_args()
    if not args.keep_cache:
        os.environ["HYBRIDSPEC_CACHE"] = tempfile.mkdtemp(prefix="hybridspec-long-run-")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target, drafter, tokenizer = load_tiny_pair()
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in heldout_prompts(8)]
    payload = {"title": "Reliability on the tiny pair (CPU, float32)", "environment": environment(),
               "notes": "benchmarks/long_run.py; GDN state errors are relative Frobenius norms per layer."}
    lines = []
    if args.calls:
        payload["calls"] = many_calls(target, drafter, prompts, args.calls, args.call_tokens)
        c = payload["calls"]
        lines += [f"- {c['calls']} consecutive HybridSpec generate() calls of {c['new_tokens_per_call']} tokens: "
                  f"RSS growth after warm-up {c['rss_growth_mib_after_warmup']} MiB (max {c['rss_max_mib']} MiB), "
                  f"latency calibrations: {c['calibrations_first_call']} in the first call, "
                  f"{c['calibrations_later_calls']} in the later ones"]
    if args.tokens:
        payload["long"] = long_generation(target, drafter, prompts[0], args.tokens)
        g = payload["long"]
        lines += [f"- {g['new_tokens']} new tokens, HybridSpec vs AR: identical text: {g['identical_to_ar']}"
                  + (f" (first divergence at token {g['first_divergence']['token']}, AR top-2 gap "
                     f"{g['first_divergence']['ar_top2_gap']:.3g})" if not g["identical_to_ar"] else "")
                  + f"; max GDN state relative error vs token-by-token decoding {g['max_gdn_state_relative_error']:.3g}"
                  + f"; {g['rounds']} rounds, τ = {g['mean_emitted_per_round']}, AR {g['ar_s']} s, HybridSpec "
                  f"{g['hybridspec_s']} s"]
    print("\n".join(lines))
    write_results("long_run_tiny_pair", payload, "\n".join(lines))


if __name__ == "__main__":
    main()
