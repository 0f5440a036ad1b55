"""The scheduler: iteration scopes, and dispatch of their events to each scope's strategy.

Data flow: a hook reports a demand ``(unit, phase)`` → the scheduler classifies and counts it,
takes the unit out of the :class:`PrefetchWindow` and hands the demand to the scope's strategy
(``_strategies.py``): while recording it is appended to the scope's :class:`Recording`, which
becomes the key's :class:`ExecutionOrder` when the scope succeeds → a later scope walks that
order with a :class:`Cursor`, checking each demand, and provides for the next entries through the
window (an all-gather issued early, or a unit in use kept unsharded for its next use) → the
scope's end releases whatever is left.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_replay import _compat
from fsdp_replay._hooks import HookSet
from fsdp_replay._order import Cursor, Depth, ExecutionOrder, Phase
from fsdp_replay._ranks import RankMismatchError, check_across_ranks
from fsdp_replay._strategies import DEMAND_ONLY, Record, Replay, ScopeMode, Static, Strategy, static_successors
from fsdp_replay._units import Unit, discover_units
from fsdp_replay._window import Held, PrefetchWindow
from fsdp_replay.config import DivergencePolicy, PrefetchConfig, PrefetchMode
from fsdp_replay.stats import Count, Demand, PrefetchStats

logger = logging.getLogger("fsdp_replay")

AUTO_KEY_GRAD = "auto:grad"
AUTO_KEY_NO_GRAD = "auto:no_grad"
STATE_DICT_VERSION = 1


class PrefetchDivergenceError(RuntimeError):
    """A replayed scope left its recorded order while ``on_divergence="raise"``."""


@dataclass(eq=False)
class _Scope:
    """One iteration (one optimizer step's forwards and backwards), and what it does with its demands."""

    key: str
    explicit: bool
    """Opened by ``iteration()``; an automatic scope spans one root forward and its backward."""
    strategy: Strategy
    """Decides what to provide for after each demand; its ``mode`` is the scope's mode."""
    backward_started: bool = False
    """Automatic scopes: a scope still open at the next root forward failed if its backward began."""


class PrefetchScheduler:
    """Schedules FSDP2 unshards for every unit under one root; create it with :func:`attach`."""

    def __init__(self, root: nn.Module, config: PrefetchConfig) -> None:
        self.config = config
        self.stats = PrefetchStats()
        self._root = weakref.ref(root)
        self._root_state = weakref.ref(_compat.fsdp_state(root))
        self.units: list[Unit] = discover_units(root)
        if not self.units:
            raise ValueError(f"attach(): no fully_shard unit with parameters under {type(root).__name__}")
        self._units_by_fqn = {u.fqn: u for u in self.units}
        self._static_successors = static_successors(self.units)
        self._orders: dict[str, ExecutionOrder] = {}
        self._verified: set[str] = set()
        self._scope: _Scope | None = None
        self._depth = Depth(config.forward_prefetch, config.backward_prefetch)
        self._param_ids = {id(p) for p in root.parameters()}
        self._optimizers_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned_step_in_scope = False
        self._saved_prefetch = {unit: _compat.disable_own_prefetch(unit.state) for unit in self.units}
        self._hooks = HookSet(self)
        can_keep = all([self._hooks.register_unit(unit) for unit in self.units])
        self._window = PrefetchWindow(max_bytes=config.max_prefetch_bytes, can_keep=can_keep)
        self._hooks.register_root(root)
        self._optimizer_hook = register_optimizer_step_pre_hook(_weak_step_hook(self))
        weakref.finalize(self, self._optimizer_hook.remove)
        self.attached = True

    # --- public API -----------------------------------------------------------------------------

    @property
    def mode(self) -> PrefetchMode:
        return self.config.mode

    @contextlib.contextmanager
    def iteration(self, key: str = "train", *, rerecord: bool = False) -> Iterator[None]:
        """One optimizer step's worth of forwards and backwards (all microbatches).

        The first successful scope of ``key`` records its demand order; later ones replay it.
        Call ``optimizer.step()`` after the scope, so no prefetch is pending across it.
        """
        self._check_attached()
        if not isinstance(key, str) or not key or key.startswith("auto:"):
            raise ValueError(f"iteration(key=...) must be a non-empty string not starting with 'auto:', got {key!r}")
        if self._scope is not None and self._scope.explicit:
            raise RuntimeError(
                f"iteration(key={key!r}) opened inside iteration(key={self._scope.key!r}); scopes do not "
                "nest: one scope spans one optimizer step, with all its microbatches"
            )
        if self._scope is not None:
            self._close_auto_scope(self._scope)
        scope = self._begin_scope(key, explicit=True, rerecord=rerecord)
        try:
            yield
        except BaseException:
            self._end_scope(scope, failure="the scope exited with an exception")
            if (root := self._root()) is not None:
                _compat.reset_iter_state(root)
            raise
        self._end_scope(scope)

    def recorded_order(self, key: str) -> list[tuple[str, str]] | None:
        """The recorded ``(unit FQN, phase)`` sequence of ``key``, or None if none is installed."""
        order = self._orders.get(key)
        return order.as_list() if order is not None else None

    def invalidate(self, key: str | None = None) -> None:
        """Drop one key's recorded order, or all of them; the next scope of that key re-records."""
        for k in list(self._orders) if key is None else [key]:
            self._drop_order(k, reason="invalidate() was called")
        scope = self._scope
        if scope is not None and scope.strategy.mode is ScopeMode.replay and scope.key not in self._orders:
            self._go_demand_only(scope)

    def reset_stats(self) -> None:
        self.stats = PrefetchStats()

    def state_dict(self) -> dict[str, Any]:
        """Recorded orders keyed by unit FQN (picklable), so a resumed run replays from its first step."""
        return {"version": STATE_DICT_VERSION, "orders": {k: o.to_state() for k, o in self._orders.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_DICT_VERSION:
            raise ValueError(
                f"fsdp_replay state_dict version {state.get('version')!r} is not supported "
                f"(expected {STATE_DICT_VERSION})"
            )
        orders = {k: ExecutionOrder.from_state(v, self._units_by_fqn) for k, v in state["orders"].items()}
        self._orders = orders
        self._verified.clear()  # loaded orders are compared across ranks before first use

    def detach(self) -> None:
        """Remove every hook and restore FSDP2's own prefetch settings, as if never attached."""
        if not self.attached:
            return
        if self._scope is not None and self._scope.explicit:
            raise RuntimeError(f"detach() called inside iteration(key={self._scope.key!r}); leave the scope first")
        if self._scope is not None:
            self._end_scope(self._scope, failure="the scheduler was detached mid-scope")
        self._window.release_all()
        self._hooks.remove()
        self._optimizer_hook.remove()
        for unit, (saved, installed) in self._saved_prefetch.items():
            if (state := unit._state()) is not None:
                _compat.restore_own_prefetch(state, saved, installed)
        self._saved_prefetch.clear()
        self.attached = False

    # --- events reported by the hooks -------------------------------------------------------------

    def on_root_pre_forward(self) -> None:
        root_state = self._root_state()
        if root_state is not None and _compat.is_root_initialized_as_child(root_state):
            raise RuntimeError(
                "fsdp_replay was attached to a module that FSDP2 treats as a child unit; attach to the "
                "outermost fully_shard module (the one whose forward runs first)"
            )
        if self._scope is not None and self._scope.explicit:
            return
        if self._scope is not None:
            self._close_auto_scope(self._scope)
        self._begin_scope(AUTO_KEY_GRAD if torch.is_grad_enabled() else AUTO_KEY_NO_GRAD, explicit=False)

    def on_root_post_forward(self, *, backward_follows: bool, failed: bool) -> None:
        scope = self._scope
        if scope is None or scope.explicit:
            return
        if failed:
            self._end_scope(scope, failure="the forward raised an exception")
        elif not backward_follows:
            self._end_scope(scope)  # otherwise the scope ends with its backward

    def on_backward_end(self) -> None:
        scope = self._scope
        if scope is None:
            return
        scope.strategy.end_backward()
        if not scope.explicit:
            self._end_scope(scope)
        else:
            scope.strategy.provide()

    def on_demand(self, unit: Unit, phase: Phase) -> None:
        scope = self._scope
        key = scope.key if scope is not None else None
        demand = _compat.classify_demand(unit.state)
        self.stats.count(key, Count.demands)
        self.stats.count(key, demand.counter)
        if self._window.demanded(unit, missed=demand is Demand.miss):
            self.stats.count(key, Count.dropped)
        if scope is None or scope.strategy.mode is ScopeMode.demand:
            return
        scope.backward_started |= phase is Phase.backward
        if (divergence := scope.strategy.on_demand(unit, phase, demand)) is not None:
            self._diverge(scope, f"scope {scope.key!r} {divergence}")

    def on_lifecycle_reshard(self, unit: Unit) -> bool:
        """FSDP2 is about to reshard ``unit`` after a use; True skips it (the unit is kept)."""
        first = self._window.skips_reshard(unit)
        if first is None:
            return False
        if first:
            self.stats.count(self._scope.key if self._scope is not None else None, Count.kept)
        return True

    def on_other_party(self, unit: Unit, call: _compat.OtherPartyCall) -> None:
        """Someone else resharded, unsharded or reset ``unit``: it is theirs now, not the window's.

        FSDP2's ``reshard()`` leaves a pending gather pending; after theirs, plain FSDP2 would have
        none, so the scheduler's own prefetch is finished and freed first.
        """
        held = self._window.take(unit)
        if held is None:
            return
        if held is Held.prefetched and call == "reshard":
            _compat.release(unit.state)
        self.stats.count(self._scope.key if self._scope is not None else None, Count.dropped)

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._steps_our_params(optimizer):
            return
        self._window.step_taken()
        scope = self._scope
        if scope is None:
            return
        if not scope.explicit:
            self._close_auto_scope(scope)
        elif len(self._window):
            if not self._warned_step_in_scope:
                self._warned_step_in_scope = True
                logger.warning(
                    "fsdp_replay: optimizer.step() inside iteration(key=%r) released %d pending prefetches "
                    "(they would run on stale weights); call step() after the scope",
                    scope.key,
                    len(self._window),
                )
            self.stats.count(scope.key, Count.wasted, self._window.release_all())

    # --- scopes ----------------------------------------------------------------------------------

    def _begin_scope(self, key: str, *, explicit: bool, rerecord: bool = False) -> _Scope:
        scope = _Scope(key=key, explicit=explicit, strategy=self._strategy_for(key, rerecord=rerecord))
        self._scope = scope
        if scope.strategy.mode is not ScopeMode.demand and (root_state := self._root_state()) is not None:
            # This scope may gather before FSDP2's root pre-forward (first step, or a resumed run).
            _compat.ensure_lazy_init(root_state)
        if explicit:
            scope.strategy.provide()  # the scope's first gathers go out before its first forward
        # An automatic scope opens inside the root's pre-forward, which is already its first
        # demand: that demand gathers at the point of use, and replay starts from there.
        return scope

    def _strategy_for(self, key: str, *, rerecord: bool) -> Strategy:
        """The mode of a new scope of ``key``: the configured mode, and for record-and-replay
        whether the key has an order to replay."""
        mode = self.config.mode
        if mode is PrefetchMode.demand:
            return DEMAND_ONLY
        count_prefetch = _weak_counter(self, key, Count.prefetches)
        if mode is PrefetchMode.static:
            return Static(self._static_successors, self._depth, self._window, count_prefetch)
        if rerecord and key in self._orders:
            self._drop_order(key, reason="rerecord=True")
        order = self._orders.get(key)
        if order is None:
            return Record()
        if self.config.check_ranks and key not in self._verified:
            self._verify_across_ranks(key, order)
        return Replay(Cursor(order, depth=self._depth), self._window, count_prefetch)

    def _close_auto_scope(self, scope: _Scope) -> None:
        """An automatic scope still open at the next root forward or optimizer step."""
        if scope.backward_started:
            self._end_scope(scope, failure="its backward did not finish")
        else:
            self._end_scope(scope)  # a forward with no backward after it

    def _end_scope(self, scope: _Scope, *, failure: str | None = None) -> None:
        self._scope = None
        self.stats.count(scope.key, Count.wasted, self._window.release_all())
        if failure is not None:
            if scope.key in self._orders:
                self._drop_order(scope.key, reason=failure)
            return
        strategy = scope.strategy
        if isinstance(strategy, Record):
            if entries := strategy.recording.entries:
                self._orders[scope.key] = ExecutionOrder(entries)
                self._verified.discard(scope.key)
                self.stats.count(scope.key, Count.recordings)
                logger.debug("fsdp_replay: recorded %d demands for scope %r", len(entries), scope.key)
        elif isinstance(strategy, Replay) and (unfinished := strategy.unfinished()) is not None:
            self._diverge(scope, f"scope {scope.key!r} {unfinished}")

    def _diverge(self, scope: _Scope, detail: str) -> None:
        self.stats.count(scope.key, Count.divergences)
        self._go_demand_only(scope)
        self._drop_order(scope.key, reason=detail)
        if self.config.on_divergence is DivergencePolicy.raise_:
            raise PrefetchDivergenceError(f"fsdp_replay: {detail} (on_divergence='raise')")

    def _go_demand_only(self, scope: _Scope) -> None:
        scope.strategy = DEMAND_ONLY
        self.stats.count(scope.key, Count.wasted, self._window.release_all())

    def _drop_order(self, key: str, *, reason: str) -> None:
        if self._orders.pop(key, None) is not None:
            self._verified.discard(key)
            logger.warning("fsdp_replay: invalidated the recorded order of %r: %s", key, reason)

    def _verify_across_ranks(self, key: str, order: ExecutionOrder) -> None:
        try:
            check_across_ranks(key, order, self.units[0].state)
        except RankMismatchError:
            self._orders.pop(key, None)
            raise
        self._verified.add(key)

    # --- helpers ---------------------------------------------------------------------------------

    def _steps_our_params(self, optimizer: torch.optim.Optimizer) -> bool:
        if optimizer not in self._optimizers_seen:
            self._optimizers_seen[optimizer] = any(
                id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"]
            )
        return self._optimizers_seen[optimizer]

    def _check_attached(self) -> None:
        if not self.attached:
            raise RuntimeError("this PrefetchScheduler was detached; attach() a new one")


def _weak_counter(scheduler: PrefetchScheduler, key: str, counter: Count) -> Callable[[], None]:
    """Counts one ``counter`` under ``key`` in the scheduler's current stats (``reset_stats()``
    replaces them); held by a scope's strategy, so it holds the scheduler weakly."""
    ref = weakref.ref(scheduler)

    def count() -> None:
        if (live := ref()) is not None:
            live.stats.count(key, counter)

    return count


def _weak_step_hook(scheduler: PrefetchScheduler) -> Any:
    """A global optimizer hook that does not keep the scheduler (or its model) alive."""
    ref = weakref.ref(scheduler)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if (live := ref()) is not None:
            live.on_optimizer_step(optimizer)

    return hook
