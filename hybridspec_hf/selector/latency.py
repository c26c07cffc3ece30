"""Latency model of a round: C(w) by context bucket, C_ar, the MoE expert-count model, η and the sunk stage-0 cost s(w).

Units: seconds. w = tokens the target processes in a round (1 anchor + drafts verified), 1 <= w <= B.

- C(w) [n_buckets, B]: a whole round verifying w tokens (drafting, both stages, acceptance, commit, the per-round
  sync), measured at a few context lengths; a context length maps to the nearest measured one in log space.
- C_ar [n_buckets]: one plain AR step (no drafting), the "don't speculate" option.
- s(w) [n_buckets, B-1]: the part of C(w+1) - C(w) paid in stage 0 (embedding, first mixer, first router), which is
  sunk once stage 0 ran on w+1 tokens.
- Expert model (MoE targets): distinct experts touched by w tokens per MoE layer and in total, and
  n̄_all(w | n_new) = expected extra distinct experts over ALL MoE layers (the first included) brought by token w+1
  when it brings n_new new experts in the first MoE layer; n̄_all(w) the same without the observation.
- η: seconds per extra distinct expert (all layers); the routing correction adds η·(n̄_all(w|n_new) - n̄_all(w)).
- Batches (optional): C_N(w) and C_ar,N of rounds over N rows (every row verifies w tokens: the dense GEMMs, the
  union of the experts the N·w tokens route to, N GDN states and attention contexts), for a few N. `for_batch(N)`
  gives the model a batch of N prompts chooses its shared w with: the tables of the smallest measured N' ≥ N (the
  batch bucket resident rounds run it in), or the largest measured; without batch tables, the batch-1 C.

Cache: `LatencyModel.save(path)` writes JSON with a cache key (model config hash, dtype, device name, library
versions: `make_cache_key`). `LatencyModel.load(path, expected_key)` returns None, with a warning naming what
differs, when the file is missing, unreadable, of another format or calibrated for another key: a stale calibration
is never used silently, and the caller recalibrates with `LatencyModel.load(p, key) or calibrate(...)`.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import statistics
import threading
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

_FORMAT = "hybridspec.latency/1"


@dataclasses.dataclass
class ExpertModel:
    """Distinct-expert statistics of a MoE target, fitted from routing observations (see fit_expert_model).

    W = the longest observed round; tables cover w = 1..W (curves) and w = 1..W-1 (extra token w+1).
    """

    num_experts: int
    top_k: int
    num_layers: int  # MoE layers
    distinct_per_layer: torch.Tensor  # [W] fp32 mean distinct experts in one MoE layer for w tokens
    distinct_total: torch.Tensor  # [W] fp32 summed over MoE layers
    extra_uncond: torch.Tensor  # [W-1] fp32 n̄_all(w)
    extra_given_new: torch.Tensor  # [W-1, top_k+1] fp32 n̄_all(w | n_new), shrunk toward n̄_all(w)
    counts: torch.Tensor  # [W-1, top_k+1] fp32 observations per (w, n_new) cell

    def extra_delta(self, w0: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
        """n̄_all(w0 | n_new) - n̄_all(w0) -> [batch] fp32. w0 past the table uses its last row. Pure torch."""
        row = (w0.long() - 1).clamp(0, self.extra_uncond.shape[0] - 1)  # [batch]
        col = n_new.long().clamp(0, self.top_k)
        return self.extra_given_new[row, col] - self.extra_uncond[row]

    def to(self, device) -> "ExpertModel":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclasses.dataclass
class LatencyModel:
    """Calibrated round latencies (seconds) by context bucket; see the module docstring for every field."""

    cost: torch.Tensor  # [n_buckets, B] fp32, C(w) for w = 1..B
    cost_ar: torch.Tensor  # [n_buckets] fp32
    context_lens: torch.Tensor  # [n_buckets] long, ascending: where each bucket was measured (kept on the CPU)
    sunk: torch.Tensor | None = None  # [n_buckets, B-1] fp32 s(w); None -> zeros
    eta: float = 0.0  # seconds per extra distinct expert
    experts: ExpertModel | None = None
    key: dict = dataclasses.field(default_factory=dict)
    batch_sizes: torch.Tensor | None = None  # [n_batch] long ascending, the first 1: batches with their own tables
    batch_cost: torch.Tensor | None = None  # [n_batch, n_buckets, B] fp32 C_N(w) (row 0 = cost)
    batch_cost_ar: torch.Tensor | None = None  # [n_batch, n_buckets] fp32 C_ar,N (row 0 = cost_ar)

    def __post_init__(self):
        if self.cost.dim() != 2 or self.cost_ar.shape != self.cost.shape[:1] or self.context_lens.shape != self.cost_ar.shape:
            raise ValueError(f"LatencyModel wants cost [n_buckets, B], cost_ar and context_lens [n_buckets]; got "
                             f"{tuple(self.cost.shape)}, {tuple(self.cost_ar.shape)}, {tuple(self.context_lens.shape)}.")
        if self.batch_sizes is not None:
            sizes = self.batch_sizes.cpu().long()
            n = sizes.numel()
            if (self.batch_cost is None or self.batch_cost.shape != (n, *self.cost.shape) or self.batch_cost_ar is None
                    or self.batch_cost_ar.shape != (n, *self.cost_ar.shape) or int(sizes[0]) != 1
                    or not bool((sizes.diff() > 0).all())):
                raise ValueError("LatencyModel batch tables want batch_sizes [n_batch] ascending from 1, batch_cost "
                                 f"[n_batch, n_buckets, B] and batch_cost_ar [n_batch, n_buckets]; got {sizes.tolist()}, "
                                 f"{None if self.batch_cost is None else tuple(self.batch_cost.shape)}, "
                                 f"{None if self.batch_cost_ar is None else tuple(self.batch_cost_ar.shape)}.")
            self.batch_sizes = sizes
        if self.sunk is None:
            self.sunk = torch.zeros(self.cost.shape[0], self.cost.shape[1] - 1, device=self.cost.device)
        self.context_lens = self.context_lens.cpu()
        lens = self.context_lens.double().clamp(min=1.0)
        self._edges_host = (lens[1:] * lens[:-1]).sqrt().tolist()  # [n_buckets-1] geometric midpoints
        self._edges = torch.tensor(self._edges_host, dtype=torch.float32, device=self.cost.device)

    @property
    def block_size(self) -> int:
        return self.cost.shape[1]

    @property
    def prices_experts(self) -> bool:
        """Whether the model charges for distinct experts: an expert model with η ≠ 0 (the η term of ΔL)."""
        return self.experts is not None and self.eta != 0.0

    @property
    def prices_routing(self) -> bool:
        """Whether the routing correction's ΔL differs from the length choice's marginal cost under this model: an
        expert term or a sunk stage-0 cost (else the correction never keeps a token: strategy.correction_can_act)."""
        return self.prices_experts or bool((self.sunk != 0).any())

    def for_batch(self, batch: int) -> "LatencyModel":
        """The model a batch of `batch` rows chooses with (see the module docstring): this one for 1 row or without
        batch tables, else one whose cost and cost_ar are the tables of the smallest measured batch ≥ `batch` (the
        largest measured, past them)."""
        if self.batch_sizes is None or batch <= 1:
            return self
        sizes = self.batch_sizes.tolist()
        index = next((i for i, n in enumerate(sizes) if n >= batch), len(sizes) - 1)
        return dataclasses.replace(self, cost=self.batch_cost[index].clone(),
                                   cost_ar=self.batch_cost_ar[index].clone(), batch_sizes=None, batch_cost=None,
                                   batch_cost_ar=None, key={**self.key, "batch": sizes[index]})

    @classmethod
    def with_batches(cls, models: Mapping[int, "LatencyModel"]) -> "LatencyModel":
        """One model from calibrations at several batch sizes {N: model} (N = 1 required: its fields are kept, the
        others give C_N and C_ar,N; all measured at the same contexts and block size)."""
        if 1 not in models:
            raise ValueError(f"with_batches needs the batch-1 calibration; got batch sizes {sorted(models)}.")
        sizes = sorted(models)
        base = models[1]
        for n in sizes:
            if models[n].cost.shape != base.cost.shape or not torch.equal(models[n].context_lens, base.context_lens):
                raise ValueError(f"the batch-{n} calibration has cost {tuple(models[n].cost.shape)} at contexts "
                                 f"{models[n].context_lens.tolist()}; batch 1 has {tuple(base.cost.shape)} at "
                                 f"{base.context_lens.tolist()}: calibrate them with the same settings.")
        return dataclasses.replace(
            base, batch_sizes=torch.tensor(sizes),
            batch_cost=torch.stack([models[n].cost.to(base.cost.device) for n in sizes]),
            batch_cost_ar=torch.stack([models[n].cost_ar.to(base.cost.device) for n in sizes]))

    def _rows(self, context_len) -> slice | torch.Tensor:
        """Table rows for context lengths: a slice for an int (a view: no kernel), a [batch] long tensor for a
        tensor (bucketize on its device). Nearest measured length in log space."""
        if isinstance(context_len, torch.Tensor):
            if not self._edges_host:  # one measured context: row 0 (a bucketize over no edges fails Triton's passes
                return torch.zeros_like(context_len.reshape(-1), dtype=torch.long)  # when compiled, H200 run 83)
            return torch.bucketize(context_len.reshape(-1).float(), self._edges)
        k = bisect.bisect_left(self._edges_host, context_len)  # = torch.bucketize(right=False)
        return slice(k, k + 1)

    def bucket(self, context_len) -> torch.Tensor:
        """Bucket index [batch] long of context lengths (int or [batch] tensor on the model's device)."""
        rows = self._rows(context_len)
        return torch.tensor([rows.start]) if isinstance(rows, slice) else rows

    def cost_for(self, context_len) -> torch.Tensor:
        """C(w), w = 1..B, for each row's context -> [batch or 1, B] fp32."""
        return self.cost[self._rows(context_len)]

    def cost_ar_for(self, context_len) -> torch.Tensor:
        """C_ar for each row's context -> [batch or 1] fp32."""
        return self.cost_ar[self._rows(context_len)]

    def sunk_for(self, context_len) -> torch.Tensor:
        """s(w), w = 1..B-1, for each row's context -> [batch or 1, B-1] fp32."""
        return self.sunk[self._rows(context_len)]

    def digest(self) -> str:
        """A content hash (two loads of one calibration are equal). Kept with the tensors' versions it was taken at
        (every call's set-up asks for it twice; ≈ 0.1 ms each on a CPU): an in-place change of a table, or a field
        set to another value, is a new content."""
        state = _content_state(self)
        cached = self.__dict__.get("_digest")
        if cached is not None and cached[0] == state:
            return cached[1]
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.__dict__["_digest"] = (state, digest)
        return digest

    def to(self, device) -> "LatencyModel":
        """A copy on device (the key, η and context_lens stay host values)."""
        return dataclasses.replace(self, cost=self.cost.to(device), cost_ar=self.cost_ar.to(device),
                                   sunk=self.sunk.to(device),
                                   experts=None if self.experts is None else self.experts.to(device),
                                   batch_cost=None if self.batch_cost is None else self.batch_cost.to(device),
                                   batch_cost_ar=None if self.batch_cost_ar is None else self.batch_cost_ar.to(device))

    def to_dict(self) -> dict:
        data = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "experts"}
        data["experts"] = None if self.experts is None else {
            f.name: _jsonable(getattr(self.experts, f.name)) for f in dataclasses.fields(self.experts)}
        return {"format": _FORMAT, **data}

    @classmethod
    def from_dict(cls, data: Mapping) -> "LatencyModel":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a latency-model dict: format {data.get('format')!r}, expected {_FORMAT!r}.")
        experts = data.get("experts")
        if experts is not None:
            experts = ExpertModel(**{k: _tensor_or_value(k, v, ExpertModel) for k, v in experts.items()})
        fields = {k: _tensor_or_value(k, v, cls) for k, v in data.items() if k not in ("format", "experts")}
        return cls(**fields, experts=experts)

    def save(self, path: str | Path, replace: bool = True) -> bool:
        """Writes the model to path atomically (a reader sees the old file or the new one, never half of one).
        replace=False: only when no file is there yet (another process's finished calibration stays); returns
        whether this model was written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        scratch.write_text(json.dumps(self.to_dict(), indent=1))
        try:
            if replace:
                os.replace(scratch, path)
                return True
            try:
                os.link(scratch, path)  # fails when the file exists: the first writer wins
            except FileExistsError:
                return False
            except OSError:  # a file system without hard links: the same check, not atomic
                if path.exists():
                    return False
                os.replace(scratch, path)
            return True
        finally:
            scratch.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path, expected_key: Mapping | None = None) -> "LatencyModel | None":
        """The cached model at path, or None (with a warning saying why) when missing, unreadable or stale.

        expected_key: the key the caller would calibrate with now (make_cache_key); None skips the check.
        """
        path = Path(path)
        if not path.exists():
            return None
        try:
            model = cls.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as err:
            warnings.warn(f"ignoring latency calibration {path}: unreadable ({err}); recalibrate.", stacklevel=2)
            return None
        if expected_key is not None and dict(model.key) != dict(expected_key):
            diff = {k: (model.key.get(k), expected_key.get(k)) for k in set(model.key) | set(expected_key)
                    if model.key.get(k) != expected_key.get(k)}
            warnings.warn(f"ignoring stale latency calibration {path}: key differs (cached, now) {diff}; "
                          "recalibrate.", stacklevel=2)
            return None
        return model


def make_cache_key(model_config: Mapping | str, dtype, device_name: str,
                   versions: Mapping[str, str] | None = None) -> dict:
    """Cache key of a calibration: sha256 of the model config (dict -> canonical JSON), dtype, device name and
    library versions (torch is always included; add transformers, triton... from the caller)."""
    text = model_config if isinstance(model_config, str) else json.dumps(model_config, sort_keys=True, default=str)
    return {"config_sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "dtype": str(dtype),
            "device": str(device_name), "versions": {"torch": torch.__version__, **(versions or {})}}


def fit_cost_curve(ws: Sequence[int], latencies: Sequence[float], block_size: int | None = None) -> torch.Tensor:
    """Monotone C(w) for w = 1..block_size from repeated (w, latency) measurements -> [block_size] fp32.

    Median per w (robust to stragglers), then weighted isotonic regression (pool-adjacent-violators) so C is
    non-decreasing, then linear interpolation at unmeasured w (flat before the first measured w, the last slope
    after the last one). block_size defaults to max(ws).
    """
    if len(ws) != len(latencies) or not ws:
        raise ValueError(f"fit_cost_curve needs one latency per w, got {len(ws)} ws and {len(latencies)} latencies.")
    groups = defaultdict(list)
    for w, t in zip(ws, latencies):
        groups[int(w)].append(float(t))
    xs = sorted(groups)
    ys = _isotonic([statistics.median(groups[w]) for w in xs], [len(groups[w]) for w in xs])
    block_size = block_size or xs[-1]
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else 0.0
    curve = []
    for w in range(1, block_size + 1):
        curve.append(ys[-1] + slope * (w - xs[-1]) if w > xs[-1] else _interp(w, xs, ys))
    return torch.tensor(curve, dtype=torch.float32)


def _isotonic(ys: list[float], weights: list[float]) -> list[float]:
    """Weighted pool-adjacent-violators: the non-decreasing sequence closest to ys in weighted least squares."""
    blocks = []  # [mean, weight, length]
    for y, wt in zip(ys, weights):
        blocks.append([y, wt, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(n)]


def _interp(w: int, xs: list[int], ys: list[float]) -> float:
    if w <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= w <= x1:
            return y0 + (y1 - y0) * (w - x0) / (x1 - x0)
    return ys[-1]


def distinct_expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Distinct experts used by the first t tokens, per layer: [layers, w, top_k] long -> [layers, w] long."""
    layers, w, _ = topk_ids.shape
    used = torch.zeros(layers, w, num_experts, dtype=torch.long, device=topk_ids.device)
    used.scatter_(2, topk_ids.long(), 1)
    return (used.cumsum(1) > 0).sum(-1)


def fit_expert_model(observations: Iterable[torch.Tensor], num_experts: int | None = None,
                     prior_strength: float = 5.0) -> ExpertModel:
    """Distinct-expert curves and the conditional table n̄_all(w | n_new) from routing observations.

    observations: per round, the expert ids chosen by each of its w tokens in each MoE layer, [layers, w, top_k]
    long, first MoE layer first (w may differ between rounds; every prefix of a round counts as a shorter round).
    num_experts: experts per layer (default: max id + 1). Cells (w, n_new) with few observations are shrunk toward
    n̄_all(w) with `prior_strength` pseudo-observations, so a rare n_new never swings the correction.
    """
    observations = [obs.long().cpu() for obs in observations]
    if not observations or any(o.dim() != 3 for o in observations):
        raise ValueError("fit_expert_model wants a non-empty list of [layers, w, top_k] expert-id tensors.")
    layers, _, top_k = observations[0].shape
    num_experts = num_experts or int(max(o.max() for o in observations)) + 1
    W = max(o.shape[1] for o in observations)
    curve_sum, curve_n = torch.zeros(W, dtype=torch.float64), torch.zeros(W, dtype=torch.float64)
    cell_sum = torch.zeros(W - 1, top_k + 1, dtype=torch.float64)
    cell_n = torch.zeros_like(cell_sum)
    for obs in observations:
        distinct = distinct_expert_counts(obs, num_experts).double()  # [layers, w]
        w = obs.shape[1]
        curve_sum[:w] += distinct.mean(0)
        curve_n[:w] += 1
        added = distinct[:, 1:] - distinct[:, :-1]  # [layers, w-1]: what token t+1 adds to the first t
        rows = torch.arange(w - 1)
        cell_sum.index_put_((rows, added[0].long()), added.sum(0), accumulate=True)
        cell_n.index_put_((rows, added[0].long()), torch.ones(w - 1, dtype=torch.float64), accumulate=True)
    per_layer = curve_sum / curve_n.clamp(min=1)
    uncond = cell_sum.sum(1) / cell_n.sum(1).clamp(min=1)  # [W-1]
    shrunk = (cell_sum + prior_strength * uncond[:, None]) / (cell_n + prior_strength).clamp(min=1e-12)
    given = torch.where(cell_n + prior_strength > 0, shrunk, uncond[:, None])  # empty cell: no information
    return ExpertModel(num_experts=num_experts, top_k=top_k, num_layers=layers,
                       distinct_per_layer=per_layer.float(), distinct_total=(per_layer * layers).float(),
                       extra_uncond=uncond.float(), extra_given_new=given.float(), counts=cell_n.float())


def fit_eta(latencies: Sequence[float], distinct_expert_totals: Sequence[float],
            ws: Sequence[int] | None = None) -> float:
    """η (seconds per extra distinct expert) by least squares, clamped >= 0.

    latency ≈ a_w + η·distinct_total. With ws (the w of each measurement) every w gets its own intercept a_w, so η
    is estimated from the variation of distinct experts AT a fixed w (e.g. rounds with different routing) and does
    not absorb the per-token cost; without ws a single intercept is used.
    """
    y = torch.tensor(latencies, dtype=torch.float64)
    n = torch.tensor(distinct_expert_totals, dtype=torch.float64)
    if ws is None:
        design = torch.stack([torch.ones_like(n), n], 1)
    else:
        levels = torch.tensor(ws).unique(return_inverse=True)[1]
        design = torch.cat([torch.nn.functional.one_hot(levels).double(), n[:, None]], 1)
    if y.shape != n.shape or y.numel() < design.shape[1]:
        raise ValueError(f"fit_eta needs matching latencies and distinct counts and at least {design.shape[1]} "
                         f"measurements; got {y.numel()} latencies, {n.numel()} counts.")
    solution = torch.linalg.lstsq(design, y[:, None]).solution
    return max(float(solution[-1, 0]), 0.0)


def calibrate(measure_round: Callable[[int, int], float], ws: Sequence[int], context_buckets: Sequence[int],
              repeats: int = 5, progress: bool = True, warmup: int = 1, measure_ar: bool = True,
              measure_stage0: Callable[[int, int], float] | None = None, key: Mapping | None = None) -> LatencyModel:
    """Build a LatencyModel by timing rounds with a user-supplied function.

    measure_round(w, context_len) -> seconds of one whole round verifying w tokens at that context length;
    w = 0 asks for one plain AR step (no drafting), measured when measure_ar (else C_ar = C(1)).
    ws: the w to measure (block size B = max(ws); unmeasured w are interpolated); context_buckets: the context
    lengths to measure at. Repeats are interleaved over (w, context) so slow drift hits every w alike; the first
    `warmup` calls per shape are discarded. measure_stage0(w, context_len) -> seconds of stage 0 on w tokens, if
    given, yields s(w) = stage0(w+1) - stage0(w) clipped to [0, C(w+1) - C(w)]. The expert model and η are fitted
    separately (fit_expert_model, fit_eta) and set with dataclasses.replace.
    """
    from tqdm.auto import tqdm

    block_size, contexts = max(ws), sorted(int(c) for c in context_buckets)
    shapes = [(w, c) for c in contexts for w in ([0] if measure_ar else []) + sorted(set(ws))]
    runners = [("round", measure_round)] + ([("stage0", measure_stage0)] if measure_stage0 else [])
    jobs = [(name, fn, w, c) for name, fn in runners for w, c in shapes if not (name == "stage0" and w == 0)]
    times = defaultdict(list)
    with tqdm(total=len(jobs) * (repeats + warmup), desc="calibrating latency", disable=not progress) as bar:
        for rep in range(warmup + repeats):
            for name, fn, w, c in jobs:
                t = float(fn(w, c))
                if rep >= warmup:
                    times[name, w, c].append(t)
                bar.update()
    cost, cost_ar, sunk = [], [], []
    for c in contexts:
        curve = _curve(times, "round", ws, c, block_size)
        cost.append(curve)
        cost_ar.append(statistics.median(times["round", 0, c]) if measure_ar else float(curve[0]))
        step = curve.diff()  # [B-1] C(w+1) - C(w)
        if measure_stage0 is None:
            sunk.append(torch.zeros_like(step))
        else:
            sunk.append(torch.minimum(_curve(times, "stage0", ws, c, block_size).diff().clamp(min=0), step))
    return LatencyModel(cost=torch.stack(cost), cost_ar=torch.tensor(cost_ar, dtype=torch.float32),
                        context_lens=torch.tensor(contexts), sunk=torch.stack(sunk), key=dict(key or {}))


def _curve(times, name: str, ws: Sequence[int], context: int, block_size: int) -> torch.Tensor:
    xs = [w for w in sorted(set(ws)) for _ in times[name, w, context]]
    ys = [t for w in sorted(set(ws)) for t in times[name, w, context]]
    return fit_cost_curve(xs, ys, block_size)


def _content_state(value):
    """What a cached digest was taken from: each tensor by identity and in-place version (nested dataclasses'
    too), any other field by its repr; the cache itself left out."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple((name, _content_state(v)) for name, v in vars(value).items() if name != "_digest")
    return repr(value)


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "data": value.cpu().tolist()}
    return value


def _tensor_or_value(name: str, value, cls):
    if isinstance(value, dict) and set(value) == {"dtype", "data"}:
        return torch.tensor(value["data"], dtype=getattr(torch, value["dtype"]))
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise KeyError(f"unknown field {name!r} in a {cls.__name__} dict.")
    return value
