"""Offline τ of the shipped tiny pair's drafter beside context n-gram lookup, and of the two combined (issue 11).

    PYTHONPATH=$PWD python benchmarks/context_lookup_tau.py --prompts 64 --max-new-tokens 192   # CPU, ≈ 3 minutes

The target's greedy continuations of `--prompts` held-out stdlib prompts (fp32), then, at every anchor p whose
16-token block fits the continuation (as `drafter.training.acceptance_lengths`): τ(p) = 1 + the longest prefix of a
proposal equal to the target's next tokens, for
  - the drafter: its argmax block (one DFlash forward on the target's features), what the rounds draft today;
  - context lookup: `drafter.lookup.context_lookup` on the tokens up to the anchor (nothing after it): the 15
    tokens after the latest earlier occurrence of the last n tokens (n = `--max-ngram` down to 1, the longest that
    occurs), repeated with their period past the end; nothing where no n matches;
  - combined: the lookup's proposal where a match of at least `n_min` tokens exists and the drafter's own
    confidence in its first three drafts (the product of their top-1 probabilities) is below a threshold, else the
    drafter's; a rule the drafts themselves can evaluate (no look at the target's tokens);
  - the rule the rounds apply (HybridSpecConfig(context_lookup=...)): the lookup's proposal where its estimated
    Σ p̂ exceeds the drafter's (its acceptance estimator on its own block); the copy's p̂ is λ·(the table by match
    length, `selector.lookup.LookupEstimator`, `--lookup-estimator`) + (1 - λ)·(the drafter's acceptance estimator
    on the signals of the copied tokens, `selector.copy_signals`), with the table's λ; the table alone beside it;
  - the larger of the two at each anchor (an oracle: a bound, not a rule).
τ over all anchors and over the loop-free ("novel") ones, whose next 8 tokens occur nowhere earlier
(`novel_continuations`, the training report's definition), and the tokens per round of full-block rounds run from
each continuation's start, each at the anchor where the one before ended (what vanilla DFlash's loop would see).
Offline: no rounds run. Trained weights, real acceptance (greedy). Writes benchmarks/results/<name>.{json,md}.

The lookup table the tiny pair ships is fitted here on training-split prompts (held-out ones stay for evaluation),
its λ after it on the same rows (the λ in 0, 0.1, ..., 1 with the most tokens per anchor):

    PYTHONPATH=$PWD python benchmarks/context_lookup_tau.py --split train --prompts 128 \
        --fit-lookup hybridspec_hf/assets/tiny_pair/lookup_estimator.json --name context_lookup_fit_tiny_pair
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import environment, write_results

from hybridspec_hf.drafter.training import (NOVELTY_NGRAM, block_labels, distinct_ngram_ratio, draft_blocks,
                                            greedy_consistent_length, novel_continuations, regenerate_responses,
                                            target_features)
from hybridspec_hf.drafter.lookup import context_lookup
from hybridspec_hf.selector import AcceptanceEstimator, copy_signals, draft_signals
from hybridspec_hf.selector.lookup import LookupEstimator
from hybridspec_hf.tiny_pair import ASSETS_DIR, code_prompts, heldout_prompts, load_tiny_pair, stdlib_files

MIN_NGRAMS = (2, 3, 4)
THRESHOLDS = (0.9, 0.7, 0.5)


def accepted(proposal: list[int], truth: list[int]) -> int:
    """Length of the longest prefix of `proposal` equal to `truth`'s."""
    count = 0
    for mine, theirs in zip(proposal, truth):
        if mine != theirs:
            break
        count += 1
    return count


def anchor_rows(target, drafter, samples, block: int, max_ngram: int) -> list[dict]:
    """Per anchor: the drafter's τ, the lookup's τ and match length (n >= 1), novelty, the drafter's first-3
    confidence and its estimated Σ p̂ (the drafter's acceptance estimator, as the rounds compute it)."""
    rows = []
    estimator = drafter.acceptance_estimator
    if estimator is None or estimator.block_size != block:  # fitted for another block size: D-Cut's product
        estimator = AcceptanceEstimator.default(block)
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        for index, sample in enumerate(samples):
            ids_t = torch.tensor([sample.ids])
            features, logits = target_features(target, ids_t, layer_ids, return_logits=True)
            length = greedy_consistent_length(sample, logits[0].argmax(-1))
            ids = sample.ids[:length]
            first, end = len(sample.prompt_ids), length - block + 1
            if end <= first:
                continue
            novel = novel_continuations(ids, NOVELTY_NGRAM)
            anchors = torch.arange(first, end)[None]
            block_logits = draft_blocks(drafter, features[:, :length], ids_t[:, :length], anchors, block)
            labels, _ = block_labels(ids_t[:, :length], torch.tensor([length]), anchors,
                                     torch.ones_like(anchors, dtype=torch.bool), block)
            match = block_logits.argmax(-1) == labels  # [1, n, block - 1]
            tau_drafter = (1 + match.long().cumprod(2).sum(2))[0].tolist()
            confidence = block_logits.softmax(-1).amax(-1)[0, :, :3].prod(-1).tolist()
            signals = draft_signals(block_logits[0])
            expected = estimator.survival(signals).sum(-1).tolist()
            # what the rounds see: the tokens up to each anchor, nothing after it
            found = [context_lookup(ids_t[:, : anchor + 1], block, 1, max_ngram) for anchor in range(first, end)]
            copies = torch.cat([proposal for proposal, _ in found])  # [anchors, block - 1]
            # the drafter's estimate of each copy (what the rounds mix with the table, selector/lookup.py)
            rating = estimator.survival(copy_signals(block_logits[0], signals, block_logits[0].argmax(-1), copies))
            for i, anchor in enumerate(range(first, end)):
                n = int(found[i][1])
                rows.append({"drafter": tau_drafter[i], "ngram": n,
                             "lookup": 1 + accepted(copies[i].tolist(), ids[anchor + 1:]) if n else 1,
                             "novel": bool(novel[anchor]), "confidence": confidence[i], "expected": expected[i],
                             "rating": rating[i], "sample": index, "anchor": anchor})
    return rows


def rounds_tau(rows: list[dict], taus: list[int]) -> float:
    """Tokens per round of rounds that verify whole blocks from each continuation's first anchor on, each starting
    where the one before ended (anchor + its τ), while the block fits: the τ a full-block loop would see."""
    at = {(r["sample"], r["anchor"]): t for r, t in zip(rows, taus)}
    tokens = rounds = 0
    for sample in sorted({r["sample"] for r in rows}):
        anchor = min(r["anchor"] for r in rows if r["sample"] == sample)
        while (sample, anchor) in at:
            tokens, rounds = tokens + at[(sample, anchor)], rounds + 1
            anchor += at[(sample, anchor)]
    return tokens / rounds


def summary(rows: list[dict], args, lookup_estimator: LookupEstimator | None) -> list[dict]:
    def line(name: str, taus: list[int], from_lookup: list[bool]) -> dict:
        novel = [t for t, r in zip(taus, rows) if r["novel"]]
        return {"proposal": name, "tau": sum(taus) / len(taus), "tau_novel": sum(novel) / len(novel) if novel else None,
                "tau_rounds": rounds_tau(rows, taus), "lookup_share": sum(from_lookup) / len(from_lookup)}

    out = [line("drafter", [r["drafter"] for r in rows], [False] * len(rows)),
           line(f"context lookup (n <= {args.max_ngram})", [r["lookup"] for r in rows], [r["ngram"] > 0 for r in rows])]
    for n_min in MIN_NGRAMS:
        for threshold in THRESHOLDS:
            use = [r["ngram"] >= n_min and r["confidence"] < threshold for r in rows]
            out.append(line(f"lookup where n >= {n_min} and drafter confidence < {threshold}",
                            [r["lookup"] if u else r["drafter"] for r, u in zip(rows, use)], use))
    if lookup_estimator is not None:  # the rule the rounds apply (generation/loop.py): the larger estimated Σ p̂
        ngram, rating = torch.tensor([r["ngram"] for r in rows]), torch.stack([r["rating"] for r in rows])
        weight = lookup_estimator.table_weight
        for name, rated in (("its table (λ = 1)", None), (f"λ = {weight:g} of its table, the rest the drafter's "
                                                            "rating of the copy (what the rounds apply)", rating)):
            if rated is not None and weight == 1.0:
                continue  # the table alone: the row above
            lookup_expected = lookup_estimator.survival(ngram, rated).sum(-1).tolist()
            use = [e > r["expected"] for r, e in zip(rows, lookup_expected)]
            out.append(line(f"lookup where its estimated Σ p̂ (n in [{lookup_estimator.min_ngram}, "
                            f"{lookup_estimator.max_ngram}]; {name}) exceeds the drafter's",
                            [r["lookup"] if u else r["drafter"] for r, u in zip(rows, use)], use))
    out.append(line("the larger of the two (oracle)", [max(r["drafter"], r["lookup"]) for r in rows],
                    [r["lookup"] > r["drafter"] for r in rows]))
    return out


def table(lines: list[dict]) -> str:
    text = ["| proposal | τ16 (all anchors) | τ16 (loop-free anchors) | τ16 of full-block rounds | anchors taken from "
            "lookup |", "|---|---|---|---|---|"]
    for r in lines:
        novel = "-" if r["tau_novel"] is None else f"{r['tau_novel']:.2f}"
        text.append(f"| {r['proposal']} | {r['tau']:.2f} | {novel} | {r['tau_rounds']:.2f} | {r['lookup_share']:.2f} |")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-ngram", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="context_lookup_tau_tiny_pair")
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout",
                        help="prompts from the held-out stdlib files (evaluation) or the training ones (--fit-lookup)")
    parser.add_argument("--fit-lookup", metavar="JSON", default=None,
                        help="fit a LookupEstimator on these rows and write it here (use --split train)")
    parser.add_argument("--min-ngram", type=int, default=2, help="the fitted table's smallest match length")
    parser.add_argument("--lookup-estimator", metavar="JSON", default=str(ASSETS_DIR / "lookup_estimator.json"),
                        help="the table the 'estimated Σ p̂' rule reads (default: the tiny pair's; skipped if absent)")
    args = parser.parse_args(argv)
    if args.fit_lookup and args.split != "train":
        raise SystemExit("--fit-lookup fits on training-split prompts only: add --split train (held-out prompts "
                         "stay for evaluation)")
    if args.block_size < 2 or args.max_ngram < 1:
        raise SystemExit(f"--block-size must be >= 2 and --max-ngram >= 1; got {args.block_size}, {args.max_ngram}")
    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_tiny_pair()
    target.float()
    drafter.float()
    with tempfile.TemporaryDirectory() as folder:
        prompts = (heldout_prompts(args.prompts) if args.split == "heldout"
                   else code_prompts(stdlib_files("train"), args.prompts, seed=1))
        samples = regenerate_responses(target, tokenizer, prompts, folder,
                                       max_new_tokens=args.max_new_tokens, batch_size=16)
    rows = anchor_rows(target, drafter, samples, args.block_size, args.max_ngram)
    if not rows:
        raise SystemExit("no anchor: every continuation is shorter than a block (raise --max-new-tokens)")
    fitted = None
    if args.fit_lookup:
        ngram = torch.tensor([r["ngram"] for r in rows])
        fitted = LookupEstimator.fit(ngram, torch.tensor([r["lookup"] - 1 for r in rows]), args.block_size,
                                     args.min_ngram, args.max_ngram)
        # then λ, the table's share against the drafter's rating of the copy, on the same rows
        fitted.table_weight = LookupEstimator.fit_table_weight(
            fitted.survival(ngram), torch.stack([r["rating"] for r in rows]),
            torch.tensor([r["expected"] for r in rows]), torch.tensor([r["lookup"] for r in rows]),
            torch.tensor([r["drafter"] for r in rows]))
        fitted.save(args.fit_lookup)
        print(f"wrote {args.fit_lookup}: Σ p̂ by n = {fitted.table.sum(-1).tolist()}, λ = {fitted.table_weight}")
    elif Path(args.lookup_estimator).is_file():
        fitted = LookupEstimator.load(args.lookup_estimator)
        if fitted.block_size != args.block_size:
            print(f"{args.lookup_estimator} rates blocks of {fitted.block_size}, not {args.block_size}: its rule is "
                  "left out")
            fitted = None
    lines = summary(rows, args, fitted)
    distinct = distinct_ngram_ratio([s.response_ids for s in samples], 4)
    notes = (f"The shipped tiny pair (trained weights, fp32), {len(samples)} {args.split} stdlib prompts × "
             f"{args.max_new_tokens} greedy tokens (distinct-4 of the continuations {distinct:.2f}), {len(rows)} "
             f"anchors of block {args.block_size} ({sum(r['novel'] for r in rows) / len(rows):.2f} of them "
             "loop-free). Offline τ: no rounds ran; 'drafter confidence' is the product of its first three drafts' "
             "top-1 probabilities. The oracle row is a bound, not a rule.")
    payload = {"title": "Offline τ: the drafter, context n-gram lookup, and the two combined (tiny pair, CPU)",
               "environment": environment(), "notes": notes, "args": vars(args), "summary": lines,
               "distinct_4": distinct, "anchors": len(rows)}
    write_results(args.name, payload, table(lines))
    return payload


if __name__ == "__main__":
    main()
