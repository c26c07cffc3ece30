"""The MoE kernels' tiles of the max-shape round, measured in the round itself at forced lengths.

    python benchmarks/round_tiles.py                     # one H200: Qwen3.5-35B-A3B shape, random bf16 weights
    python benchmarks/round_tiles.py --variants base,g16x128-d32x128,base --lengths 1,2,4,8,16
    python benchmarks/round_tiles.py --variants base,base-moe-decode,base   # an A/B switch (common.SWITCHES)

A GPU-resident round verifies the whole block (T = 16 at the 35B-A3B drafter's block) with a device-side valid
length, so its MoE layers run the direct-rows kernels at T = 16 whatever w the selector chose: the tiles
`moe_triton.default_tiles(16, "direct")` picked for 16 valid tokens (≈ 102 distinct experts a layer under uniform
routing) also serve rounds of one to eight (8 to ≈ 57 experts), where few slots make few programs (run 123 of
gpu_rounds_runs.md, `breakdown_run123.md`: at w = 1 the round's gate_up took 1 030 µs against 775 for the AR step's
decode kernel). Each variant sets the direct rows' tiles at the block's T (gate_up and down: block_n x block_k,
warps, stages), captures the round afresh with its length forced (`calibration.ForcedLength` beside HybridSpec's
selector work, as calibration times C(w)), and times a replay at each w (CUDA events, the median of `--replays`,
three times; the verified length read back). "base" is the code's tiles; put it first and last: the spread of its
rows is the noise. A variant may end in "+SWITCH" / "-SWITCH" (common.SWITCHES: that A/B switch on / off). Random
bf16 weights, a random drafter (each replay commits ≈ 1 token).
Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from breakdown import captured_rounds, forced_label, parts_of, wall_ms  # noqa: E402
from common import environment, method_variant, variant_base, variant_switches, write_results  # noqa: E402
from e2e import build  # noqa: E402

import hybridspec_hf  # noqa: E402
from hybridspec_hf import HybridSpecConfig  # noqa: E402
from hybridspec_hf.generation.calibration import ForcedLength, shadow_selector  # noqa: E402
from hybridspec_hf.kernels import moe_triton  # noqa: E402

_TILE = r"(\d+)x(\d+)(?:w(\d+))?(?:s(\d+))?"


def parse_variant(spec: str) -> tuple | None:
    """"base" -> None; "g16x128-d32x128" or "g16x128w4s3-d32x64w8s4" -> (gate_up Tiles, down Tiles); a clear
    SystemExit otherwise. Warps and stages default to Tiles' (4, 4)."""
    if spec == "base":
        return None
    match = re.fullmatch(f"g{_TILE}-d{_TILE}", spec)
    if match is None:
        raise SystemExit(f"unknown variant {spec!r}: 'base' or gBNxBK[wWARPS][sSTAGES]-dBNxBK[wWARPS][sSTAGES], "
                         "e.g. g16x128-d32x128")
    g = [int(v) if v else None for v in match.groups()[:4]]
    d = [int(v) if v else None for v in match.groups()[4:]]

    def tiles(n, k, warps, stages):
        return moe_triton.Tiles(n, k, warps or 4, stages or 4)
    return tiles(*g), tiles(*d)


@contextlib.contextmanager
def direct_tiles(tiles: tuple | None, tokens: int):
    """Inside: the direct rows at `tokens` tokens take `tiles` (gate_up, down); None: the code's own."""
    original = moe_triton.default_tiles

    def default_tiles(num_tokens, mode):
        block_m, gate_up, down = original(num_tokens, mode)
        if tiles is not None and mode == "direct" and num_tokens == tokens:
            gate_up, down = tiles
        return block_m, gate_up, down
    moe_triton.default_tiles = default_tiles
    try:
        yield
    finally:
        moe_triton.default_tiles = original


def measure(target, drafter, prompt: torch.Tensor, spec: str, lengths: list[int], replays: int) -> dict:
    """One variant: the forced round captured afresh under its tiles, a replay's wall at each w (ms: the median of
    the three medians, and all three) and the tokens each w's replays verified (read back)."""
    block = drafter.config.block_size
    forced = ForcedLength(block, shadow_selector(target, block))
    settings = HybridSpecConfig(cuda_graphs="on", verify_shape="max", selector=forced)
    kwargs = dict(generation_strategy="hybridspec", hybridspec_config=settings, assistant_model=drafter,
                  attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0)
    capacity = 3 * replays * len(lengths) + 2 * len(lengths) + 64  # each replay commits ≈ 1 token (random drafter)
    hybridspec_hf.release_graphs(target)
    row = {"variant": spec, "wall_ms": {}, "wall_ms_all": {}, "verified": {},
           "switches": variant_switches(spec, drafter)}
    with method_variant(spec, target, drafter) as tiles, direct_tiles(parse_variant(tiles), block):
        rounds = captured_rounds(target, prompt, capacity, kwargs)
        parts = parts_of(rounds, "hybridspec", "forced", [], lengths, forced)
        for n in lengths:
            part = parts[forced_label(n)]
            part.before()
            walls = [wall_ms(part.replay, replays) for _ in range(3)]
            row["wall_ms"][n], row["wall_ms_all"][n] = sorted(walls)[1], walls
            row["verified"][n] = int(rounds.round_valid.max())
    hybridspec_hf.release_graphs(target)
    return row


def report(rows: list[dict], lengths: list[int]) -> str:
    base = [r for r in rows if r["variant"] == "base"]
    mean = {n: statistics.mean(r["wall_ms"][n] for r in base) for n in lengths} if base else None
    spread = {n: max(r["wall_ms"][n] for r in base) - min(r["wall_ms"][n] for r in base) for n in lengths} \
        if base else None
    head = "| variant | " + " | ".join(f"w = {n} ms" for n in lengths) + " |"
    lines = [head, "|" + "---|" * (len(lengths) + 1)]
    for r in rows:
        cells = [f"{r['wall_ms'][n]:.3f}" + (f" ({(r['wall_ms'][n] - mean[n]) * 1e3:+.0f} µs)" if mean else "")
                 for n in lengths]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    if spread:
        lines += ["", "Δ against the mean of the base rows; their spread (the noise), µs: "
                  + ", ".join(f"w = {n}: {spread[n] * 1e3:.0f}" for n in lengths)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--replays", type=int, default=10, help="replays per wall measurement (3 measurements)")
    parser.add_argument("--lengths", default="1,2,4,8,16", help="forced round lengths w")
    parser.add_argument("--variants", default="base,g16x128-d32x128,base")
    parser.add_argument("--name", default="round_tiles")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for spec in variants:  # every variant's error before the model is built
        parse_variant(variant_base(spec))
    lengths = [int(n) for n in args.lengths.split(",")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = build(args.model, args.layers, device)
    if max(lengths) > drafter.config.block_size:
        raise SystemExit(f"--lengths: at most the drafter's block ({drafter.config.block_size}), got {max(lengths)}")
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for spec in variants:
        rows.append(measure(target, drafter, prompt, spec, lengths, args.replays))
        print(spec, {n: round(ms, 3) for n, ms in rows[-1]["wall_ms"].items()}, flush=True)
    config = target.config.get_text_config()
    table = (f"{args.model}, {config.num_hidden_layers} layers, random bf16 weights, random drafter; the max-shape "
             f"round (T = {drafter.config.block_size}) with its length forced, batch 1, context {args.context}; "
             f"wall = the median of three medians of {args.replays} replays (CUDA events).\n\n"
             + report(rows, lengths))
    payload = {"title": f"The max-shape round's MoE tiles at forced lengths ({args.model})",
               "environment": environment(), "weights": "random", "lengths": lengths, "rows": rows,
               "notes": __doc__.split("\n\n")[1]}
    write_results(args.name, payload, table)
    print(table)
    return payload


if __name__ == "__main__":
    main()
