"""Latency calibration on the user's device: C(w) of whole rounds by context bucket, C_ar, the expert-count model
and η, cached per (model config, drafter config, dtype, device name, library versions).

`calibrate_latency` times real HybridSpec rounds through generate() with a forced length (so every measured round
is the same code path as a real one: drafting, the max-shape verification with its valid length, acceptance, the
hand-off and the commit) and records the routers' choices for the expert model. First use of a calibrated strategy
without a cache calibrates automatically (HybridSpecConfig.calibration="auto", the default) and says so; pass
calibration="require" to get an error instead, or latency_model= to use a saved one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from hybridspec_hf import patches
from hybridspec_hf.config import HybridSpecConfig, resolved_compile_backend, resolved_verify_shape
from hybridspec_hf.graphs.capture import distributed, host_syncs
from hybridspec_hf.generation.router_hooks import RouterRecorder
from hybridspec_hf.selector.profiles import AcceptanceProfile
from hybridspec_hf.selector import (LatencyModel, LengthSelector, calibrate, fit_eta, fit_expert_model, make_cache_key,
                                    make_selector)
from hybridspec_hf.selector.length import on_device

logger = logging.getLogger(__name__)


PLAIN_FOREVER = 2 ** 30  # a plain_run count that outlasts any generation


class ForcedLength(LengthSelector):
    """Always verifies w tokens (w = 0: a plain decoding step without drafting). For calibration.

    `set(w)` changes w in place, also on the device: GPU-resident rounds captured with this selector read w from a
    device tensor, so one capture serves every w.
    shadow: a selector whose device work every round also runs, its answers discarded (`shadow_selector`): the
    timed rounds then cost what the rounds of a call choosing with that selector cost at the same w — its survival
    bookkeeping, length choice, routing correction (stage 0 verifies the extra token, which is then dropped) and
    throughput update. Without it a calibration under-prices HybridSpec's drafted rounds by that work: ≈ 0.2 ms of
    small kernels a round on the H200, 40 % of the tiny pair's round there (gpu_rounds_tiny_pair2.md).
    """

    name = "forced"

    def __init__(self, w: int, shadow: LengthSelector | None = None):
        self.w = w
        self.shadow = shadow
        self.routing_correction = bool(shadow is not None and shadow.routing_correction)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    SHADOW_DECISIONS = ("choose", "keep_extra", "should_draft", "plain_run", "observe")

    def compile_shadow(self, compiled) -> bool:
        """Compile the shadow's decisions (`compiled`: method -> its compiled form; RoundStrategy.compile_decisions),
        so that the timed rounds run them as a compiled HybridSpec round does; the forced length's own few kernels
        stay eager. Not the round's decisions as a whole, as for HybridSpec: on the H200 (torch 2.11, Triton 3.6)
        two graphs that traced through this class failed Triton's MLIR passes (`_choose`, `_plain_run_eager`; run 82
        of benchmarks/results/gpu_rounds_runs.md) while HybridSpec's own compiled and ran. False: no shadow."""
        if self.shadow is None:
            return False
        for name in self.SHADOW_DECISIONS:
            if name not in vars(self.shadow):  # compiled already (one shadow serves every call of a calibration)
                setattr(self.shadow, name, compiled(getattr(self.shadow, name)))
        return True

    def set(self, w: int) -> None:
        self.w = w
        for tensor in self._on_device.values():
            tensor.fill_(w)

    def restart(self, context_len: torch.Tensor) -> None:
        """Create the device copy of w before any graph capture (a fill inside a graph would be replayed)."""
        self._tensor(context_len.device)
        if self.shadow is not None and hasattr(self.shadow, "restart"):
            self.shadow.restart(context_len)

    def reset(self) -> None:
        if self.shadow is not None:
            self.shadow.reset()

    def _tensor(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = torch.full((1,), self.w, dtype=torch.long, device=device)
        return self._on_device[device]

    def _shadows(self, name: str, resident: bool):
        """The shadow's decision `name`: its compiled form (`compile_shadow`) for a GPU-resident round, as HybridSpec's
        resident rounds run it; its eager code for an eager round (host ints and measured seconds, on which a
        compiled form would guard and recompile, or fail: `bisect` on a host context length), as HybridSpec's eager
        rounds run it."""
        method = getattr(self.shadow, name)
        return method if resident else getattr(method, "eager", method)

    def should_draft(self, context_len):
        if self.shadow is not None:
            self._shadows("should_draft", isinstance(context_len, torch.Tensor))(context_len)
        return self._drafts(context_len)

    def _drafts(self, context_len):
        if isinstance(context_len, torch.Tensor):
            return self._tensor(context_len.device) > 0
        return self.w > 0

    def plain_run(self, context_len) -> torch.Tensor:
        """Plain steps before the next draft: none while w > 0, else to the end (w = 0 times plain steps)."""
        if self.shadow is not None and hasattr(self.shadow, "plain_run"):
            self._shadows("plain_run", isinstance(context_len, torch.Tensor))(context_len)
        draft = self._drafts(context_len)  # the shadow ran its whole decision, as a HybridSpec plain step does
        return torch.where(draft, 0, PLAIN_FOREVER) if isinstance(draft, torch.Tensor) else \
            torch.tensor([0 if draft else PLAIN_FOREVER])

    def choose(self, survival, context_len, w_max=None) -> torch.Tensor:
        if self.shadow is not None:
            self._shadows("choose", isinstance(context_len, torch.Tensor))(survival, context_len, w_max)
        w = self._tensor(survival.device).clamp(min=1, max=survival.shape[1] + 1).expand(survival.shape[0])
        return w if w_max is None else torch.minimum(w, on_device(w_max, w.device))

    def keep_extra(self, survival, w0, n_new, context_len, w_max=None) -> torch.Tensor:
        if self.shadow is None:
            return super().keep_extra(survival, w0, n_new, context_len, w_max)
        keep = self._shadows("keep_extra", isinstance(context_len, torch.Tensor))
        return keep(survival, w0, n_new, context_len, w_max) & False  # the round verifies w

    def observe(self, w, emitted, latency=None, drafted=True, spread=None) -> None:
        if self.shadow is not None:  # resident rounds are priced at C(w) (no latency); eager ones pass measured seconds
            self._shadows("observe", latency is None)(w, emitted, latency, drafted, spread)

    def batch_state(self, rows, left) -> None:
        if self.shadow is not None:
            self.shadow.batch_state(rows, left)


def dense_verification(target, block_size: int) -> bool:
    """Whether every MoE layer of the target verifies a block of up to `block_size` tokens with dense experts (on a
    CPU: patches.cpu_verification_blocks). A round then costs the same whichever experts its tokens route to: η is
    0 by construction, and the routing correction, which prices extra distinct experts, can never keep a token
    (LatencyModel.prices_routing)."""
    blocks = patches.moe_blocks(target)
    return bool(blocks) and len(patches.cpu_verification_blocks(blocks, block_size)) == len(blocks)


def shadow_selector(target, block_size: int, corrects: bool | None = None) -> LengthSelector:
    """The selector whose device work calibration rounds run beside the forced length (`ForcedLength`): HybridSpec's
    own, with the routing correction where the target has MoE routers whose experts a verification does not run
    densely, over a placeholder latency model (the values do not change which kernels run). Where they run densely
    (`dense_verification`) HybridSpec's rounds never correct, and rounds timed with the correction (stage 0 on an
    extra token, the routing masks of every MoE layer, the GDN layers' valid-length masks) priced the tiny pair's
    drafted rounds on a CPU ≈ 2 ms (10 %) above what they cost, so that HybridSpec stepped plain where drafting
    paid. "nominal" and "ratio" read the same calibration, so their C(w) carries this work too (a little above their
    own: their rounds run less of it). corrects: with (True) or without (False) the correction, whatever the
    target (None: as above)."""
    cost = torch.linspace(1.0, 2.0, block_size).unsqueeze(0) * 1e-3
    placeholder = LatencyModel(cost=cost, cost_ar=torch.tensor([0.8e-3]), context_lens=torch.tensor([64]))
    if corrects is None:
        corrects = bool(patches.moe_blocks(target)) and not dense_verification(target, block_size)
    return make_selector("hybridspec" if corrects else "nominal", {"latency_model": placeholder})


# what a cached calibration was measured with, besides the model and the libraries: bumped when the measurement
# changes (2: batch tables timed on rounds that verified the forced w; kernels launched with PDL; 3: the rounds run
# HybridSpec's selector work beside the forced length, `ForcedLength.shadow`; 4: that work compiled on CUDA,
# HybridSpecConfig.compile_decisions; 5: that compile no longer fails on CUDA, run 83; 6: a call's first round, after
# its prefill, not timed; 7: no routing correction in the timed rounds where verification runs dense experts, CPU),
# so that a cache written
# before is measured again instead of being read
CALIBRATION_REVISION = 7


def cache_key(target, drafter, kernel_backend: str, verify_shape: str | None = None,
              compile_decisions: str = "auto") -> dict:
    import transformers

    device = next(target.parameters()).device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}:{os.cpu_count()}cpu"
    shape = verify_shape or resolved_verify_shape(HybridSpecConfig(), device)
    settings = HybridSpecConfig(compile_decisions=compile_decisions)
    config = {"target": target.config.to_dict(), "drafter": drafter.config.to_dict(), "kernels": kernel_backend,
              "verify_shape": shape, "decisions": resolved_compile_backend(settings, device) or "eager"}
    return make_cache_key(config, next(target.parameters()).dtype, device_name,
                          {"transformers": transformers.__version__, "hybridspec_calibration": str(CALIBRATION_REVISION)})


def cache_path(key: dict) -> Path:
    root = Path(os.environ.get("HYBRIDSPEC_CACHE", Path.home() / ".cache" / "hybridspec_hf"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / "latency" / f"{digest}.json"


def resolve_latency_model(settings: HybridSpecConfig, target, drafter) -> LatencyModel:
    """The latency model for a calibrated strategy: given, cached, or calibrated now (settings.calibration)."""
    if settings.latency_model is not None:
        return latency_model_from(settings.latency_model)
    shape = resolved_verify_shape(settings, next(target.parameters()).device)  # the two shapes cost differently
    key = cache_key(target, drafter, settings.kernel_backend, shape, settings.compile_decisions)
    path = cache_path(key)
    model = _load_cached(path, key)
    if model is not None:
        return model
    if settings.calibration == "require":
        raise ValueError(
            f"No latency calibration for this model/device (looked in {path}). Run `hybridspec calibrate`, pass "
            "HybridSpecConfig(latency_model=...), or use calibration='auto'."
        )
    logger.warning("HybridSpec: no latency calibration for this model on this device yet; calibrating now "
                   "(cached in %s).", path)
    with host_syncs():  # set-up: timing and routing statistics are read on the host
        model = calibrate_latency(target, drafter, kernel_backend=settings.kernel_backend, verify_shape=shape,
                                  cuda_graphs="uncaptured" if settings.cuda_graphs == "uncaptured" else "auto",
                                  compile_decisions=settings.compile_decisions)
    model.key = key
    # as later calls will read it from the cache (the JSON round trip): the same digest, so the rounds this call
    # captures serve those calls too (the fresh model's digest differed and the next call captured again)
    model = LatencyModel.from_dict(json.loads(json.dumps(model.to_dict())))
    if distributed():  # rank 0 writes; every rank already holds the mean over ranks
        if torch.distributed.get_rank() == 0:
            model.save(path)
        return model
    if not model.save(path, replace=False):
        # another process calibrated the same model and device meanwhile: use its model, so every process (and
        # this one's later calls, which read the cache) takes decisions from the same one and reuses its rounds
        cached = LatencyModel.load(path, key)
        model = cached if cached is not None else model
    return model


# A cached calibration that priced a call's rounds this much dearer than they ran (median of measured / calibrated
# over at least STALE_ROUNDS rounds) was taken while the machine was busy: the shipped tiny pair on 2 busy CPU cores
# calibrated 5-9x dearer (measured / calibrated 0.1-0.2), clean runs measure 1.0-1.25x of a clean calibration.
STALE_RATIO = 0.4
STALE_ROUNDS = 16


def cached_file(settings: HybridSpecConfig, model: LatencyModel) -> Path | None:
    """The cache file `resolve_latency_model` read or wrote `model` from (no latency_model given, one process), else
    None: the calibration `retire_if_busy` may delete. Its key names the file (no second key computed)."""
    if settings.latency_model is not None or distributed() or not model.key:
        return None
    return cache_path(model.key)


def retire_if_busy(path: Path | None, rounds) -> bool:
    """Delete the cached calibration at `path` (with a warning) when this call's rounds (telemetry RoundRecords with
    predicted_s) ran in under STALE_RATIO of the time it priced them at, median over >= STALE_ROUNDS rounds: a
    calibration taken on a busy machine, which would otherwise price every later call's rounds wrong. The next
    call calibrates afresh. A call slower than its calibration (this machine busy now) keeps it. True if deleted."""
    ratios = sorted(r.wall_s / r.predicted_s for r in rounds if r.predicted_s and r.predicted_s > 0)
    if path is None or len(ratios) < STALE_ROUNDS:
        return False
    median = ratios[len(ratios) // 2]
    if median >= STALE_RATIO:
        return False
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        logger.warning("HybridSpec: the cached latency calibration %s priced this call's rounds %.1fx dearer than "
                       "they ran (taken while the machine was busy?) and could not be deleted (%s); delete it to "
                       "calibrate afresh.", path, 1 / median, error)
        return False
    _READ.pop(str(path), None)
    logger.warning("HybridSpec: the cached latency calibration %s priced this call's rounds %.1fx dearer than they "
                   "ran (median over %d rounds; taken while the machine was busy?): deleted, the next call "
                   "calibrates afresh.", path, 1 / median, len(ratios))
    return True


def latency_model_from(value) -> LatencyModel:
    """A LatencyModel given as itself or as a path to its JSON."""
    if isinstance(value, LatencyModel):
        return value
    model = LatencyModel.load(value)
    if model is None:
        raise ValueError(f"Could not read a latency model from {value!r}; run `hybridspec calibrate` to make one.")
    return model


def _load_cached(path: Path, key: dict) -> LatencyModel | None:
    """The cached calibration; under tensor parallelism rank 0 reads it and every rank gets rank 0's copy (ranks
    must agree on whether to calibrate, since calibrating runs collective forwards)."""
    if not distributed():
        return _load_file(path, key)
    payload = [None]
    if torch.distributed.get_rank() == 0:
        model = _load_file(path, key)
        payload = [None if model is None else model.to_dict()]
    torch.distributed.broadcast_object_list(payload, src=0)
    return None if payload[0] is None else LatencyModel.from_dict(payload[0])


# The models read from the cache, by path: (mtime_ns, size, model). A generate() call that finds the same file
# unchanged gets the model it read before instead of parsing it again (≈ 0.3 ms of a call's set-up on a CPU); the
# path is the key's digest (`cache_path`), and the key was checked when the file was read. LatencyModel is never
# changed in place (`for_batch` and `to` return new ones).
_READ: dict[str, tuple[int, int, LatencyModel]] = {}


def _load_file(path: Path, key: dict) -> LatencyModel | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        _READ.pop(str(path), None)
        return None
    hit = _READ.get(str(path))
    if hit is not None and hit[:2] == (stat.st_mtime_ns, stat.st_size):
        return hit[2]
    model = LatencyModel.load(path, key)
    if model is not None:
        _READ[str(path)] = (stat.st_mtime_ns, stat.st_size, model)
    return model


def _mean_over_ranks(model: LatencyModel) -> LatencyModel:
    """The latency model averaged over the ranks (one collective at set-up, none per round)."""
    # NCCL reduces CUDA tensors only; gloo CPU tensors
    nccl = torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    tensors = {"cost": model.cost.to(device, copy=True), "cost_ar": model.cost_ar.to(device, copy=True),
               "eta": torch.tensor([float(model.eta)], device=device)}
    for name in ("sunk", "batch_cost", "batch_cost_ar"):
        if getattr(model, name) is not None:
            tensors[name] = getattr(model, name).to(device, copy=True)
    for value in tensors.values():
        torch.distributed.all_reduce(value)
        value /= torch.distributed.get_world_size()
    eta = float(tensors.pop("eta"))
    return dataclasses.replace(model, eta=eta, **{name: value.cpu() for name, value in tensors.items()})


def calibrate_latency(
    target,
    drafter,
    *,
    context_lens: tuple[int, ...] = (64, 512),
    repeats: int = 2,
    rounds_per_call: int = 3,
    kernel_backend: str = "auto",
    prompt_ids: torch.Tensor | None = None,
    progress: bool = True,
    routing_profile=None,
    verify_shape: str | None = None,
    cuda_graphs: str = "auto",
    batch_sizes: tuple[int, ...] = (1,),
    compile_decisions: str = "auto",
) -> LatencyModel:
    """Measure C(w) for w = 1..B and C_ar at each context length, fit the expert model and η.

    prompt_ids: [1, L] real text to take prompts from (random tokens otherwise; real text gives real routing).
    verify_shape: the rounds' verification shape ("exact" or "max"; None: the device's default, see
    HybridSpecConfig), timed as such.
    routing_profile: a `selector.profiles.RoutingProfile` (timing mode's calibrated routing, GPU-resident rounds
    only): the rounds are timed with the routers' choices replaced by the profile's, and the expert model is fitted
    on the same replayed ids, so a benchmark under calibrated routing is calibrated under it too.
    cuda_graphs: how the timed rounds run ("auto": GPU-resident rounds in CUDA graphs on CUDA; "uncaptured": the
    same rounds without capture, as the calls it calibrates for run them).
    batch_sizes: batch sizes N > 1 to time too (`calibrate_batches`): C_N(w) and C_ar,N of rounds over N prompts,
    the tables a batch's shared w is chosen with (LatencyModel.for_batch).
    compile_decisions: how the timed rounds run their decisions (HybridSpecConfig.compile_decisions), as the
    calls it calibrates for run them.
    rounds_per_call: rounds timed per call after its first. More do not price better on the H200: four passes in
    one process (tiny pair, run 93 of benchmarks/results/gpu_rounds_runs.md) gave C(16) 0.659 / 0.724 ms with 8
    rounds a call and 0.694 / 0.665 with 3 — the spread is between passes, not within a call.
    Under tensor parallelism every rank calls it and gets the same model: the mean over the ranks' timings.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    block_size = drafter.config.block_size
    device = next(target.parameters()).device
    limit = target.config.get_text_config().max_position_embeddings
    context_lens = tuple(c for c in context_lens if c + 2 * block_size < limit) or (min(64, limit // 4),)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.get_text_config().vocab_size
    blocks = patches.moe_blocks(target)
    recorder = RouterRecorder(blocks) if blocks else None
    samples: list[tuple[int, float, int]] = []  # (w, seconds, forward index) for η and the expert model

    class AfterRounds(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = len(target.hybridspec_telemetry.rounds) >= rounds_per_call
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    def prompt(context: int) -> torch.Tensor:
        if prompt_ids is not None and prompt_ids.shape[1] > context:
            start = int(torch.randint(0, prompt_ids.shape[1] - context, (1,), generator=generator))
            return prompt_ids[:, start : start + context].to(device)
        return torch.randint(0, vocab, (1, context), generator=generator).to(device)

    # one selector for every measurement (GPU-resident rounds are captured once), running HybridSpec's device work
    forced = ForcedLength(0, shadow_selector(target, block_size))
    medians: dict[tuple[int, int], list[float]] = {}  # (w, context) -> round medians of GPU-resident calls
    timing = {}
    if routing_profile is not None:  # replayed routing needs timing mode: a profile accepting nothing (τ = 1)
        if not blocks:
            raise ValueError("routing_profile= replaces MoE routers' choices; this target has no MoE layer.")
        positions = block_size - 1
        half = torch.full((1, positions), 0.5)
        timing = dict(acceptance_profile=AcceptanceProfile(half, half, half, torch.zeros(1, dtype=torch.long),
                                                           name="calibration"),
                      routing_profile=routing_profile, cuda_graphs="on" if cuda_graphs == "auto" else cuda_graphs)

    def run(w: int, context: int, cuda_graphs: str):
        forced.set(w)
        ids = prompt(context)
        if cuda_graphs == "uncaptured" or (device.type == "cuda" and cuda_graphs != "off"):
            # GPU-resident rounds: a call stops on max_new_tokens alone, without EOS, so the rounds know m on the
            # device as a user's call does (`device_commit`); a host-side criterion (AfterRounds) made every round
            # decide m on the host, and the tiny pair's C_ar on the H200 was priced 0.35 ms against the 0.28 its
            # plain steps took, its C(w) 3-11 % high (runs 105 and 109 of benchmarks/results/gpu_rounds_runs.md).
            # Room for rounds_per_call + 1 rounds of the whole w after the first whatever they accept
            stop = dict(max_new_tokens=(rounds_per_call + 2) * (w + 1) if w else block_size + rounds_per_call + 1,
                        eos_token_id=None)
        else:  # the eager loop: the host drives every round anyway; stop after rounds_per_call rounds
            stop = dict(max_new_tokens=block_size * (rounds_per_call + 1),
                        stopping_criteria=StoppingCriteriaList([AfterRounds()]))
        target.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, assistant_model=drafter,
            generation_strategy="hybridspec", **stop,
            hybridspec_config=HybridSpecConfig(selector=forced, kernel_backend=kernel_backend,
                                               verify_shape=verify_shape or "auto",
                                               compile_decisions=compile_decisions,
                                               **{"cuda_graphs": cuda_graphs, **timing}),
        )
        return target.hybridspec_telemetry

    record = True  # the routing and the per-shape medians that η is fitted from (the first pass only)

    def measure_round(w: int, context: int) -> float:
        first = len(recorder.forwards) if recorder else 0
        telemetry = run(w, context, cuda_graphs)
        # the call's first round is not timed: it follows the prefill (the drafter appends the whole prompt's
        # features; always drafted), while the rounds priced are a call's steady ones; in a median of four it sat in
        # the upper middle and raised C(w). For w = 0: the plain steps that follow it.
        steady = telemetry.rounds[1:] or telemetry.rounds
        # drafted rounds that verified the whole w (not cut short by max_new_tokens); w = 0: the plain steps
        kind = [r for r in steady if r.drafted == (w > 0)]
        whole = [r for r in kind if w == 0 or r.w == w]
        times = sorted(r.wall_s for r in whole or kind or steady)
        median = times[len(times) // 2]
        logger.debug("calibration w=%d context=%d (%s): rounds in order (drafted, ms) %s; median %.3f ms", w, context,
                     telemetry.path, [(r.drafted, round(r.wall_s * 1e3, 3)) for r in telemetry.rounds], median * 1e3)
        if not record:  # a second pass times C(w) only
            return median
        if telemetry.path == "cuda_graphs" or routing_profile is not None:  # routing: recorded below
            medians.setdefault((w, context), []).append(median)
        elif recorder and w > 0:
            for index, r in enumerate(telemetry.rounds):  # forward 0 is the prefill
                samples.append((r.w, r.wall_s, first + 1 + index))
        return median

    try:
        model = calibrate(measure_round, measured_lengths(block_size), context_lens, repeats=repeats,
                          progress=progress)
        if routing_profile is not None:  # the replayed ids are the routing: observe them, timings from the graphs
            config = target.config.get_text_config()
            bank = routing_profile.bank(len(blocks), config.num_experts, config.num_experts_per_tok)
            for (w, context), times in sorted(medians.items()):
                for r in range(0, bank.shape[0], 16) if w > 0 else ():
                    recorder.forwards.append(bank[r, :, :w])
                    samples.append((w, sorted(times)[len(times) // 2], len(recorder.forwards) - 1))
        elif recorder and medians:  # routing of the same lengths and contexts, eagerly; timings from the graphs
            for (w, context), times in sorted(medians.items()):
                if w == 0:
                    continue
                first = len(recorder.forwards)
                telemetry = run(w, context, "off")
                for index, r in enumerate(telemetry.rounds):
                    samples.append((r.w, sorted(times)[len(times) // 2], first + 1 + index))
    finally:
        if recorder:
            recorder.remove()
    if recorder and samples:
        observations = [recorder.forwards[i][:, :w] for w, _, i in samples if i < len(recorder.forwards)]
        experts = fit_expert_model(observations, num_experts=blocks[0].experts.num_experts
                                   if hasattr(blocks[0].experts, "num_experts") else None)
        distinct = [float(_distinct_total(obs)) for obs in observations]
        eta = 0.0 if dense_verification(target, block_size) else fit_eta(  # dense experts: no cost per expert
            [s for _, s, _ in samples[: len(distinct)]], distinct, [w for w, _, _ in samples[: len(distinct)]])
        model = dataclasses.replace(model, experts=experts, eta=eta)
    if forced.routing_correction and not model.prices_routing:
        # HybridSpec's rounds under this model will not correct (no cost per distinct expert, nothing sunk): time
        # C(w) again as they will run, without it. On the H200 the tiny pair's rounds (launch-bound experts, η = 0)
        # were priced 25 % above their measured time with the correction's work in them, 3-4 % without (runs 103
        # and 105 of benchmarks/results/gpu_rounds_runs.md)
        forced, record = ForcedLength(0, shadow_selector(target, block_size, corrects=False)), False
        retimed = calibrate(measure_round, measured_lengths(block_size), context_lens, repeats=repeats,
                            progress=progress)
        model = dataclasses.replace(retimed, experts=model.experts, eta=model.eta)
    if any(n > 1 for n in batch_sizes):
        model = calibrate_batches(model, target, drafter, sorted({n for n in batch_sizes if n > 1}), prompt,
                                  context_lens, repeats, rounds_per_call, kernel_backend, verify_shape, cuda_graphs,
                                  progress, compile_decisions)
    if distributed():  # tensor parallelism: every rank must choose the same w, so all use the mean calibration
        model = _mean_over_ranks(model)
    return model


def calibrate_batches(model: LatencyModel, target, drafter, batch_sizes: list[int], prompt, context_lens,
                      repeats: int, rounds_per_call: int, kernel_backend: str, verify_shape: str | None,
                      cuda_graphs: str, progress: bool, compile_decisions: str = "auto") -> LatencyModel:
    """`model` (the batch-1 calibration) with C_N(w) and C_ar,N for each N in batch_sizes: rounds over N prompts of
    the context's length (no padding), every row verifying the forced w, through generate() as a batched call runs
    them (GPU-resident rounds of N's bucket on CUDA, the eager batched loop elsewhere). Each call stops on
    max_new_tokens (a host-side criterion would send a batch to the eager loop): rounds_per_call + 1 + B tokens, so
    that its first rounds_per_call + 1 rounds have room to verify the whole block (a round never verifies past a
    row's max_length) and only rounds that verified the forced w are timed. Until 2026-12-02 a call had
    rounds_per_call + 2 tokens, so C_N(w) above w ≈ 4 was the cost of verifying ≈ 4 tokens (flat): the H200 runs
    43 and 49 measured batch 2-8 rounds of w ≈ 15 at 1.2-1.4x the calibrated C_N(16). The routers' statistics and η
    stay batch 1's (the routing correction is off in batches)."""
    block_size = drafter.config.block_size
    forced = ForcedLength(0, shadow_selector(target, block_size))
    tables = {1: model}
    for batch in batch_sizes:
        def measure_round(w: int, context: int, batch=batch) -> float:
            forced.set(w)
            ids = torch.cat([prompt(context) for _ in range(batch)])
            target.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=rounds_per_call + 1 + block_size,
                eos_token_id=None, pad_token_id=0, assistant_model=drafter, generation_strategy="hybridspec",
                hybridspec_config=HybridSpecConfig(selector=forced, kernel_backend=kernel_backend,
                                                   verify_shape=verify_shape or "auto", cuda_graphs=cuda_graphs,
                                                   compile_decisions=compile_decisions))
            rounds = target.hybridspec_telemetry.rounds
            # whole-batch rounds (no row finished yet) that verified w; w = 0: the plain steps after the first,
            # drafted, round
            times = sorted(r.wall_s for r in rounds if r.drafted == (w > 0) and r.rows == batch
                           and (w == 0 or r.w == w)) or sorted(r.wall_s for r in rounds)
            return times[len(times) // 2]

        tables[batch] = calibrate(measure_round, measured_lengths(block_size), context_lens, repeats=repeats,
                                  progress=progress)
    return LatencyModel.with_batches(tables)


def measured_lengths(block_size: int) -> list[int]:
    """The w measured: all of them up to 8, then a spread (C(w) is interpolated between, and fitted monotone)."""
    return sorted({w for w in (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, block_size) if w <= block_size})


def _distinct_total(observation: torch.Tensor) -> int:
    """Distinct experts summed over MoE layers; observation [layers, w, k]."""
    return sum(int(layer.unique().numel()) for layer in observation)
