"""Build the tiny pair's corpus from this interpreter's standard library: split, tokenizer, token streams, prompts.

Run on the machine whose stdlib is pinned (CPython 3.11.7 here); the GPU machine has another Python, so everything
that reads the stdlib happens here and travels as files:

    python scripts/tiny_pair/build_corpus.py            # writes the split + tokenizer into the package assets
                                                        # and the token streams + prompts into .data/tiny_pair/

Outputs
- hybridspec_hf/assets/tiny_pair/stdlib_split.json   every *.py outside site-packages: path, sha256, split, reason
- hybridspec_hf/assets/tiny_pair/tokenizer/          byte-level BPE (vocab 4096) trained on the train split only
- .data/tiny_pair/corpus.safetensors                 int16 token streams "train" and "heldout" (files joined by eos)
- .data/tiny_pair/{train,heldout}_prompts.jsonl      code windows for drafter training / evaluation

    python scripts/tiny_pair/build_corpus.py --prompts-only --train-prompts 48483 --train-skip 24576

writes the prompt files only (the pinned split, no tokenizer, no streams): here the training windows after the first
24 576 (the same seeded order, so these are the windows a drafter trained on the first 24 576 never saw). Those come
from the largest files only (the round-robin order has exhausted the small ones by then); for fresh windows across
all files, end them elsewhere:

    python scripts/tiny_pair/build_corpus.py --prompts-only --train-prompts 24576 --train-lengths 200,480

draws half the windows at most 200 characters long and half at most 480 (each at least 3/8 of that), every file
visited round-robin for each length, the two lists interleaved: prompts that end where the 320-character windows of
the default order rarely end, so the target's responses to them are new text from every file.

    python scripts/tiny_pair/build_corpus.py --prompts-only --train-prompts 24576 --splice

splices the training windows (each one's first half of lines + another's second half): the text is the training
split's, but no training file continues from the junction, so the target's responses are text it cannot recall, the
regime held-out prompts put it in (tiny_pair_gpu_runs.md, "A CPU probe").
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import random
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hybridspec_hf.tiny_pair import (  # noqa: E402
    ASSETS_DIR, SPLIT_FILE, StdlibFile, code_prompts, sha256_bytes, spliced_prompts, stdlib_files, stdlib_root,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]
HELDOUT_PER_MILLE = 30
MAX_FILE_BYTES = 300_000
RULES = {
    "scope": "every *.py under sysconfig.get_paths()['stdlib'], except site-packages/ and dist-packages/ (never listed)",
    "excluded": {
        "not utf-8": "bytes do not decode as UTF-8",
        "does not parse": "ast.parse fails on this Python (Python 2 or deliberately broken test inputs)",
        "test data": "a path component named data, tokenizedata or encoded_modules (inputs of tests, not code)",
        "codec table": "encodings/* holding a charmap decoding_table (a 256-entry table, not code)",
        "data blob": f"larger than {MAX_FILE_BYTES} bytes (pydoc_data/topics.py and similar generated data)",
    },
    "heldout": f"int(sha256('heldout:' + path), 16) % 1000 < {HELDOUT_PER_MILLE}, over non-excluded files; "
               "the split depends on the path only, so it is stable across Python versions",
}


def exclusion_reason(rel: str, data: bytes) -> str | None:
    parts = rel.split("/")
    if any(p in ("data", "tokenizedata", "encoded_modules") for p in parts[:-1]):
        return "test data"
    if len(data) > MAX_FILE_BYTES:
        return "data blob"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not utf-8"
    if parts[0] == "encodings" and "decoding_table" in text:
        return "codec table"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(text)
    except (SyntaxError, ValueError):
        return "does not parse"
    return None


def build_split(root: Path) -> dict:
    files = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if rel.split("/")[0] in ("site-packages", "dist-packages") or not file.is_file():
            continue
        data = file.read_bytes()
        entry = {"path": rel, "sha256": sha256_bytes(data)}
        reason = exclusion_reason(rel, data)
        if reason:
            entry.update(split="excluded", reason=reason)
        else:
            heldout = int(hashlib.sha256(f"heldout:{rel}".encode()).hexdigest(), 16) % 1000 < HELDOUT_PER_MILLE
            entry["split"] = "heldout" if heldout else "train"
        files.append(entry)
    return {"python_version": platform.python_version(), "implementation": platform.python_implementation(),
            "rules": RULES, "files": files}


def read_split_files(root: Path, split: dict, which: str) -> list[StdlibFile]:
    return [StdlibFile(e["path"], (root / e["path"]).read_text(encoding="utf-8"))
            for e in split["files"] if e["split"] == which]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                   mask_token="<|mask|>", model_max_length=2048, clean_up_tokenization_spaces=False,
                                   padding_side="left")  # batched generate() pads on the left


def token_stream(tokenizer, files: list[StdlibFile], seed: int) -> torch.Tensor:
    """Files in a seeded order, each followed by eos, as one int16 stream."""
    order = list(files)
    random.Random(seed).shuffle(order)
    encoded = tokenizer([f.text for f in order], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    flat = [t for ids in encoded for t in ids + [eos]]
    return torch.tensor(flat, dtype=torch.int16)


def write_jsonl(path: Path, prompts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


def write_prompts(data_dir: Path, train_files: list[StdlibFile], heldout_files: list[StdlibFile], args) -> None:
    """{train,heldout}_prompts.jsonl: code windows of the seeded order, the training ones after --train-skip."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.train_lengths.split(",") if n.strip().isdigit()]
    if len(lengths) != len(args.train_lengths.split(",")) or min(lengths, default=0) < 80:
        raise SystemExit(f"--train-lengths {args.train_lengths!r}: give comma-separated window lengths of at least 80 "
                         "characters (the default order is 320)")
    per_length = [code_prompts(train_files, -(-args.train_prompts // len(lengths)), max_chars=n,
                               min_chars=n * 3 // 8, seed=args.seed + i) for i, n in enumerate(lengths)]
    train = [p for group in zip(*per_length) for p in group][:args.train_prompts]
    train = train[args.train_skip:]
    needed = 2 if args.splice else 1  # a splice joins two windows
    if len(train) < needed:
        raise SystemExit(f"--train-skip {args.train_skip} leaves {len(train)} training prompts ({needed} needed): the "
                         f"split has {len(train) + args.train_skip} windows for --train-prompts {args.train_prompts}")
    write_jsonl(data_dir / "train_prompts.jsonl", spliced_prompts(train, seed=args.seed) if args.splice else train)
    write_jsonl(data_dir / "heldout_prompts.jsonl", code_prompts(heldout_files, args.heldout_prompts, seed=args.seed))
    print(f"{len(train)} training prompts (after {args.train_skip}), {args.heldout_prompts} held-out")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO / ".data" / "tiny_pair"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--train-prompts", type=int, default=8192)
    parser.add_argument("--heldout-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-only", action="store_true",
                        help="write the prompt files from the pinned split only (keeps the tokenizer and streams)")
    parser.add_argument("--train-skip", type=int, default=0,
                        help="drop the first N training windows (of the same seeded order) from train_prompts.jsonl")
    parser.add_argument("--splice", action="store_true",
                        help="training prompts spliced: each window's first half of lines + another window's second "
                             "half (hybridspec_hf.tiny_pair.spliced_prompts), continuations the target cannot recall")
    parser.add_argument("--train-lengths", default="320",
                        help="comma-separated maximum window lengths in characters; the training prompts are drawn "
                             "equally from each, interleaved (default 320: the order the shipped drafter trained on)")
    args = parser.parse_args(argv)

    root = stdlib_root()
    data_dir = Path(args.data_dir)
    if args.prompts_only:  # the pinned files exactly, or a clear refusal (another Python has other files)
        try:
            train, heldout = (stdlib_files(which, root, strict=True) for which in ("train", "heldout"))
        except RuntimeError as e:
            raise SystemExit(f"--prompts-only needs the pinned split's files unchanged: {e} Run it on that "
                             "Python version (prompt files travel to other machines as files).") from None
        write_prompts(data_dir, train, heldout, args)
        return
    split = build_split(root)
    SPLIT_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(SPLIT_FILE, "w", encoding="utf-8") as f:
        json.dump(split, f, indent=0)
        f.write("\n")
    counts = {s: sum(e["split"] == s for e in split["files"]) for s in ("train", "heldout", "excluded")}
    print(f"split of {root}: {counts}")

    train_files = read_split_files(root, split, "train")
    heldout_files = read_split_files(root, split, "heldout")
    tokenizer = train_tokenizer([f.text for f in train_files], args.vocab_size)
    tokenizer.save_pretrained(str(ASSETS_DIR / "tokenizer"))

    data_dir.mkdir(parents=True, exist_ok=True)
    streams = {"train": token_stream(tokenizer, train_files, args.seed),
               "heldout": token_stream(tokenizer, heldout_files, args.seed)}
    save_file(streams, str(data_dir / "corpus.safetensors"))
    train_bytes = sum(len(f.text.encode()) for f in train_files)
    write_prompts(data_dir, train_files, heldout_files, args)
    meta = {"python_version": split["python_version"], "files": counts, "train_bytes": train_bytes,
            "tokens": {k: int(v.numel()) for k, v in streams.items()},
            "bytes_per_token_train": train_bytes / streams["train"].numel(),
            "vocab_size": len(tokenizer), "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}}
    (data_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
