"""The scheduler: its public API, and dispatch of the hooks' events to each scope's strategy.

Data flow: a hook reports a demand ``(unit, phase)`` → the scheduler classifies and counts it,
takes the unit out of the :class:`PrefetchWindow` and hands it to the scope's strategy
(``_strategies.py``), which records it, or checks it against the recorded order and provides for
what comes next through the window → the scope's end installs a recording as the key's order
and releases whatever the window still holds (how scopes begin and end: ``_lifecycle.py``).
README.md "How it behaves" walks it file by file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Iterator, Sequence

import torch.nn as nn

from fsdp_replay import _checkpoint, _compat
from fsdp_replay._automatic import AUTO_KEY_BACKWARD, AutomaticScopes, automatic_key
from fsdp_replay._hooks import HookSet
from fsdp_replay._lifecycle import PrefetchDivergenceError, ScopeLifecycle
from fsdp_replay._adaptive import AdaptiveDepth
from fsdp_replay._order import Phase, RecordedOrders
from fsdp_replay._ranks import RankMismatchError, agree_on_max
from fsdp_replay._roots import Roots
from fsdp_replay._scope import OFF_ORDER
from fsdp_replay._modes import ScopeModes
from fsdp_replay._strategies import Record, ScopeMode, gather_at_demand
from fsdp_replay._units import Unit
from fsdp_replay._weak import OptimizerSteps
from fsdp_replay._window import Held, PrefetchWindow
from fsdp_replay.config import PrefetchConfig, PrefetchMode
from fsdp_replay.explain import ExplainReport, build_report
from fsdp_replay.stats import Count, Demand, MissReason, PrefetchStats, Why
from fsdp_replay.waits import DemandWaits

logger = logging.getLogger("fsdp_replay")

# [Note: Enum members on the per-demand path]
# Python 3.11 reads an Enum member (``Held.kept``) about four times slower than a module global
# (~80 ns against ~20 ns: the lookup goes through the Enum's metaclass), and a demand's path once
# read some 35 of them. So code that runs per demand, per refill entry or per FSDP2 use reads the
# members it compares against from globals like these, bound once at import. BENCHMARKS.md
# "4c. CPU cost after issue 15 part 2" measured it.

_MISS, _DEMAND_MODE, _KEPT, _BACKWARD = Demand.miss, ScopeMode.demand, Held.kept, Phase.backward
"""Read per demand (see the note above)."""

# [Note: counting a scope's demands]
# A demand's counters (demands, hits, misses, resident, per key and in total) are not bumped as it
# comes: the scope appends how it was served to ``Scope.served``, and the scheduler counts that
# list into its stats when they are read and when the scope ends (``ScopeLifecycle.count_pending``), with
# ``list.count``. Per-demand counting was ~65 of the ~670 Python opcodes a replayed demand ran
# (sys.settrace opcode count, 16 units, torch 2.13); docs/HOST_COST.md has the whole budget.

# [Note: trims of the per-demand path]
# Measured with ``bench/bench_calls.py --units 16 --steps 1 --opcodes`` (Python opcodes added to
# plain FSDP2 per demand, exact, torch 2.13): ``issue_unshard`` returns whether its gather is
# pending instead of a second read, and opens no empty context below torch 2.14 (-13 per replayed
# demand); ``is_sharded_idle`` reads a single param group directly (-25 per static demand).
# Together with the note above: replay 672 -> 564, static 592 -> 475, demand 304 -> 235.
# Later, counted on the code of the 2026-12-07 host-cost runs (replay 589.1, static 506.5, demand
# 252.7; 27.8, 33.9 and 13.9 Python calls a demand): a prefetch is one call from the window
# ([Note: one call per gather] in ``_compat/gathers.py``); FSDP2's reshard after each use asks the
# scheduler only while the window holds the unit (``Interception.held``, the window's dict lookup);
# the window's prefetches mark their units gathered as they are issued, so a demand takes its unit
# out of the window in one call; the hook hands the unit's state on; static reads the window's
# size without a Python call (``PrefetchWindow.count``). Replay 537.2, static 447.5, demand 227.8.
# Then a replay refill stops at its last entry unread once the depth is reached ([Note: the last
# entry unread] in ``_strategies.py``): replay 489.1.


def _checked_key(key: object, method: str) -> str:
    """A scope key as the methods that read by key take it: a mistyped one would find nothing, silently."""
    if not isinstance(key, str):
        raise ValueError(
            f"{method}(key=...) must be a string: a key given to iteration(), or 'auto:grad', "
            f"'auto:no_grad' or 'auto:backward'; got {key!r}"
        )
    return key


class PrefetchScheduler:
    """Schedules FSDP2 unshards for every unit under its roots; create it with :func:`attach`."""

    def __init__(self, roots: Sequence[nn.Module], config: PrefetchConfig) -> None:
        self.config = config
        self._roots = Roots(roots)
        self.units: list[Unit] = self._roots.discover_units()
        if not self.units:
            names = ", ".join(type(root).__name__ for root in roots)
            raise ValueError(f"attach(): no fully_shard unit with parameters under {names}")
        self._orders = RecordedOrders(record_steps=config.record_steps)
        self._depths = AdaptiveDepth(
            config.forward_prefetch, config.backward_prefetch, deepest=len(self.units), agree=self._agree_on_max
        )
        self._warned_step_in_scope = False
        self._automatic = AutomaticScopes(len(roots))
        self._saved_prefetch = {unit: _compat.disable_own_prefetch(unit.state) for unit in self.units}
        self._window = PrefetchWindow(max_bytes=config.max_prefetch_bytes)
        self._hooks = HookSet(self, held=self._window.holds)
        self._window.can_keep = all([self._hooks.register_unit(unit) for unit in self.units])
        self._modes = ScopeModes(config, self.units, self._orders, self._depths, self._window)
        measure = config.measure_waits or self._depths.adaptive
        self._waits = DemandWaits(on_host=_compat.device(self.units[0].state).type == "cpu") if measure else None
        if self._waits is not None and not all([self._hooks.time_waits(unit, self._waits) for unit in self.units]):
            self._waits = None
            logger.warning(
                "fsdp_replay: measuring waits (measure_waits, or an 'auto' depth) needs FSDP2's internals, which are "
                "not used on this torch; waits are not measured and an 'auto' depth stays at 1"
            )
        self._scopes = ScopeLifecycle(
            self.units,
            window=self._window,
            orders=self._orders,
            depths=self._depths,
            modes=self._modes,
            roots=self._roots,
            automatic=self._automatic,
            waits=self._waits,
            check_ranks=config.check_ranks,
            on_divergence=config.on_divergence,
        )
        for root in roots:
            self._hooks.register_root(root)
        self._optimizer_steps = OptimizerSteps((p for root in roots for p in root.parameters()), self._on_optimizer_step)
        self.attached = True

    # --- public API -----------------------------------------------------------------------------

    @property
    def mode(self) -> PrefetchMode:
        return self.config.mode

    @contextlib.contextmanager
    def iteration(self, key: str = "train", *, rerecord: bool = False) -> Iterator[None]:
        """A scope: one optimizer step's worth of forwards and backwards (all its microbatches).

        The first successful scope of ``key`` records its demand order; later ones replay it (in
        ``record_and_replay`` mode). Call ``optimizer.step()`` after the scope, so no prefetch is
        pending across it. A scope that exits with an exception keeps no recording, drops a
        replayed order, and calls FSDP2's ``reset_iter_state()`` on the root.

        Args:
            key: names the order; one key per distinct sequence of demands (``"train"``, ``"eval"``).
                ``"auto:"`` keys are for automatic scopes: outside ``iteration()`` each root forward
                up to the end of its backward is one (``"auto:grad"`` or ``"auto:no_grad"``), and so
                is a backward that starts with no scope open (``"auto:backward"``).
            rerecord: drop the key's order first, so this scope records it again.

        Raises:
            ValueError: ``key`` is not a non-empty string, or starts with ``"auto:"``; ``rerecord``
                is not a bool.
            RuntimeError: the scheduler was detached, or this scope would nest in another one.
            RankMismatchError: with ``check_ranks``, ranks recorded different orders for ``key``
                (raised on every rank, before the first replay of that order).
            PrefetchDivergenceError: with ``on_divergence="raise"``, a demand in the scope (or its
                end) left the recorded order.
        """
        if not self.attached:
            raise RuntimeError("this PrefetchScheduler was detached; attach() a new one")
        if not isinstance(key, str) or not key or key.startswith("auto:"):
            raise ValueError(f"iteration(key=...) must be a non-empty string not starting with 'auto:', got {key!r}")
        if not isinstance(rerecord, bool):
            raise ValueError(f"iteration(rerecord=...) must be True or False, got {rerecord!r}")
        scopes = self._scopes
        if (open_scope := scopes.open) is not None:
            if open_scope.explicit:
                raise RuntimeError(
                    f"iteration(key={key!r}) opened inside iteration(key={open_scope.key!r}); iterations do not "
                    "nest: one iteration() spans one optimizer step, with all its microbatches"
                )
            scopes.close_auto(open_scope)
        scope = scopes.begin(key, explicit=True, rerecord=rerecord)
        try:
            yield
        except BaseException:
            scopes.end(scope, failure="its iteration() block exited with an exception")
            self._roots.reset_iter_state()
            raise
        scopes.end(scope)

    def recorded_order(self, key: str) -> list[tuple[str, str]] | None:
        """The recorded order of ``key``.

        Args:
            key: a scope key, as given to :meth:`iteration` (or ``"auto:grad"`` / ``"auto:no_grad"`` /
                ``"auto:backward"``).

        Returns:
            Its ``(unit FQN, phase)`` sequence, or None if no order of ``key`` is installed.
        """
        order = self._orders.get(_checked_key(key, "recorded_order"))
        return order.as_list() if order is not None else None

    def explain(self, key: str = "train") -> ExplainReport:
        """What the last finished scope of ``key`` did with each demand, and why any gather was exposed.

        ``report.rows`` has one row per demand (how it was served; for a miss, the reason; the
        wait when ``measure_waits`` is on); ``print(report)`` shows a compact table and
        ``report.plot(path)`` a timeline picture. README.md "Why was this gather exposed?".

        Raises:
            ValueError: no scope of ``key`` has finished yet (the message lists the keys that have).
        """
        finished = self._scopes.finished.get(_checked_key(key, "explain"))
        if finished is None:
            known = ", ".join(repr(k) for k in self._scopes.finished) or "none yet"
            raise ValueError(f"explain({key!r}): no scope of that key has finished; keys with a finished scope: {known}")
        return build_report(finished)

    def prefetch_depth(self, key: str = "train") -> tuple[int, int]:
        """The ``(forward, backward)`` depth the next scope of ``key`` runs with (``"auto"`` adapts it)."""
        return tuple(self._depths.of(_checked_key(key, "prefetch_depth")))

    def set_max_prefetch_bytes(self, max_bytes: int | None) -> None:
        """Change the byte cap from the next refill on (an ``"auto"`` depth re-learns what it allows).

        Raises:
            ValueError: ``max_bytes`` is neither a positive integer nor None.
        """
        self.config = dataclasses.replace(self.config, max_prefetch_bytes=max_bytes)  # validates it
        self._window.max_bytes = max_bytes
        self._depths.cap_changed()

    def invalidate(self, key: str | None = None) -> None:
        """Drop recorded orders; the next scope of such a key records again.

        Args:
            key: the key whose order to drop; None drops every order. An unknown key is ignored.

        .. note::
            Called inside a scope that replays a dropped order, the scope finishes demand-only.
        """
        for k in self._orders.keys() if key is None else [_checked_key(key, "invalidate")]:
            self._orders.drop(k, reason="invalidate() was called")
        scope = self._scopes.open
        if scope is not None and scope.strategy.mode is ScopeMode.replay and scope.key not in self._orders:
            self._scopes.go_demand_only(scope, Why(MissReason.invalidated, "invalidate() dropped the order it replayed"))

    @property
    def stats(self) -> PrefetchStats:
        """Counters since :func:`attach` or the last :meth:`reset_stats`, cumulative and per scope key."""
        self._scopes.count_pending()
        return self._scopes.stats

    def reset_stats(self) -> None:
        self._scopes.reset_stats()

    def state_dict(self) -> dict[str, Any]:
        """The recorded orders, so that a resumed run replays from its first step.

        Returns:
            A picklable dict for :meth:`load_state_dict` (a version, each key's order with units
            named by FQN, and what they were recorded on: unit FQNs, parameter shapes and dtypes,
            world size, mesh shape, torch release); save it with the model's checkpoint.
        """
        return _checkpoint.save(self._orders, self.units)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install the orders of a :meth:`state_dict`, replacing every order recorded so far.

        A stale order does not stop a resumed run: if the state was saved on another setup
        (changed model or wrapping, world size, mesh shape or torch release), one warning says what
        changed and no order is installed; an order naming a unit this model lacks is left out with
        a warning. Their keys record again at their next scope, with numerics unchanged.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: the state's version is not supported, or an entry is malformed. The
                installed orders are then left as they were.

        .. note::
            With ``check_ranks``, each loaded order is compared across ranks before its first replay.
        """
        _checkpoint.load(state, self._orders, self.units)

    def detach(self) -> None:
        """Remove every hook and restore FSDP2's own prefetch settings, as if never attached.

        Whatever is held ahead of use is released, and an automatic scope still open ends as failed.
        Calling it again does nothing.

        Raises:
            RuntimeError: called inside :meth:`iteration`.
        """
        if not self.attached:
            return
        if (scope := self._scopes.open) is not None:
            if scope.explicit:
                raise RuntimeError(f"detach() called inside iteration(key={scope.key!r}); leave the iteration() block first")
            self._scopes.end(scope, failure="the scheduler was detached mid-iteration")
        self._window.release_all("detach()")
        self._hooks.remove()
        self._optimizer_steps.remove()
        for unit, (saved, installed) in self._saved_prefetch.items():
            if (state := unit.state_or_none()) is not None:
                _compat.restore_own_prefetch(state, saved, installed)
        self._saved_prefetch.clear()
        self.attached = False

    # --- events reported by the hooks (SchedulerEvents; [Note: hook order and the end of backward])

    def on_root_pre_forward(self) -> None:
        """A root's forward starts: outside ``iteration()`` it opens an automatic scope."""
        self._roots.check_still_roots()
        scope = self._scopes.open
        if scope is not None and scope.explicit:
            return
        if not self._automatic.on:
            self._automatic.say_off()
            return
        key = automatic_key()
        if scope is not None:
            if scope.backwards_pending and not scope.backward_started and scope.key == key:
                return  # one more forward before their backward (two forwards per loss, microbatches interleaved)
            self._scopes.close_auto(scope)
        self._scopes.begin(key, explicit=False)

    def on_root_post_forward(self, *, backward_follows: bool, failed: bool) -> None:
        """The root's forward ended: an automatic scope with no backward to come ends here."""
        scope = self._scopes.open
        if scope is None or scope.explicit:
            return
        if failed:
            self._scopes.end(scope, failure="the forward raised an exception")
            return
        scope.backwards_pending += backward_follows
        if not scope.backwards_pending:
            self._scopes.end(scope)  # otherwise the scope ends with the last backward
            return
        # The user's code runs next: the loss, or a step given up after its forward and a rollback
        # to a checkpoint, while what was provided for the backward stays held.
        self._window.note_versions()

    def on_backward_end(self, *, finalized_by_caller: bool) -> None:
        """FSDP2's root post-backward callback ran: a segment of the scope ends.

        ``finalized_by_caller``: the callback was called directly rather than by autograd, or
        under manual backward finalization: a pipeline stage's doing, whose microbatch backwards
        no automatic scope can delimit.
        """
        scope = self._scopes.open
        if finalized_by_caller and (scope is None or not scope.explicit) and self._automatic.on:
            self._scopes.stop_automatic("its backward is finalized by its caller (as a pipeline stage does)")
            return
        if scope is None:
            return
        scope.strategy.end_backward()
        for unit in self._window.take_dropped():  # before a scope's end, which would count them wasted
            scope.dropped_at_backward_end(unit)
            self._scopes.stats.count(scope.key, Count.dropped)
        if not scope.explicit:
            scope.backward_started = False
            scope.backwards_pending = max(scope.backwards_pending - 1, 0)
            if not scope.backwards_pending:
                self._scopes.end(scope)
                return
        scope.strategy.provide()
        self._window.note_versions()  # the user's code runs next (another microbatch's forward may follow)

    def on_demand(self, unit: Unit, phase: Phase, state: Any) -> None:
        """``unit`` (FSDP2 state ``state``) needs its parameters now, before FSDP2 acts on the demand."""
        scope = self._scopes.open
        if self._window.unverified is not None:  # [Note: parameters changed before a demand] in _window.py
            changed = self._window.verify()
            if scope is not None:
                scope.parameters_changed(changed)
        if scope is None and not phase.in_forward and self._automatic.on:
            scope = self._scopes.begin(AUTO_KEY_BACKWARD, explicit=False)  # ends with this backward
        demand = _compat.classify_demand(state, backward=phase is _BACKWARD)
        held = self._window.take(unit)  # its demand came: it leaves the window
        if demand is _MISS:
            self._window.gathered(unit)  # FSDP2 gathers it now (held still: FSDP2 dropped the prefetch)
        if scope is None:
            self._demanded_outside_scope(demand, held)
            return
        why = None
        if demand is _MISS:
            why = scope.why_missed(unit, phase, held)
            if held is not None:
                self._scopes.stats.count(scope.key, Count.dropped)
        position = scope.demanded(unit, phase, demand, held, why)
        if self._waits is not None:
            self._waits.demanded(unit, position)
        strategy = scope.strategy
        if why is not None and strategy.gathers_misses:
            self._gather_missed(unit, phase)
        divergence = None
        if strategy.mode is not _DEMAND_MODE:
            if not phase.in_forward:
                scope.backward_started = True
            divergence = strategy.on_demand(unit, phase, demand)
        if why is not None:
            if why is OFF_ORDER:  # the strategy said which: it diverged here, or realigned (the prefix rule)
                why = scope.off_order(divergence)
            self._scopes.stats.miss_reasons[why.reason] += 1
        if divergence is not None:
            self._scopes.diverge(scope, f"iteration {scope.key!r} {divergence}")

    def _demanded_outside_scope(self, demand: Demand, held: Held | None) -> None:
        """A demand with no scope open (automatic scopes are off): only counted."""
        self._scopes.stats.count_served(None, [demand])
        if demand is _MISS:
            if held is not None:
                self._scopes.stats.count(None, Count.dropped)
            self._scopes.stats.miss_reasons[self._automatic.why_no_scope().reason] += 1

    def _gather_missed(self, unit: Unit, phase: Phase) -> None:
        """Issue a missed unit's gather at its demand; with ``measure_waits`` the issue counts as its wait."""
        if self._waits is None:
            gather_at_demand(unit, phase)
            return
        start = time.perf_counter()
        gather_at_demand(unit, phase)
        self._waits.issued(unit, time.perf_counter() - start)

    def on_lifecycle_reshard(self, unit: Unit) -> bool:
        """FSDP2 is about to reshard ``unit`` after a use; True skips it (the unit is kept)."""
        if self._window.holds(unit) is not _KEPT:
            return False
        if self._window.skip_reshard(unit):
            scope = self._scopes.open
            self._scopes.stats.count(scope.key if scope is not None else None, Count.kept)
        return True

    def on_other_party(self, unit: Unit, call: _compat.OtherPartyCall) -> None:
        """Someone else resharded, unsharded or reset ``unit``: it is theirs now, not the window's.

        FSDP2's ``reshard()`` leaves a pending gather pending; after theirs, plain FSDP2 would have
        none, so the scheduler's own prefetch is finished and freed first.
        """
        scope = self._scopes.open
        if call == "reshard" and scope is not None and isinstance(scope.strategy, Record):
            scope.strategy.recording.resharded_by_other(unit)
        gathers_now = call == "unshard" and _compat.is_sharded_idle(unit.state)
        held = self._window.take(unit)
        if gathers_now or (call == "unshard" and held is Held.prefetched):
            # The gather starts now, or the window's own (issued after any optimizer step: none is
            # left pending across one) becomes theirs: either way its values are current, so the
            # unit may be kept later. (A pipeline's UNSHARD of a chunk root prefetched at the
            # scope's start once made its next keep fail as stale.)
            self._window.gathered(unit)
        if scope is not None:
            undoes = call != "unshard" and not _compat.is_sharded_idle(unit.state)
            scope.other_party(unit, call, held, undoes=undoes)
        if held is None:
            return
        if held is Held.prefetched and call == "reshard":
            _compat.release(unit.state)
        self._scopes.stats.count(scope.key if scope is not None else None, Count.dropped)

    def _on_optimizer_step(self, concerned: bool) -> None:
        """An optimizer step is about to run: of the roots' parameters (``concerned``), or of another model's.

        Another model's ends no scope of this one (a GAN generator's scope, waiting for a backward
        through the discriminator, goes on past the discriminator's step), but what the window holds
        is released: plain FSDP2 leaves no gather of its own pending and no unit unsharded past its
        use, across any step, and neither may the scheduler.
        """
        scope = self._scopes.open
        if not concerned:
            if len(self._window):
                released = self._window.release_all("another model's optimizer.step()")
                self._scopes.stats.count(scope.key if scope is not None else None, Count.wasted, released)
            return
        self._window.step_taken()
        if scope is None:
            return
        if not scope.explicit:
            self._scopes.close_auto(scope)
        elif len(self._window):
            if not self._warned_step_in_scope:
                self._warned_step_in_scope = True
                logger.warning(
                    "fsdp_replay: optimizer.step() inside iteration(key=%r) released %d pending prefetches "
                    "(they would run on stale weights); call step() after the iteration() block", scope.key, len(self._window)
                )
            self._scopes.stats.count(scope.key, Count.wasted, self._window.release_all("optimizer.step() inside iteration()"))

    def _agree_on_max(self, values: list[int]) -> list[int]:
        return agree_on_max(values, [unit.state for unit in self.units])


__all__ = ["PrefetchDivergenceError", "PrefetchScheduler", "RankMismatchError"]
