"""Install the trained pair into the package and write benchmarks/results/tiny_pair_training.{json,md,png}.

    python scripts/tiny_pair/make_report.py --target-run RUN4_DIR --drafter-run RUN7_DIR --drafter-first-run RUN5_DIR \\
        --drafter-continued-runs RUN6_DIR

Each run folder holds what `run_pipeline.py` put in $OUT (results.json, target/ or target.tar, drafter.tar). The
target may come from one run and the drafter from another (a drafter-only rerun with --target-dir); a drafter
continued from an earlier run's (`--init-drafter`) names that run in --drafter-first-run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"
ASSETS = REPO / "hybridspec_hf" / "assets" / "tiny_pair"


def extract(tar_path: Path, member_dir: str, dest: Path, names: tuple[str, ...]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(tar_path) as tar:
        tar.extractall(tmp, filter="data")
        for name in names:
            shutil.copy(Path(tmp) / member_dir / name, dest / name)


def install_target(run: Path) -> None:
    """The run's target into the package: a `target/` folder (shards) or, from older runs, `target.tar`."""
    dest = ASSETS / "target"
    if (run / "target").is_dir():
        for old in dest.glob("model*.safetensors*"):
            old.unlink()
        for path in (run / "target").iterdir():
            shutil.copy(path, dest / path.name)
    else:
        extract(run / "target.tar", "target", dest, ("config.json", "generation_config.json", "model.safetensors"))


def plot(target: dict, drafter: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ul = target.get("unlikelihood_log") or []
    fig, axes = plt.subplots(1, 3 if ul else 2, figsize=(16 if ul else 11, 4))
    a, b = axes[0], axes[1]
    curve = target["loss_curve"]
    a.plot([e["tokens"] / 1e6 for e in curve], [e["loss"] for e in curve], lw=0.8, label="train (batch)")
    held = target["heldout_curve"]
    a.plot([e["tokens"] / 1e6 for e in held], [e["heldout_loss"] for e in held], "o-", label="held-out")
    a.set(xlabel="tokens seen (M)", ylabel="cross-entropy (nats)",
          title=f"target ({target['parameters'] / 1e6:.1f} M params, stdlib)")
    a.legend()
    if ul:
        c = axes[2]
        c.plot([e["update"] for e in ul], [e["distinct4_heldout"] for e in ul], "o-", label="distinct-4, held-out")
        c.plot([e["update"] for e in ul], [e["distinct4_train"] for e in ul], "o-", label="distinct-4, train windows")
        c2 = c.twinx()
        c2.plot([e["update"] for e in ul], [e["heldout_loss"] for e in ul], "s-", color="C3", label="held-out loss")
        c.set(xlabel="update", ylabel="distinct-4 of greedy continuations", title="unlikelihood fine-tuning")
        c2.set_ylabel("held-out loss (nats)")
        c.legend(loc="lower right")
        c2.legend(loc="center right")
    curve = drafter["loss_curve"]
    b.plot([e["step"] for e in curve], [e["loss"] for e in curve], label="weighted CE")
    b2 = b.twinx()
    b2.plot([e["step"] for e in curve], [e["tau"] for e in curve], color="C1", label="τ (train batches, B=16)")
    b.set(xlabel="step", ylabel="DFlash loss", title="drafter")
    b2.set_ylabel("τ")
    b.legend(loc="upper center")
    b2.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def status_lines(report: dict) -> list[str]:
    """Against issue 11's goals: distinct-4 ≥ 0.6, τ16 ≥ 4.5 over all anchors and ≥ 3.5 on loop-free ones."""
    e = report["drafter_eval"]["block_sizes"]
    tau16, novel16 = e["16"]["tau"], e["16"].get("tau_novel")
    distinct4 = report["drafter_eval"]["distinct_ngram_ratio"]["4"]
    files = report["shipped_files"]
    biggest = max(files.values())

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return [
        f"- Size: {report['shipped_bytes'] / 2**20:.1f} MiB shipped (budget 30), largest file {biggest / 2**20:.1f} MiB "
        "(budget 15).",
        f"- Target held-out perplexity {report['target']['shipped_weights']['heldout_perplexity']:.2f}.",
        f"- Distinct-4 of the target's greedy continuations of held-out prompts {distinct4:.2f}: goal ≥ 0.6 "
        f"{met(distinct4 >= 0.6)}.",
        f"- τ at block 16 = {tau16:.2f}: goal ≥ 4.5 {met(tau16 >= 4.5)}; on novel anchors (no loop, no copy; "
        f"{e['16']['novel_anchor_fraction']:.0%} of the anchors) τ = {novel16:.2f}: goal ≥ 3.5 "
        f"{met(novel16 is not None and novel16 >= 3.5)}.",
    ]


def unlikelihood_lines(t: dict) -> list[str]:
    log = t.get("unlikelihood_log") or []
    if not log:
        return []
    r = t["recipe"]
    first, last = log[0], log[-1]
    return [
        f"- Unlikelihood fine-tuning against greedy loops (Welleck et al. 2019, sequence level; `train_target.py "
        f"--ul-*`): {t['unlikelihood_seconds']:.0f} s, {last['update'] + r['ul_steps_per_round']} updates; each round "
        f"the model continues {r['ul_prompts']} training windows of {r['ul_prompt_len']} tokens greedily for "
        f"{r['ul_new_tokens']} tokens, and each update adds α = {r['ul_alpha']:g} × −log(1 − p) of the tokens "
        "that complete a 4-gram already in their continuation to the language-model loss of a fresh training batch "
        f"(lr {r['ul_lr']:g}, warm-up 10 %, linear decay; rounds already at distinct-4 ≥ {r['ul_distinct_goal']:g} "
        f"take language-model updates only). Distinct-4 of greedy continuations of held-out windows "
        f"{first['distinct4_heldout']:.2f} → {last['distinct4_heldout']:.2f}; held-out loss "
        f"{t['heldout_loss_before_unlikelihood']:.3f} → {t['heldout_loss_nats']:.3f} nats (the price; third panel of "
        "the plot).",
    ]


def markdown(report: dict) -> str:
    t, d, e = report["target"], report["drafter"], report["drafter_eval"]
    cfg = t["config"]
    lines = [
        "# Tiny pair: trained target + DFlash drafter (shipped in `hybridspec_hf/assets/tiny_pair/`)",
        "",
        f"Date {report['date']}; {report['gpu']}; {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.",
        "Trained weights (not random). Loss curves: `tiny_pair_training.png`; all numbers: `tiny_pair_training.json`;",
        "the GPU calls and what went wrong: `tiny_pair_gpu_runs.md`.",
        "",
        "## Status against the goals",
        *status_lines(report),
        "",
        "## Corpus",
        f"- CPython {report['corpus']['python_version']} standard library, `*.py` only, no site-packages: "
        f"{report['corpus']['files']['train']} training files, {report['corpus']['files']['heldout']} held-out files "
        f"(never trained on by target, tokenizer or drafter), {report['corpus']['files']['excluded']} excluded "
        "(codec tables, test data, non-UTF-8, data blobs); pinned with sha256 in `stdlib_split.json`.",
        f"- Tokenizer: byte-level BPE, vocab {report['corpus']['vocab_size']} (`<|endoftext|>` eos, `<|pad|>`, "
        f"`<|mask|>`), trained on the training split; {report['corpus']['bytes_per_token_train']:.2f} bytes/token.",
        f"- Token streams: {report['corpus']['tokens']['train'] / 1e6:.2f} M training tokens, "
        f"{report['corpus']['tokens']['heldout'] / 1e3:.0f} k held-out tokens.",
        "",
        "## Target (`Qwen3_5MoeForCausalLM`)",
        f"- {t['parameters'] / 1e6:.2f} M parameters: {cfg['num_hidden_layers']} layers (GDN ×3 then gated full "
        f"attention), hidden {cfg['hidden_size']}, GDN {cfg['linear_num_key_heads']} key heads / "
        f"{cfg['linear_num_value_heads']} value heads × {cfg['linear_key_head_dim']}, attention "
        f"{cfg['num_attention_heads']} q / {cfg['num_key_value_heads']} kv heads × {cfg['head_dim']}, "
        f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} (width {cfg['moe_intermediate_size']}) + "
        f"shared expert (width {cfg['shared_expert_intermediate_size']}), tied embeddings, bf16 on disk.",
        f"- Pre-training: {t['steps']} steps × batch 64 × 512 tokens = {t['tokens_seen'] / 1e6:.1f} M tokens "
        f"({t['epochs']:.2f} epochs) in {t['train_seconds']:.0f} s ({t['tokens_per_second'] / 1e3:.0f} k tokens/s); "
        "AdamW (0.9, 0.95, wd 0.1), lr 2e-3, 60 warm-up steps, cosine to 10 %, grad clip 1.0, bf16 autocast, "
        f"router aux loss 1e-3, experts `{t['experts_implementation']}`, transformers' pure-torch GDN.",
        *unlikelihood_lines(t),
        f"- Held-out (all {t['shipped_weights']['heldout_tokens_scored'] / 1e3:.0f} k tokens, weights as shipped in "
        f"fp32): loss {t['shipped_weights']['heldout_loss_nats']:.3f} nats, **perplexity "
        f"{t['shipped_weights']['heldout_perplexity']:.2f}** (≈ {t['heldout_bits_per_byte_approx']:.2f} bits/byte).",
        "- CPU decoding: `load_tiny_pair()` gives the target transformers' `eager` experts on CPU; the default "
        "`grouped_mm` decodes one token ≈ 25× slower there (590 vs 24 ms/token, 2 cores, torch 2.13, measured with "
        "the first shipped target).",
        "",
        "## Drafter (`DFlashDrafter`, trained with `hybridspec_hf.drafter.training.train_drafter`)",
        f"- {d['parameters'] / 1e6:.2f} M parameters: {d['recipe']['num_layers']} layers, target layers "
        f"{d['recipe']['target_layer_ids']}, block {d['recipe']['block_size']}, mask token "
        f"{d['recipe']['mask_token_id']}; borrows the target's embedding and LM head.",
        f"- Data: the target's greedy continuations ({d['recipe']['max_new_tokens']} new tokens) of "
        f"{d['num_train_sequences']} training-split code prompts ({d['train_response_tokens'] / 1e6:.2f} M response "
        "tokens).",
        f"- Recipe: {d['recipe']['steps']} steps × {d['recipe']['batch_size']} sequences × ≤ "
        f"{d['recipe']['num_anchors']} anchors (one forward per sequence), CE weighted exp(-(k-1)/{d['recipe']['gamma']:g}), "
        f"AdamW lr {d['recipe']['lr']:g}, warm-up {d['recipe']['warmup_ratio']:g}, cosine, clip "
        f"{d['recipe']['grad_clip']:g}, {d['recipe']['mixed_precision']} autocast, target features cached: "
        f"{d.get('feature_cache')}; {d['train_seconds']:.0f} s on the {d['device']}.",
    ]
    for c in report.get("drafter_continuations", []):
        lines.append(
            f"- Continued on the {c['device']} from the weights before: {c['recipe']['steps']} more steps × "
            f"{c['recipe']['batch_size']} sequences × ≤ {c['recipe']['num_anchors']} anchors on the target's greedy "
            f"continuations of {c['num_train_sequences']} training prompts ({c['train_response_tokens'] / 1e6:.2f} M "
            f"response tokens), lr {c['recipe']['lr']:g}, {c['train_seconds']:.0f} s (`tiny_pair_gpu_runs.md`).")
    lines += [
        "",
        "## Acceptance length τ (offline, greedy) on held-out stdlib code",
        f"{e['num_sequences']} held-out prompts, the target's greedy continuations ({e['response_tokens']} tokens, "
        f"computed on: {report['evaluated_on']}); "
        "τ(p) = 1 + longest prefix of the drafter's block equal to the continuation, over every anchor p whose block "
        "fits in the continuation; weights as shipped, fp32.",
        "",
        "| block | τ | anchors | τ on novel anchors | novel fraction | τ of the block-16 draft cut to this size |",
        "|---|---|---|---|---|---|",
    ]
    for b, r in e["block_sizes"].items():
        novel = f"{r['tau_novel']:.2f}" if r.get("tau_novel") is not None else "–"
        cut = f"{r['tau_truncated_from_largest']:.2f}" if "tau_truncated_from_largest" in r else "–"
        lines.append(f"| {b} | **{r['tau']:.2f}** | {r['num_anchors']} | {novel} | "
                     f"{r['novel_anchor_fraction']:.2f} | {cut} |")
    dn = e["distinct_ngram_ratio"]
    lines += [
        "",
        "\"Novel\" anchors: the next 8 tokens occur nowhere earlier in the sequence (no loop, no copy).",
        f"Distinct-n of the target's greedy continuations (mean over sequences): 1-gram {dn['1']:.2f}, 2-gram "
        f"{dn['2']:.2f}, 3-gram {dn['3']:.2f}, 4-gram {dn['4']:.2f}; {e['responses_ending_in_eos']} of "
        f"{e['num_sequences']} continuations end in eos (real held-out code: distinct-4 ≈ 0.82 over 128-token "
        "windows). The novel-anchor τ is the number that loops cannot inflate.",
        "",
        f"## Calibration (block {e.get('calibration_block_size')}): drafter top-1 probability vs match",
        "",
        "| top-1 prob | positions | mean prob | match rate | positions reached | match rate when reached |",
        "|---|---|---|---|---|---|",
    ]
    for row in e.get("calibration", []):
        def f(x):
            return "–" if x is None else f"{x:.3f}"
        lines.append(f"| {row['bin'][0]:.1f}–{row['bin'][1]:.1f} | {row['count']} | {f(row['mean_prob'])} | "
                     f"{f(row['match_rate'])} | {row['count_reached']} | {f(row['match_rate_reached'])} |")
    lines += ["", "\"Reached\": every earlier position of the block matched, so greedy verification looks at it.", "",
              "## Example (held-out prompt → target's greedy continuation)", ""]
    for ex in report["examples"][:2]:
        lines += ["```python", ex["prompt"] + "⟪continuation⟫" + ex["response"], "```", ""]
    lines += ["## Commands", "", "```"] + report["commands"] + ["```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-run", required=True, type=Path)
    parser.add_argument("--drafter-run", required=True, type=Path)
    parser.add_argument("--drafter-first-run", type=Path, default=None,
                        help="the run whose drafter --drafter-run continued (run_pipeline.py --init-drafter)")
    parser.add_argument("--drafter-continued-runs", type=Path, nargs="*", default=[],
                        help="runs between --drafter-first-run and --drafter-run, in order, each continuing the one "
                             "before")
    parser.add_argument("--commands", nargs="*", default=[])
    args = parser.parse_args()
    target_results = json.loads((args.target_run / "results.json").read_text())
    drafter_results = json.loads((args.drafter_run / "results.json").read_text())
    first = json.loads((args.drafter_first_run / "results.json").read_text()) if args.drafter_first_run else None
    between = [json.loads((run / "results.json").read_text())["drafter"] for run in args.drafter_continued_runs]
    install_target(args.target_run)
    extract(args.drafter_run / "drafter.tar", "drafter", ASSETS / "drafter", ("config.json", "model.safetensors"))
    corpus = json.loads((REPO / ".data" / "tiny_pair" / "meta.json").read_text())
    target = target_results["target"]
    report = {
        "date": drafter_results["date"], "gpu": drafter_results["versions"]["gpu"],
        "versions": drafter_results["versions"], "weights": "trained (not random)",
        "corpus": corpus, "target": target, "drafter": (first or drafter_results)["drafter"],
        "drafter_eval": drafter_results["drafter_eval"], "examples": drafter_results["responses"]["examples"],
        "responses": {k: v for k, v in drafter_results["responses"].items() if k != "examples"},
        "stages_s": {"target_run": target_results["stages_s"], "drafter_run": drafter_results["stages_s"]},
        "drafter_continuations": [*between, drafter_results["drafter"]] if first else [],
        "evaluated_on": drafter_results.get("evaluated_on", "gpu"),
        "commands": args.commands,
        "shipped_files": {p.relative_to(ASSETS).as_posix(): p.stat().st_size
                          for p in sorted(ASSETS.rglob("*")) if p.is_file()},
    }
    report["shipped_bytes"] = sum(report["shipped_files"].values())
    (RESULTS / "tiny_pair_training.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(target, drafter_results["drafter"], RESULTS / "tiny_pair_training.png")
    (RESULTS / "tiny_pair_training.md").write_text(markdown(report))
    print((RESULTS / "tiny_pair_training.md").read_text())


if __name__ == "__main__":
    main()
