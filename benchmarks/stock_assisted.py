"""transformers' own speculative decoding on a GDN hybrid target, checked against its greedy AR (CPU, no hybridspec).

    python benchmarks/stock_assisted.py --name stock_assisted_tf525      # ≈ 2 min on 2 cores

From transformers 5.25 on, `generate(..., prompt_lookup_num_tokens=n)` (and assisted decoding with an ordinary
assistant) runs on Qwen3.5 / Qwen3-Next targets: the cache records a copy of every GDN layer's recurrent state per
token of a verification (`activate_past_recording(recurrent_states_to_keep=...)`) and `crop` restores the one after
the last accepted token. This script loads the shipped tiny target with transformers alone (hybridspec_hf is never
imported in this process: the held-out prompts are tokenised in a child process), decodes every prompt greedily with
plain generate() and with prompt lookup, and reports where they differ and AR's top-1 − top-2 logit gap there (a
gap ≫ float32 rounding is not a near-tie). `--keep-extra 1` re-runs prompt lookup with the cache told to keep one
state more than transformers asks for: a verification runs the drafts plus the token before them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_results  # noqa: E402  (common imports no hybridspec_hf)

ASSETS = Path(__file__).resolve().parents[1] / "hybridspec_hf" / "assets" / "tiny_pair"
_PROMPT_IDS = ("import json, sys; from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_tokenizer; "
               "tok = load_tiny_tokenizer(); "
               "print(json.dumps([tok(t).input_ids for t in heldout_prompts(int(sys.argv[1]))]))")


def prompt_ids(count: int) -> list[list[int]]:
    """The held-out prompts' token ids, tokenised in a child process (which imports hybridspec_hf, this one not)."""
    done = subprocess.run([sys.executable, "-c", _PROMPT_IDS, str(count)], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def keep_extra_states(extra: int):
    """Inside: every GDN cache layer records `extra` more recurrent states than generate() asks for."""
    from transformers import cache_utils

    mixin = cache_utils.LinearAttentionCacheLayerMixin
    original = mixin.activate_past_recording

    def activate(self, recurrent_states_to_keep=None):
        keep = None if recurrent_states_to_keep is None else recurrent_states_to_keep + extra
        return original(self, recurrent_states_to_keep=keep)

    mixin.activate_past_recording = activate
    try:
        yield
    finally:
        mixin.activate_past_recording = original


def compare(target, ids: list[list[int]], tokens: int, lookup: int) -> list[dict]:
    rows = []
    for index, prompt in enumerate(ids):
        prompt = torch.tensor([prompt])
        ar = target.generate(prompt, do_sample=False, max_new_tokens=tokens, return_dict_in_generate=True,
                             output_logits=True)
        spec = target.generate(prompt, do_sample=False, max_new_tokens=tokens, prompt_lookup_num_tokens=lookup)
        a, b = ar.sequences[0], spec[0]
        n = min(a.numel(), b.numel())
        row = {"prompt": index, "identical": bool(a.numel() == b.numel() and torch.equal(a, b))}
        if not torch.equal(a[:n], b[:n]):
            first = int((a[:n] != b[:n]).nonzero()[0])
            step = first - prompt.shape[1]
            top2 = ar.logits[step][0].float().topk(2).values
            row |= {"first_difference": step, "ar_top2_gap": float(top2[0] - top2[1])}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lookup-tokens", type=int, default=10)
    parser.add_argument("--keep-extra", type=int, default=None,
                        help="also re-run with the GDN layers keeping this many more recurrent states")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="stock_assisted")
    parser.add_argument("--allow-imported", action="store_true", help=argparse.SUPPRESS)  # tests: package loaded
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import Qwen3_5MoeForCausalLM

    if getattr(Qwen3_5MoeForCausalLM, "_is_stateful", False):
        raise SystemExit(f"transformers {transformers.__version__} refuses assisted decoding for this target "
                         "(5.25 and later run it)")
    target = Qwen3_5MoeForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.float32, local_files_only=True,
                                                   experts_implementation="eager").eval()
    ids = prompt_ids(args.prompts)
    runs = {"as transformers runs it": compare(target, ids, args.tokens, args.lookup_tokens)}
    if args.keep_extra:
        with keep_extra_states(args.keep_extra):
            runs[f"{args.keep_extra} more state(s) kept"] = compare(target, ids, args.tokens, args.lookup_tokens)
    if not args.allow_imported:
        assert "hybridspec_hf" not in sys.modules, "this process must run transformers alone"
    lines = ["| prompt lookup | prompts identical to AR | first differences: AR top-2 gap min / median |",
             "|---|---|---|"]
    for name, rows in runs.items():
        gaps = sorted(r["ar_top2_gap"] for r in rows if "ar_top2_gap" in r)
        gap = f"{gaps[0]:.3f} / {gaps[len(gaps) // 2]:.3f}" if gaps else "-"
        lines.append(f"| {name} | {sum(r['identical'] for r in rows)} of {len(rows)} | {gap} |")
        print(lines[-1], flush=True)
    notes = (f"The shipped tiny qwen3_5_moe target (trained weights, float32, CPU) loaded by transformers alone; "
             f"{args.prompts} held-out stdlib prompts, {args.tokens} greedy tokens, prompt_lookup_num_tokens="
             f"{args.lookup_tokens}. A row's gaps: AR's top-1 − top-2 logit at each diverging prompt's first "
             "difference (float32 rounding flips only gaps below ≈ 1e-5).")
    payload = {"title": "transformers' own prompt-lookup decoding against its greedy AR on a GDN hybrid (CPU)",
               "environment": environment(), "notes": notes, "runs": runs, "settings": vars(args)}
    write_results(args.name, payload, "\n".join(lines))


if __name__ == "__main__":
    main()
