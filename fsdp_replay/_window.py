"""The units held ahead of use: all-gathers issued early, and units kept unsharded for their next use."""

from __future__ import annotations

import enum
from typing import Any, Callable

from fsdp_replay import _compat
from fsdp_replay._timeline import Event, Timeline
from fsdp_replay._units import Unit
from fsdp_replay.stats import MissReason, Why


class Held(enum.Enum):
    """How the window provides for a unit's next demand."""

    prefetched = "prefetched"
    """Its all-gather was issued ahead of the demand."""
    kept = "kept"
    """It is in use now and FSDP2's reshard at the end of that use is skipped."""


_PREFETCHED, _KEPT, _PROVIDED = Held.prefetched, Held.kept, Event.provided
"""Read per demand: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""

_NO_KEEPS = Why(MissReason.public_fallback, "without FSDP2's internals its reshards cannot be skipped, so a unit in use is not kept")
_STALE = Why(MissReason.cannot_keep, "its unsharded values predate the last optimizer step")


class PrefetchWindow:
    """Units whose next demand the scheduler has already provided for, in insertion order.

    A unit is held either as a *prefetch* (its all-gather issued before the demand) or as a *keep*
    (it is in use now, and FSDP2's own reshard at the end of that use is skipped because the order
    needs the unit again next). Both hold one unit's unsharded bytes, which the byte cap counts.
    Against the prefetch depth, replay counts only the prefetches among the entries it provides
    for (a keep is no all-gather in flight), while static counts everything held (``len``): it
    never keeps, and its wrong guesses stay held until used or released (see ``_strategies.py``).

    Every decision here depends only on the recorded order and on unit sizes, which all ranks
    share, so all ranks issue the same all-gathers in the same order. Another party's reshard,
    unshard or reset of a held unit (see [Note: fsdp_replay never owns FSDP2's settings] in
    ``_compat/intercept.py``) hands it over: :meth:`take` drops it without touching FSDP2.
    """

    def __init__(self, *, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.can_keep = True
        """Whether FSDP2's reshards can be seen and skipped (its internals are available): the
        scheduler says once it has registered its hooks."""
        self._held: dict[Unit, Held] = {}
        self.holds: Callable[[Unit], Held | None] = self._held.get
        """How the unit's next demand is already provided for, if it is (asked per refill entry and
        per reshard: the dict's own ``get``, not a Python call)."""
        self.count: Callable[[], int] = self._held.__len__
        """How many units are held: ``len(window)`` without a Python call (static asks it per guess)."""
        self._skipped: set[Unit] = set()
        """Kept units a reshard of which was skipped (so plain FSDP2 would have them sharded now)."""
        self._bytes_ahead = 0
        self.wasted = 0
        """Units released one at a time (:meth:`release`) since the scheduler last counted them."""
        self.wasted_bytes = 0
        """Their unsharded bytes, and those of every :meth:`release_all`, since the scheduler last counted them."""
        self.issued = 0
        """Prefetches issued since the scheduler last counted them into its stats (it does when they
        are read and when a scope ends: no call per prefetch)."""
        self._gathered: set[Unit] = set()
        """Units all-gathered since the last optimizer step: only their unsharded values are current.
        A unit left unsharded across a step is stale, and plain FSDP2 renews it at its next reshard
        and gather, so only these are ever kept."""
        self.timeline = Timeline()
        """The open scope's timeline (the scheduler sets it): each gather issued and keep is appended."""
        self.unverified: dict[Unit, int] | None = None
        """Units held while the user's code ran, with their parameters' versions from before it
        (:meth:`note_versions`); the next demand checks them first (:meth:`verify`)."""

    def __len__(self) -> int:
        return len(self._held)

    def units(self, held: Held) -> list[Unit]:
        """The units held one way, in the order they joined the window."""
        return [unit for unit, how in self._held.items() if how is held]

    @property
    def bytes_ahead(self) -> int:
        return self._bytes_ahead

    def fits(self, unit: Unit) -> bool:
        """Within the byte cap; one unit may always be held even if it alone exceeds it."""
        if self.max_bytes is None or not len(self):
            return True
        return self._bytes_ahead + unit.unsharded_bytes <= self.max_bytes

    def prefetch(self, unit: Unit, state: Any, *, backward: bool) -> bool:
        """Issue ``unit``'s all-gather ahead of use (``state``: its FSDP2 state); False if FSDP2 would
        decline or drop it (no unshard in backward, a gradient reduction pending)."""
        if not _compat.issue_unshard(state, backward=backward, fqn=unit.fqn):
            return False
        self._held[unit] = _PREFETCHED
        self._gathered.add(unit)
        self.issued += 1
        self._bytes_ahead += unit.unsharded_bytes
        self.timeline.append((_PROVIDED, unit, _PREFETCHED))
        return True

    def note_versions(self) -> None:
        """The user's code runs next, before any demand (an explicit scope has just started, a
        backward has just ended, an automatic scope's forward has just ended): note what each held
        unit's gather or keep was taken from.

        [Note: parameters changed before a demand]
        A prefetch issued there holds the values the parameters had then. Code between
        ``iteration()``'s start and the first forward may change them in place: a checkpoint
        loaded, EMA weights copied in for an evaluation, a weight sync; so may code after a step
        given up after its forward (a rollback), while an automatic scope still holds what it
        provided for that forward's backward. Plain FSDP2 gathers at the
        forward and uses the new values, so the held gather must be dropped. The parameters'
        version counters say whether they changed (``_compat.param_versions``); every rank changes
        its shards alike, so every rank drops the same gathers. Noted here once per scope and per
        backward, checked at the next demand: one attribute test per demand otherwise (about 5
        Python opcodes of plain FSDP2's ~9,300 a demand; docs/HOST_COST.md).
        """
        self.unverified = {unit: _compat.param_versions(unit.state) for unit in self._held} or None

    def verify(self) -> list[Unit]:
        """Release each unit :meth:`note_versions` noted whose parameters changed since: its gather
        or keep holds their old values (FSDP2 gathers it again at its demand). Returns them."""
        noted, self.unverified = self.unverified, None
        changed = [
            unit
            for unit, versions in (noted or {}).items()
            if unit in self._held and (state := unit.state_or_none()) is not None and _compat.param_versions(state) != versions
        ]
        for unit in changed:
            self.release(unit, "its parameters changed in place before its demand")
        return changed

    def why_not_kept(self, unit: Unit) -> Why | None:
        """Why the in-use ``unit`` may not be kept for its next use rather than resharded; None if it may."""
        if not self.can_keep:
            return _NO_KEEPS
        return None if unit in self._gathered else _STALE

    def keep(self, unit: Unit) -> None:
        """Hold the in-use ``unit``: FSDP2's reshards of it are skipped until its next demand."""
        self._held[unit] = _KEPT
        self._bytes_ahead += unit.unsharded_bytes
        self.timeline.append((_PROVIDED, unit, _KEPT))

    def skip_reshard(self, unit: Unit) -> bool:
        """FSDP2's reshard of the kept ``unit`` after a use is skipped; returns whether it is the
        first for the current keep (what the ``kept`` counter counts)."""
        first = unit not in self._skipped
        self._skipped.add(unit)
        return first

    def gathered(self, unit: Unit) -> None:
        """``unit`` is all-gathered now by someone else's doing (FSDP2 at a missed demand, a
        pipeline's UNSHARD action): its values are current. (The window's own prefetches count
        themselves as they are issued; a gather someone else left pending may predate a step.)"""
        self._gathered.add(unit)

    def step_taken(self) -> None:
        """An optimizer step updated the sharded parameters: no unsharded value is current now."""
        self._gathered.clear()

    def take(self, unit: Unit) -> Held | None:
        """``unit`` leaves the window, FSDP2 untouched: its demand came, or another party took it over.

        Says how the scheduler had provided for it. A kept unit demanded is in use again: FSDP2
        reshards it after this use, unless a refill keeps it again.
        """
        held = self._held.pop(unit, None)
        if held is None:
            return None
        self._skipped.discard(unit)
        self._bytes_ahead -= unit.unsharded_bytes
        return held

    def release(self, unit: Unit, why: str) -> None:
        """Free the unused prefetch or keep of ``unit`` now, noting ``why`` (its entry was skipped:
        replay passed it by); counted into :attr:`wasted`. Its bytes leave the cap at once."""
        held = self._held[unit]
        self.timeline.append((Event.released, unit, held, why))
        self._free(unit, held)
        self.take(unit)
        self.wasted += 1
        self.wasted_bytes += unit.unsharded_bytes

    def _free(self, unit: Unit, held: Held) -> None:
        """Undo what the window did for ``unit``: cancel its pending gather, or reshard it if a reshard was skipped."""
        state = unit.state_or_none()
        if state is None:
            return
        if held is _PREFETCHED:
            if _compat.is_pending(state):
                with _compat.trace("fsdp_replay::release", unit.fqn):
                    _compat.release(state)
        elif unit in self._skipped:
            with _compat.trace("fsdp_replay::release", unit.fqn):
                _compat.reshard_if_idle(state)

    def take_dropped(self) -> list[Unit]:
        """Take out each prefetch whose gather FSDP2 finished and dropped as it finalized a backward
        (``finalize_backward``: a gather no use waited on), FSDP2 untouched; returns them. Held on,
        each would take a depth slot and bytes until its unit's next demand, which may not come in
        the scope: a static guess that was wrong stopped static's prefetches for the rest of an
        explicit scope (a multi-task model's heads: 258 misses in 324 demands, against 180)."""
        dropped = [
            unit
            for unit, held in self._held.items()
            if held is _PREFETCHED and ((state := unit.state_or_none()) is None or not _compat.is_pending(state))
        ]
        for unit in dropped:
            self.take(unit)
        return dropped

    def release_all(self, why: str) -> int:
        """Free every unused prefetch and keep, noting ``why`` in the timeline; returns how many were wasted.

        A gather left pending past the scope would make the next unshard a no-op, and a unit left
        unsharded would keep its old values: either way it would run on stale weights after
        ``optimizer.step()``. A keep whose reshard was never skipped needs nothing: FSDP2 reshards
        the unit at the end of its current use, as it would have anyway.
        """
        wasted = len(self)
        self.wasted_bytes += self._bytes_ahead
        prefetched, kept = self.units(Held.prefetched), self.units(Held.kept)
        self.timeline += [(Event.released, unit, Held.prefetched, why) for unit in prefetched]
        self.timeline += [(Event.released, unit, Held.kept, why) for unit in kept]
        for unit in prefetched + kept:
            self._free(unit, self._held[unit])
        self._held.clear()
        self._skipped.clear()
        self.unverified = None
        self._bytes_ahead = 0
        return wasted
