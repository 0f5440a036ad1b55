"""The scheduler: iteration scopes, the three modes, and the prefetch window they drive.

Data flow: a hook reports a demand ``(unit, phase)`` → while recording it is appended to the
scope's entries, which become the key's :class:`ExecutionOrder` when the scope succeeds → a later
scope walks that order with a :class:`Cursor`, checking each demand → after every demand,
:meth:`PrefetchScheduler._refill` provides for the next entries through the
:class:`PrefetchWindow` (an all-gather issued early, or a unit in use kept unsharded for its next
use), and the scope's end releases whatever is left.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_replay import _compat
from fsdp_replay.config import PrefetchConfig, PrefetchMode
from fsdp_replay.hooks import HookSet
from fsdp_replay.order import Cursor, Depth, ExecutionOrder, Phase, Recording, first_difference
from fsdp_replay.stats import PrefetchStats
from fsdp_replay.units import Unit, discover_units
from fsdp_replay.window import Held, PrefetchWindow

logger = logging.getLogger("fsdp_replay")

AUTO_KEY_GRAD = "auto:grad"
AUTO_KEY_NO_GRAD = "auto:no_grad"
STATE_DICT_VERSION = 1


class PrefetchDivergenceError(RuntimeError):
    """A replayed scope left its recorded order while ``on_divergence="raise"``."""


class RankMismatchError(RuntimeError):
    """Ranks recorded different orders; replaying them would issue mismatched collectives."""


@dataclass(eq=False)
class _Scope:
    """One iteration: the demands it records, or the cursor it replays, and where it stands."""

    key: str
    explicit: bool
    recording: Recording | None = None
    cursor: Cursor | None = None
    demand_only: bool = False
    """No prefetch for the rest of the scope (``demand`` mode, or after a divergence)."""
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
        self._static_next = _static_successors(self.units)
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
        if scope is not None and scope.cursor is not None and scope.key not in self._orders:
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
        if scope.recording is not None:
            scope.recording.end_backward()
        elif scope.cursor is not None:
            scope.cursor.end_backward()
        if not scope.explicit:
            self._end_scope(scope)
        else:
            self._refill(scope)

    def on_demand(self, unit: Unit, phase: Phase) -> None:
        scope = self._scope
        key = scope.key if scope is not None else None
        state = unit.state
        kind = _compat.demand_kind(state)
        self.stats.count(key, "demands")
        self.stats.count(key, kind)
        if self._window.demanded(unit, missed=kind == "misses"):
            self.stats.count(key, "dropped")
        if scope is None or scope.demand_only:
            return
        scope.backward_started |= phase is Phase.backward
        if scope.recording is not None:
            with _compat.trace("fsdp_replay::record", unit.fqn, phase.value):
                scope.recording.append(unit, phase, needs_gather=kind != "resident")
            return
        if scope.cursor is not None and not self._replay_matches(scope, unit, phase):
            return
        if kind == "misses" and _compat.may_gather(state):
            # Issued before any prefetch, so the demanded gather is not queued behind them.
            with _compat.trace("fsdp_replay::gather_at_demand", unit.fqn):
                _compat.issue_unshard(state, backward=not phase.in_forward)
        if scope.cursor is not None:
            scope.cursor.advance()
            self._refill(scope, demanded=unit)
        else:
            self._prefetch_static(scope, unit, phase)

    def on_lifecycle_reshard(self, unit: Unit) -> bool:
        """FSDP2 is about to reshard ``unit`` after a use; True skips it (the unit is kept)."""
        first = self._window.skips_reshard(unit)
        if first is None:
            return False
        if first:
            self.stats.count(self._scope.key if self._scope is not None else None, "kept")
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
        self.stats.count(self._scope.key if self._scope is not None else None, "dropped")

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
            self.stats.count(scope.key, "wasted", self._window.release_all())

    # --- scopes ----------------------------------------------------------------------------------

    def _begin_scope(self, key: str, *, explicit: bool, rerecord: bool = False) -> _Scope:
        scope = _Scope(key=key, explicit=explicit)
        if self.config.mode is PrefetchMode.demand:
            scope.demand_only = True
        elif self.config.mode is PrefetchMode.record_and_replay:
            if rerecord and key in self._orders:
                self._drop_order(key, reason="rerecord=True")
            order = self._orders.get(key)
            if order is None:
                scope.recording = Recording()
            else:
                if self.config.check_ranks and key not in self._verified:
                    self._verify_across_ranks(key, order)
                scope.cursor = Cursor(order, depth=self._depth)
        self._scope = scope
        if not scope.demand_only and (root_state := self._root_state()) is not None:
            # This scope may gather before FSDP2's root pre-forward (first step, or a resumed run).
            _compat.ensure_lazy_init(root_state)
        if explicit:
            self._refill(scope)  # the scope's first gathers go out before its first forward
        # An automatic scope opens inside the root's pre-forward, which is already its first
        # demand: that demand gathers at the point of use, and replay starts from there.
        return scope

    def _close_auto_scope(self, scope: _Scope) -> None:
        """An automatic scope still open at the next root forward or optimizer step."""
        if scope.backward_started:
            self._end_scope(scope, failure="its backward did not finish")
        else:
            self._end_scope(scope)  # a forward with no backward after it

    def _end_scope(self, scope: _Scope, *, failure: str | None = None) -> None:
        self._scope = None
        self.stats.count(scope.key, "wasted", self._window.release_all())
        if failure is not None:
            if scope.key in self._orders:
                self._drop_order(scope.key, reason=failure)
            return
        if scope.recording is not None:
            if entries := scope.recording.entries:
                self._orders[scope.key] = ExecutionOrder(entries)
                self._verified.discard(scope.key)
                self.stats.count(scope.key, "recordings")
                logger.debug("fsdp_replay: recorded %d demands for scope %r", len(entries), scope.key)
            return
        cursor = scope.cursor
        if cursor is not None and not scope.demand_only and not cursor.done:
            self._diverge(
                scope,
                f"scope {scope.key!r} ended after {cursor.position} of {len(cursor.order)} recorded demands; "
                f"next expected {cursor.expected.describe()}",
            )

    def _replay_matches(self, scope: _Scope, unit: Unit, phase: Phase) -> bool:
        cursor = scope.cursor
        expected = cursor.expected
        if expected is not None and expected.matches(unit, phase):
            return True
        self._diverge(
            scope,
            f"scope {scope.key!r} diverged at demand {cursor.position}: expected "
            f"{expected.describe() if expected is not None else 'the end of the recorded order'}, "
            f"got ({unit.fqn!r}, {phase.value!r})",
        )
        return False

    def _diverge(self, scope: _Scope, detail: str) -> None:
        self.stats.count(scope.key, "divergences")
        self._go_demand_only(scope)
        self._drop_order(scope.key, reason=detail)
        if self.config.on_divergence == "raise":
            raise PrefetchDivergenceError(f"fsdp_replay: {detail} (on_divergence='raise')")

    def _go_demand_only(self, scope: _Scope) -> None:
        scope.demand_only = True
        self.stats.count(scope.key, "wasted", self._window.release_all())

    def _drop_order(self, key: str, *, reason: str) -> None:
        if self._orders.pop(key, None) is not None:
            self._verified.discard(key)
            logger.warning("fsdp_replay: invalidated the recorded order of %r: %s", key, reason)

    # --- prefetch --------------------------------------------------------------------------------

    def _refill(self, scope: _Scope, demanded: Unit | None = None) -> None:
        """Provide for the next entries of the cursor's lookahead, nearest first.

        At most ``depth`` all-gathers are in flight ahead. A unit in use now (``demanded``, about
        to run, or an outer unit still running) that its entry needs again is not resharded and
        gathered again: it is kept unsharded, which costs its bytes but no gather slot. A unit
        already unsharded or gathering by someone else's doing needs nothing.
        """
        cursor = scope.cursor
        if cursor is None or scope.demand_only:
            return
        ahead = cursor.lookahead()
        gathers = 0
        for entry in ahead.entries:
            unit = entry.unit
            held = self._window.holds(unit)
            if held is not None:
                gathers += held is Held.prefetched
                continue
            state = unit.state
            in_use = unit is demanded or _compat.in_use(state)
            if not in_use and not _compat.is_sharded_idle(state):
                continue  # resident or gathering already (accumulation settings, a user's unshard)
            if (not in_use and gathers >= ahead.gathers) or not self._window.fits(unit):
                return  # the next demand frees a slot or room
            if in_use:
                if not self._window.may_keep(unit):
                    return  # cannot keep it (no FSDP2 internals, or stale values): nothing later may jump the queue
                self._window.keep(unit)
            elif self._window.prefetch(unit, backward=not entry.phase.in_forward):
                gathers += 1
                self.stats.count(scope.key, "prefetches")

    def _prefetch_static(self, scope: _Scope, unit: Unit, phase: Phase) -> None:
        """Module-tree order in forward, its reverse in backward: the attach-time guess.

        A wrong guess stays pending until its unit is used, so the gathers already held count
        against the depth: memory stays within ``depth`` units ahead however often it guesses wrong.
        """
        depth = self._depth.of(phase)
        for successor in self._static_next[phase.in_forward][unit][:depth]:
            if len(self._window) >= depth:
                return
            if not _compat.is_sharded_idle(successor.state):
                continue
            if not self._window.fits(successor):
                return
            if self._window.prefetch(successor, backward=not phase.in_forward):
                self.stats.count(scope.key, "prefetches")

    # --- cross-rank check -----------------------------------------------------------------------

    def _verify_across_ranks(self, key: str, order: ExecutionOrder) -> None:
        """Compare length + digest over the units' process group; on mismatch raise on every rank."""
        state = self.units[0].state
        group = _compat.process_group(state)
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            self._verified.add(key)
            return
        with _compat.trace("fsdp_replay::check_ranks", key):
            mine = torch.tensor([len(order), order.digest()], dtype=torch.int64, device=_compat.device(state))
            # Pre-filled with our own value: a no-op (fake) backend then compares equal.
            gathered = [mine.clone() for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, mine, group=group)
            if all(torch.equal(g, mine) for g in gathered):
                self._verified.add(key)
                return
            all_orders: list[Any] = [order.to_state() for _ in gathered]
            dist.all_gather_object(all_orders, order.to_state(), group=group)
        self._orders.pop(key, None)
        raise RankMismatchError(_describe_rank_mismatch(key, all_orders))

    def _steps_our_params(self, optimizer: torch.optim.Optimizer) -> bool:
        if optimizer not in self._optimizers_seen:
            self._optimizers_seen[optimizer] = any(
                id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"]
            )
        return self._optimizers_seen[optimizer]

    def _check_attached(self) -> None:
        if not self.attached:
            raise RuntimeError("this PrefetchScheduler was detached; attach() a new one")


def _static_successors(units: list[Unit]) -> dict[bool, dict[Unit, list[Unit]]]:
    """For each unit, the units after it in forward (True) and backward (False) static order."""
    backward = list(reversed(units))
    return {
        True: {u: units[i + 1 :] for i, u in enumerate(units)},
        False: {u: backward[i + 1 :] for i, u in enumerate(backward)},
    }


def _describe_rank_mismatch(key: str, orders: list[list[tuple]]) -> str:
    reference = orders[0]
    lines = [f"fsdp_replay: ranks recorded different demand orders for scope {key!r} (check_ranks=True):"]
    for rank, order in enumerate(orders[1:], start=1):
        if order == reference:
            continue
        pos = first_difference(reference, order)
        ref = reference[pos][:2] if pos < len(reference) else "end of order"
        got = order[pos][:2] if pos < len(order) else "end of order"
        lines.append(
            f"  first difference at demand {pos}: rank 0 has {ref}, rank {rank} has {got} "
            f"(lengths {len(reference)} vs {len(order)})"
        )
    lines.append("Every rank must run the same units in the same order; replay would mismatch collectives.")
    return "\n".join(lines)


def _weak_step_hook(scheduler: PrefetchScheduler) -> Any:
    """A global optimizer hook that does not keep the scheduler (or its model) alive."""
    ref = weakref.ref(scheduler)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if (live := ref()) is not None:
            live.on_optimizer_step(optimizer)

    return hook
