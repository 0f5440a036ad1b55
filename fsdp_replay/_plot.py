"""The timeline picture of an :class:`~fsdp_replay.explain.ExplainReport` (matplotlib, no pyplot)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp_replay.explain import ExplainReport

_COLOURS = {"hit": "tab:green", "kept": "tab:blue", "resident": "tab:gray", "miss": "tab:red"}
_MARKERS = {"forward": "o", "backward": "s", "recompute": "^"}


def draw_report(report: ExplainReport, path: Path) -> Path:
    """Demands along x, units along y, coloured by how each was served and shaped by its phase:
    where each gather was issued (a line from there to its use; dashed: a keep), gathers undone
    unused (a hollow circle); below, the wait each demand blocked for, when measured."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state
    from matplotlib.ticker import MaxNLocator

    rows = report.rows
    units = list(dict.fromkeys(row.unit for row in rows)) + [u.unit for u in report.undone]
    units = list(dict.fromkeys(units))
    y = {unit: i for i, unit in enumerate(units)}
    panels = 2 if report.waits_measured else 1
    height = max(3.0, 0.22 * len(units) + 1.5)
    figure = Figure(figsize=(min(24.0, 4.0 + 0.12 * len(rows)), height + (2.2 if panels == 2 else 0.0)))
    axes = figure.subplots(panels, 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": [height, 2.2][:panels]})
    timeline = axes[0][0]
    for row in rows:
        if row.provided_at is not None:
            style = "--" if row.served == "kept" else "-"
            timeline.plot([row.provided_at, row.position], [y[row.unit]] * 2, style, color=_COLOURS[row.served.value], lw=1, alpha=0.7)
    for served, colour in _COLOURS.items():
        for phase, marker in _MARKERS.items():
            chosen = [row for row in rows if row.served == served and row.phase == phase]
            if chosen:
                timeline.scatter(
                    [r.position for r in chosen], [y[r.unit] for r in chosen], c=colour, marker=marker, zorder=3,
                    s=60 if served == "miss" else 30, edgecolors="black" if served == "miss" else "none",
                )
    for served, colour in _COLOURS.items():
        timeline.scatter([], [], c=colour, marker="o", label=served)
    for phase, marker in _MARKERS.items():
        timeline.scatter([], [], c="white", edgecolors="black", marker=marker, label=phase)
    if report.undone:
        timeline.scatter(
            [u.position for u in report.undone], [y[u.unit] for u in report.undone], facecolors="none",
            edgecolors="black", s=40, label="undone unused", zorder=3,
        )
    timeline.set_yticks(range(len(units)), units, fontsize=7)
    timeline.invert_yaxis()
    timeline.set_ylabel("unit")
    timeline.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    outcome = report.outcome if len(report.outcome) <= 60 else report.outcome[:57] + "..."
    timeline.set_title(f"{report.key!r}: {report.mode} scope, {outcome}\nlines: gather issued -> used (dashed: kept)", fontsize=8)
    if panels == 2:
        waits = axes[1][0]
        waits.bar(
            [row.position for row in rows], [(row.wait_s or 0.0) * 1e3 for row in rows],
            color=[_COLOURS[row.served.value] for row in rows], width=0.8,
        )
        waits.set_ylabel("wait ms")
        waits.set_ylim(bottom=0, top=max([(row.wait_s or 0.0) * 1e3 for row in rows] + [0.01]) * 1.1)
    axes[-1][0].set_xlabel("demand position in the scope")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path
