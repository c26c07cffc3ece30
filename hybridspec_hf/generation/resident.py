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
tests cover this path.

One `ResidentRounds` is built per (target, drafter, strategy settings, sampling, capacity) and reused by later
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
import time

import torch

from hybridspec_hf import patches
from hybridspec_hf.generation.acceptance import greedy_accept, sample_tokens, speculative_sample
from hybridspec_hf.generation.checks import ROW_WISE_PROCESSORS
from hybridspec_hf.generation.router_hooks import RoutingReplay, VerifyWindow
from hybridspec_hf.generation.telemetry import RoundRecord
from hybridspec_hf.graphs.capture import Replay, host_syncs
from hybridspec_hf.graphs.static_target import StaticTarget
from hybridspec_hf.kernels import gdn_triton
from hybridspec_hf.patches.experts import fused_experts_for

_CAPACITY_STEP = 512
MAX_ROUNDS_PER_TARGET = 3  # captured settings kept per target (graphs, static caches): see the module docstring
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


MAX_EOS_IDS = 8  # EOS ids a round can test on the device


def _same_settings(have: _Key, want: _Key) -> bool:
    return dataclasses.replace(have, capacity=want.capacity) == want


def _reusable(have: _Key, want: _Key) -> bool:
    """Cached rounds serve a call with the same settings whose length fits their static cache (up to 4× larger than
    needed: attention reads the whole capacity, masked, so a much larger one would cost every round)."""
    return _same_settings(have, want) and want.capacity <= have.capacity <= 4 * want.capacity


def resident_rounds(model, drafter, strategy, logits_processor, do_sample: bool, max_length: int,
                    position_rows: int, device_commit: bool, capture: bool = True) -> "ResidentRounds":
    """The target's `ResidentRounds` for these settings: a kept one when it fits, else a new one (kept sets of the
    same settings are released first, as are the least recently used ones beyond what the module docstring allows).
    capture=False: the same rounds launched eagerly on CUDA too (HybridSpecConfig(cuda_graphs="uncaptured"))."""
    block = drafter.config.block_size if drafter is not None else 1
    capacity = -(-(max_length + block) // _CAPACITY_STEP) * _CAPACITY_STEP
    key = _Key(id(drafter), strategy.identity(), do_sample, tuple(repr(p.__dict__) for p in logits_processor),
               capacity, position_rows, device_commit, capture)
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

    def __init__(self, model, drafter, strategy, logits_processor, do_sample: bool, capacity: int,
                 position_rows: int, device_commit: bool, key: _Key):
        self.key = key
        self.model, self.drafter, self.strategy = model, drafter, strategy
        self.logits_processor, self.do_sample = logits_processor, do_sample
        self.device = next(model.parameters()).device
        feature_ids = list(drafter.config.target_layer_ids) if drafter is not None and strategy.name != "ar" else []
        block = drafter.config.block_size if drafter is not None else 1
        self.target = StaticTarget(model, capacity, feature_ids, position_rows, strategy.kernel_backend,
                                   strategy.gdn_verifier, max_tokens=block)
        self.context = None
        if drafter is not None and strategy.name != "ar":
            from hybridspec_hf.drafter import StaticDraftContext

            self.context = StaticDraftContext(drafter, capacity, self.device, drafter.dtype)
        self.moe = moe = patches.moe_blocks(model)
        self.linears = patches.decoder_linears(model)
        self.attention = patches.attention_layers(model)
        self.routing = self.window = None  # hooks on the model: made last, right before capture
        self.block_size = drafter.config.block_size if self.context is not None else 1
        self.verify_tokens = strategy.fixed_length if strategy.mode == "fixed" else self.block_size
        long = dict(dtype=torch.long, device=self.device)
        self.last_token = torch.zeros(1, 1, **long)  # the anchor: last emitted token, not yet in the cache
        self.max_length = torch.zeros(1, **long)  # generate()'s max_length (prompt + new tokens)
        self.count = torch.zeros(1, **long)  # m: tokens of the last verification to commit
        # device_commit: EOS and max_length are the only stopping rules, so m is known on the device and the spec
        # graph commits it too (one graph per round); otherwise the host fills `count` and replays the commit graph
        self.device_commit = device_commit
        self.eos_ids = torch.full((MAX_EOS_IDS,), -1, **long)
        self.profile = _profile_on(strategy.profile, self.device, self.block_size)  # timing mode (or None)
        self.profile_row = torch.zeros(1, **long)
        self.one = torch.ones(1, **long)
        pinned = self.device.type == "cuda"
        # hand-off: [target tokens (T), a, w, kept, n_new, draft_next, m (device_commit)]
        self.handoff = torch.zeros(self.verify_tokens + 6, dtype=torch.long, pin_memory=pinned)
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
        self.verify_length = torch.zeros(1, dtype=torch.long, pin_memory=pinned)
        self.verified = self.verify_tokens  # tokens the last round verified (its commit graph, in "exact")
        self.step = self.spec = self.draft = None
        self.verifies: dict[int, Replay] = {}
        self.commits: dict[int, Replay] = {}
        try:
            # the fused paths' weight copies (MoE shared expert, GDN input projections): made here, outside capture
            # (a copy made inside would be a graph node replayed every round), refreshed in place by `start`, freed
            # by `close`
            self._prepare_weight_copies()
            self.routing = _routing_replay(strategy.routing, moe, model, self.device)  # before the window: it sets ids
            self.window = VerifyWindow(moe)
            replay = functools.partial(Replay, device=self.device, capture=key.capture)
            with torch.no_grad(), experts as self.fused_experts:
                self.step = replay(self._step)
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
        self.capture_s = time.perf_counter() - start

    def close(self, release_copies: bool = True) -> None:
        """Remove every hook this object put on the model and, with release_copies (no other kept set reads them),
        the model's weight copies (graphs and buffers go with the object)."""
        for hooks in (self.window, self.routing):
            if hooks is not None:
                hooks.remove()
        self.step = self.spec = self.draft = None
        self.verifies, self.commits = {}, {}
        if release_copies:
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

    def reset_selector(self) -> None:
        """A new generate() call: the selector's streams restart from its prior, in place (graphs hold them)."""
        selector = self.strategy.selector
        if selector is not None:
            restart = getattr(selector, "restart", None)
            restart(self.target.length) if restart is not None else selector.reset()

    # ------------------------------------------------------------------------------------------ captured functions
    def _scores(self, raw: torch.Tensor) -> torch.Tensor:
        """Row-wise logits processors on raw [T, V] fp32 logits (every row as AR would process it)."""
        if len(self.logits_processor) == 0:
            return raw
        prefix = self.last_token.expand(raw.shape[0], 1)  # row-wise processors ignore it
        return self.logits_processor(prefix, raw)

    @contextlib.contextmanager
    def _routing_armed(self):
        """Calibrated routing (timing mode) applies to the rounds' forwards only, never to the eager prefill."""
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

    def _write_handoff(self, values: torch.Tensor) -> None:
        self.handoff.copy_(values, non_blocking=True)

    def _step(self):
        """A plain decoding step: verify the anchor and commit it (m = 1 is known, so one graph does both).

        Our GDN path instead of transformers' decode path (on the H200 the stock one-token forward cost 13.7 ms in a
        graph against ≈ 11.8 ms with the block verify + one-launch commit, benchmarks/results/gpu_rounds_runs.md).
        With the fused kernels each GDN layer takes one recurrent step that updates its state and conv window in
        place (`decode_step`: S read and written once, no commit launch; `gdn_triton.DECODE_STEP`, measured in run 24
        of benchmarks/results/gpu_rounds_runs.md); otherwise the block verify + commit.
        """
        context_len = self.target.length.clone()
        session = self.target.session(decode_step=gdn_triton.DECODE_STEP)
        with self._routing_armed():
            logits, features = self.target.forward(self.last_token, verify=session)
        scores = self._scores(logits[0].float())  # [1, V]
        token = sample_tokens(scores.softmax(-1)) if self.do_sample else scores.argmax(-1)  # [1]
        if self.context is not None:
            with patches.fused_kernels():  # the drafter's K/V of the new features: its k-norm and RoPE fused
                self.context.append(features, 1)
        self.target.commit(session, self.one)
        self.last_token.copy_(token.view(1, 1))
        draft_next = self._flag(self.strategy.should_draft(context_len)) if self.speculative else \
            torch.zeros(1, dtype=torch.long, device=self.device)
        if self.strategy.selector is not None:
            self.strategy.selector.observe(self.one, self.one, None, False)
        zeros = torch.zeros(self.verify_tokens - 1, dtype=torch.long, device=self.device)
        nothing = torch.zeros_like(self.one)
        self._write_handoff(torch.cat([token.view(1), zeros, nothing, self.one, nothing, nothing, draft_next,
                                       self.one]))

    def _spec(self):
        """A whole speculative round over the block's shape (modes "fixed" and "max"): draft, then verify."""
        self._draft()
        self._verify(self.verify_tokens)

    def _draft(self):
        """Draft, choose w0 (and arm the routing correction): what the round verifies."""
        t = self.verify_tokens
        self.round_context_len = self.target.length.clone()
        with patches.fused_kernels():  # the drafter's RMSNorms and RoPE take our kernels too
            draft_logits = self.drafter.draft_static(self.last_token, self.context)  # [1, B-1, V]
        drafts = draft_logits.argmax(-1)
        self.block = torch.cat([self.last_token, drafts[:, : t - 1]], dim=1)  # [1, T]
        room = self.max_length - (self.target.length + 1)  # tokens generate() still allows
        w_max = room.clamp(min=1, max=t)
        self.choice, signals, self.replayed = None, None, None
        if self.profile is not None:  # timing mode: the next profile row's signals and accepted count
            row = self.profile_row % self.profile.accepted.shape[0]
            signals = {k: getattr(self.profile, k).index_select(0, row) for k in ("top1", "margin", "entropy")}
            self.replayed = self.profile.accepted.index_select(0, row)  # [1] a with the whole block verified
            if self.routing is not None:
                self.routing.row.copy_(self.profile_row)
            self.profile_row.add_(1)
        if self.strategy.mode != "fixed":
            with patches.fused_kernels():  # the draft signals in one launch
                self.choice = self.strategy.choose(draft_logits, self.round_context_len, w_max, signals)
            self.round_valid = self.choice.valid  # the extra token included until the correction drops it
        else:
            self.round_valid = w_max
        if self.exact:  # the host reads how many tokens stage 0 verifies (w0, + 1 for the extra token)
            self.verify_length.copy_(self.round_valid, non_blocking=True)

    def _verify(self, n: int):
        """Verify the block's first n tokens (n = T in modes "fixed"/"max"; n = w0 (+1) in "exact"), accept,
        commit when m is known on the device, hand off."""
        t, choice, valid = self.verify_tokens, self.choice, self.round_valid
        tokens = self.block[:, :n]
        session, logits, features = self._verify_forward(tokens, valid, choice)
        scores = self._scores(logits[0].float())  # [n, V]
        if self.do_sample:
            accepted, sampled = speculative_sample(tokens[:, 1:], scores.softmax(-1)[None], valid)
            target_tokens = torch.cat([tokens[:, 1:], sampled[:, None]], dim=1)
            target_tokens = target_tokens.scatter(1, accepted.view(-1, 1), sampled.view(-1, 1))
        else:
            target_tokens = scores.argmax(-1)[None]  # [1, n]
            accepted = greedy_accept(tokens[:, 1:], target_tokens, valid)
        if self.replayed is not None:
            accepted = torch.minimum(self.replayed, valid.view(-1) - 1)
        if n < t:  # the hand-off keeps the block's layout
            target_tokens = torch.cat([target_tokens, target_tokens.new_zeros(1, t - n)], dim=1)
        self.strategy.observe_acceptance(choice, accepted)
        draft_next = self._flag(self.strategy.should_draft(self.round_context_len))
        keep = choice.keep.long() if choice is not None else torch.zeros_like(self.one)
        n_new = choice.n_new if choice is not None else torch.zeros_like(self.one)
        self.pending, self.features, self.valid, self.target_tokens = session, features, valid, target_tokens
        if self.device_commit:  # m = a + 1, cut after the first EOS among the emitted tokens
            positions = torch.arange(t, device=self.device)
            emitted = positions <= accepted.view(1)
            eos = (target_tokens.view(-1, 1) == self.eos_ids.view(1, -1)).any(-1) & emitted  # [T]
            first_eos = torch.where(eos, positions, t).min()
            self.count.copy_(torch.minimum(accepted.view(1) + 1, first_eos.view(1) + 1))
            self._commit()
        self._write_handoff(torch.cat([target_tokens.view(-1), accepted.view(1), valid.view(1), keep.view(1),
                                       n_new.view(1), draft_next, self.count]))

    def _verify_forward(self, tokens: torch.Tensor, valid: torch.Tensor, choice):
        """The round's target forward: tokens [1, n] verified after the committed ones (GDN states not written),
        `valid` [1] long of them counting, the routing window armed with the round's `Choice` (or None).
        Returns the verify session (what a commit reads), logits [1, n, V] and features [1, n, F]."""
        if choice is not None:
            self.window.arm(choice)
        session = self.target.session(valid)
        try:
            with self._routing_armed():
                logits, features = self.target.forward(tokens, verify=session)
        finally:
            self.window.disarm()
        return session, logits, features

    def _commit(self):
        """Keep m = self.count tokens of the last verification."""
        self.target.commit(self.pending, self.count)
        with patches.fused_kernels():
            self.context.append(self.features, self.count)
        self.last_token.copy_(self.target_tokens.gather(1, (self.count - 1).clamp(min=0).view(1, 1)))
        if self.strategy.selector is not None:
            self.strategy.selector.observe(self.valid.view(1), self.count, None, True)

    # ------------------------------------------------------------------------------------------ host side
    def restart_profile(self) -> None:
        if self.profile is not None:
            self.profile_row.zero_()

    def start(self, cache, last_position: torch.Tensor, prompt_features: torch.Tensor, first_token: torch.Tensor,
              max_length: int, eos_ids: set[int]) -> None:
        """Load a prefilled call into the static buffers (eager, once per generate() call)."""
        self._prepare_weight_copies()  # weights changed in place since capture: the copies follow
        if self.device_commit:
            ids = sorted(eos_ids)[:MAX_EOS_IDS]
            self.eos_ids.fill_(-1)
            self.eos_ids[: len(ids)].copy_(torch.tensor(ids, dtype=torch.long))
        self.target.load(cache, last_position)
        if self.context is not None:
            self.context.reset()
            self.context.append(prompt_features, prompt_features.shape[1])
        self.last_token.copy_(first_token.view(1, 1))
        self.max_length.fill_(max_length)
        self.reset_selector()
        self.restart_profile()

    def run_step(self) -> list[int]:
        self.step()
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


def _routing_replay(profile, moe_blocks, model, device) -> RoutingReplay | None:
    """Timing mode's calibrated routing: a bank of expert ids sampled from the profile for this model's MoE layers."""
    if profile is None or not moe_blocks:
        return None
    config = model.config.get_text_config()
    bank = profile.bank(len(moe_blocks), config.num_experts, config.num_experts_per_tok)
    return RoutingReplay(moe_blocks, bank.to(device))


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

    _DEVICE_SIDE = ("MaxLengthCriteria", "EosTokenCriteria")

    def __init__(self, input_ids: torch.Tensor, generation_config, stopping_criteria, streamer):
        self.input_ids = input_ids  # [1, L] on the model's device: prompt + the prefill's token
        self.tokens: list[int] = []
        self.streamer = streamer
        self.max_length = generation_config.max_length
        eos = getattr(generation_config, "_eos_token_tensor", None)
        eos = generation_config.eos_token_id if eos is None else eos.reshape(-1).tolist()
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.criteria = [c for c in stopping_criteria if type(c).__name__ not in self._DEVICE_SIDE]
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
    replay (two for a speculative round), one wait for the hand-off, and the emission of its tokens."""
    t = rounds.verify_tokens
    draft_next = rounds.speculative
    last = time.perf_counter()
    context_len = emitter.length - 1
    while not emitter.finished:
        rounds.waited_s = 0.0
        if draft_next:
            handoff = rounds.run_spec()
            a, w, kept, n_new, draft_next, device_m = handoff[t : t + 6]
            committed = 0
            for token in handoff[: a + 1]:
                emitter.emit(token)
                committed += 1
                if emitter.finished:
                    break
            if not rounds.device_commit:
                rounds.run_commit(committed)
            elif committed != device_m:
                raise RuntimeError(f"HybridSpec: the device committed {device_m} tokens, the host emitted {committed}.")
            drafted = True
        else:
            handoff = rounds.run_step()
            a, w, kept, n_new, draft_next = 0, 1, 0, 0, handoff[t + 4]  # m = 1
            emitter.emit(handoff[0])
            committed, drafted = 1, False
        draft_next = bool(draft_next) and rounds.speculative
        now = time.perf_counter()
        corrected = drafted and rounds.strategy.corrects
        device_side = drafted and rounds.strategy.mode != "fixed"
        telemetry.rounds.append(RoundRecord(
            w, a, committed, committed, now - last, drafted,
            w0=w - kept if device_side else None,
            extra_kept=bool(kept) if corrected else None,
            n_new=n_new if corrected else None,
            predicted_s=predicted_latency(w, context_len, drafted),
            host_s=now - last - rounds.waited_s,
        ))
        context_len += committed
        last = now
