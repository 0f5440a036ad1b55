"""One iteration scope: what it does with its demands, and what it keeps for ``explain()``.

The scheduler opens a scope per ``iteration()`` block (or per automatic forward and backward),
hands each demand to it, and finishes it into a :class:`~fsdp_replay._timeline.FinishedScope`.
Here is the per-scope bookkeeping: its strategy (what mode it runs in, and why it fell back to
demand-only), its timeline, and why a demand of it missed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from fsdp_replay import _compat
from fsdp_replay._adaptive import ScopeWaits, phase_waits
from fsdp_replay._order import Phase
from fsdp_replay._strategies import DEMAND_ONLY, OFF_ORDER, ScopeMode, Strategy
from fsdp_replay._timeline import Event, FinishedScope, Timeline
from fsdp_replay._units import Unit
from fsdp_replay._window import Held
from fsdp_replay.stats import Demand, MissReason, Why
from fsdp_replay.waits import WaitLog

_DEMAND = Event.demand
"""Read per demand: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""
_OPENS_SCOPE = Why(MissReason.automatic_scope_start, "it opens the scope, inside the root's forward")
_OPENS_BACKWARD_SCOPE = Why(MissReason.automatic_scope_start, "it opens the scope: a backward with no scope open")
_CHANGED_IN_PLACE = Why(MissReason.changed_in_place, "its gather, issued ahead, held their values from before the change")
_FINALIZED = Why(MissReason.dropped, "FSDP2 dropped its pending gather (it does so when it finalizes a backward)")
_FINALIZED_KEEP = Why(MissReason.dropped, "FSDP2 resharded it although it was kept (it does so when it finalizes a backward)")


@dataclass(eq=False)
class Scope:
    """One iteration (one optimizer step's forwards and backwards), and what it does with its demands."""

    key: str
    explicit: bool
    """Opened by ``iteration()``; an automatic scope spans root forwards up to the end of their backwards."""
    strategy: Strategy
    """Decides what to provide for after each demand; its ``mode`` is the scope's mode."""
    backward_started: bool = False
    """Automatic scopes: a backward demand came since the last backward ended. A scope still open at
    the next root forward or optimizer step then failed: its backward did not finish."""
    backwards_pending: int = 0
    """Automatic scopes: root forwards whose output may still take a backward, less the backwards
    that ended. The scope ends when none is left; while some are, a next root forward joins it."""
    reset: bool = False
    """Automatic scopes: ``reset_iter_state()`` was called in it, FSDP2's recovery from a step that
    raised (in a loss, say, which no hook sees). It ends failed at the next root forward or
    optimizer step, as an ``iteration()`` that raised does, not as a scope that stopped short."""
    timeline: Timeline = field(default_factory=Timeline)
    """Its demands and what the window did around them, for ``explain()``."""
    served: list[Demand] = field(default_factory=list)
    """How each of its demands so far was served, in order (its length is the next demand's position)."""
    counted: int = 0
    """How many of :attr:`served` the scheduler has counted into its stats."""
    demand_only: Why = Why(MissReason.demand_mode)
    """Why the scope prefetches nothing, once it does not: demand mode, or what made it fall back."""
    undone: dict[Unit, Why] = field(default_factory=dict)
    """Units whose gather or keep was undone since their last demand, and by what: another party's
    reshard or reset, or a change of their parameters (their next miss is blamed on it)."""
    outcome: str = "completed"
    compare_demands: Callable[[], None] | None = None
    """Compares its demands so far across ranks, raising ``RankMismatchError`` if they differ: set
    where it replays an order whose units the data runs only sometimes, under ``check_ranks``
    (``_lifecycle.py``). Called as each backward begins and at the scope's end (see :meth:`demanded`)."""
    _forward_since_compared: bool = False
    started: float = field(default_factory=time.perf_counter)
    mode: str = field(init=False)
    """What the scope set out to do (``record``, ``replay``, ``static``, ``demand``), whatever it fell back to."""

    def __post_init__(self) -> None:
        self.mode = self.strategy.mode.value

    def why_missed(self, unit: Unit, phase: Phase, held: Held | None) -> Why:
        """Why a demand found its unit neither gathered nor gathering (call before :meth:`demanded`)."""
        if held is not None:
            return _FINALIZED if held is Held.prefetched else _FINALIZED_KEEP
        if (undone := self.undone.get(unit)) is not None:
            return undone
        mode = self.strategy.mode
        if mode is ScopeMode.demand:
            return self.demand_only
        if not self.explicit and not self.served and mode is not ScopeMode.record:
            return _OPENS_SCOPE if phase.in_forward else _OPENS_BACKWARD_SCOPE
        return self.strategy.why_missed(unit, phase)

    def demanded(self, unit: Unit, phase: Phase, demand: Demand, held: Held | None, why: Why | None) -> int:
        """Log a demand in the timeline; returns its position in the scope."""
        if self.undone:
            self.undone.pop(unit, None)
        self.timeline.append((_DEMAND, unit, phase, demand, held, why))
        served = self.served
        served.append(demand)
        if self.compare_demands is not None:
            # Where ranks ran different units in forward, the backward's prefetches (provided for
            # the units each ran) would pair different collectives: the ranks compare first, at the
            # first backward demand after forwards, a point every rank reaches.
            if phase.in_forward:
                self._forward_since_compared = True
            elif self._forward_since_compared:
                self._forward_since_compared = False
                self.compare_demands()
        return len(served) - 1

    def demand_list(self) -> list[tuple[str, str]]:
        """Its demands so far, as ``(unit FQN, phase)``."""
        return [(event[1].fqn, event[2].value) for event in self.timeline if event[0] is Event.demand]

    def other_party(self, unit: Unit, call: _compat.OtherPartyCall, held: Held | None, *, undoes: bool) -> None:
        """Someone else acted on ``unit``: ``held`` is what the window had provided for it, now
        theirs; ``undoes``: a reshard or reset of the unit while it was unsharded or gathering,
        which the unit's next miss is blamed on.

        ``reset_iter_state()`` recovers from a forward or backward that raised: the backwards this
        scope's forwards waited for will not come, so a next root forward does not join it.
        """
        if call == "reset":
            self.backwards_pending = 0
            self.reset = True
        if held is None and not undoes:
            return
        who = _compat.other_party(call)
        if undoes:
            self.undone[unit] = Why(MissReason.dropped, who)
        if held is not None:
            self.timeline.append((Event.taken_over, unit, held, who))

    def dropped_at_backward_end(self, unit: Unit) -> None:
        """FSDP2 dropped the gather provided for ``unit`` as it finalized a backward (the window has
        let it go): its next miss is blamed on that."""
        self.undone[unit] = _FINALIZED
        self.timeline.append((Event.taken_over, unit, Held.prefetched, "FSDP2 finalizing a backward"))

    def parameters_changed(self, released: list[Unit]) -> None:
        """The window released these units' gathers or keeps: their parameters changed in place
        since ([Note: parameters changed before a demand] in ``_window.py``)."""
        for unit in released:
            self.undone[unit] = _CHANGED_IN_PLACE

    def off_order(self, divergence: str | None) -> Why:
        """The last demand missed off the order: it diverged there, or replay tolerated it (skipped
        entries, not in the order, realigned). A divergence found at a late demand of a skipped
        entry is also written on the miss of the demand that skipped it, where the order was left."""
        if not divergence:
            why = self.strategy.tolerated
        else:
            why = Why(MissReason.after_divergence, divergence)
            left_at = getattr(self.strategy, "left_at", None)
            demands = [i for i, event in enumerate(self.timeline) if event[0] is Event.demand]
            if left_at is not None and (row := self.timeline[demands[left_at]])[5] is not None:
                self.timeline[demands[left_at]] = (*row[:5], why)
        at = max(i for i, event in enumerate(self.timeline) if event[0] is Event.demand)
        self.timeline[at] = (*self.timeline[at][:5], why)
        return why

    def fall_back(self, why: Why) -> None:
        """Finish the scope demand-only (its window is released by the caller)."""
        self.strategy = DEMAND_ONLY
        self.demand_only = why

    def waits_by_phase(self, waits: WaitLog | None) -> ScopeWaits | None:
        """What an ``"auto"`` depth learns from the scope: None unless it prefetched to the end."""
        if waits is None or self.outcome != "completed" or self.strategy.mode not in (ScopeMode.replay, ScopeMode.static):
            return None
        in_forward = [event[2].in_forward for event in self.timeline if event[0] is Event.demand]
        return ScopeWaits(
            waited_s=phase_waits([(in_forward[row], seconds) for row, seconds in waits.seconds()]),
            scope_s=time.perf_counter() - self.started,
            capped=tuple(self.strategy.capped),
        )

    def finished(self, outcome: str | None, waits: WaitLog | None) -> FinishedScope:
        if outcome is not None:
            self.outcome = outcome
        return FinishedScope(self.key, self.mode, self.outcome, self.timeline, waits)


__all__ = ["OFF_ORDER", "Scope"]
