"""Why was this gather exposed? ``PrefetchScheduler.explain(key)``: one row per demand of a scope.

Each row says how the demand was served, and for a miss why it was not provided for in the
user's terms (:class:`~fsdp_replay.stats.MissReason`); with ``measure_waits`` it also says how
long the use blocked on its parameters. Recorded entries that replay passed by (units the data
skipped) and the gathers released for them are listed with their reasons. ``print(report)`` gives a compact table and
:meth:`ExplainReport.plot` a timeline picture. The rows are built from the scope's timeline
(``_timeline.py``) when asked, so a scope that nobody explains costs one append per event.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_replay._timeline import Event, FinishedScope
from fsdp_replay._window import Held
from fsdp_replay.stats import Demand, MissReason

__all__ = ["DemandRow", "ExplainReport", "GatherUndone", "Served", "SkippedEntry"]


class Served(str, enum.Enum):
    """How a demand found its unit; a member compares equal to its value."""

    hit = "hit"
    """Its all-gather was issued ahead of the demand (it may still have been waited for)."""
    kept = "kept"
    """It was kept unsharded from its previous use."""
    resident = "resident"
    """Already unsharded by someone else's doing (``reshard_after_forward=False``, the root, a user's
    ``unshard()``), or a backward use FSDP2 needs no parameters for (``set_unshard_in_backward(False)``)."""
    miss = "miss"
    """Its all-gather was issued at the point of use."""


@dataclass(frozen=True)
class DemandRow:
    """One demand of the scope."""

    position: int
    """Its place among the scope's demands, from 0 (the recorded order's position when replaying from the start)."""
    unit: str
    """The unit's FQN (``chunk<i>/...`` with several roots)."""
    phase: str
    """``forward``, ``backward`` or ``recompute``."""
    served: Served
    reason: MissReason | None = None
    """Why it missed; None unless it did."""
    detail: str | None = None
    """The reason's particulars: which divergence, whose call, which setting."""
    wait_s: float | None = None
    """Seconds the use blocked waiting for its parameters; None where waits were not measured."""
    provided_at: float | None = None
    """Where its gather was issued or its keep decided: halfway after the demand it followed
    (``-0.5``: before the first); None unless served from the window."""


@dataclass(frozen=True)
class GatherUndone:
    """A gather issued ahead (or a keep) whose demand never used it."""

    position: float
    """Where it was undone: halfway after the demand it followed."""
    unit: str
    held: str
    """``prefetched`` or ``kept``."""
    why: str
    """Released by the scheduler (the scope ended, a divergence, ...) or undone by whom."""
    wasted: bool
    """True where the scheduler released it; False where another party took it over."""


@dataclass(frozen=True)
class SkippedEntry:
    """A recorded entry that a replayed scope passed by: its unit did not run there this time."""

    position: float
    """Where it was skipped: halfway after the demand it followed."""
    unit: str
    phase: str
    why: str
    """Which demand skipped it, or that the scope ended before it."""


@dataclass
class ExplainReport:
    """What one finished scope of a key did with each demand, and why gathers were exposed."""

    key: str
    mode: str
    """What the scope set out to do: ``record``, ``replay``, ``static`` or ``demand``."""
    outcome: str
    """``completed``, or why it did not."""
    rows: list[DemandRow]
    undone: list[GatherUndone] = field(default_factory=list)
    """Gathers issued ahead that no demand used: wasted by the scheduler or taken over by others."""
    skipped: list[SkippedEntry] = field(default_factory=list)
    """Recorded entries the scope passed by (see docs/TOLERANT_REPLAY.md)."""
    waits_measured: bool = False

    @property
    def miss_reasons(self) -> collections.Counter[MissReason]:
        return collections.Counter(row.reason for row in self.rows if row.reason is not None)

    @property
    def total_wait_s(self) -> float | None:
        return sum(row.wait_s or 0.0 for row in self.rows) if self.waits_measured else None

    def plot(self, path: str | Path) -> Path:
        """Draw the scope's timeline into ``path`` (PNG, or any format matplotlib infers from the suffix).

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``).
        """
        from fsdp_replay._plot import draw_report

        return draw_report(self, Path(path))

    def __str__(self) -> str:
        return _render(self)


def build_report(scope: FinishedScope) -> ExplainReport:
    """Turn a finished scope's timeline into rows: where each unit was provided for, used and undone."""
    waits: dict[int, float] = collections.defaultdict(float)
    if scope.waits is not None:
        for position, seconds in scope.waits.seconds():
            waits[position] += seconds
    provided_at: dict[object, float] = {}
    rows: list[DemandRow] = []
    undone: list[GatherUndone] = []
    skipped: list[SkippedEntry] = []
    for event in scope.timeline:
        kind, unit = event[0], event[1]
        between = len(rows) - 0.5
        if kind is Event.demand:
            _, _, phase, demand, held, why = event
            served = Served.kept if held is Held.kept and demand is not Demand.miss else Served(demand.value)
            rows.append(
                DemandRow(
                    position=len(rows),
                    unit=unit.fqn,
                    phase=phase.value,
                    served=served,
                    reason=why.reason if why is not None else None,
                    detail=why.detail if why is not None else None,
                    wait_s=waits.get(len(rows), 0.0) if scope.waits is not None else None,
                    provided_at=provided_at.pop(unit, None) if held is not None else None,
                )
            )
        elif kind is Event.provided:
            provided_at[unit] = between
        elif kind is Event.skipped:
            skipped.append(SkippedEntry(between, unit.fqn, event[2].value, event[3]))
        else:
            provided_at.pop(unit, None)
            undone.append(GatherUndone(between, unit.fqn, event[2].value, event[3], wasted=kind is Event.released))
    return ExplainReport(
        scope.key, scope.mode, scope.outcome, rows, undone, skipped, waits_measured=scope.waits is not None
    )


# --- the compact table ---------------------------------------------------------------------------

_LARGEST_WAITS = 8


def _render(report: ExplainReport) -> str:
    rows = report.rows
    served = collections.Counter(row.served for row in rows)
    lines = [
        f"fsdp_replay explain {report.key!r}: {report.mode} scope, {report.outcome}; {len(rows)} demands: "
        + ", ".join(f"{served[s]} {s.value}" for s in Served)
        + (f"; blocked {report.total_wait_s * 1e3:.2f} ms in all" if report.waits_measured else "; waits not measured")
    ]
    lines += _per_unit(report)
    if misses := [row for row in rows if row.served is Served.miss]:
        lines.append("misses by reason:")
        by_reason: dict[str, list[DemandRow]] = collections.defaultdict(list)
        for row in misses:
            by_reason[f"{row.reason.value}: {row.detail}" if row.detail else str(row.reason.value)].append(row)
        for text, which in sorted(by_reason.items(), key=lambda item: -len(item[1])):
            at = ", ".join(f"#{r.position} {r.unit} {r.phase}" for r in which[:4]) + (", ..." if len(which) > 4 else "")
            lines.append(f"  {len(which):4d}  {text}  ({at})")
    if report.waits_measured and (waited := sorted((r for r in rows if r.wait_s), key=lambda r: -r.wait_s)):
        lines.append("largest waits:")
        width = max(len(row.unit) for row in waited[:_LARGEST_WAITS])
        for row in waited[:_LARGEST_WAITS]:
            lines.append(
                f"  #{row.position:<5d} {row.unit:<{width}} {row.phase:<9} {row.served.value:<8} "
                f"{row.wait_s * 1e3:8.2f} ms  {_why_waited(row)}"
            )
    if report.skipped:
        lines.append(f"skipped entries: {len(report.skipped)}")
        for s in report.skipped[:_LARGEST_WAITS]:
            lines.append(f"  after #{int(s.position + 0.5) - 1:<5d} {s.unit} {s.phase}: {s.why}")
    for wasted, title in ((True, "wasted gathers"), (False, "taken over by others")):
        if undone := [u for u in report.undone if u.wasted is wasted]:
            lines.append(f"{title}: {len(undone)}")
            for why, n in collections.Counter(_reason_of(u.why) for u in undone).most_common():
                lines.append(f"  {n:4d}  {why}")
            for u in undone[:_LARGEST_WAITS]:
                lines.append(f"  after #{int(u.position + 0.5) - 1:<5d} {u.unit} ({u.held}): {u.why}")
    return "\n".join(lines)


def _reason_of(why: str) -> str:
    """The reason of a release without its particulars (which entry, which demand)."""
    return "its entry was skipped" if why.startswith("its entry (") else why


def _per_unit(report: ExplainReport) -> list[str]:
    groups: dict[tuple[str, str], list[DemandRow]] = {}
    for row in report.rows:
        groups.setdefault((row.unit, row.phase), []).append(row)
    width = max([len(unit) for unit, _ in groups] + [4])
    lines = [f"  {'unit':<{width}} {'phase':<9} {'uses':>4} {'hit':>4} {'kept':>4} {'res':>4} {'miss':>4} {'wait ms':>9}"]
    for (unit, phase), which in groups.items():
        n = collections.Counter(r.served for r in which)
        wait = f"{sum(r.wait_s or 0.0 for r in which) * 1e3:9.2f}" if report.waits_measured else f"{'-':>9}"
        lines.append(
            f"  {unit:<{width}} {phase:<9} {len(which):4d} {n[Served.hit]:4d} {n[Served.kept]:4d} "
            f"{n[Served.resident]:4d} {n[Served.miss]:4d} {wait}"
        )
    return lines


def _why_waited(row: DemandRow) -> str:
    if row.reason is not None:
        return f"miss: {row.reason.value}" + (f" ({row.detail})" if row.detail else "")
    if row.provided_at is not None:
        after = round(row.provided_at + 0.5) - 1
        return "issued at the scope's start" if after < 0 else f"issued after #{after}"
    return ""
