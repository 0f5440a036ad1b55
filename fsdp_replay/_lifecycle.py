"""How the scheduler's iteration scopes begin and end, and what each leaves behind.

A scope begins with its strategy (``_modes.py``) and, when explicit, a first refill; it ends
completed, failed, diverged or stopped, and then installs or trims the key's recorded order,
releases what the window still holds, keeps the scope for ``explain()`` and hands its waits to an
``"auto"`` depth. :class:`ScopeLifecycle` is mixed into
:class:`~fsdp_replay.scheduler.PrefetchScheduler`, which dispatches the hooks' events
(``scheduler.py``): the two files split one object's work by concern, the state they share is
declared below.
"""

from __future__ import annotations

import logging

from fsdp_replay._adaptive import AdaptiveDepth
from fsdp_replay._automatic import AUTO_KEYS, AutomaticScopes
from fsdp_replay._modes import ScopeModes
from fsdp_replay._order import RecordedOrders
from fsdp_replay._ranks import RankMismatchError, check_demands_across_ranks
from fsdp_replay._roots import Roots
from fsdp_replay._scope import Scope
from fsdp_replay._strategies import Record, Replay, ScopeMode
from fsdp_replay._timeline import FinishedScope, Timeline
from fsdp_replay._units import Unit
from fsdp_replay._window import PrefetchWindow
from fsdp_replay.config import DivergencePolicy, PrefetchConfig
from fsdp_replay.stats import Count, MissReason, PrefetchStats, Why
from fsdp_replay.waits import DemandWaits

logger = logging.getLogger("fsdp_replay")


class PrefetchDivergenceError(RuntimeError):
    """A replayed scope left its recorded order while ``on_divergence="raise"``."""


class ScopeLifecycle:
    """Scope bookkeeping of :class:`~fsdp_replay.scheduler.PrefetchScheduler` (see the module docstring)."""

    config: PrefetchConfig
    units: list[Unit]
    _scope: Scope | None
    """The open scope, if any."""
    _finished: dict[str, FinishedScope]
    """The last finished scope of each key, for ``explain()``."""
    _stats: PrefetchStats
    _window: PrefetchWindow
    _orders: RecordedOrders
    _depths: AdaptiveDepth
    _modes: ScopeModes
    _roots: Roots
    _automatic: AutomaticScopes
    _waits: DemandWaits | None

    def _begin_scope(self, key: str, *, explicit: bool, rerecord: bool = False) -> Scope:
        scope = Scope(key=key, explicit=explicit, strategy=self._modes.strategy_for(key, rerecord=rerecord))
        strategy = scope.strategy
        # Decided from the order, which every rank shares (it was compared before its first replay).
        if self.config.check_ranks and isinstance(strategy, Replay) and strategy.cursor.order.conditional:
            scope.compare_demands = lambda: self._compare_demands(scope)
        self._scope = scope
        self._window.timeline = scope.timeline
        if self._waits is not None:
            self._waits.take()  # what blocked outside any scope is nobody's demand
        if scope.strategy.mode is not ScopeMode.demand:
            # This scope may gather before FSDP2's root pre-forward (first step, or a resumed run).
            self._roots.lazy_init()
        if explicit:
            scope.strategy.provide()  # the scope's first gathers go out before its first forward
        # An automatic scope opens inside the root's pre-forward, which is already its first
        # demand: that demand gathers at the point of use, and replay starts from there.
        return scope

    def _close_auto_scope(self, scope: Scope) -> None:
        """An automatic scope still open at the next root forward or optimizer step."""
        if scope.backward_started:
            self._end_scope(scope, failure="its backward did not finish")
        else:
            self._end_scope(scope)  # a forward with no backward after it

    def _end_scope(self, scope: Scope, *, failure: str | None = None) -> None:
        why = f"the scope failed: {failure}" if failure is not None else "the scope ended before its demand"
        self._stats.count(scope.key, Count.wasted, self._window.release_all(why))
        self._count_pending()
        self._scope = None
        if failure is not None:
            self._orders.drop(scope.key, reason=failure)
            self._finish(scope, f"failed: {failure}", failed=True)
            return
        strategy = scope.strategy
        try:
            if scope.compare_demands is not None:
                scope.compare_demands()
            if isinstance(strategy, Record):
                if (entries := strategy.recording.entries) and self._orders.install(scope.key, strategy.recording):
                    self._depths.rerecorded(scope.key)
                    self._stats.count(scope.key, Count.recordings)
                    logger.debug("fsdp_replay: recorded %d demands for iteration %r", len(entries), scope.key)
            elif isinstance(strategy, Replay):
                if (unfinished := strategy.unfinished()) is not None:
                    self._diverge(scope, f"iteration {scope.key!r} {unfinished}")
                elif strategy.skipped_prefix:
                    self._orders.trim(scope.key, strategy.cursor.order)
        finally:  # also when a divergence raises: every rank takes part in the depth's agreement
            self._finish(scope, None)

    def _compare_demands(self, scope: Scope) -> None:
        """Where data decides which units run, check that every rank ran the same (before anything
        here may raise, so that every rank takes part).

        Raises:
            RankMismatchError: they did not; the key's order is dropped on every rank.
        """
        try:
            check_demands_across_ranks(scope.key, scope.demand_list(), [unit.state for unit in self.units])
        except RankMismatchError:
            self._orders.discard_unchecked(scope.key)
            scope.outcome = "failed: the ranks ran different units"
            raise

    def _finish(self, scope: Scope, outcome: str | None, *, failed: bool = False) -> None:
        """Keep the scope for ``explain()`` (the window's events go to a throwaway timeline until the
        next), and, unless it failed, let its waits decide an ``"auto"`` depth on every rank."""
        waits = self._waits.take() if self._waits is not None else None
        self._finished[scope.key] = scope.finished(outcome, waits)
        self._window.timeline = Timeline()
        if not failed and self._depths.adaptive:  # reading the waits syncs on CUDA: only where they decide
            self._depths.scope_ended(scope.key, scope.waits_by_phase(waits))

    def _diverge(self, scope: Scope, detail: str) -> None:
        self._stats.count(scope.key, Count.divergences)
        scope.outcome = f"diverged: {detail}"
        self._go_demand_only(scope, Why(MissReason.after_divergence, detail))
        self._orders.drop(scope.key, reason=detail)
        if self.config.on_divergence is DivergencePolicy.raise_:
            raise PrefetchDivergenceError(f"fsdp_replay: {detail} (on_divergence='raise')")

    def _stop_automatic_scopes(self, reason: str) -> None:
        """No more automatic scopes: their orders are dropped and the open one ends unrecorded."""
        scope = self._scope
        if scope is not None and not scope.explicit:
            self._stats.count(scope.key, Count.wasted, self._window.release_all(f"automatic scopes stopped: {reason}"))
            self._count_pending()
            self._scope = None
            self._finish(scope, f"stopped: {reason}")
        for key in AUTO_KEYS:
            self._orders.discard_unchecked(key)
        self._automatic.turn_off(reason)

    def _go_demand_only(self, scope: Scope, why: Why) -> None:
        scope.fall_back(why)
        self._stats.count(scope.key, Count.wasted, self._window.release_all(str(why)))

    def _count_pending(self) -> None:
        """Count the open scope's demands and the prefetches the window issued (and released one at
        a time) since the last count, under the open scope's key.

        Only strategies prefetch, inside a scope, so counting them when the stats are read and
        when a scope ends attributes each to its key, at no cost per demand or prefetch.
        """
        window, scope = self._window, self._scope
        key = scope.key if scope is not None else None
        if scope is not None and scope.counted < len(scope.served):
            self._stats.count_served(key, scope.served[scope.counted :])
            scope.counted = len(scope.served)
        if window.issued:
            self._stats.count(key, Count.prefetches, window.issued)
            window.issued = 0
        if window.wasted:
            self._stats.count(key, Count.wasted, window.wasted)
            window.wasted = 0
        if window.wasted_bytes:
            self._stats.count(key, Count.wasted_bytes, window.wasted_bytes)
            window.wasted_bytes = 0
