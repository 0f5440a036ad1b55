"""How the scheduler's iteration scopes begin and end, and what each leaves behind.

A scope begins with its strategy (``_modes.py``) and, when explicit, a first refill; it ends
completed, failed, diverged or stopped, and then installs or trims the key's recorded order,
releases what the window still holds, keeps the scope for ``explain()`` and hands its waits to an
``"auto"`` depth. :class:`~fsdp_replay.scheduler.PrefetchScheduler` holds one
:class:`ScopeLifecycle` and dispatches the hooks' events (``scheduler.py``); the lifecycle holds
the open scope, the last finished one of each key and the counters they are counted into.
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
from fsdp_replay.config import DivergencePolicy
from fsdp_replay.stats import Count, MissReason, PrefetchStats, Why
from fsdp_replay.waits import DemandWaits

logger = logging.getLogger("fsdp_replay")


class PrefetchDivergenceError(RuntimeError):
    """A replayed scope left its recorded order while ``on_divergence="raise"``."""


class ScopeLifecycle:
    """The open scope, the last finished scope of each key, and the stats both are counted into."""

    def __init__(
        self,
        units: list[Unit],
        *,
        window: PrefetchWindow,
        orders: RecordedOrders,
        depths: AdaptiveDepth,
        modes: ScopeModes,
        roots: Roots,
        automatic: AutomaticScopes,
        waits: DemandWaits | None,
        check_ranks: bool,
        on_divergence: DivergencePolicy,
    ) -> None:
        self._units = units
        self._window = window
        self._orders = orders
        self._depths = depths
        self._modes = modes
        self._roots = roots
        self._automatic = automatic
        self._waits = waits
        self._check_ranks = check_ranks
        self._on_divergence = on_divergence
        self.open: Scope | None = None
        """The open scope, if any (read per demand)."""
        self.finished: dict[str, FinishedScope] = {}
        """The last finished scope of each key, for ``explain()``."""
        self.stats = PrefetchStats()
        """Counters since attach or the last :meth:`reset_stats` (count what is pending before reading them)."""

    def begin(self, key: str, *, explicit: bool, rerecord: bool = False) -> Scope:
        scope = Scope(key=key, explicit=explicit, strategy=self._modes.strategy_for(key, rerecord=rerecord))
        strategy = scope.strategy
        if strategy.mode is not ScopeMode.demand:
            # This scope may gather before FSDP2's root pre-forward (first step, or a resumed run).
            self._roots.lazy_init()  # before the scope opens: it raises where attached to a child unit
        # Decided from the order, which every rank shares (it was compared before its first replay).
        if self._check_ranks and isinstance(strategy, Replay) and strategy.cursor.order.conditional:
            scope.compare_demands = lambda: self._compare_demands(scope)
        self.open = scope
        self._window.timeline = scope.timeline
        if self._waits is not None:
            self._waits.take()  # what blocked outside any scope is nobody's demand
        if explicit:
            scope.strategy.provide()  # the scope's first gathers go out before its first forward
            self._window.note_versions()  # the user's code may change the parameters before it
        # An automatic scope opens inside the root's pre-forward, which is already its first
        # demand: that demand gathers at the point of use, and replay starts from there.
        return scope

    def close_auto(self, scope: Scope) -> None:
        """An automatic scope still open at the next root forward or optimizer step."""
        if scope.backward_started:
            self.end(scope, failure="its backward did not finish")
        elif scope.reset:
            self.end(scope, failure="reset_iter_state() was called in it")
        else:
            self.end(scope)  # a forward with no backward after it

    def end(self, scope: Scope, *, failure: str | None = None) -> None:
        why = f"the scope failed: {failure}" if failure is not None else "the scope ended before its demand"
        self.stats.count(scope.key, Count.wasted, self._window.release_all(why))
        self.count_pending()
        self.open = None
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
                    self.stats.count(scope.key, Count.recordings)
                    logger.debug("fsdp_replay: recorded %d demands for iteration %r", len(entries), scope.key)
            elif isinstance(strategy, Replay):
                unfinished = strategy.unfinished(may_run_less=not self._orders.ran_less(scope.key))
                self._orders.replay_ended(scope.key, ran_less=strategy.stopped_short or strategy.ran_less)
                if unfinished is not None:
                    self.diverge(scope, f"iteration {scope.key!r} {unfinished}")
                    return
                if strategy.stopped_short:
                    scope.outcome = "stopped short of its order"
                if strategy.skipped_prefix and (followed := strategy.followed_order(scope.served)) is not None:
                    self._orders.trim(scope.key, followed)
        finally:  # also when a divergence raises: every rank takes part in the depth's agreement
            self._finish(scope, None)

    def _compare_demands(self, scope: Scope) -> None:
        """Where data decides which units run, check that every rank ran the same (before anything
        here may raise, so that every rank takes part).

        Raises:
            RankMismatchError: they did not; the key's order is dropped on every rank.
        """
        try:
            check_demands_across_ranks(scope.key, scope.demand_list(), [unit.state for unit in self._units])
        except RankMismatchError:
            self._orders.discard_unchecked(scope.key)
            scope.outcome = "failed: the ranks ran different units"
            raise

    def _finish(self, scope: Scope, outcome: str | None, *, failed: bool = False) -> None:
        """Keep the scope for ``explain()`` (the window's events go to a throwaway timeline until the
        next), and, unless it failed, let its waits decide an ``"auto"`` depth on every rank."""
        waits = self._waits.take() if self._waits is not None else None
        self.finished[scope.key] = scope.finished(outcome, waits)
        self._window.timeline = Timeline()
        if not failed and self._depths.adaptive:  # reading the waits syncs on CUDA: only where they decide
            self._depths.scope_ended(scope.key, scope.waits_by_phase(waits))

    def diverge(self, scope: Scope, detail: str) -> None:
        self.stats.count(scope.key, Count.divergences)
        scope.outcome = f"diverged: {detail}"
        self.go_demand_only(scope, Why(MissReason.after_divergence, detail))
        self._orders.drop(scope.key, reason=detail)
        if self._on_divergence is DivergencePolicy.raise_:
            raise PrefetchDivergenceError(f"fsdp_replay: {detail} (on_divergence='raise')")

    def stop_automatic(self, reason: str) -> None:
        """No more automatic scopes: their orders are dropped and the open one ends unrecorded."""
        scope = self.open
        if scope is not None and not scope.explicit:
            self.stats.count(scope.key, Count.wasted, self._window.release_all(f"automatic scopes stopped: {reason}"))
            self.count_pending()
            self.open = None
            self._finish(scope, f"stopped: {reason}")
        for key in AUTO_KEYS:
            self._orders.discard_unchecked(key)
        self._automatic.turn_off(reason)

    def go_demand_only(self, scope: Scope, why: Why) -> None:
        scope.fall_back(why)
        self.stats.count(scope.key, Count.wasted, self._window.release_all(str(why)))

    def reset_stats(self) -> None:
        """Start the counters afresh: what the window and the open scope did so far is not counted."""
        window = self._window
        window.issued = window.wasted = window.wasted_bytes = 0
        if self.open is not None:
            self.open.counted = len(self.open.served)
        self.stats = PrefetchStats()

    def count_pending(self) -> None:
        """Count the open scope's demands and the prefetches the window issued (and released one at
        a time) since the last count, under the open scope's key.

        Only strategies prefetch, inside a scope, so counting them when the stats are read and
        when a scope ends attributes each to its key, at no cost per demand or prefetch.
        """
        window, scope = self._window, self.open
        key = scope.key if scope is not None else None
        if scope is not None and scope.counted < len(scope.served):
            self.stats.count_served(key, scope.served[scope.counted :])
            scope.counted = len(scope.served)
        if window.issued:
            self.stats.count(key, Count.prefetches, window.issued)
            window.issued = 0
        if window.wasted:
            self.stats.count(key, Count.wasted, window.wasted)
            window.wasted = 0
        if window.wasted_bytes:
            self.stats.count(key, Count.wasted_bytes, window.wasted_bytes)
            window.wasted_bytes = 0
