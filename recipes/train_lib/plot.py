"""The run's picture: loss, step time and prefetch hit rate per step, drawn from ``metrics.jsonl``.

matplotlib is optional (the ``recipes`` extra): without it the run draws nothing and its summary
says so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_FILE = "metrics.png"
NOT_DRAWN = "not drawn: matplotlib is not installed (pip install matplotlib)"
"""The summary's line for a picture skipped without matplotlib (this one and ``order.png``)."""

Series = dict[str, list[tuple[int, float]]]
"""Name -> ``(step, value)`` points, as drawn."""


def series(metrics: list[dict[str, Any]]) -> Series:
    """One point per step for each panel; eval loss only on the steps that evaluated."""
    return {
        "loss": [(m["step"], m["loss"]) for m in metrics],
        "eval_loss": [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m],
        "step_time_ms": [(m["step"], m["step_time_s"] * 1e3) for m in metrics],
        "hit_rate_pct": [(m["step"], m["hit_rate"] * 100) for m in metrics],
    }


def plot_metrics(metrics: list[dict[str, Any]], path: Path, *, title: str) -> Series | None:
    """Draw three panels sharing the step axis into ``path``; the series drawn, or None without matplotlib.

    Steps that recorded a prefetch order are marked: they prefetch nothing, so their hit rate is
    low and their step time high by design.
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state
    except ImportError:
        return None
    points = series(metrics)
    fig = Figure(figsize=(7, 7), layout="constrained")
    loss_ax, time_ax, hit_ax = fig.subplots(3, 1, sharex=True)
    loss_ax.plot(*zip(*points["loss"]), ".-", label="train")
    if points["eval_loss"]:
        loss_ax.plot(*zip(*points["eval_loss"]), "o--", label="eval")
    loss_ax.set_ylabel("loss")
    time_ax.plot(*zip(*points["step_time_ms"]), ".-")
    time_ax.set_ylabel("step time (ms)")
    hit_ax.plot(*zip(*points["hit_rate_pct"]), ".-")
    hit_ax.set_ylabel("hit rate (%)\n(hits + resident) / demands")
    hit_ax.set_ylim(-5, 105)
    hit_ax.set_xlabel("step")
    recorded = [m["step"] for m in metrics if m.get("recordings")]
    for ax in (loss_ax, time_ax, hit_ax):
        for step in recorded:
            ax.axvline(step, color="grey", linestyle=":")
    if recorded:
        loss_ax.plot([], [], color="grey", linestyle=":", label="records the order")  # one legend entry
    loss_ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return points
