"""GPU-resident rounds: the round loop of `loop.py` over static buffers, replayed from CUDA graphs.

A speculative round is one replay and one hand-off when EOS and max_length are the only stopping rules (the
common case; m is then known on the device). With verify_shape "max" (the default on CUDA) and the fixed-length
strategies ("dflash", "static"):

    spec graph    draft → choose w0 → verify min(B, room) tokens with a device-side valid length (stage 0 →
                  routing correction → stage 1) → accept → m = a + 1 (cut after the first EOS) → commit: S_m of every
                  GDN layer + conv windows (one launch), lengths, drafter context, selector update → hand-off copy
    host          wait for the hand-off (the round's one device→host transfer), emit its tokens to the streamer

With verify_shape "exact" the round is split: a draft graph (draft, choose) copies the number of tokens stage 0
verifies (w0, + 1 for the routing correction's extra token) to pinned memory, the host reads it and replays the
verify graph of that length (the rest of the round). It verifies only the chosen tokens, at the cost of a second
read per round (on the H200 with our fused kernels this did not pay: gpu_rounds_runs.md, run 16).

With host-only criteria (stop strings, user criteria) the host decides m: the verify graph stops before the commit,
the host emits tokens until a criterion fires, fills m into a device buffer and replays the commit graph captured
with that verify graph.

A plain decoding step (the "ar" strategy, or HybridSpec's plain-decoding option) is one graph: verify the anchor,
commit it (m = 1), the token, and its hand-off. On the CPU the same functions run eagerly (no capture), so the CPU
tests cover this path. A strategy that may skip drafting runs its plain steps in stretches: the first step after a
speculative round decides how many plain steps follow before the next draft (`Strategy.plain_run`), and the steps in
between run no selector work. It also defers their drafter context appends: each step parks its features in a
buffer of DEFERRED_STEPS columns, and the stretch's deciding step and its last step (the host knows which) replay a
second graph that appends the parked features after the step, as does every step that fills the buffer's last
column; so a speculative round finds the drafter's context whole. The steps in between launch no drafter kernel
(appending at once made HybridSpec's plain step 1-7 % slower than AR's on the H200, 3.13 against 2.93 ms at batch 1).

A batch (generation/batched.py hands over after its eager prefill) runs in rounds built for N rows, N the smallest
bucket of BATCH_BUCKETS (1, 2, 4, 8, 16) that holds it: one set of graphs per bucket rather than per batch size, the
rows past the batch inert. Each row's cache holds its real tokens from slot 0 (`StaticTarget.load` drops the left
padding), with its own device-side length and positions: the attention kernels and masks read each row's length,
and the prompt's padding is never in the static cache. A round drafts every row, chooses one w from the live rows'
mean survival (`RoundStrategy.choose_rows`; no routing correction, as in the eager batched loop), verifies w tokens
of every row (finished and inert rows only their anchor, whose experts are masked), accepts per row, and commits
per row m_b = min(a_b + 1, up to its first EOS, its room) (0 for rows that ended: their state stays as it was). A row
ends on the device when it commits an EOS or reaches max_length (`live`); it keeps its place, and its share of the
dense GEMMs and attention, in the replay until the call ends, but emits nothing more. The hand-off carries every
row's tokens, a, m and live. Host-only stopping criteria and streamers are not taken at batch > 1 (the eager
batched loop runs them).

One `ResidentRounds` is built per (target, drafter, strategy settings, sampling, capacity, rows) and reused by later
generate() calls. `resident_rounds` keeps up to MAX_ROUNDS_PER_TARGET of them per target, most recently used last,
so that a caller who alternates strategies or drafters does not re-capture on every call (run 24 of
benchmarks/results/gpu_rounds_runs.md: 46 captures in 11 calls that alternated). On CUDA a further set is kept only
while the free memory holds two more of the largest kept one; otherwise the least recently used sets are released
first (and all of them, before one retry, if a capture runs out of memory). Each set's hooks on the model are inert
unless that set arms them, and the weight copies they read are the model's, shared and refreshed in place, so the
sets do not interfere; the copies go with the last set.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time

import torch

from hybridspec_hf import patches
from hybridspec_hf.generation.acceptance import sample_tokens, speculative_sample
from hybridspec_hf.generation.checks import ROW_WISE_PROCESSORS
from hybridspec_hf.generation.router_hooks import RoutingReplay, VerifyWindow
from hybridspec_hf.generation.round_tail import (commit_count, context_length, greedy_accepted, new_anchor, round_accept,
                                                round_advance, round_head)
from hybridspec_hf.generation.strategy import Choice, compiled_region
from hybridspec_hf.generation.telemetry import RoundRecord
from hybridspec_hf.graphs.capture import Replay, branch, branches_capture, host_syncs
from hybridspec_hf.graphs.static_target import StaticTarget, head_skippable
from hybridspec_hf.kernels import gdn_triton, head_argmax_triton, step_tail_triton
from hybridspec_hf.kernels.gemv_triton import MAX_ROWS, quantize_rows, weight_version
from hybridspec_hf.kernels.lookup_triton import context_lookup_static
from hybridspec_hf.kernels.step_tail_triton import step_tail, step_tail_reference
from hybridspec_hf.patches._cache import set_rows
from hybridspec_hf.patches.experts import fused_experts_for
from hybridspec_hf.selector.length import batch_row_stats, batch_rows_left
from hybridspec_hf.selector.survival import draft_tokens_and_signals

_CAPACITY_STEP = 512
MAX_ROUNDS_PER_TARGET = 3  # captured settings kept per target (graphs, static caches): see the module docstring
# True: plain steps park the drafter's features and append them at the ends of their stretch (module docstring);
# False: each step appends at once (the drafter sees the same context either way). On since run 40 on the H200
# (benchmarks/results/batch_qwen35_35b_a3b_run40.md, the A/B in one run): HybridSpec's plain step at batch 16 cost
# 11.70 against 11.90 ms (AR 11.63); the speculative rounds then still appended the buffer before drafting (the
# high profile lost up to 1 %), which the stretch's own appends have replaced since. `--defer-appends` is the A/B.
DEFER_CONTEXT_APPENDS = True
# True: a plain step's bookkeeping after its token (count, lengths, anchor, rows that end, hand-off values) is one
# launch on CUDA (kernels/step_tail_triton.py) instead of ≈ 20 torch launches; False: the torch ops
# (A/B: `--variants plain,-step-tail`)
FUSED_STEP_TAIL = True
# True: a speculative round committed on the device decides whether the next round drafts and updates the selector
# with this round in one call of the strategy (`RoundStrategy.end_round`: one compiled region, fewer kernels);
# False: the two calls apart (should_draft before the commit, observe_round in it). Same decisions either way
# (should_draft reads the selector before this round's update in both). A/B: the strategy
# "hybridspec-round-end" in benchmarks/round_kernels.py.
FUSED_ROUND_END = True
# True: a speculative round committed on the device runs its bookkeeping after the target's forward — greedy
# acceptance, the commit count, lengths, the anchor, the rows that end, the hand-off values — as two compiled regions
# (generation/round_tail.py, with compile_decisions) instead of ≈ 40 torch launches (run 135 of
# benchmarks/results/gpu_rounds_runs.md); False: the same functions eagerly, op by op. The same integers either way.
# On since run 137 (an H100, round_tiles_run137.md): the max-shape round −59 to −91 µs at w = 1 / 4 / 16 (base
# spread ±16), 41 kernels fewer a round (breakdown_run140.md); HybridSpec at batch 1 1.71 → 1.73x AR (medium),
# 2.57 → 2.58x (high) in run 138's A/B. A/B: `hybridspec-round-tail`.
FUSED_ROUND_TAIL = True
# True: a speculative round of the max shape whose chosen length fits one of SHORT_LENGTHS verifies only that many
# tokens (the shortest that holds it): its verify is captured once per length, each in the body of a CUDA graph
# conditional node after the draft (graphs/capture.py `branch`), so a replay runs the one the round chose and the
# round stays one graph and one hand-off. At T <= 2 the MoE runs its decode kernels, which read each of the round's
# experts once near the bandwidth; the block's direct rows (T = 16) take 1.4-3.1x the bytes' time at w <= 4 (run 123
# of benchmarks/results/gpu_rounds_runs.md: a w = 1 round's verify 1.07 ms dearer than the exact length's on the
# H100). Needs the commit on the device (`device_commit`) and, on CUDA, torch's conditional-node capture API
# (`capture.branches_capture`: torch 2.13 has it, the GPU image's 2.11 does not, so run 127 could not measure it);
# the CPU runs the same choice eagerly (tests). Off until measured on a GPU (A/B: `hybridspec+short-verify`).
SHORT_VERIFY = False
# True: a round's drafts (the argmax of the drafter's logits) come out of the draft-signals kernel's stream
# (selector.survival.draft_tokens_and_signals: the logits read once, in the head's bf16), not from torch's argmax
# over an fp32 copy of them (the copy, the argmax's two launches and ≈ 45 MB of traffic a round at a 248k
# vocabulary); in timing mode too (its signals are then the profile's), so a timed round pays what a real one
# does. False: fp32 logits, torch's argmax, the signals apart. The same drafts either way. A/B: `draft-tokens`.
FUSED_DRAFT_TOKENS = True
# True: a round committed on the device runs its GDN commit (every layer's accepted state, one launch: ≈ 60 µs a
# round on an H100, breakdown_run142.md) on a side stream forked after the selector's update, beside the drafter's
# context append, the round's advance and the hand-off (none of which reads the GDN states), joined before the round
# ends: inside the round's CUDA graph two branches instead of one chain. The next graph (or eager op) on the
# round's stream starts after both, so every later reader sees the committed states. False: one stream, the commit
# between the selector's update and the append (the same place). Off until measured on a GPU (A/B:
# `commit-beside`); the CPU has one stream and runs the same order either way.
COMMIT_BESIDE = False
# True: greedy rounds without logits processors take their tokens (a plain step's and a verification's of at most
# MAX_ROWS rows) from an int8 copy of the target's LM head and only the head's rows its error bound leaves within
# reach of the maximum (kernels/head_argmax_triton.py: the head's own first argmax, up to the order of fp32 sums),
# not from the bf16 head's logits and torch's argmax: half of the step's largest read (1.02 GB at a 248k x 2 048
# head). The copy is the drafter's int8 head where it has one (DFlashConfig.head_quantization), else made with the
# rounds (≈ 0.5 GB more GPU memory at that head) and refreshed with the other weight copies. What
# HybridSpecConfig(greedy_head="auto") does on the devices of INT8_GREEDY_HEAD_DEVICES (elsewhere its torch form costs
# more than the head); "int8" / "model" choose either anywhere. On since run 163 (H100, random 35B-A3B-shaped
# weights): the AR step 3.08 -> 2.91-2.92 ms, AR at batch 1 +6-7 %, HybridSpec +0.2-3 % (A/B: `int8-greedy-head`).
INT8_GREEDY_HEAD = True
INT8_GREEDY_HEAD_DEVICES = ("cuda",)
SHORT_LENGTHS = (2,)  # verify lengths captured besides the block's, ascending
_ACTIVE = "_hybridspec_resident"  # the target's most recently used rounds
_KEPT = "_hybridspec_resident_kept"  # every rounds the target keeps, least recently used first


def unsupported_reason(model, drafter, strategy, generation_config, logits_processor, cache) -> str | None:
    """Why this generate() call cannot run GPU-resident rounds (None: it can)."""
    names = [type(p).__name__ for p in logits_processor]
    other = sorted(set(names) - set(ROW_WISE_PROCESSORS))
    if other:
        return f"logits processors {other} depend on the prefix or keep state"
    if generation_config.return_dict_in_generate and (generation_config.output_scores or
                                                      generation_config.output_logits):
        return "output_scores/output_logits keep every row of every round"
    attn = getattr(model.config.get_text_config(), "_attn_implementation", None) or "sdpa"
    if attn not in ("sdpa", "eager"):
        return f"attn_implementation={attn!r} (needs 'sdpa' or 'eager')"
    if type(cache).__name__ not in ("DynamicCache", "StaticCache"):
        return f"cache {type(cache).__name__}"
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        return (f"the model is split over devices {sorted(devices)} (device_map; the eager loop runs it, one GDN "
                "commit per device; for speed use tensor parallelism: from_pretrained(..., tp_plan='auto'))")
    device = next(model.parameters()).device
    if drafter is not None and drafter.device != device:
        return f"the drafter is on {drafter.device}, the target on {device} (drafter.to({str(device)!r}))"
    dtype = next(model.parameters()).dtype
    if next(model.parameters()).device.type == "cuda" and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype} (the Triton kernels take float32, bfloat16 or float16)"
    experts = getattr(model.config.get_text_config(), "_experts_implementation", None)
    if next(model.parameters()).device.type == "cuda" and experts == "eager" and patches.moe_blocks(model):
        return ("experts_implementation='eager' reads routing on the host (use model.set_experts_implementation("
                "'grouped_mm') or 'batched_mm')")
    return None


def batch_unsupported_reason(batch: int, generation_config, stopping_criteria, streamer) -> str | None:
    """Why a batch (or a left-padded prompt) cannot run resident rounds (None: it can)."""
    if streamer is not None:
        return "a streamer with a left-padded prompt"
    if batch_bucket(batch) is None:
        return f"batch size {batch} (resident rounds run batches of up to {BATCH_BUCKETS[-1]} rows)"
    host_only = sorted({type(c).__name__ for c in stopping_criteria} - set(HostEmitter.DEVICE_SIDE))
    if host_only:
        return f"stopping criteria {host_only} decide on the host (a batch's rounds end rows on the device)"
    if len(eos_ids(generation_config)) > MAX_EOS_IDS:
        return f"more than {MAX_EOS_IDS} EOS ids"
    return None


def eos_ids(generation_config) -> set[int]:
    """generate()'s EOS token ids."""
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos = generation_config.eos_token_id if eos is None else eos.reshape(-1).tolist()
    return set([eos] if isinstance(eos, int) else (eos or []))


@dataclasses.dataclass(frozen=True)
class _Key:
    drafter: int
    strategy: int
    sampling: bool
    processors: tuple
    capacity: int
    position_rows: int
    device_commit: bool
    capture: bool
    rows: int = 1  # batch rows of the static buffers (a bucket of BATCH_BUCKETS)
    defer: bool = False  # DEFER_CONTEXT_APPENDS when captured (rounds of either setting may be kept side by side)
    head: str | None = None  # the drafter's config.head_quantization (its draft graph multiplies by that head)
    layers: str | None = None  # the drafter's config.layers_quantization (its draft graph reads those copies)


MAX_EOS_IDS = 8  # EOS ids a round can test on the device
BATCH_BUCKETS = (1, 2, 4, 8, 16)  # batch rows resident rounds are built for; a batch runs in the smallest that fits


def batch_bucket(batch: int) -> int | None:
    """The rows of the resident rounds a batch of `batch` prompts runs in (None: larger than the largest bucket)."""
    return next((rows for rows in BATCH_BUCKETS if rows >= batch), None)


def _same_settings(have: _Key, want: _Key) -> bool:
    return dataclasses.replace(have, capacity=want.capacity) == want


def _reusable(have: _Key, want: _Key) -> bool:
    """Cached rounds serve a call with the same settings whose length fits their static cache (up to 4× larger than
    needed: attention reads the whole capacity, masked, so a much larger one would cost every round)."""
    return _same_settings(have, want) and want.capacity <= have.capacity <= 4 * want.capacity


def resident_rounds(model, drafter, strategy, logits_processor, do_sample: bool, max_length: int,
                    position_rows: int, device_commit: bool, capture: bool = True, rows: int = 1) -> "ResidentRounds":
    """The target's `ResidentRounds` for these settings: a kept one when it fits, else a new one (kept sets of the
    same settings are released first, as are the least recently used ones beyond what the module docstring allows).
    capture=False: the same rounds launched eagerly on CUDA too (HybridSpecConfig(cuda_graphs="uncaptured")).
    rows: batch rows (a bucket of BATCH_BUCKETS; a batch of fewer prompts fills the rest with inert rows)."""
    if rows not in BATCH_BUCKETS or (rows > 1 and not device_commit):
        raise ValueError(f"resident rounds run batch buckets {BATCH_BUCKETS} (got rows={rows}); a batch needs EOS "
                         "and max_length as its only stopping rules (device_commit).")
    block = drafter.config.block_size if drafter is not None else 1
    capacity = -(-(max_length + block) // _CAPACITY_STEP) * _CAPACITY_STEP
    key = _Key(id(drafter), strategy.identity(), do_sample, tuple(repr(p.__dict__) for p in logits_processor),
               capacity, position_rows, device_commit, capture, rows, DEFER_CONTEXT_APPENDS,
               getattr(drafter.config, "head_quantization", None) if drafter is not None else None,
               getattr(drafter.config, "layers_quantization", None) if drafter is not None else None)
    kept = model.__dict__.setdefault(_KEPT, [])
    found = next((rounds for rounds in reversed(kept) if _reusable(rounds.key, key)), None)
    if found is not None:
        kept.remove(found)
        kept.append(found)
        model.__dict__[_ACTIVE] = found
        return found
    for rounds in [r for r in kept if _same_settings(r.key, key)]:  # outgrown (or too large) for these settings
        _release(model, rounds)
    devices = [next(model.parameters()).device] if next(model.parameters()).device.type == "cuda" else []
    while kept and (len(kept) >= MAX_ROUNDS_PER_TARGET or not _room_for_another(kept, devices)):
        _release(model, kept[0])
    try:
        rounds = _build(model, drafter, strategy, logits_processor, do_sample, capacity, position_rows,
                        device_commit, key, devices)
    except torch.cuda.OutOfMemoryError:
        if not kept:
            raise
        release_resident_rounds(model)  # the other settings' graphs and caches made way for none: free them, retry
        rounds = _build(model, drafter, strategy, logits_processor, do_sample, capacity, position_rows,
                        device_commit, key, devices)
    kept = model.__dict__.setdefault(_KEPT, [])
    kept.append(rounds)
    model.__dict__[_ACTIVE] = rounds
    return rounds


def _build(model, drafter, strategy, logits_processor, do_sample, capacity, position_rows, device_commit, key,
           devices) -> "ResidentRounds":
    before = torch.cuda.memory_allocated(devices[0]) if devices else 0
    with torch.random.fork_rng(devices=devices):  # warm-up and capture draw random numbers: the seed stays the user's
        rounds = ResidentRounds(model, drafter, strategy, logits_processor, do_sample, capacity, position_rows,
                                device_commit, key)
    # static cache, buffers and graph pools (CUDA): what keeping the rounds for later calls costs
    rounds.memory_bytes = torch.cuda.memory_allocated(devices[0]) - before if devices else 0
    return rounds


def _room_for_another(kept: list, devices: list) -> bool:
    """CUDA: whether the free memory holds two more sets as large as the largest kept one (elsewhere: always)."""
    if not devices:
        return True
    free, _ = torch.cuda.mem_get_info(devices[0])
    return free >= 2 * max(rounds.memory_bytes for rounds in kept)


def _release(model, rounds: "ResidentRounds") -> None:
    """Free one kept set (its graphs, static cache and hooks; the shared weight copies with the last set)."""
    kept = model.__dict__.get(_KEPT, [])
    if rounds in kept:
        kept.remove(rounds)
    if model.__dict__.get(_ACTIVE) is rounds:
        model.__dict__.pop(_ACTIVE)
    rounds.close(release_copies=not kept)
    if not kept:
        model.__dict__.pop(_KEPT, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_resident_rounds(model) -> None:
    """Free every captured set of rounds the target keeps (graphs, static caches, weight copies)."""
    for rounds in list(model.__dict__.get(_KEPT, [])):
        _release(model, rounds)
    model.__dict__.pop(_ACTIVE, None)


class ResidentRounds:
    """Static buffers and graphs of GPU-resident rounds (see the module docstring)."""

    DEFERRED_STEPS = 32  # plain steps whose context appends wait for the next speculative round (buffer columns)

    def __init__(self, model, drafter, strategy, logits_processor, do_sample: bool, capacity: int,
                 position_rows: int, device_commit: bool, key: _Key):
        self.key = key
        self.model, self.drafter, self.strategy = model, drafter, strategy
        self.logits_processor, self.do_sample = logits_processor, do_sample
        self.device = next(model.parameters()).device
        self.rows = rows = key.rows  # batch rows N (1: one sequence)
        feature_ids = list(drafter.config.target_layer_ids) if drafter is not None and strategy.name != "ar" else []
        block = drafter.config.block_size if drafter is not None else 1
        self.target = StaticTarget(model, capacity, feature_ids, position_rows, strategy.kernel_backend,
                                   strategy.gdn_verifier, max_tokens=block, rows=rows)
        self.context = None
        if drafter is not None and strategy.name != "ar":
            from hybridspec_hf.drafter import StaticDraftContext

            self.context = StaticDraftContext(drafter, capacity, self.device, drafter.dtype, rows)
        # plain steps' features [N, DEFERRED_STEPS, F] waiting for the context, and how many columns of each row
        # count (a row that ended adds none); `deferred_steps` counts the plain steps since the last append, on the host
        self.defers = DEFER_CONTEXT_APPENDS and self.context is not None and strategy.takes_plain_steps()
        if self.defers:
            self.deferred = torch.zeros(rows, self.DEFERRED_STEPS, drafter.fc.in_features, device=self.device,
                                        dtype=next(model.parameters()).dtype)
            self.deferred_count = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.deferred_steps = 0
        self.moe = moe = patches.moe_blocks(model)
        self.linears = patches.decoder_linears(model)
        self.attention = patches.attention_layers(model)
        self.routing = self.window = None  # hooks on the model: made last, right before capture
        self.block_size = drafter.config.block_size if self.context is not None else 1
        self.verify_tokens = strategy.fixed_length if strategy.mode == "fixed" else self.block_size
        long = dict(dtype=torch.long, device=self.device)
        self.last_token = torch.zeros(rows, 1, **long)  # the anchor: last emitted token, not yet in the cache
        # generate()'s max_length (prompt + new tokens) less the row's left padding: its tokens may reach this
        self.limit = torch.zeros(rows, **long)
        self.count = torch.zeros(rows, **long)  # m: tokens of the last verification to commit, per row
        # rows still generating: 0 once a row emitted EOS or reached its limit, and for the inert rows that fill a
        # batch up to its bucket (they keep costing their share of each replay, and commit nothing)
        self.live = torch.ones(rows, **long)
        # device_commit: EOS and max_length are the only stopping rules, so m is known on the device and the spec
        # graph commits it too (one graph per round); otherwise the host fills `count` and replays the commit graph
        self.device_commit = device_commit
        self.eos_ids = torch.full((MAX_EOS_IDS,), -1, **long)
        self.profile = _profile_on(strategy.profile, self.device, self.block_size)  # timing mode (or None)
        self.profile_row = torch.zeros(rows, **long)  # each row replays its own run of the profile's rows
        self.one = torch.ones(1, **long)
        self.zero = torch.zeros(1, **long)  # a constant the graphs read (never written): no launch for a zero field
        pinned = self.device.type == "cuda"
        # hand-off: [target tokens (N·T), a (N), m (N, device_commit), live after the round (N), w, kept, n_new,
        # draft_next]: `unpack` reads it
        self.handoff = torch.zeros(rows * (self.verify_tokens + 3) + 4, dtype=torch.long, pin_memory=pinned)
        # what the hand-off copy reads (`_write_handoff`, `step_tail`)
        self.handoff_values = torch.zeros(self.handoff.shape, **long)
        self.handoff_ready = torch.cuda.Event() if pinned else None
        self.pending: patches.VerifySession | None = None
        self.waited_s = 0.0  # host time spent waiting for hand-offs (telemetry: host time = wall - wait)
        self.features = self.valid = self.target_tokens = None
        self.reset_selector()
        self.speculative = self.context is not None  # else every round is a plain step ("ar")
        start = time.perf_counter()
        # CUDA: the graphs are captured with our experts kernel (each distinct expert read once; on the H200 it
        # took the 35B-A3B AR step from 9.6 to 7.0 ms); the model's own experts setting is restored after capture
        experts = fused_experts_for(moe) if self.device.type == "cuda" else contextlib.nullcontext(False)
        # exact-length verification: a draft graph (draft + choose) hands w0 to the host, which replays the verify
        # graph of that length (and, when the host decides m, the commit graph that reads that verify's outputs)
        self.exact = self.speculative and strategy.mode == "exact"
        # the max shape's shorter verifies (SHORT_VERIFY): rounds whose length the strategy chooses, committed on the
        # device; captured only where conditional nodes exist (the uncaptured CUDA path would sync on each choice)
        branches = self.device.type != "cuda" or (key.capture and branches_capture(self.device))
        self.short_lengths = tuple(n for n in SHORT_LENGTHS if n < self.verify_tokens) if (
            SHORT_VERIFY and self.speculative and not self.exact and strategy.mode != "fixed" and device_commit
            and branches) else ()
        self.verify_length = torch.zeros(1, dtype=torch.long, pin_memory=pinned)
        # context lookup (one row, a strategy that chooses w; its table already on the device), on the device: the
        # call's tokens so far in a static buffer (the prompt written by `start`; each round writes its anchor, then
        # its block where it will be verified, each plain step its anchor: every position below the length holds
        # the committed token), the draft graph's proposal (B-1 tokens, match length) read from it in one launch
        # (kernels/lookup_triton.py), and whether the round verified it, handed to the host for telemetry
        self.lookup = strategy.lookup if self.speculative and rows == 1 and strategy.mode != "fixed" else None
        if self.lookup is not None:
            self.lookup_ids = torch.zeros(1, capacity + self.block_size, **long)
            self.lookup_offsets = torch.arange(self.block_size, **long)
            self.lookup_proposal = torch.zeros(1, self.block_size - 1, **long)
            self.lookup_ngram = torch.zeros(1, **long)
            self.lookup_used = torch.zeros(1, dtype=torch.long, pin_memory=pinned)
        self.verified = self.verify_tokens  # tokens the last round verified (its commit graph, in "exact")
        self.step = self.step_append = self.spec = self.draft = self.decide = None
        # plain steps exist (a selector that may not draft): the first after a speculative round decides how many
        self.decides = self.speculative and strategy.takes_plain_steps()
        self.verifies: dict[int, Replay] = {}
        self.commits: dict[int, Replay] = {}
        learned = [(tensor, tensor.clone()) for tensor in self._learned_state()]
        try:
            # the fused paths' weight copies (MoE shared expert, GDN input projections): made here, outside capture
            # (a copy made inside would be a graph node replayed every round), refreshed in place by `start`, freed
            # by `close`
            self._prepare_weight_copies()
            # before the window: it sets ids
            self.routing = _routing_replay(strategy.routing, moe, model, self.device, rows)
            self.window = VerifyWindow(moe)
            # the decisions' device work in a few compiled kernels (HybridSpecConfig.compile_decisions); a second
            # warm-up call before each capture, so that any recompile (a guard the first call's state changed)
            # happens outside the capture
            compiled = strategy.compile_backend is not None and strategy.compile_decisions(strategy.compile_backend)
            # the drafter's logits in its head's dtype where the drafts come out of the signals' stream (a drafter
            # whose draft_static predates `upcast` keeps its fp32 logits)
            self.head_dtype_drafts = (FUSED_DRAFT_TOKENS and self.speculative
                                      and "upcast" in inspect.signature(self.drafter.draft_static).parameters)
            # the GDN commit's stream beside the round's (COMMIT_BESIDE; CUDA only, not inside conditional bodies)
            self.beside = (torch.cuda.Stream(self.device) if COMMIT_BESIDE and self.speculative and device_commit
                           and self.device.type == "cuda" and not self.short_lengths else None)
            # a round's bookkeeping around the forward, committed on the device (round_tail.py): compiled with the
            # decisions (FUSED_ROUND_TAIL), else eagerly
            self.tail = FUSED_ROUND_TAIL and self.speculative and device_commit and strategy.compile_backend is not None
            regions = (round_head, round_accept, commit_count, round_advance)
            self.head_fn, self.accept_fn, self.count_fn, self.advance_fn = regions
            if self.tail:
                self.head_fn, self.accept_fn, self.count_fn, self.advance_fn = (
                    compiled_region(fn, strategy.compile_backend) for fn in regions)
                compiled = True
            replay = functools.partial(Replay, device=self.device, capture=key.capture, warmup=2 if compiled else 1)
            with torch.no_grad(), experts as self.fused_experts:
                self.step = replay(self._step)
                if self.defers:
                    self.step_append = replay(self._step_append)
                if self.decides:  # the plain step that decides the stretch of plain steps after it (and appends)
                    self.decide = replay(functools.partial(self._step_append if self.defers else self._step,
                                                           decide=True))
                if self.exact:
                    self.draft = replay(self._draft)
                    for n in range(1, self.verify_tokens + 1):
                        pool = self.draft.pool()
                        self.verifies[n] = replay(functools.partial(self._verify, n), pool=pool)
                        if not device_commit:  # captured right after its verify: it reads that graph's outputs
                            self.commits[n] = replay(self._commit, pool=pool)
                elif self.speculative:
                    self.spec = replay(self._spec)
                    if not device_commit:
                        self.commits[self.verify_tokens] = replay(self._commit, pool=self.spec.pool())
        except BaseException:  # a failed capture (or CUDA OOM) leaves no hooks and no half-built rounds behind
            self.close(release_copies=not model.__dict__.get(_KEPT))  # the copies stay while kept sets read them
            raise
        for tensor, before in learned:  # what the capture's warm-up runs taught is undone
            tensor.copy_(before)
        self.capture_s = time.perf_counter() - start

    def _learned_state(self) -> list[torch.Tensor]:
        """The tensors the rounds' decisions learn into: the selector's streams (its speculative evidence, kept
        across calls) and the acceptance estimator's online correction. A capture runs every round function once
        eagerly first (`Replay`'s warm-up, which compiles the Triton kernels), on whatever the buffers hold, and
        that round must teach them nothing: its empty commit (0 tokens) was carried into the calls as a speculative
        round of evidence, which the CPU twin never saw (emulated on the CPU, a fresh set's first call stepped plain
        at once, where without it it drafts: tests/test_resident.py)."""
        selector, estimator = self.strategy.selector, self.strategy.estimator
        holders = [selector, getattr(selector, "throughput", None), estimator]
        return [value for holder in holders if holder is not None for value in vars(holder).values()
                if isinstance(value, torch.Tensor)]

    def close(self, release_copies: bool = True) -> None:
        """Remove every hook this object put on the model and, with release_copies (no other kept set reads them),
        the model's weight copies (graphs and buffers go with the object)."""
        for hooks in (self.window, self.routing):
            if hooks is not None:
                hooks.remove()
        self.step = self.step_append = self.spec = self.draft = self.decide = None
        self.verifies, self.commits = {}, {}
        if release_copies:
            if getattr(self, "head_copy", None) is not None:  # the drafter's reference too (made again on its next use)
                self.drafter.release_quantized_head()
            self.head_copy = self.greedy_head = None
            patches.release_fused_moe(self.moe)
            patches.release_gdn_projections(self.target.gdn_layers)
            patches.release_attention_projections(self.attention)
            patches.release_linears(self.linears)
        self.target.close()

    def _prepare_weight_copies(self) -> None:
        patches.prepare_fused_moe(self.moe)
        patches.prepare_gdn_projections(self.target.gdn_layers)
        patches.prepare_attention_projections(self.attention)
        patches.prepare_linears(self.linears)  # the projections' skinny GEMM (inert until its table names a shape)
        # the drafter's int8 head copy (DFlashConfig.head_quantization), made before the capture and held here: the
        # draft graph reads it by address, so it lives as long as these rounds whatever the drafter does with its
        # own reference later, and follows the head's weights in place as the copies above do
        quantized_head = getattr(self.drafter, "quantized_head", None)
        current = quantized_head(self.rows * (self.drafter.config.block_size - 1)) if quantized_head is not None \
            else None
        held = getattr(self, "head_copy", None)
        if held is None:
            self.head_copy = current
        elif current is not None and current is not held:  # the drafter made another: its values into ours
            held.weight.copy_(current.weight)
            held.scale.copy_(current.scale)
        self.greedy_head = self._greedy_head_copy()

    def _greedy_head_copy(self):
        """The int8 copy of the target's head that greedy tokens come from (the strategy's greedy_head; "auto":
        INT8_GREEDY_HEAD on its devices), or None: the drafter's copy where it has one of this head, else our own,
        made now or, when the head's weight changed (`weight_version`), made again into the same tensors (graphs read
        them by address)."""
        mode = self.strategy.greedy_head
        if mode == "auto":
            mode = "int8" if INT8_GREEDY_HEAD and self.device.type in INT8_GREEDY_HEAD_DEVICES and head_skippable(
                self.model) else "model"
        if mode == "model" or self.do_sample or len(self.logits_processor):
            return None
        if not head_skippable(self.model):
            raise ValueError(f'greedy_head="int8": {type(self.model).__name__}\'s LM head is not a plain bias-free '
                             '`lm_head` Linear that is its output embeddings (or its config scales or caps logits); '
                             'use greedy_head="model" or "auto".')
        weight = self.model.lm_head.weight
        if self.head_copy is not None and self.head_copy.fits(weight):
            return self.head_copy
        held = getattr(self, "greedy_head", None)
        key = weight_version(weight)
        if held is not None and held is not self.head_copy and held.fits(weight):
            if key != self.greedy_head_key:
                quantize_rows(weight, out=held)
        else:
            held = quantize_rows(weight)
        self.greedy_head_key = key
        return held

    def greedy_from_copy(self, tokens: int) -> bool:
        """Whether a forward over `tokens` tokens of each row takes its greedy tokens from the head's int8 copy (the
        kernel takes at most MAX_ROWS rows) instead of the head's logits."""
        return self.greedy_head is not None and self.rows * tokens <= MAX_ROWS

    def _greedy_tokens_from_copy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of final hidden states [N, T, H] from the head's int8 copy and its candidate rows -> [N, T]."""
        return head_argmax_triton.greedy_tokens(hidden, self.model.lm_head.weight, self.greedy_head)

    def reset_selector(self) -> None:
        """A new generate() call: the selector's streams restart from its prior, in place (graphs hold them),
        keeping what earlier calls' speculative rounds taught (HybridSpec.restart). `opens_plain`: the selector has
        such evidence, so the call opens with a deciding plain step (its `plain_run` drafts next if speculation
        pays) instead of a draft nobody asked for (read once here, at the call's set-up)."""
        selector = self.strategy.selector
        self.opens_plain = False
        if selector is not None:
            restart = getattr(selector, "restart", None)
            restart(self._context_len()) if restart is not None else selector.reset()
            informed = getattr(selector, "informed", None)
            if informed is not None:
                with host_syncs():
                    self.opens_plain = bool(informed().all())

    # ------------------------------------------------------------------------------------------ captured functions
    def _context_len(self) -> torch.Tensor:
        """[1] long: the context the selector's latency model is read at, the longest live row's (one stream: w is
        shared by the rows)."""
        return context_length(self.target.length, self.live)

    def _scores(self, raw: torch.Tensor) -> torch.Tensor:
        """Row-wise logits processors on raw [N, T, V] fp32 logits (every row as AR would process it)."""
        if len(self.logits_processor) == 0:
            return raw
        flat = raw.reshape(-1, raw.shape[-1])
        prefix = self.last_token[:1].expand(flat.shape[0], 1)  # row-wise processors ignore it
        return self.logits_processor(prefix, flat).view(raw.shape)

    @contextlib.contextmanager
    def _routing_armed(self):
        """Calibrated routing (timing mode) applies to the speculative rounds' forwards only: never to the eager
        prefill, nor to a plain step (see `_step`)."""
        if self.routing is None:
            yield
            return
        self.routing.armed = True
        try:
            yield
        finally:
            self.routing.armed = False

    def _flag(self, value) -> torch.Tensor:
        """A [1] long on the device from a bool or a bool tensor (strategies answer either)."""
        if isinstance(value, torch.Tensor):
            return value.reshape(-1)[:1].long().to(self.device)
        return torch.full((1,), int(bool(value)), dtype=torch.long, device=self.device)

    def _write_handoff(self, target_tokens: torch.Tensor, accepted: torch.Tensor, live: torch.Tensor,
                       w: torch.Tensor, keep: torch.Tensor, n_new: torch.Tensor, draft_next: torch.Tensor,
                       copy: bool = True) -> None:
        """The round's hand-off values into `handoff_values`: target_tokens [N, T], accepted and live [N], the rest
        [1] (m is `count`); `copy`: then the round's one device→host copy (non-blocking into pinned memory)."""
        torch.cat([target_tokens.reshape(-1), accepted.reshape(-1), self.count, live.reshape(-1), w.reshape(1),
                   keep.reshape(1), n_new.reshape(1), draft_next.reshape(1)], out=self.handoff_values)
        if copy:
            self.handoff.copy_(self.handoff_values, non_blocking=True)

    def unpack(self, handoff: list[int]) -> tuple:
        """(tokens [N][T], a [N], m [N], live [N], w, kept, n_new, draft_next) of a hand-off read on the host."""
        n, t = self.rows, self.verify_tokens
        tokens = [handoff[row * t: (row + 1) * t] for row in range(n)]
        a, m, live = (handoff[n * t + i * n: n * t + (i + 1) * n] for i in range(3))
        w, kept, n_new, draft_next = handoff[n * (t + 3):]
        return tokens, a, m, live, w, kept, n_new, draft_next

    def _step(self, decide: bool = False):
        """A plain decoding step: verify the anchor and commit it (m = 1 per live row is known, so one graph does
        both). `decide` (the first plain step after a speculative round): the selector decides how many plain steps
        follow before the next draft (`Strategy.plain_run`, handed off in the draft_next slot); the steps it
        decided run without any selector work, as AR's step (the host counts them down).

        Our GDN path instead of transformers' decode path (on the H200 the stock one-token forward cost 13.7 ms in a
        graph against ≈ 11.8 ms with the block verify + one-launch commit, benchmarks/results/gpu_rounds_runs.md).
        With the fused kernels and one row each GDN layer takes one recurrent step that updates its state and conv
        window in place (`decode_step`: S read and written once, no commit launch; `gdn_triton.DECODE_STEP`,
        measured in run 24 of benchmarks/results/gpu_rounds_runs.md); otherwise (and for a batch, whose finished
        rows must keep their state) the block verify + commit.
        """
        if decide:  # plain_run below decides for this batch (before this step's token)
            context_len = self._context_len()
            self._batch_state(self.limit - (self.target.length + 1))
        session = self.target.session(decode_step=gdn_triton.DECODE_STEP and self.rows == 1)
        # not under calibrated routing: one token reads top-k experts whatever ids the profile would give it, and
        # the replay's kernels (≈ 0.15 ms a step at 35B, e2e run 44) would make the plain step dearer than AR's
        if self.lookup is not None:  # the anchor is committed by this step: context lookup's text
            self.lookup_ids.index_copy_(1, self.target.length[:1], self.last_token[:1])
        from_copy = self.greedy_from_copy(1)
        logits, features = self.target.forward(self.last_token, verify=session, head=not from_copy)
        if from_copy:  # logits: the final hidden states
            token = self._greedy_tokens_from_copy(logits)[:, 0]
        elif self.do_sample or len(self.logits_processor):
            scores = self._scores(logits.float())[:, 0]  # [N, V]
            token = sample_tokens(scores.softmax(-1)) if self.do_sample else scores.argmax(-1)  # [N]
        else:
            token = _greedy_scores(logits[:, 0]).argmax(-1)
        # the plain steps before the next draft (decide), else nothing: the host knows
        draft_next = self.zero
        if decide:
            draft_next = self.strategy.plain_run(context_len).reshape(-1)[:1].to(self.device, torch.long)
        self._commit_step(session, token, draft_next)
        if self.defers:
            self._defer(features)
        elif self.context is not None:
            with patches.fused_kernels():  # the drafter's K/V of the new features: its k-norm and RoPE fused
                self.context.append(features, self.count if self.rows > 1 else 1)

    def _commit_step(self, session: patches.VerifySession, token: torch.Tensor, draft_next: torch.Tensor) -> None:
        """A plain step's commit of its token [N] (m = 1 per live row): count, GDN states, lengths, the anchor, the
        rows that end, the hand-off. With FUSED_STEP_TAIL on CUDA all but the GDN commit (none after a decoding
        step) and the hand-off copy are one launch (kernels/step_tail_triton.py), else its torch reference."""
        target = self.target
        fused = FUSED_STEP_TAIL and step_tail_triton.applies(self.device)
        tail = step_tail if fused else step_tail_reference
        tail(token.view(-1), self.live, self.count, target.length, target.next_position,
             target.attention_lengths if self.rows == 1 else None, self.last_token, self.eos_ids, self.limit,
             draft_next, self.handoff_values, self.device_commit)
        target.commit_states(session, self.count)
        self.handoff.copy_(self.handoff_values, non_blocking=True)

    def _defer(self, features: torch.Tensor) -> None:
        """Park a plain step's features [N, 1, F] in column `deferred_count` of each row and count them by m: a
        row's counted columns stay contiguous from 0 (a row that ended writes into its next column, uncounted), as
        `StaticDraftContext.append` takes them. `run_step` keeps the column below DEFERRED_STEPS."""
        column = self.deferred_count.view(-1, 1, 1).expand_as(features)
        self.deferred.scatter_(1, column, features.to(self.deferred.dtype))
        self.deferred_count.add_(self.count)

    def _append_deferred(self) -> None:
        """Append the parked features to the drafter's context (each row its counted columns), then empty the buffer."""
        with patches.fused_kernels():  # the drafter's K/V of the features: its k-norm and RoPE fused
            self.context.append(self.deferred, self.deferred_count)
        self.deferred_count.zero_()

    def _step_append(self, decide: bool = False):
        """A plain step that fills the buffer's last column, then the append of the whole buffer."""
        self._step(decide)
        self._append_deferred()

    def _spec(self):
        """A whole speculative round (modes "fixed" and "max"): draft, then verify the block's shape, or the shortest
        of `short_lengths` that holds every row's valid tokens (one conditional branch per length, SHORT_VERIFY);
        the branches write the same buffers, and the hand-off is copied after them."""
        self._draft()
        if not self.short_lengths:
            self._verify(self.verify_tokens)
            return
        draws = self._draws()
        valid = self.round_valid.reshape(-1).max().reshape(1)

        def shortest(lengths: tuple[int, ...]) -> None:
            n, longer = lengths[0], lengths[1:]
            if not longer:
                self._verify(n, draws, hand_off=False)
                return
            branch(valid <= n, functools.partial(self._verify, n, draws, hand_off=False),
                   functools.partial(shortest, longer))

        shortest(self.short_lengths + (self.verify_tokens,))
        self.handoff.copy_(self.handoff_values, non_blocking=True)

    def _draws(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sampling: the random numbers a round's acceptance reads, drawn before its verify branches (none may draw
        inside a conditional body): coins [N, T-1] for the drafts, exponential races [N, V] for the emitted token;
        the same draws, in the same order, as `speculative_sample` makes over the block's shape."""
        if not self.do_sample:
            return None
        vocab = self.model.get_output_embeddings().weight.shape[0]
        coins = torch.rand(self.rows, self.verify_tokens - 1, device=self.device)
        races = torch.empty(self.rows, vocab, dtype=torch.float32, device=self.device).exponential_()
        return coins, races

    def _draft(self):
        """Draft, choose w0 (and arm the routing correction): what the round verifies. A batch shares one w (the
        rows' mean survival, as the eager batched loop) and runs without the routing correction."""
        t = self.verify_tokens
        with patches.fused_kernels():  # the drafter's RMSNorms and RoPE take our kernels too
            # [N, B-1, V]; in the head's dtype when the drafts and signals below read it in fp32 themselves
            if self.head_dtype_drafts:
                draft_logits = self.drafter.draft_static(self.last_token, self.context, upcast=False)
            else:
                draft_logits = self.drafter.draft_static(self.last_token, self.context)
            if FUSED_DRAFT_TOKENS:
                wanted = self.strategy.mode != "fixed" and self.profile is None  # timing mode: the profile's
                drafts, own_signals = draft_tokens_and_signals(draft_logits, signals=wanted)
            else:
                drafts, own_signals = draft_logits.argmax(-1), None
        # the block [N, T], each row's room [N], w_max [1] and the selector's context length [1] (round_tail.py)
        self.block, room, w_max, self.round_context_len = self.head_fn(self.last_token, drafts, self.target.length,
                                                                       self.limit, self.live, t)
        self._batch_state(room)
        self.choice, signals, self.replayed = None, own_signals, None
        if self.profile is not None:  # timing mode: each row's next profile row: signals and accepted count
            row = self.profile_row % self.profile.accepted.shape[0]
            signals = {k: getattr(self.profile, k).index_select(0, row) for k in ("top1", "margin", "entropy")}
            self.replayed = self.profile.accepted.index_select(0, row)  # [N] a with the whole block verified
            if self.routing is not None:
                self.routing.row.copy_(self.profile_row)
            self.profile_row.add_(1)
        if self.strategy.mode != "fixed":
            with patches.fused_kernels():  # the draft signals in one launch
                if self.rows == 1:
                    proposal = None
                    if self.lookup is not None:  # (copied tokens, match length, drafts)
                        proposal = (*self._lookup_proposal(), drafts)
                    self.choice = self.strategy.choose(draft_logits, self.round_context_len, w_max, signals, proposal)
                    if self.lookup is not None:  # the copy where it is expected to yield more than the drafts
                        copied = torch.where(self.choice.lookup[:, None], proposal[0], self.block[:, 1:])
                        self.block = torch.cat([self.block[:, :1], copied], dim=1)
                        self.lookup_used.copy_(self.choice.lookup.long(), non_blocking=True)
                        # the block where it is verified: its accepted tokens are the text the next lookups read
                        self.lookup_ids.index_copy_(1, self.target.length[:1] + self.lookup_offsets, self.block)
                else:
                    self.choice = self.strategy.choose_rows(draft_logits, self.round_context_len, w_max, self.live,
                                                            signals)
            self.round_w = self.choice.valid if self.rows == 1 else self.choice.w0  # w incl. a kept extra token
            self.round_valid = self.choice.valid  # the extra token included until the correction drops it
        else:
            self.round_w = self.round_valid = w_max
            if self.rows > 1:  # finished and inert rows verify their anchor only (their experts are not read)
                self.round_valid = torch.where(self.live > 0, w_max, 1)
                self.choice = Choice(w_max, self.round_valid, torch.zeros_like(self.live[:1], dtype=torch.bool),
                                     torch.zeros_like(self.one))
        if self.exact:  # the host reads how many tokens stage 0 verifies (w0, + 1 for the extra token)
            self.verify_length.copy_(self.round_w, non_blocking=True)

    def _lookup_proposal(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This round's context-lookup proposal ([1, B-1] tokens, [1] match length; device buffers): the anchor
        written after the committed tokens, then the lookup over them (one launch on CUDA)."""
        length = self.target.length[:1]
        self.lookup_ids.index_copy_(1, length, self.last_token[:1])
        return context_lookup_static(self.lookup_ids, length + 1, self.block_size, self.lookup.min_ngram,
                                     self.lookup.max_ngram, out=(self.lookup_proposal, self.lookup_ngram))

    def _verify(self, n: int, draws: tuple[torch.Tensor, torch.Tensor] | None = None, hand_off: bool = True):
        """Verify the block's first n tokens (n = T in modes "fixed"/"max", or a short length holding the valid ones;
        n = w0 (+1) in "exact"), accept, commit when m is known on the device, hand off (the values; their copy to
        the host unless `hand_off` is False). `draws`: sampling's random numbers, drawn before (`_draws`)."""
        t, choice, valid = self.verify_tokens, self.choice, self.round_valid
        tokens = self.block[:, :n]
        from_copy = self.greedy_from_copy(n)
        session, logits, features = self._verify_forward(tokens, valid, choice, head=not from_copy)
        if from_copy:  # logits: the final hidden states
            target_tokens = self._greedy_tokens_from_copy(logits)
        elif self.do_sample:
            coins, races = draws if draws is not None else (None, None)
            accepted, sampled = speculative_sample(tokens[:, 1:], self._scores(logits.float()).softmax(-1), valid,
                                                   coins=None if coins is None else coins[:, : n - 1], races=races)
            target_tokens = torch.cat([tokens[:, 1:], sampled[:, None]], dim=1)
            target_tokens = target_tokens.scatter(1, accepted.view(-1, 1), sampled.view(-1, 1))
            if self.replayed is not None:  # timing mode: the profile's count (the tokens stay the sample's)
                accepted = torch.minimum(self.replayed, valid.view(-1) - 1)
        else:  # [N, n]; accepted below (`greedy_accepted`, in `round_accept` when the device commits)
            scores = self._scores(logits.float()) if len(self.logits_processor) else logits
            target_tokens = _greedy_scores(scores).argmax(-1)
        if n < t:  # the block's layout (positions past n are past valid: they never count)
            target_tokens = torch.cat([target_tokens, target_tokens.new_zeros(self.rows, t - n)], dim=1)
        if not self.device_commit:  # the host decides m, then replays the commit graph (`_commit`)
            if not self.do_sample:
                accepted = greedy_accepted(target_tokens, self.block, valid, self.replayed)
            draft_next = self._decide_next(choice, accepted, counted=False)
            self.pending, self.features, self.target_tokens = session, features, target_tokens
            keep = choice.keep.long() if choice is not None else self.zero
            n_new = choice.n_new if choice is not None else self.zero
            self._write_handoff(target_tokens, accepted, self.live, self.round_w, keep, n_new, draft_next,
                                copy=hand_off)
            return
        # m = a + 1, cut after the first EOS among the emitted tokens and at the row's room (round_tail.py)
        count_args = (self.eos_ids, self.target.length, self.limit, self.live, self.count)
        if self.do_sample:
            count32 = self.count_fn(target_tokens, accepted, *count_args)
        else:
            accepted, count32 = self.accept_fn(target_tokens, self.block, valid, self.replayed, *count_args)
        draft_next = self._decide_next(choice, accepted, counted=True)
        with self._commit_stream():  # COMMIT_BESIDE: beside the append and the advance, joined below
            self.target.commit_states(session, count32)
        with patches.fused_kernels():
            self.context.append(features, self.count)
        keep = choice.keep if choice is not None else self.zero
        n_new = choice.n_new if choice is not None else self.zero
        self.advance_fn(target_tokens, accepted, self.count, self.target.length, self.target.next_position,
                        self.target.attention_lengths if self.rows == 1 else None, self.last_token, self.live,
                        self.eos_ids, self.limit, self.round_w, keep, n_new, draft_next, self.handoff_values)
        if hand_off:
            self.handoff.copy_(self.handoff_values, non_blocking=True)
        if self.beside is not None:  # joined: whatever runs after the round sees the committed states
            torch.cuda.current_stream(self.device).wait_stream(self.beside)

    def _commit_stream(self):
        """Where a round's GDN commit runs: the round's stream, or (COMMIT_BESIDE) the side stream, forked here from
        the round's (it waits for everything enqueued so far: the forward, the count) and joined at the round's end."""
        if self.beside is None:
            return contextlib.nullcontext()
        self.beside.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.beside)

    def _decide_next(self, choice, accepted: torch.Tensor, counted: bool) -> torch.Tensor:
        """The selector's work after a round's acceptance: the estimator's online step, whether the next round drafts
        ([1] long, decided before this round's update) and, once the round is `counted` (m in `count`, committed on
        the device), the selector's update with it (FUSED_ROUND_END: both in one call); uncounted, `_commit` updates
        the selector after the host's m."""
        if self.strategy.mode != "fixed":
            self.strategy.observe_acceptance(choice, accepted)
        selector = self.strategy.selector is not None
        if counted and selector and FUSED_ROUND_END:
            return self._flag(self.strategy.end_round(self.round_context_len, self.round_w.view(1),
                                                      *self._round_tokens()))
        draft_next = self._flag(self.strategy.should_draft(self.round_context_len))
        if counted and selector:
            self.strategy.observe_round(self.round_w.view(1), *self._round_tokens())
        return draft_next

    def _verify_forward(self, tokens: torch.Tensor, valid: torch.Tensor, choice, head: bool = True):
        """The round's target forward: tokens [N, n] verified after each row's committed ones (GDN states not
        written), `valid` [N] long of them counting, the routing window armed with the round's `Choice` (or None).
        Returns the verify session (what a commit reads), logits [N, n, V] (head=False: the final hidden states
        [N, n, H]) and features [N, n, F]."""
        if choice is not None:
            self.window.arm(choice)
        session = self.target.session(valid)
        try:
            with self._routing_armed():
                logits, features = self.target.forward(tokens, verify=session, head=head)
        finally:
            self.window.disarm()
        return session, logits, features

    def _batch_state(self, room: torch.Tensor) -> None:
        """A batch's selector decides for its live rows and the room of the roomiest (room [N], before the round's
        or step's tokens): what a speculative round's spread of tokens between rows costs the call
        (selector.spread_discount). Nothing at one row."""
        if self.rows > 1 and self.strategy.selector is not None:
            self.strategy.selector.batch_state(*batch_rows_left(self.live, room))

    def _round_tokens(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(emitted, spread) of the round just counted, as the selector learns them: one stream for the batch, tokens
        per live row and their spread between rows (the eager batched loop's rule, selector.batch_row_stats), priced
        at the batch set in `_draft`; at one row its count and no spread."""
        return (self.count, None) if self.rows == 1 else batch_row_stats(self.count, self.live)

    def _commit(self):
        """Keep m = self.count tokens (per row) of the last verification, m decided on the host (`run_commit`); the
        selector learns the round."""
        self.target.commit(self.pending, self.count)
        with patches.fused_kernels():
            self.context.append(self.features, self.count)
        new_anchor(self.target_tokens, self.count, self.last_token)
        if self.strategy.selector is not None:
            self.strategy.observe_round(self.round_w.view(1), *self._round_tokens())

    # ------------------------------------------------------------------------------------------ host side
    def restart_profile(self, start_row: int = 0) -> None:
        """Row b of a batch replays the profile from row start_row + b·(rows / N): each row its own run of rounds."""
        if self.profile is not None:
            stride = max(1, self.profile.accepted.shape[0] // self.rows)
            self.profile_row.copy_(torch.arange(self.rows, device=self.device) * stride + start_row)

    def start(self, cache, last_position: torch.Tensor, prompt_features: torch.Tensor, first_token: torch.Tensor,
              max_length: int, eos_ids: set[int], real: torch.Tensor | None = None,
              live: list[bool] | None = None, profile_start: int = 0, prompt_ids: torch.Tensor | None = None
              ) -> None:
        """Load a prefilled call into the static buffers (eager, once per generate() call).

        A batch of B ≤ N prompts: real [B, P] is its attention mask (left padding), prompt_features [B, P', F] the
        prefill's features of the last P' columns, first_token [B], live [B] the rows still generating after the
        prefill; rows B .. N-1 stay inert. prompt_ids [1, ≥ P]: the call's tokens so far, whose first P (the cached
        ones) context lookup reads (required where the rounds run it)."""
        self._prepare_weight_copies()  # weights changed in place since capture: the copies follow
        if self.device_commit:
            ids = sorted(eos_ids)[:MAX_EOS_IDS]
            self.eos_ids.fill_(-1)
            self.eos_ids[: len(ids)].copy_(torch.tensor(ids, dtype=torch.long))
        self.target.load(cache, last_position, real)
        batch = first_token.numel()
        pads = torch.zeros(batch, dtype=torch.long) if real is None else (real == 0).sum(1).cpu()
        self.limit.zero_()
        self.limit[:batch].copy_(max_length - pads)
        self.live.zero_()
        self.live[:batch].copy_(torch.tensor([True] * batch if live is None else live, dtype=torch.long))
        self.last_token.zero_()
        self.last_token[:batch].copy_(first_token.view(-1, 1))
        if self.lookup is not None:
            cached = int(self.target.length[0])
            if prompt_ids is None or prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < cached:
                raise ValueError(f"Context lookup reads the call's tokens: start() needs prompt_ids [1, >= {cached}] "
                                 f"(the cached tokens first), got "
                                 f"{None if prompt_ids is None else tuple(prompt_ids.shape)}.")
            self.lookup_ids[:, :cached].copy_(prompt_ids[:, :cached])
        if self.context is not None:
            self.context.reset()
            if real is None and self.rows == 1:
                self.context.append(prompt_features, prompt_features.shape[1])
            else:  # each row's real features first, counted per row; inert rows count none
                columns = real[:, real.shape[1] - prompt_features.shape[1]:].to(prompt_features.device)
                order = torch.sort((columns == 0).long(), dim=1, stable=True).indices
                index = order[..., None].expand(-1, -1, prompt_features.shape[-1])
                features = prompt_features.new_zeros(self.rows, *prompt_features.shape[1:])
                features[:batch] = prompt_features.gather(1, index)
                counts = torch.zeros(self.rows, dtype=torch.long, device=self.device)
                counts[:batch] = columns.sum(1).to(self.device)
                self.context.append(features, counts)
            if self.defers:
                self.deferred_count.zero_()
        self.deferred_steps = 0
        self.reset_selector()
        self.restart_profile(profile_start)

    def run_step(self, decide: bool = False, last: bool = False) -> list[int]:
        """A plain step; `decide`: the one that decides how many plain steps follow (its hand-off's draft_next);
        `last`: the last of a stretch, a draft comes next. Deferring appends, the deciding step and the last one
        append the parked features (as does a step that fills the buffer's last column), so a speculative round
        never has any to append: the drafter's context is whole when it drafts."""
        if decide and not self.decides:
            raise RuntimeError("HybridSpec: a deciding plain step for a strategy that always drafts.")
        full = self.defers and (decide or last or self.deferred_steps == self.DEFERRED_STEPS - 1)
        if decide:
            self.decide()
        else:
            (self.step_append if full else self.step)()
        self.deferred_steps = 0 if full else self.deferred_steps + 1
        return self._read_handoff()

    def run_spec(self) -> list[int]:
        if not self.exact:
            self.spec()
            return self._read_handoff()
        self.draft()
        self._wait()  # the round's first read: how many tokens to verify
        self.verified = int(self.verify_length)
        self.verifies[self.verified]()
        return self._read_handoff()

    def run_commit(self, count: int) -> None:
        self.count.fill_(count)
        self.commits[self.verified]()

    def _wait(self) -> None:
        """Wait for the copies the graphs enqueued (non-blocking, into pinned memory) to land."""
        if self.handoff_ready is not None:
            self.handoff_ready.record()
            start = time.perf_counter()
            with host_syncs():
                self.handoff_ready.synchronize()
            self.waited_s += time.perf_counter() - start

    def _read_handoff(self) -> list[int]:
        """The round's device→host wait for its tokens (the hand-off copy was enqueued by the graph)."""
        self._wait()
        return self.handoff.tolist()

    def finish(self, cache, length: int) -> None:
        """Write the committed state back into the caller's cache."""
        self.target.store(cache, length)

    def finish_rows(self, cache, lengths: list[int], real: torch.Tensor, output_length: int) -> None:
        """A batch: rebuild the caller's DynamicCache as the eager batched loop leaves it (patches.set_rows: row b's
        processed columns, left padding included, then zeros). lengths [B]: tokens each row committed (its real
        prompt included); real [B, P] the prompt's attention mask. The padding columns' keys come from the caller's
        prefilled cache (the static one holds real tokens only)."""
        prompt = real.shape[1]
        counts = real.sum(1).tolist()
        snapshots = []
        for row, length in enumerate(lengths):
            mine = self.target.row_snapshot(row, length)
            parts = []
            for theirs, (first, second) in zip(cache.layers, mine):
                if patches.is_linear_cache_layer(theirs):
                    parts.append((first, second))
                    continue
                generated = slice(counts[row], length)  # the row's slots after its real prompt
                parts.append((torch.cat([theirs.keys[row, :, :prompt], first[:, generated]], dim=-2),
                              torch.cat([theirs.values[row, :, :prompt], second[:, generated]], dim=-2)))
            snapshots.append(parts)
        set_rows(cache, snapshots, output_length - 1)


def _greedy_scores(logits: torch.Tensor) -> torch.Tensor:
    """What greedy decoding takes the argmax of: logits in fp32, as generate() casts them; no copy where the cast
    changes no value (bf16, fp16, fp32: argmax takes the first maximum either way), a rounded copy from fp64 (where
    rounding may tie two logits that fp64 tells apart)."""
    return logits if logits.dtype in (torch.bfloat16, torch.float16, torch.float32) else logits.float()


def _routing_replay(profile, moe_blocks, model, device, rows: int) -> RoutingReplay | None:
    """Timing mode's calibrated routing: a bank of expert ids sampled from the profile for this model's MoE layers
    (each batch row reads its own bank row)."""
    if profile is None or not moe_blocks:
        return None
    config = model.config.get_text_config()
    bank = profile.bank(len(moe_blocks), config.num_experts, config.num_experts_per_tok)
    return RoutingReplay(moe_blocks, bank.to(device), rows)


def _profile_on(profile, device, block_size: int):
    """The strategy's acceptance profile on the rounds' device, checked against the drafter's block size."""
    if profile is None:
        return None
    if profile.block_size != block_size:
        raise ValueError(f"the acceptance profile {profile.name!r} has block size {profile.block_size}; the drafter "
                         f"drafts blocks of {block_size}. Use a profile recorded or made for this block size.")
    return profile.to(device)


# ---------------------------------------------------------------------------------------------- the decode loop
class HostEmitter:
    """Emits tokens on the host, one at a time as AR would: streamer, EOS, max_length and the remaining stopping
    criteria (stop strings, user criteria; called with CPU input_ids and scores=None)."""

    DEVICE_SIDE = ("MaxLengthCriteria", "EosTokenCriteria")

    def __init__(self, input_ids: torch.Tensor, generation_config, stopping_criteria, streamer):
        self.input_ids = input_ids  # [1, L] on the model's device: prompt + the prefill's token
        self.tokens: list[int] = []
        self.streamer = streamer
        self.max_length = generation_config.max_length
        self.eos = eos_ids(generation_config)
        self.criteria = [c for c in stopping_criteria if type(c).__name__ not in self.DEVICE_SIDE]
        self.host_ids = input_ids.cpu() if self.criteria else None
        self.finished = input_ids.shape[1] >= self.max_length

    @property
    def length(self) -> int:
        return self.input_ids.shape[1] + len(self.tokens)

    def emit(self, token: int) -> None:
        self.tokens.append(token)
        if self.streamer is not None:
            self.streamer.put(torch.tensor([token]))
        self.finished = token in self.eos or self.length >= self.max_length
        if self.criteria:
            self.host_ids = torch.cat([self.host_ids, torch.tensor([[token]])], dim=1)
            self.finished |= any(bool(c(self.host_ids, None).all()) for c in self.criteria)

    def sequences(self) -> torch.Tensor:
        new = torch.tensor([self.tokens], dtype=self.input_ids.dtype).to(self.input_ids.device)
        return torch.cat([self.input_ids, new], dim=1)


def resident_decode(rounds: ResidentRounds, emitter: HostEmitter, telemetry, predicted_latency) -> None:
    """Rounds until a criterion fires; the caller prefilled and `rounds.start(...)`-ed. Host time per round: one
    replay (two for a speculative round), one wait for the hand-off, and the emission of its tokens (context lookup
    runs in the draft graph: no host work of its own)."""
    draft_next = rounds.speculative and not (rounds.decides and rounds.opens_plain)
    plain_left = 0  # plain steps a deciding step ordered before the next draft (they run without selector work)
    predicted = []  # (w, context, drafted) of each round: its calibrated latency is looked up after the loop
    last = time.perf_counter()
    context_len = emitter.length - 1
    while not emitter.finished:
        rounds.waited_s = 0.0
        if draft_next:
            tokens, a, device_m, _, w, kept, n_new, draft_next = rounds.unpack(rounds.run_spec())
            a, device_m = a[0], device_m[0]
            committed = 0
            for token in tokens[0][: a + 1]:
                emitter.emit(token)
                committed += 1
                if emitter.finished:
                    break
            if not rounds.device_commit:
                rounds.run_commit(committed)
            elif committed != device_m:
                raise RuntimeError(f"HybridSpec: the device committed {device_m} tokens, the host emitted {committed}.")
            drafted = True
            copied = bool(rounds.lookup_used.numpy()[0]) if rounds.lookup is not None else None
        else:
            decide = rounds.decides and plain_left == 0
            tokens, _, _, _, _, _, _, plan = rounds.unpack(rounds.run_step(decide, last=plain_left == 1))
            plain_left = plan if decide else plain_left - 1
            draft_next = rounds.decides and plain_left <= 0
            a, w, kept, n_new = 0, 1, 0, 0  # m = 1
            emitter.emit(tokens[0][0])
            committed, drafted, copied = 1, False, None
        draft_next = bool(draft_next) and rounds.speculative
        now = time.perf_counter()
        corrected = drafted and rounds.strategy.corrects
        device_side = drafted and rounds.strategy.mode != "fixed"
        telemetry.rounds.append(RoundRecord(
            w, a, committed, committed, now - last, drafted,
            w0=w - kept if device_side else None,
            extra_kept=bool(kept) if corrected else None,
            n_new=n_new if corrected else None,
            host_s=now - last - rounds.waited_s,
            lookup=copied,
        ))
        predicted.append((w, context_len, drafted))
        context_len += committed
        last = now
    _fill_predictions(telemetry.rounds, predicted, predicted_latency)


def _fill_predictions(records: list, predicted: list, predicted_latency) -> None:
    """Each round's calibrated latency (telemetry), looked up once the rounds are done: in the loop the lookup
    (≈ 3 µs of host time) would sit between a hand-off and the next launch, where the GPU waits for the host."""
    for record, args in zip(records[len(records) - len(predicted):], predicted):
        record.predicted_s = predicted_latency(*args)


class RowsHost:
    """A batch's tokens on the host (batched resident rounds): the device decides each row's m and when it ends
    (EOS, max_length); the host emits the same tokens by the same rules and checks that it agrees.

    As transformers' batched generate(): the output runs to the length at which the last row stopped, rows that
    stopped earlier filled with pad_token_id."""

    def __init__(self, input_ids: torch.Tensor, first: list[int], generation_config, eos: set[int]):
        self.input_ids = input_ids  # [B, P] the left-padded prompts
        self.max_length = generation_config.max_length
        self.eos = eos
        self.pad_token_id = generation_config.pad_token_id
        if eos and self.pad_token_id is None:
            raise ValueError("`pad_token_id` must be set for a batch with an EOS token: finished rows are filled with "
                             "it (pass pad_token_id=..., e.g. the EOS id).")
        self.tokens: list[list[int]] = [[] for _ in first]
        self.live = [True] * len(first)
        for row, token in enumerate(first):
            self.emit(row, token)

    def length(self, row: int) -> int:
        return self.input_ids.shape[1] + len(self.tokens[row])

    def emit(self, row: int, token: int) -> None:
        self.tokens[row].append(token)
        self.live[row] = token not in self.eos and self.length(row) < self.max_length

    def sequences(self) -> torch.Tensor:
        """[B, L] prompts and tokens, L = the longest row; shorter rows (stopped at EOS) padded."""
        width = max(len(tokens) for tokens in self.tokens)
        rows = [tokens + [self.pad_token_id] * (width - len(tokens)) for tokens in self.tokens]
        new = torch.tensor(rows, dtype=self.input_ids.dtype).to(self.input_ids.device)
        return torch.cat([self.input_ids, new], dim=1)


def resident_decode_rows(rounds: ResidentRounds, host: RowsHost, telemetry, predicted_latency) -> None:
    """A batch's rounds until every row ended; the caller prefilled and `rounds.start(...)`-ed. One hand-off per
    round carries every row's tokens, accepted counts, m and whether it still runs."""
    draft_next = rounds.speculative and not (rounds.decides and rounds.opens_plain)
    plain_left = 0  # plain steps a deciding step ordered before the next draft
    predicted = []  # (w, context, drafted) of each round: its calibrated latency is looked up after the loop
    last = time.perf_counter()
    while any(host.live):
        rounds.waited_s = 0.0
        running = [row for row, live in enumerate(host.live) if live]
        context_len = max(host.length(row) - 1 for row in running)
        drafted = draft_next
        decide = not drafted and rounds.decides and plain_left == 0
        handoff = rounds.run_spec() if drafted else rounds.run_step(decide, last=plain_left == 1)
        tokens, a, device_m, device_live, w, _, _, draft_next = rounds.unpack(handoff)
        if not drafted:  # draft_next is the deciding step's count of plain steps to come (else nothing)
            plain_left = draft_next if decide else plain_left - 1
            draft_next = rounds.decides and plain_left <= 0
        emitted = 0
        for row in running:
            count = 0
            for token in tokens[row][: (a[row] + 1) if drafted else 1]:
                host.emit(row, token)
                count += 1
                if not host.live[row]:
                    break
            if count != device_m[row] or host.live[row] != bool(device_live[row]):
                raise RuntimeError(f"HybridSpec: batch row {row}: the device committed {device_m[row]} tokens "
                                   f"(running: {bool(device_live[row])}), the host emitted {count} (running: "
                                   f"{host.live[row]}).")
            emitted += count
        draft_next = bool(draft_next) and rounds.speculative
        now = time.perf_counter()
        w = w if drafted else 1
        telemetry.rounds.append(RoundRecord(
            w, sum(a[row] for row in running) if drafted else 0, emitted, emitted, now - last, drafted,
            w0=w if drafted and rounds.strategy.mode != "fixed" else None,
            host_s=now - last - rounds.waited_s, rows=len(running),
        ))
        predicted.append((w, context_len, drafted))
        last = now
    _fill_predictions(telemetry.rounds, predicted, predicted_latency)
