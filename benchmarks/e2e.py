"""End-to-end benchmark at full size: every method side by side in one process.

    python benchmarks/e2e.py --model qwen35_35b_a3b              # one H200; also `hybridspec bench`
    python benchmarks/e2e.py --model tiny --tokens 24           # the harness itself, on a CPU (seconds)

Random bf16 weights (random router: uniform routing), a random DFlash drafter, and acceptance replayed from the
declared, versioned profiles in benchmarks/profiles/ (timing mode: each speculative round takes the next profile
row's draft signals and accepts min(a_full, w - 1) drafts; verification and commit run for real on the real shapes;
the text is not the model's, so no equality is claimed here — correctness is tests/ and gpu_rounds.py's fp32 runs).
The first half of each profile's rows is replayed; the calibrated strategies' acceptance estimator is fitted on the
other half (as a user fits it on traces of their drafter), and their latency model is calibrated under the routing
the rounds see. ms/token is decoding: the decode loop's wall time (every round, with the host's work between rounds)
per emitted token for our methods; (timed call - prefill-only call) / (new tokens - 1) for HF eager.
Methods, all through generate(): HF eager AR (no profile: plain decoding), our captured AR ("ar"), vanilla DFlash
(whole block) with our verifier and with the serving engines' per-token-state verifier, static w = 7, the
per-round-ratio selector (EVICT-like), HybridSpec without routing correction ("nominal"), HybridSpec with the
per-token-state verifier, HybridSpec with exact-length rounds ("hybridspec_exact": a draft graph, then the verify
graph of the chosen length, instead of the default max-shape round on CUDA: one graph verifying the whole block with a
device-side valid length), and HybridSpec. Routing: "uniform" (the random router) and "calibrated" (every router's
choices replaced by expert ids sampled from the excess reuse fitted on the real pair, profiles/routing_tiny_pair.json).
Not run unless asked: HF static cache + compile (minutes of compilation; --with-compile).
Writes benchmarks/results/e2e_<model>.{json,md} and .png plots (speedup bars, round latency vs w, chosen lengths).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, add_switches, apply_switches, environment, method_variant, profile_elsewhere,  # noqa: E402
                    switch_settings, variant_switches, write_results)

import hybridspec_hf  # noqa: E402
from hybridspec_hf import DFlashDrafter, HybridSpecConfig  # noqa: E402
from hybridspec_hf.config import CALIBRATED_STRATEGIES, resolved_verify_shape  # noqa: E402
from hybridspec_hf.generation.calibration import calibrate_latency  # noqa: E402
from hybridspec_hf.selector import AcceptanceEstimator  # noqa: E402
from hybridspec_hf.selector.profiles import RoutingProfile, load_profile  # noqa: E402

PROFILES = Path(__file__).resolve().parent / "profiles"
METHODS = ["hf_eager", "ar", "dflash", "dflash_per_token_state", "static7", "ratio", "nominal",
           "hybridspec_per_token_state", "hybridspec_exact", "hybridspec"]
NOT_RUN = {
    "hf_static_compile": "not run by default (generate(cache_implementation='static') compiles for minutes); "
                         "--with-compile runs it",
}
HBM_TBPS = 4.25  # H200 copy bandwidth ceiling used for rooflines


# name -> (layers, hidden size, attention heads, GDN value heads, expert and shared-expert intermediate size)
QWEN35_MOE_SHAPES = {
    "qwen35_35b_a3b": (40, 2048, 16, 32, 512),  # also Qwen3.6-35B-A3B: same architecture, the same with random weights
    "qwen35_122b_a10b": (48, 3072, 32, 64, 1024),  # 244 GB in bf16: two H200s under tensor parallelism (multigpu.py)
}


def model_config(name: str, layers: int | None):
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    if name == "tiny":
        n = layers or 4
        return Qwen3_5MoeTextConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=n, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=4096,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)])
    if name in QWEN35_MOE_SHAPES:  # the fields the Qwen3.5-MoE sizes differ in (shared/notes/transformers.md)
        default_layers, hidden, heads, value_heads, inter = QWEN35_MOE_SHAPES[name]
        n = layers or default_layers
        return Qwen3_5MoeTextConfig(
            vocab_size=248320, hidden_size=hidden, num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=inter, shared_expert_intermediate_size=inter, max_position_embeddings=262144,
            layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)],
            tie_word_embeddings=False)
    if name == "qwen3_next_80b_a3b":  # 48 layers ≈ 160 GB in bf16: does not fit one H200, run fewer (--layers)
        n = layers or 32
        return Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=n, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
            num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            max_position_embeddings=262144, norm_topk_prob=True,
            layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)])
    raise ValueError(f"unknown model {name!r}")


def build(name: str, layers: int | None, device: str):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    config = model_config(name, layers)
    cls = Qwen3NextForCausalLM if config.model_type == "qwen3_next" else Qwen3_5MoeForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        target = cls._from_config(config, dtype=dtype).eval()
    if device == "cpu":
        target.set_experts_implementation("eager")
    drafter = DFlashDrafter.from_target(target, num_layers=5 if name != "tiny" else 1, block_size=16)
    drafter = drafter.to(device, dtype).eval().bind_target(target)
    return target, drafter


def uniform_distinct(target, tokens: int) -> float:
    """E·(1-(1-k/E)^T): the distinct experts per MoE layer that `tokens` tokens reach under a uniform router."""
    config = target.config.get_text_config()
    experts, k = config.num_experts, config.num_experts_per_tok
    return experts * (1 - (1 - k / experts) ** tokens)


def roofline_bytes(target, tokens: int, routing=None, context: int = 0, distinct: float | None = None) -> dict | None:
    """Fewest bytes a target forward over `tokens` tokens moves, by part: dense weights (LM head included; the
    embedding table counted as the rows read), the distinct experts the tokens touch per MoE layer (uniform:
    E·(1-(1-k/E)^w); calibrated: measured on the routing profile's bank; `distinct`: a count measured elsewhere,
    mean per MoE layer), the GDN states read and written, and `context` tokens of KV cache read. None for a model
    without experts."""
    config = target.config.get_text_config()
    experts = getattr(config, "num_experts", None)
    if experts is None:
        return None
    k, size = config.num_experts_per_tok, 3 * config.hidden_size * config.moe_intermediate_size
    size *= next(target.parameters()).element_size()
    moe_layers = sum(1 for name, _ in target.named_modules() if name.endswith(".mlp.experts"))
    embed = target.get_input_embeddings().weight
    routed = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if ".mlp.experts." in n)
    dense = sum(p.numel() * p.element_size() for p in target.parameters()) - routed - embed.numel() * embed.element_size()
    if distinct is not None and routing is not None:
        raise ValueError("roofline_bytes: give a routing profile or a measured distinct count, not both")
    if distinct is None:
        distinct = uniform_distinct(target, tokens)
    if routing is not None:
        bank = routing.bank(1, experts, k, rounds=64)  # [rounds, 1, B, k]
        distinct = sum(len(set(bank[r, 0, :tokens].flatten().tolist())) for r in range(64)) / 64
    types = list(getattr(config, "layer_types", None) or [])
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4  # fp32
    kv = context * 2 * config.num_key_value_heads * config.head_dim * embed.element_size()
    return {"dense weights (LM head included)": dense, "experts": moe_layers * distinct * size,
            "GDN state (read + write)": 2 * types.count("linear_attention") * state,
            "KV cache": types.count("full_attention") * kv,
            "embedding rows": tokens * embed.shape[1] * embed.element_size()}


def copy_tbps(device: torch.device | str = "cuda", gib: int = 2, repeats: int = 10) -> float:
    """This GPU's device-to-device copy bandwidth (TB/s: bytes read + written per second, the median of `repeats`
    copies of a `gib` GiB buffer): how HBM_TBPS was measured on the H200, so rooflines at it compare across GPUs."""
    source = torch.empty(gib << 30, dtype=torch.uint8, device=device).random_(0, 256)
    dest = torch.empty_like(source)
    dest.copy_(source)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dest.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    seconds = sorted(times)[len(times) // 2]
    return 2 * source.numel() / seconds / 1e12


def roofline_seconds(target, tokens: int, routing=None, context: int = 0) -> float | None:
    """`roofline_bytes` at the H200's copy bandwidth."""
    parts = roofline_bytes(target, tokens, routing, context)
    return None if parts is None else sum(parts.values()) / (HBM_TBPS * 1e12)


def ceiling_tokens_per_s(target, tau: float, block: int, routing=None) -> float | None:
    """Bytes ceiling of rounds verifying the whole block (τ tokens per round; drafting not counted)."""
    seconds = roofline_seconds(target, block, routing)
    return None if seconds is None else tau / seconds


def length_choice_bound(cost: torch.Tensor, cost_ar: float, accepted: torch.Tensor) -> float:
    """How much faster than vanilla DFlash (always the whole block) ANY choice of verification length can be, given
    round costs `cost` [B] (C(w), w = 1..B) and the rows' accepted lengths `accepted` [rows] (with the whole block
    verified): an oracle that knows each round's accepted length a beforehand verifies a + 1 tokens (a plain step at
    cost_ar when a = 0) and emits the same tokens as DFlash does. Its tokens/s over DFlash's bounds every selector's
    gain over vanilla DFlash under these costs and this profile."""
    block = cost.shape[0]
    a = accepted.double().clamp(max=block - 1)
    spent = torch.where(a == 0, torch.full_like(a, cost_ar), cost.double()[(a + 1).long() - 1])
    return float(cost[-1].double() * a.numel() / spent.sum())


def run_method(target, drafter, prompt, method: str, profile, tokens: int, routing=None, latency=None,
               estimator=None, cuda_graphs: str = "auto") -> dict:
    """One method: a warm-up call (captures, compiles), a prefill-only call (time to first token), a timed call.
    Decode ms/token = (timed - prefill-only) / (new tokens - 1): the decoding speed, without the prefill that every
    method shares (reported separately). cuda_graphs: HybridSpecConfig.cuda_graphs of our methods. A method
    "BASE+FLAG" / "BASE-FLAG" runs BASE with that A/B switch on / off (common.method_variant)."""
    with method_variant(method, target) as base:
        row = _run_method(target, drafter, prompt, base, profile, tokens, routing, latency, estimator, cuda_graphs)
        if base != method:
            row["switches"] = variant_switches(method)
        return row


def _run_method(target, drafter, prompt, method: str, profile, tokens: int, routing, latency, estimator,
                cuda_graphs: str) -> dict:
    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    warmup_tokens = tokens  # the same length: resident rounds are captured for the call's static-cache capacity
    if method == "hf_eager":
        kwargs = {}
    elif method == "hf_static_compile":  # transformers' fast path: compiles on the first call of each length
        kwargs, warmup_tokens = {"cache_implementation": "static"}, tokens
    else:
        strategy = {"static7": "static"}.get(method, method).replace("_per_token_state", "").replace("_exact", "")
        verifier = "per_token_state" if method.endswith("_per_token_state") else "block"
        shape = "exact" if method.endswith("_exact") else resolved_verify_shape(HybridSpecConfig(), prompt.device)
        timed = profile is not None and method != "ar"
        calibrated = latency is not None and strategy in CALIBRATED_STRATEGIES  # the others need no C(w)
        settings = HybridSpecConfig(static_length=7, acceptance_profile=profile if timed else None,
                                    routing_profile=routing if timed else None, gdn_verifier=verifier,
                                    latency_model=latency(shape) if calibrated else None,
                                    acceptance_estimator=estimator, verify_shape=shape, cuda_graphs=cuda_graphs)
        kwargs = dict(generation_strategy=strategy, hybridspec_config=settings,
                      assistant_model=drafter if method != "ar" else None)

    def timed_call(new_tokens: int) -> tuple[float, int]:
        sync()
        start = time.perf_counter()
        out = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens, **kwargs)
        sync()
        return time.perf_counter() - start, out.shape[1] - prompt.shape[1]

    # one method's rounds at a time (a target keeps up to 3 captured sets): the GPU memory column is this method's
    hybridspec_hf.release_graphs(target)
    sync()
    start = time.perf_counter()
    replayed = profile if not method.startswith("hf_") and method != "ar" else None
    with profile_elsewhere(replayed):  # warm-up: captures, compiles (on another stretch of the profile)
        target.generate(prompt, do_sample=False, max_new_tokens=warmup_tokens, **kwargs)
    sync()
    warmup_s = time.perf_counter() - start
    capture_s = 0.0 if method.startswith("hf_") else hybridspec_hf.get_telemetry(target).capture_s
    prefill = min(timed_call(1)[0] for _ in range(3))
    if prompt.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, new = timed_call(tokens)
    decode = (seconds - prefill) / max(new - 1, 1)
    if not method.startswith("hf_"):  # our methods: the decode loop's own wall time (rounds, host work between)
        rounds = hybridspec_hf.get_telemetry(target).rounds
        decode = sum(r.wall_s for r in rounds) / max(sum(r.emitted for r in rounds), 1)
    row = {"ms_per_token": decode * 1e3, "tokens_per_s": 1.0 / decode, "new_tokens": new,
           "prefill_ms": prefill * 1e3, "end_to_end_ms_per_token": seconds / new * 1e3,
           "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if prompt.is_cuda else None}
    if method == "hf_static_compile":  # did generate() compile (transformers keeps the compiled call on the model)?
        row.update(compiled=hasattr(target, "_compiled_call"), warmup_s=warmup_s)
    if not method.startswith("hf_"):
        tel = hybridspec_hf.get_telemetry(target)
        rounds = tel.rounds
        row.update(path=tel.path, capture_s=capture_s, recaptured=tel.capture_s > 0, tau=tel.mean_emitted, mean_w=tel.mean_verified,
                   round_ms=statistics.median(r.wall_s for r in rounds) * 1e3,
                   host_ms=statistics.median(r.host_s or 0.0 for r in rounds) * 1e3,  # None: eager loop
                   plain_steps=sum(not r.drafted for r in rounds), rounds=len(rounds),
                   chosen_w=[r.w for r in rounds if r.drafted],
                   round_ms_by_w={w: statistics.median(r.wall_s * 1e3 for r in rounds if r.w == w and r.drafted)
                                  for w in sorted({r.w for r in rounds if r.drafted})})
    return row


def bounds(target, models: dict, accepted: torch.Tensor, routing) -> dict:
    """The most any length choice can gain over vanilla DFlash on these rows (`length_choice_bound`): under each
    calibrated latency model's measured C(w), and under the bytes roofline C(w) (the target's forward only)."""
    result = {f"measured C(w), {shape} verification": length_choice_bound(m.cost[0], float(m.cost_ar[0]), accepted)
              for shape, m in models.items()}
    roof = [roofline_seconds(target, w, routing) for w in range(1, 17)]
    if roof[0] is not None:
        result["bytes roofline C(w)"] = length_choice_bound(torch.tensor(roof), roof[0], accepted)
    return result


def routing_profile(name: str) -> RoutingProfile | None:
    """"uniform": the random router (None); "calibrated": expert ids sampled from the reuse fitted on the real pair."""
    if name == "uniform":
        return None
    if name == "calibrated":
        return RoutingProfile.from_dict(json.loads((PROFILES / "routing_tiny_pair.json").read_text()))
    raise ValueError(f"routing must be 'uniform' or 'calibrated', got {name!r}")


def profile_halves(name: str):
    """(profile, replayed rows, held-out rows, acceptance estimator) of a declared profile: the first half of its rows
    is replayed; the estimator (the draft-side p̂ every calibrated strategy reads) is fitted on the other half, as a
    user fits it on traces of their drafter."""
    profile = load_profile(PROFILES / f"{name}.safetensors")
    half = profile.accepted.shape[0] // 2
    replay, held = profile.rows(slice(0, half)), profile.rows(slice(half, None))
    return profile, replay, held, AcceptanceEstimator.fit(held.signals())


def latency_for(target, drafter, routing, routing_name: str, report: dict, cuda_graphs: str = "auto"):
    """`latency(shape)`: the calibrated strategies' latency model for a verify shape, measured once under the routing
    (and verify shape) the rounds see, and entered in report["latency"]."""
    models = {}

    def latency(shape: str):
        if shape not in models:
            start = time.perf_counter()
            models[shape] = calibrate_latency(target, drafter, routing_profile=routing, progress=False,
                                              verify_shape=shape, cuda_graphs=cuda_graphs)
            label = f"{routing_name} routing, {shape} verification"
            report.setdefault("latency", {})[label] = {**latency_table(models[shape]),
                                                      "calibration_s": time.perf_counter() - start}
            print("latency model,", label, report["latency"][label], flush=True)
        return models[shape]

    latency.models = models  # what was calibrated so far, by verify shape
    return latency


def latency_table(model) -> dict:
    """C(w) and C_ar (ms) at the first calibrated context, and C(16)/C(4) (the paper's is 1.71, real routing)."""
    cost = model.cost[0] * 1e3
    return {"context": int(model.context_lens[0]), "cost_ms": [round(float(c), 3) for c in cost],
            "cost_ar_ms": round(float(model.cost_ar[0]) * 1e3, 3),
            "c16_over_c4": round(float(cost[-1] / cost[3]), 3) if cost.shape[0] >= 4 else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_35b_a3b", choices=[*QWEN35_MOE_SHAPES, "qwen3_next_80b_a3b", "tiny"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: all that fit)")
    parser.add_argument("--profiles", default="dflash_like,low,tiny_pair_heldout",
                        help="acceptance profiles in benchmarks/profiles/ (comma-separated stems)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated subset of " + ",".join(METHODS) + "; METHOD+FLAG / METHOD-FLAG runs "
                             "METHOD with an A/B switch on / off (e.g. hybridspec+defer-appends)")
    parser.add_argument("--routing", default="uniform,calibrated", help="uniform (random router) and/or calibrated")
    parser.add_argument("--tokens", type=int, default=512, help="new tokens per timed call (HF eager: ≤ 64)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens (random ids)")
    parser.add_argument("--with-compile", action="store_true", help="also time generate(cache_implementation='static')")
    parser.add_argument("--name", default=None, help="results stem (default e2e_<model>)")
    add_switches(parser, "moe-decode", "defer-appends", "pdl", "early-reads", "gdn-norm-fold", "wide-direct",
                 "align-kernel")
    args = parser.parse_args(argv)
    apply_switches(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, drafter = build(args.model, args.layers, device)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    methods = args.methods.split(",")
    report: dict = {"model": args.model, "layers": target.config.get_text_config().num_hidden_layers,
                    "parameters_b": sum(p.numel() for p in target.parameters()) / 1e9, "device": device,
                    "weights": "random", "not_run": dict(NOT_RUN), "switches": switch_settings(),
                    "profiles": {}}
    if args.with_compile:
        report["not_run"].pop("hf_static_compile")
        methods.insert(1, "hf_static_compile")
    plain = {}
    for m in [m for m in methods if m in ("hf_eager", "hf_static_compile", "ar")]:
        try:
            plain[m] = run_method(target, drafter, prompt, m, None, min(args.tokens, 64) if m == "hf_eager" else args.tokens)
        except Exception as error:  # transformers' own fast path may not run on this model: say so, keep the rest
            if m != "hf_static_compile":
                raise
            plain[m] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print("plain decoding,", m, plain[m], flush=True)
    report["latency"] = {}
    for routing_name in args.routing.split(","):
        routing = routing_profile(routing_name)
        latency = latency_for(target, drafter, routing, routing_name, report)
        for name in args.profiles.split(","):
            profile, replay, held, estimator = profile_halves(name)
            half = replay.accepted.shape[0]
            rows = dict(plain)
            ceiling = ceiling_tokens_per_s(target, replay.mean_accepted_length, profile.block_size, routing)
            report["profiles"][f"{name} / {routing_name} routing"] = {
                "mean_accepted_length": replay.mean_accepted_length, "routing": routing_name,
                "replayed_rows": half, "estimator_fit_rows": held.accepted.shape[0],
                "bytes_ceiling_tokens_per_s": ceiling, "methods": rows}
            for method in methods:
                if method in rows:
                    continue
                try:
                    rows[method] = run_method(target, drafter, prompt, method, replay, args.tokens, routing,
                                              latency, estimator)
                except Exception as error:  # keep what was measured, say what failed (CUDA errors are sticky: stop)
                    rows[method] = {"error": f"{type(error).__name__}: {error}"}
                    save(args.name or f"e2e_{args.model}", report)
                    raise
                print(name, routing_name, method, {k: v for k, v in rows[method].items() if k != "chosen_w"},
                      flush=True)
            report["profiles"][f"{name} / {routing_name} routing"]["length_choice_bound"] = bounds(
                target, latency.models, replay.accepted, routing)
            save(args.name or f"e2e_{args.model}", report)  # after every profile: a cut-short run keeps what it did
    print(markdown(report))


def save(name: str, report: dict) -> None:
    payload = {"title": f"End-to-end, timing mode ({report['model']})", "environment": environment(), **report,
               "notes": __doc__.split("\n\n")[2]}
    write_results(name, payload, markdown(report))
    plots(report, RESULTS / name)


def markdown(report: dict) -> str:
    switches = ", ".join(f"{k} {v}" for k, v in report.get("switches", {}).items())
    lines = [f"{report['model']}, {report['layers']} layers, {report['parameters_b']:.2f} B parameters, random "
             f"weights, on {report['device']} ({switches}); acceptance replayed from the first half of each profile's rows (timing "
             "mode), the acceptance estimator of the calibrated strategies fitted on the other half. ms/token and "
             "tokens/s are decoding: the decode loop's wall time per token (ours), timed call minus a prefill-only call (HF "
             "eager); `e2e ms/tok` includes the prefill."]
    for routing, table in report.get("latency", {}).items():
        lines += ["", f"Latency model ({routing}; calibrated in {table['calibration_s']:.0f} s, context "
                      f"{table['context']}): C_ar {table['cost_ar_ms']:.2f} ms; C(w) for w = 1..16: "
                      + ", ".join(f"{c:.2f}" for c in table["cost_ms"]) + f" ms; C(16)/C(4) = {table['c16_over_c4']} "
                      "(paper, real routing: 1.71)."]
    for name, data in report["profiles"].items():
        rows = data["methods"]
        ar = rows.get("ar", {}).get("tokens_per_s")
        hf = rows.get("hf_eager", {}).get("tokens_per_s")
        ceiling = data["bytes_ceiling_tokens_per_s"]
        lines += ["", f"### `{name}` (mean accepted length {data['mean_accepted_length']:.2f} at B = 16"
                      + (f"; bytes ceiling ≈ {ceiling:,.0f} tokens/s" if ceiling else "") + ")", "",
                  "| method | ms/token | tokens/s | × our AR | × HF eager | τ | mean w | round ms | plain steps | "
                  "prefill ms | e2e ms/tok | GPU GiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for method, row in rows.items():
            if "error" in row:
                lines.append(f"| {method} | failed: {row['error'][:120]} |" + " |" * 10)
                continue

            def fmt(key, spec=".2f"):
                value = row.get(key)
                return "–" if value is None else format(value, spec)
            lines.append(f"| {method} | {fmt('ms_per_token')} | {fmt('tokens_per_s', '.1f')} | "
                         f"{row['tokens_per_s'] / ar if ar else float('nan'):.2f} | "
                         f"{row['tokens_per_s'] / hf if hf else float('nan'):.2f} | {fmt('tau')} | {fmt('mean_w')} | "
                         f"{fmt('round_ms')} | {row.get('plain_steps', '–')} | {fmt('prefill_ms', '.1f')} | "
                         f"{fmt('end_to_end_ms_per_token')} | {fmt('gpu_memory_gib', '.1f')} |")
        compiled = rows.get("hf_static_compile", {})
        if "warmup_s" in compiled:
            lines += ["", f"HF static cache + compile: generate() {'compiled' if compiled['compiled'] else 'did NOT compile'}"
                          f" its forward; first call (compilation, {compiled['new_tokens']} tokens) "
                          f"{compiled['warmup_s']:.0f} s."]
        if data.get("length_choice_bound"):
            lines += ["", "Length-choice bound (an oracle that knows each round's accepted length verifies exactly "
                          "a + 1 tokens; its speed over vanilla DFlash bounds any selector's): "
                      + ", ".join(f"{k}: {v:.2f}×" for k, v in data["length_choice_bound"].items())]
        if "tokens_per_s" in rows.get("hybridspec", {}):
            hs = rows["hybridspec"]["tokens_per_s"]
            ablation = {other: hs / rows[other]["tokens_per_s"] for other in ("ar", "dflash", "ratio", "nominal", "static7")
                        if "tokens_per_s" in rows.get(other, {})}
            lines += ["", "HybridSpec speedup over: " + ", ".join(f"{k} {v:.2f}×" for k, v in ablation.items())]
        for variant in [m for m in rows if m != "hybridspec" and m.startswith("hybridspec")
                        and "tokens_per_s" in rows[m] and "tokens_per_s" in rows.get("hybridspec", {})]:
            lines += ["", f"A/B: {variant} ({rows[variant]['switches']}) over hybridspec: "
                          f"{rows[variant]['tokens_per_s'] / rows['hybridspec']['tokens_per_s']:.3f}×"]
    lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in report["not_run"].items())]
    return "\n".join(lines)


def plots(report: dict, stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(report["profiles"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, name in enumerate(profiles):
        rows = report["profiles"][name]["methods"]
        ar = rows.get("ar", {}).get("tokens_per_s") or 1.0
        methods = [m for m in rows if not m.startswith("hf_") and "tokens_per_s" in rows[m]]
        axes[0].bar([x + i * 0.8 / len(profiles) for x in range(len(methods))],
                    [rows[m]["tokens_per_s"] / ar for m in methods], width=0.8 / len(profiles), label=name)
        axes[0].set_xticks(range(len(methods)), methods, rotation=30)
        for method in ("hybridspec", "dflash", "static7"):
            by_w = rows.get(method, {}).get("round_ms_by_w") or {}
            if by_w:
                axes[1].plot(list(by_w), list(by_w.values()), "o", label=f"{name}/{method}")
        axes[2].hist(rows.get("hybridspec", {}).get("chosen_w", []), bins=range(1, 18), alpha=0.5, label=name)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("speedup over our AR")
    axes[1].set_xlabel("w (tokens verified)")
    axes[1].set_ylabel("round ms (median)")
    axes[2].set_xlabel("HybridSpec's chosen w")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
