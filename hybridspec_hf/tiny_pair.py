"""The tiny target + DFlash drafter pair shipped with the package, and the stdlib corpus it was trained on.

The target is a real `Qwen3_5MoeForCausalLM` (GDN ×3 then gated full attention, MoE with a shared expert) trained on
the Python standard library's own source; the drafter is a DFlash drafter trained on the target's greedy
continuations (`hybridspec_hf.drafter.training`). `benchmarks/results/tiny_pair_training.md` has the recipe and
numbers; `scripts/tiny_pair/` rebuilds everything.

The corpus split is pinned by `assets/tiny_pair/stdlib_split.json` (relative path, sha256, split per file). The stdlib
differs between Python versions, so readers skip files whose hash differs from the pinned one, and say how many.
Held-out files were never trained on, by the target, the tokenizer or the drafter.
"""
from __future__ import annotations

import hashlib
import json
import random
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "tiny_pair"
SPLIT_FILE = ASSETS_DIR / "stdlib_split.json"
SPLITS = ("train", "heldout", "excluded")


@dataclass(frozen=True)
class StdlibFile:
    path: str  # relative to the stdlib root, POSIX separators
    text: str


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder (`sysconfig.get_paths()["stdlib"]`)."""
    return Path(sysconfig.get_paths()["stdlib"])


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_stdlib_split() -> dict:
    """The pinned split: `{"python_version", "rules", "files": [{"path", "sha256", "split", "reason"?}, ...]}`."""
    with open(SPLIT_FILE, encoding="utf-8") as f:
        return json.load(f)


def stdlib_files(split: str = "heldout", root: str | Path | None = None, *, strict: bool = False) -> list[StdlibFile]:
    """The files of one split that this interpreter has with the pinned content, sorted by path.

    A file missing here or with another sha256 (another Python version) is skipped with one warning that counts them;
    `strict=True` raises instead.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root) if root is not None else stdlib_root()
    found, missing, changed = [], [], []
    for entry in load_stdlib_split()["files"]:
        if entry["split"] != split:
            continue
        file = root / entry["path"]
        if not file.is_file():
            missing.append(entry["path"])
            continue
        data = file.read_bytes()
        if sha256_bytes(data) != entry["sha256"]:
            changed.append(entry["path"])
            continue
        found.append(StdlibFile(entry["path"], data.decode("utf-8")))
    if missing or changed:
        message = (
            f"stdlib split {split!r}: {len(missing)} pinned files missing and {len(changed)} with another sha256 under "
            f"{root} (the split was pinned on Python {load_stdlib_split()['python_version']}). "
            f"First ones: {(missing + changed)[:3]}."
        )
        if strict:
            raise RuntimeError(message)
        warnings.warn(message + " They are skipped.", stacklevel=2)
    return found


def code_prompts(files: list[StdlibFile], num_prompts: int, *, max_chars: int = 320, min_chars: int = 120,
                 seed: int = 0) -> list[str]:
    """`num_prompts` code windows: each starts at a line start and ends at a line end, min_chars..max_chars long.

    Deterministic for a given file list and seed. Files are visited round-robin in a seeded order, so prompts spread
    over all files rather than crowding into the largest.
    """
    rng = random.Random(seed)
    candidates = []  # per file: list of (start, end) character windows
    for file in files:
        text = file.text
        line_starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
        windows = []
        for start in line_starts:
            if not text[start:start + 1].strip():  # begin on a non-blank, non-indented-whitespace character
                continue
            end = text.rfind("\n", start, start + max_chars)
            if end - start >= min_chars:
                windows.append((start, end + 1))
        if windows:
            rng.shuffle(windows)
            candidates.append((file.text, windows))
    if not candidates:
        raise ValueError(f"none of the {len(files)} files has a window of {min_chars}..{max_chars} characters")
    rng.shuffle(candidates)
    prompts, round_index = [], 0
    while len(prompts) < num_prompts:
        added = False
        for text, windows in candidates:
            if round_index < len(windows) and len(prompts) < num_prompts:
                start, end = windows[round_index]
                prompts.append(text[start:end])
                added = True
        if not added:
            break
        round_index += 1
    return prompts


def spliced_prompts(prompts: list[str], *, seed: int = 0) -> list[str]:
    """Each prompt's first half of lines followed by the second half of another prompt's (a seeded cycle over the
    prompts of two lines or more, so each is used once as each half; the text stays the given prompts', the junction
    is new); prompts of one line are kept whole. For drafter responses from training-split windows whose
    continuation the target cannot recall from its training files (benchmarks/results/tiny_pair_gpu_runs.md: the
    shipped drafter's τ16 3.38 on training-split cuts, 2.52 spliced, 2.47 held-out)."""
    lines = [text.splitlines(keepends=True) for text in prompts]
    order = [i for i, parts in enumerate(lines) if len(parts) >= 2]
    if len(order) < 2:
        raise ValueError(f"splicing takes at least two prompts of two lines or more, got {len(order)}")
    random.Random(seed).shuffle(order)
    spliced = list(prompts)
    for i, j in zip(order, order[1:] + order[:1]):
        spliced[i] = "".join(lines[i][: len(lines[i]) // 2] + lines[j][len(lines[j]) // 2:])
    return spliced


def heldout_prompts(num_prompts: int = 64, *, max_chars: int = 320, min_chars: int = 120, seed: int = 0) -> list[str]:
    """Code prompts from held-out stdlib files (never trained on), for evaluation."""
    return code_prompts(stdlib_files("heldout"), num_prompts, max_chars=max_chars, min_chars=min_chars, seed=seed)


def load_tiny_tokenizer(path: str | Path | None = None):
    """The tiny pair's byte-level BPE tokenizer (vocab 4096; `<|endoftext|>` eos, `<|pad|>`, `<|mask|>`)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path or ASSETS_DIR / "tokenizer"), local_files_only=True)


def load_tiny_pair(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
                   path: str | Path | None = None):
    """`(target, drafter, tokenizer)`: the shipped bf16 weights upcast to `dtype` on `device`, in eval mode.

    Works offline; the drafter is bound to the target (it borrows the target's embedding and LM head) and carries the
    acceptance estimator fitted on the pair's traces (`drafter.acceptance_estimator`, used by the calibrated
    strategies when HybridSpecConfig names none) and the survival table of context-lookup proposals
    (`drafter.lookup_estimator`, HybridSpecConfig.context_lookup). On CPU the
    target's experts run transformers' "eager" implementation: its default, grouped_mm, decodes one token ~25× slower
    there (590 vs 24 ms per token on 2 cores, torch 2.13).
    """
    from transformers import Qwen3_5MoeForCausalLM

    from hybridspec_hf.drafter import DFlashDrafter

    root = Path(path) if path is not None else ASSETS_DIR
    experts = {"experts_implementation": "eager"} if torch.device(device).type == "cpu" else {}
    target = Qwen3_5MoeForCausalLM.from_pretrained(root / "target", dtype=dtype, local_files_only=True, **experts)
    target = target.to(device).eval()
    drafter = DFlashDrafter.from_pretrained(root / "drafter", dtype=dtype, local_files_only=True).to(device).eval()
    drafter.bind_target(target)
    fitted = root / "acceptance_estimator.json"  # the better calibrated on held-out traces (acceptance_traces.py)
    if drafter.acceptance_estimator is None and fitted.is_file():
        from hybridspec_hf.selector import AcceptanceEstimator

        drafter.acceptance_estimator = AcceptanceEstimator.load(fitted)
    table = root / "lookup_estimator.json"  # context lookup's survival, fitted on training-split traces
    if drafter.lookup_estimator is None and table.is_file():
        from hybridspec_hf.selector.lookup import LookupEstimator

        drafter.lookup_estimator = LookupEstimator.load(table)
    return target, drafter, load_tiny_tokenizer(root / "tokenizer")
