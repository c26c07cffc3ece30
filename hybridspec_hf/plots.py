"""Matplotlib helpers for HybridSpec telemetry, latency calibration and acceptance calibration.

Each function draws on a given Axes (or a new figure) and returns the Axes; matplotlib is imported lazily
(`pip install hybridspec-hf[notebooks]`).
"""
from __future__ import annotations

import torch


def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(5, 3.2))[1]


def chosen_length_histogram(telemetry, ax=None):
    """How often each w was verified (and, for the routing correction, how often the extra token was kept)."""
    ax = _axes(ax)
    ws = [r.w for r in telemetry.rounds if r.drafted]
    if ws:
        ax.hist(ws, bins=range(1, telemetry.block_size + 2), align="left", rwidth=0.85, label="w verified")
    kept = [r.w for r in telemetry.rounds if r.extra_kept]
    if kept:
        ax.hist(kept, bins=range(1, telemetry.block_size + 2), align="left", rwidth=0.45, label="extra token kept")
    ax.set(xlabel="w (tokens verified)", ylabel="rounds", title=f"{telemetry.strategy}: chosen lengths")
    ax.legend()
    return ax


def acceptance_vs_length(telemetry, ax=None):
    """Mean tokens emitted per round as a function of the verified length w."""
    ax = _axes(ax)
    by_w: dict[int, list[int]] = {}
    for r in telemetry.rounds:
        by_w.setdefault(r.w, []).append(r.emitted)
    ws = sorted(by_w)
    ax.plot(ws, [sum(by_w[w]) / len(by_w[w]) for w in ws], "o-", label="mean τ")
    ax.plot(ws, ws, ":", color="gray", label="τ = w (all accepted)")
    ax.set(xlabel="w (tokens verified)", ylabel="tokens emitted per round", title="acceptance vs length")
    ax.legend()
    return ax


def latency_curves(latency_model, ax=None, paper_ratio: float | None = 1.71):
    """C(w) per context bucket, in ms, with C(16)/C(4) next to the paper's ratio."""
    ax = _axes(ax)
    ws = torch.arange(1, latency_model.block_size + 1)
    for row, context in enumerate(latency_model.context_lens.tolist()):
        cost = latency_model.cost[row].cpu() * 1e3
        label = f"context {context}"
        if latency_model.block_size >= 16:
            label += f" (C(16)/C(4) = {float(cost[15] / cost[3]):.2f}; paper {paper_ratio})"
        ax.plot(ws, cost, "o-", ms=3, label=label)
        ax.axhline(float(latency_model.cost_ar[row]) * 1e3, ls=":", color="gray")
    ax.set(xlabel="w (tokens verified)", ylabel="round latency C(w) [ms]", title="calibrated round latency")
    ax.legend(fontsize=7)
    return ax


def reliability(predicted: torch.Tensor, outcome: torch.Tensor, bins: int = 10, ax=None, label: str = "survival"):
    """Calibration: observed frequency against predicted probability, in equal-width bins."""
    ax = _axes(ax)
    predicted, outcome = predicted.flatten().float(), outcome.flatten().float()
    edges = torch.linspace(0, 1, bins + 1)
    index = torch.bucketize(predicted, edges[1:-1])
    xs, ys = [], []
    for b in range(bins):
        chosen = index == b
        if chosen.any():
            xs.append(float(predicted[chosen].mean()))
            ys.append(float(outcome[chosen].mean()))
    ax.plot([0, 1], [0, 1], ":", color="gray")
    ax.plot(xs, ys, "o-", label=label)
    ax.set(xlabel="predicted probability", ylabel="observed frequency", title="calibration")
    ax.legend()
    return ax


def predicted_vs_measured(telemetry, ax=None):
    """Each round's measured wall time against the calibrated latency it was chosen with (calibrated strategies)."""
    ax = _axes(ax)
    pairs = [(r.predicted_s * 1e3, r.wall_s * 1e3) for r in telemetry.rounds if r.predicted_s is not None]
    if pairs:
        xs, ys = zip(*pairs, strict=True)
        ax.scatter(xs, ys, s=8)
        top = max(max(xs), max(ys))
        ax.plot([0, top], [0, top], ":", color="gray")
    ax.set(xlabel="predicted C(w) [ms]", ylabel="measured round [ms]", title="latency model")
    return ax
