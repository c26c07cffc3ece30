"""The drafter's LM head in int8 (`DFlashConfig.head_quantization`): what it costs and what it changes.

    PYTHONPATH=$PWD python benchmarks/draft_head.py --part kernel   # a GPU: the head alone and the draft graph
    PYTHONPATH=$PWD python benchmarks/draft_head.py --part tau      # a CPU: the tiny pair's τ with either head

A DFlash drafter multiplies by the target's LM head every draft: at the Qwen3.5-35B-A3B shape a 248 320 x 2 048 bf16
head, ≈ 1.02 GB read per round for 15 rows of logits (the draft graph's largest kernel: ≈ 0.36 of its 0.77 ms on an
H100, benchmarks/results/breakdown_run145.md). With head_quantization "int8" the drafter multiplies by an int8 copy
(one float32 scale per row, `gemv_triton.quantize_rows`) in our skinny GEMM (`linear_int8`): ≈ 0.51 GB. The drafts
are proposals, so the output stays the target's (tests/test_head_quantization.py); what can change is which drafts
are proposed, where two of the drafter's logits nearly tie.

--part kernel (random bf16 weights, N(0, 0.02)): the head alone at 1 and 15 rows, each call captured in a CUDA graph
(median of `--replays` replays, CUDA events): F.linear on the bf16 head (cuBLAS) against the int8 GEMV at each of
`--configs` (BLOCK_N x BLOCK_K, s split-K, w warps, t stages); bytes moved and TB/s beside them. Then the draft
graph itself (`draft_static` of the 35B benchmark drafter, 5 layers, a 16-token block over `--context` context
tokens; the target built with 4 layers: the drafter reads only its embedding and head) with each head: median µs of
a replay and the largest logit difference, for the four choices of head (bf16, int8) and layers (bf16, int8:
`DFlashConfig.layers_quantization`). Between them each drafter layer's projection groups (q|k|v, o, gate|up, down) at
1 and 16 rows: the bf16 draft path's product against the int8 GEMV at `gemv_triton.int8_config` and at each of
`--layer-configs`. On a CPU the kernel part is a smoke run (a small head, the interpreter).

--part tau (the shipped tiny pair, CPU): the target's greedy continuations of `--prompts` held-out prompts
(`--tokens` each), then the drafter's offline acceptance length τ at blocks 16 and 8 (`training.acceptance_lengths`:
all anchors, and the novel ones) with the head as it is and with its int8 copy, and with its layers as their int8
copies (`DFlashConfig.layers_quantization`) multiply, alone and with the int8 head, on the same continuations.
Writes benchmarks/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU runs: kernels in the Triton interpreter (read at launch)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture, environment, time_graph, write_results  # noqa: E402
from e2e import build, model_config  # noqa: E402

from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.kernels import gemv_triton  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import GemvConfig, gemv, quantize_rows  # noqa: E402

DEFAULT_CONFIGS = "64x256s1w4t4,128x128s1w4t4,64x128s1w4t4,32x256s1w4t3,128x256s1w8t3,64x512s1w4t3"
DEFAULT_LAYER_CONFIGS = ("32x128s1w4t4,32x128s2w4t4,32x128s4w4t4,32x128s8w4t4,64x128s2w4t4,64x128s4w4t4,"
                         "16x128s4w4t4,32x256s2w4t3,32x256s4w4t3")


def parse_config(spec: str) -> GemvConfig:
    """"64x256s1w4t4" -> GemvConfig(64, 256, split_k=1, num_warps=4, num_stages=4, dot=True)."""
    try:
        size, rest = spec.split("s")
        block_n, block_k = (int(v) for v in size.split("x"))
        split, rest = rest.split("w")
        warps, stages = rest.split("t")
        return GemvConfig(block_n, block_k, int(split), int(warps), int(stages), True)
    except ValueError:
        raise SystemExit(f"--configs: {spec!r} is not BNxBKsSPLITwWARPStSTAGES (e.g. 64x256s1w4t4)") from None


def head_alone(vocab: int, hidden: int, rows_list: list[int], configs: list[str], replays: int) -> list[dict]:
    """The bf16 head by F.linear against the int8 GEMV per config, each captured alone."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    quantized = quantize_rows(weight)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, hidden, device=device, generator=generator).to(torch.bfloat16)
        reference = torch.nn.functional.linear(x.float(), weight.float())
        variants = [("bf16 F.linear", lambda: torch.nn.functional.linear(x, weight),
                     weight.numel() * 2)]
        variants += [(f"int8 {spec}", (lambda c: lambda: gemv(x, quantized.weight, None, c,
                                                              scale=quantized.scale))(parse_config(spec)),
                      quantized.nbytes) for spec in configs]
        for name, function, weight_bytes in variants:
            out.append(measured(function, reference, weight_bytes, replays, rows=rows, variant=name, argmax=True))
    return out


def measured(function, reference: torch.Tensor, weight_bytes: int, replays: int, argmax: bool = False,
             **fields) -> dict:
    """A row for one product: `fields`, its weight bytes, its largest error against the fp32 `reference` relative to
    the reference's largest value (and, with `argmax`, the share of rows whose argmax it keeps), and on CUDA the
    call captured alone and timed (`time_graph`) with the TB/s of its weight bytes."""
    with torch.no_grad():
        result = function().float()
        row = dict(fields, weight_bytes=weight_bytes,
                   rel_error_vs_fp32=((result - reference).abs().max() / reference.abs().max()).item())
        if argmax:
            row["argmax_agreement_vs_fp32"] = (result.argmax(-1) == reference.argmax(-1)).float().mean().item()
        if torch.cuda.is_available():
            graph = capture(function)
            timing = time_graph(graph, 1, replays)
            del graph
            row.update(timing, tb_per_s=weight_bytes / (timing["median_us"] * 1e-6) / 1e12)
    print(row)
    return row


def layer_shapes(drafter) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection group a drafter layer multiplies by (`fused._int8_groups`' order)."""
    attn, mlp = drafter.layers[0].self_attn, drafter.layers[0].mlp
    qkv = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    return {"q|k|v": (qkv, attn.q_proj.in_features), "o": (attn.o_proj.out_features, attn.o_proj.in_features),
            "gate|up": (2 * mlp.gate_proj.out_features, mlp.gate_proj.in_features),
            "down": (mlp.down_proj.out_features, mlp.down_proj.in_features)}


def layers_alone(shapes: dict[str, tuple[int, int]], rows_list: list[int], configs: list[str],
                 replays: int) -> list[dict]:
    """Each drafter projection shape as the bf16 draft path multiplies (`gemv_triton.linear`: TABLE's config or
    cuBLAS) against the int8 GEMV at `int8_config` ("auto") and at each of `configs`, each call captured alone."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    generator = torch.Generator(device=device).manual_seed(1)
    out = []
    for label, (n, k) in shapes.items():
        weight = (torch.randn(n, k, device=device, generator=generator) * 0.02).to(torch.bfloat16)
        quantized = quantize_rows(weight)
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, generator=generator).to(torch.bfloat16)
            reference = torch.nn.functional.linear(x.float(), weight.float())
            variants = [("bf16 (the draft path's)", lambda: gemv_triton.linear(x, weight), weight.numel() * 2)]
            specs = [("auto", gemv_triton.int8_config(n, k))] + [(spec, parse_config(spec)) for spec in configs]
            variants += [(f"int8 {spec} = {c.block_n}x{c.block_k}s{c.split_k}w{c.num_warps}t{c.num_stages}"
                          if spec == "auto" else f"int8 {spec}",
                          (lambda c: lambda: gemv(x, quantized.weight, None, c, scale=quantized.scale))(c),
                          quantized.nbytes) for spec, c in specs]
            for name, function, weight_bytes in variants:
                out.append(measured(function, reference, weight_bytes, replays, shape=label, n=n, k=k, rows=rows,
                                    variant=name))
    return out


def draft_graph(model: str, context: int, replays: int) -> list[dict]:
    """`draft_static` of the benchmark drafter with the head as it is or its int8 copy and the layers as they are or
    their int8 copies (`DRAFT_VARIANTS`), each captured."""
    from hybridspec_hf.drafter import fused

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    on_cpu, fused._ON_CPU = fused._ON_CPU, not cuda  # the CPU smoke run takes the fused path in the interpreter
    try:
        return _draft_graph(model, context, replays, cuda, device)
    finally:
        fused._ON_CPU = on_cpu


def _draft_graph(model: str, context: int, replays: int, cuda: bool, device: torch.device) -> list[dict]:
    from hybridspec_hf.drafter import StaticDraftContext, fused

    _, drafter = build(model, 4, device.type)
    width = drafter.fc.in_features
    context = context if cuda else min(context, 32)
    ctx = StaticDraftContext(drafter, context + 64, device, drafter.dtype)
    anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
    out, logits = [], {}
    with torch.no_grad():
        ctx.append(torch.randn(1, context, width, device=device, dtype=drafter.dtype), context)
        for head, layers in DRAFT_VARIANTS:
            drafter.config.head_quantization, drafter.config.layers_quantization = head, layers
            ctx.fused = fused.refresh_weights(drafter, ctx.fused, device, drafter.dtype)  # the int8 layer copies
            with patches.fused_kernels():
                if not fused.active(drafter, ctx):
                    raise RuntimeError(f"draft graph: the fused draft path does not take head={head}, "
                                       f"layers={layers}; the timing would not be the resident draft's")
                function = lambda: drafter.draft_static(anchor, ctx, upcast=False)  # noqa: E731
                logits[head, layers] = function().float()
                row = dict(head=head or "bf16 (the target's)", layers=layers or "bf16")
                if cuda:
                    graph = capture(function)
                    row.update(time_graph(graph, 1, replays))
                    del graph
            plain = logits[DRAFT_VARIANTS[0]]
            row.update(largest_logit_difference=(logits[head, layers] - plain).abs().max().item(),
                       draft_agreement=(logits[head, layers].argmax(-1) == plain.argmax(-1)).float().mean().item())
            out.append(row)
            print(row)
        drafter.config.head_quantization = drafter.config.layers_quantization = None
    return out


DRAFT_VARIANTS = ((None, None), ("int8", None), (None, "int8"), ("int8", "int8"))  # (head, layers) quantization


TAU_VARIANTS = (("the target's head", None, False), ("int8", "int8", False), ("int8 layers", None, True),
                ("int8 head and layers", "int8", True))  # (label, head_quantization, int8 layers)


def tau(prompts: int, tokens: int, variants=TAU_VARIANTS) -> dict:
    """The tiny pair's offline τ with the head as it is or in int8 and the layers as they are or as their int8
    copies multiply (`fused.int8_equivalent`), on the same greedy continuations."""
    from hybridspec_hf.drafter import fused
    from hybridspec_hf.drafter.training import acceptance_lengths, regenerate_responses
    from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair

    target, drafter, tokenizer = load_tiny_pair()
    texts = heldout_prompts(prompts)
    with tempfile.TemporaryDirectory() as folder:
        samples = regenerate_responses(target, tokenizer, texts, folder, max_new_tokens=tokens, batch_size=32,
                                       desc="regenerate (greedy)")
    result = {}
    for label, head, layers in variants:
        model = fused.int8_equivalent(drafter) if layers else drafter
        model.config.head_quantization = head
        with torch.no_grad():
            result[label] = acceptance_lengths(target, model, samples, (16, 8))
        model.config.head_quantization = None
    return result


def main(argv: list[str] | None = None) -> dict:
    """Runs the part; returns what it wrote (on a CPU the kernel part is a smoke run and writes nothing)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["kernel", "tau"], default="kernel")
    parser.add_argument("--model", default="qwen35_35b_a3b")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="int8 GEMV configs to time (kernel part)")
    parser.add_argument("--layer-configs", default=DEFAULT_LAYER_CONFIGS,
                        help="int8 GEMV configs to time at the drafter layers' shapes beside int8_config's (kernel "
                             "part; 'none': the head and the draft graph only)")
    parser.add_argument("--rows", default="1,15")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.part == "tau":
        result = tau(args.prompts, args.tokens)
        lines = ["| drafter | τ16 | τ16 novel anchors | τ8 | τ8 novel | anchors (16) |",
                 "|---|---|---|---|---|---|"]
        for head, r in result.items():
            b16, b8 = r["block_sizes"]["16"], r["block_sizes"]["8"]
            lines.append(f"| {head} | **{b16['tau']:.3f}** | {b16['tau_novel']:.3f} | {b8['tau']:.3f} | "
                         f"{b8['tau_novel']:.3f} | {b16['num_anchors']} |")
        table = "\n".join(lines)
        print(table)
        notes = (f"The shipped tiny pair (trained weights, fp32 on the CPU), {args.prompts} held-out stdlib prompts, "
                 f"the target's greedy continuations of {args.tokens} tokens; τ by `training.acceptance_lengths` "
                 "(every anchor whose block fits; novel: the next 8 tokens do not occur earlier), the drafter with "
                 "the target's head as it is and with its int8 copy (head_quantization), and with its layers' "
                 "projections as their int8 copies multiply (layers_quantization, measured through "
                 "`fused.int8_equivalent`: the dequantized weights on the eager path, whose context k|v are "
                 "quantized too), on the same continuations.")
        payload = dict(title="The drafter's LM head and layers in int8: acceptance on the tiny pair",
                       environment=environment(),
                       command=" ".join(sys.argv), weights="trained (the shipped tiny pair)", result=result, notes=notes)
        write_results(args.name or "draft_head_tau_tiny_pair", payload, table)
        return payload
    config = model_config(args.model, 4).get_text_config() if cuda else None
    vocab, hidden = (config.vocab_size, config.hidden_size) if cuda else (1000, 256)
    configs = args.configs.split(",") if cuda else args.configs.split(",")[:2]
    rows = [int(r) for r in args.rows.split(",")]
    alone = head_alone(vocab, hidden, rows, configs, args.replays)
    layer_configs = [] if args.layer_configs == "none" else args.layer_configs.split(",")[:None if cuda else 1]
    layers = []
    if args.layer_configs != "none":
        _, drafter = build(args.model if cuda else "tiny", 4, "cuda" if cuda else "cpu")
        block_rows = [16 if r > 1 else r for r in rows]  # a draft multiplies its layers by its whole block
        layers = layers_alone(layer_shapes(drafter), block_rows, layer_configs, args.replays)
        del drafter
    graph = draft_graph(args.model if cuda else "tiny", args.context, args.replays)
    lines = ["| rows | head | µs (median) | p10 | p90 | weight MB | TB/s | argmax = fp32's |", "|---|---|---|---|---|---|---|---|"]
    for r in alone:
        if "median_us" in r:
            lines.append(f"| {r['rows']} | {r['variant']} | **{r['median_us']:.1f}** | {r['p10_us']:.1f} | "
                         f"{r['p90_us']:.1f} | {r['weight_bytes'] / 1e6:.0f} | {r['tb_per_s']:.2f} | "
                         f"{r['argmax_agreement_vs_fp32']:.3f} |")
    if layers:
        lines += ["", "| layer projection | N x K | rows | variant | µs (median) | p10 | p90 | weight MB | TB/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in layers:
            if "median_us" in r:
                lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['variant']} | "
                             f"**{r['median_us']:.1f}** | {r['p10_us']:.1f} | {r['p90_us']:.1f} | "
                             f"{r['weight_bytes'] / 1e6:.1f} | {r['tb_per_s']:.2f} |")
    lines += ["", "| draft graph: head | layers | µs (median) | p10 | p90 | largest logit difference | drafts equal |",
              "|---|---|---|---|---|---|---|"]
    for r in graph:
        if "median_us" in r:
            lines.append(f"| {r['head']} | {r['layers']} | **{r['median_us']:.1f}** | {r['p10_us']:.1f} | "
                         f"{r['p90_us']:.1f} | {r['largest_logit_difference']:.3g} | {r['draft_agreement']:.3f} |")
    table = "\n".join(lines)
    print(table)
    payload = dict(title=f"The drafter's LM head and layers in int8 ({args.model})", environment=environment(),
                   command=" ".join(sys.argv), weights="random", head_alone=alone, layers_alone=layers,
                   draft_graph=graph, int8_config=str(gemv_triton.INT8_CONFIG))
    if not cuda:
        return payload
    notes = (f"Random bf16 weights (the head N(0, 0.02)); head {vocab} x {hidden}; CUDA graphs, "
             f"{args.replays} timed replays after 20 untimed; the draft graph: e2e.py's {args.model} drafter "
             f"(5 layers), a 16-token block over {args.context} context tokens, fused kernels, with the head and "
             "the layers each as they are (bf16) or int8 (head_quantization, layers_quantization); drafts equal: "
             "the share of the block's argmax equal to the all-bf16 graph's. Layer projections: each drafter "
             "layer's projection groups at 1 and 16 rows (a draft's block), bf16 as the draft path multiplies "
             "(TABLE's GEMV config or cuBLAS) against the int8 GEMV at int8_config (auto) and the listed configs.")
    write_results(args.name or "draft_head", {**payload, "notes": notes}, table)
    return payload


if __name__ == "__main__":
    main()
