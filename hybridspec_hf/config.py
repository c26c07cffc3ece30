"""HybridSpecConfig: the knobs of a HybridSpec generate() call, passed as `hybridspec_config=`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from hybridspec_hf.selector import AcceptanceEstimator, LatencyModel, LengthSelector
from hybridspec_hf.selector.lookup import LookupEstimator

# "hybridspec": Dinkelbach length + plain-decoding option + routing correction; "nominal": the same without routing
# correction; "dflash": verify the whole block; "static": a fixed length; "ratio": per-round G(w)/C(w) (EVICT-like);
# "confidence": longest draft prefix whose survival ≥ a threshold (D-Cut-like).
# "ar": plain decoding through the same machinery (GPU-resident on CUDA): the baseline speedups are measured against.
STRATEGIES = ("hybridspec", "nominal", "dflash", "static", "ratio", "confidence", "ar")
CALIBRATED_STRATEGIES = ("hybridspec", "nominal", "ratio")
KERNEL_BACKENDS = ("auto", "torch", "triton")
VERIFY_SHAPES = ("auto", "max", "exact")
CALIBRATION_MODES = ("auto", "require")
CUDA_GRAPH_MODES = ("auto", "on", "off", "uncaptured")
GDN_VERIFIERS = ("block", "per_token_state")
COMPILE_DECISIONS = ("auto", "off", "inductor", "aot_eager")
GREEDY_HEADS = ("auto", "int8", "model")
CONTEXT_LOOKUP_MODES = ("auto", "on", "off")


@dataclass
class HybridSpecConfig:
    """Settings of one HybridSpec generation.

    static_length: w for "static": tokens the target verifies per round (anchor + drafts), 1 ≤ w ≤ block size.
    confidence_threshold: survival threshold of the "confidence" strategy.
    kernel_backend: GDN verify/commit kernels: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton".
    latency_model: a `selector.LatencyModel` or a path to its JSON, for the calibrated strategies ("hybridspec",
        "nominal", "ratio"). None: the cached calibration of this model/dtype/device/versions.
    calibration: what a calibrated strategy does when no latency model is given or cached: "auto" calibrates now
        (a progress bar; a few seconds for tiny models, about a minute for 35B on an H200) and caches the result;
        "require" raises instead.
    acceptance_estimator: a `selector.AcceptanceEstimator` or a path to its JSON; None: the drafter's own
        (`drafter.acceptance_estimator`: `DFlashDrafter.save_pretrained` writes it beside the weights and
        `from_pretrained` reads it; the shipped tiny pair has one), else the uncalibrated prefix-product of the
        drafter's top-1 probabilities (D-Cut's score, which under-estimates survival: p̂₈ 0.06 against 0.32 measured
        on the DFlash-like profile).
    selector: a `selector.LengthSelector` instance that replaces the strategy's own (advanced; used by calibration).
    verify_shape: for strategies that choose w on the device: "max" verifies min(B, room) tokens with a device-side
        valid length (GPU-resident rounds: one graph per round, no host read inside it); "exact" reads w0 (+1 for the
        routing correction) on the host and verifies only those tokens (GPU-resident rounds: a draft graph, then the
        verify graph of that length). "auto": "max" on CUDA — one hand-off per round, a 0.6-1 s capture and a 36 s
        first-use calibration at the 35B-A3B shape on an H100; "exact" was 2-5 % faster at batch 1 and 8 % at batch
        4 once captured (run 160 of benchmarks/results/gpu_rounds_runs.md; 1.6–5.9 % on the H200 in run 29) for a
        second host read per round, 3.4-4.8 s of capture and 94 s of calibration, so choose it for long generations
        and batches — and "exact" elsewhere (on a CPU every verified row costs).
    cuda_graphs: "auto": GPU-resident rounds captured in CUDA graphs on CUDA when the call allows them, else the
        eager loop (telemetry.path_reason says why); "on": resident rounds required (on a CPU they run uncaptured);
        "off": the eager loop; "uncaptured": resident rounds required, never captured (every kernel launched from
        the host: slow; to tell a capture problem from a logic one, or where capture fails).
    compile_decisions: the device work of a resident round's decisions (length choice, routing correction, draft
        decision, the selector's update) compiled with `torch.compile` into a few fused kernels instead of ≈ 130
        small ones (RoundStrategy.compile_decisions; this package's selectors only), and a round's bookkeeping
        after the target's forward when it commits on the device (greedy acceptance, commit count, hand-off:
        generation/round_tail.py, any selector; ≈ 40 launches fewer). "auto": "inductor" for resident
        rounds on CUDA (the first capture compiles: seconds, cached by torch on this machine), "off" elsewhere;
        "off": eager; "inductor" / "aot_eager": that torch.compile backend, on any device (the CPU twin: tests).
    greedy_head: where greedy GPU-resident rounds take their tokens from (sampling always reads the head's logits).
        "int8": the LM head's int8 copy and only the head's rows that the copy's error bound leaves within reach of
        the maximum (kernels/head_argmax_triton.py): the head's own first argmax (its logits rounded to its dtype),
        up to the order of fp32 sums, with about half the head's bytes read a step; the copy is the drafter's int8
        head where DFlashConfig.head_quantization is "int8", else ≈ 0.25 bytes per head weight more GPU memory
        (0.5 GB at a 248k x 2 048 head) until `hybridspec_hf.release_graphs(target)`; a model whose head is not a
        plain bias-free `lm_head` Linear is refused. "model": the head's logits and their argmax. "auto": "int8" on
        CUDA while `generation.resident.INT8_GREEDY_HEAD` is on (the default since run 163: an H100's AR step
        3.08 -> 2.91 ms), "model" elsewhere.
    context_lookup: a second proposal beside the drafter's block each round (drafter/lookup.py): the tokens that
        followed the latest earlier occurrence of the last n tokens (prompt-lookup decoding), verified instead of
        the drafter's block where its estimated Σ p̂ exceeds the drafter's: a `selector.lookup.LookupEstimator`
        table by match length, mixed with the drafter's own estimate of the copied tokens (read from the same
        draft logits) by the table's `table_weight`. Exact either way (both are verified alike). For the
        strategies that choose w from estimates ("hybridspec", "nominal", "ratio", "confidence"), batch 1, in the
        eager loop (a host index of the context's n-grams) and the GPU-resident rounds alike (there on the device,
        inside the draft graph, over a buffer of the call's tokens: kernels/lookup_triton.py).
        "auto": on where that holds and a table is at hand (`lookup_estimator`, else the drafter's
        `drafter.lookup_estimator`: the shipped tiny pair has one), off elsewhere (telemetry.context_lookup_off
        says why); "on": required (a clear error where it cannot run); "off": the drafter's block only.
    lookup_estimator: a `selector.lookup.LookupEstimator` or a path to its JSON; None: the drafter's own.
    """

    static_length: int = 7
    confidence_threshold: float = 0.5
    kernel_backend: str = "auto"
    latency_model: Any = None
    calibration: str = "auto"
    acceptance_estimator: Any = None
    selector: Any = field(default=None, repr=False)
    verify_shape: str = "auto"
    cuda_graphs: str = "auto"
    gdn_verifier: str = "block"
    compile_decisions: str = "auto"
    greedy_head: str = "auto"
    context_lookup: str = "auto"
    lookup_estimator: Any = None
    acceptance_profile: Any = field(default=None, repr=False)
    routing_profile: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.static_length, int) or isinstance(self.static_length, bool) or self.static_length < 1:
            raise ValueError(f"static_length must be an int ≥ 1 (tokens verified per round), got {self.static_length!r}.")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold is a probability in [0, 1], got {self.confidence_threshold!r}.")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}.")
        if self.verify_shape not in VERIFY_SHAPES:
            raise ValueError(f"verify_shape must be one of {VERIFY_SHAPES}, got {self.verify_shape!r}.")
        if self.gdn_verifier not in GDN_VERIFIERS:
            raise ValueError(f"gdn_verifier must be one of {GDN_VERIFIERS}, got {self.gdn_verifier!r}.")
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}.")
        if self.compile_decisions not in COMPILE_DECISIONS:
            raise ValueError(f"compile_decisions must be one of {COMPILE_DECISIONS}, got {self.compile_decisions!r}.")
        if self.greedy_head not in GREEDY_HEADS:
            raise ValueError(f"greedy_head must be one of {GREEDY_HEADS}, got {self.greedy_head!r}.")
        if self.greedy_head == "int8" and self.cuda_graphs == "off":
            raise ValueError('greedy_head="int8" is a GPU-resident rounds path; cuda_graphs="off" runs the eager loop. '
                             'Use cuda_graphs="auto" or "on", or greedy_head="model".')
        if self.context_lookup not in CONTEXT_LOOKUP_MODES:
            raise ValueError(f"context_lookup must be one of {CONTEXT_LOOKUP_MODES}, got {self.context_lookup!r}.")
        if self.calibration not in CALIBRATION_MODES:
            raise ValueError(f"calibration must be one of {CALIBRATION_MODES}, got {self.calibration!r}.")
        if self.selector is not None and not isinstance(self.selector, LengthSelector):
            raise TypeError(f"selector must be a hybridspec_hf.selector.LengthSelector, got {type(self.selector).__name__}.")
        for name, kind in (("acceptance_estimator", AcceptanceEstimator), ("latency_model", LatencyModel),
                           ("lookup_estimator", LookupEstimator)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (kind, str, os.PathLike)):
                raise TypeError(f"{name} must be a {kind.__name__} or a path to its JSON, got {type(value).__name__}.")

    def to_dict(self) -> dict:
        objects = ("selector", "acceptance_profile", "routing_profile")
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in objects}
        for name in objects[1:]:
            data[name] = None if getattr(self, name) is None else id(getattr(self, name))
        return data


def resolved_compile_backend(settings: "HybridSpecConfig", device: torch.device) -> str | None:
    """The torch.compile backend of resident rounds' decisions (None: eager; see HybridSpecConfig.compile_decisions)."""
    if settings.compile_decisions == "auto":
        return "inductor" if torch.device(device).type == "cuda" else None
    return None if settings.compile_decisions == "off" else settings.compile_decisions


def resolved_verify_shape(settings: "HybridSpecConfig", device: torch.device) -> str:
    """The verification shape a call runs with ("auto" resolved by device; see HybridSpecConfig.verify_shape)."""
    if settings.verify_shape != "auto":
        return settings.verify_shape
    return "max" if torch.device(device).type == "cuda" else "exact"
