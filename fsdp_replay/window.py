"""The units held ahead of use: all-gathers issued early, and units kept unsharded for their next use."""

from __future__ import annotations

from typing import Any, Literal

from fsdp_replay import _compat
from fsdp_replay.units import Unit

Held = Literal["prefetched", "kept"]


class PrefetchWindow:
    """Units whose next demand the scheduler has already provided for, in insertion order.

    A unit is held either as a *prefetch* (its all-gather issued before the demand) or as a *keep*
    (it is in use now and FSDP2 is told to skip its reshard, because the order needs it again
    next). Both hold one unit's unsharded bytes, which the byte cap counts; only a prefetch is an
    all-gather in flight, so only prefetches count against the prefetch depth.

    Every decision here depends only on the recorded order and on unit sizes, which all ranks
    share, so all ranks issue the same all-gathers in the same order.
    """

    def __init__(self, *, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._prefetched: dict[Unit, None] = {}
        self._kept: dict[Unit, Any] = {}
        """Kept unit -> the reshard settings to restore once it is demanded or released."""
        self._bytes_ahead = 0

    def __len__(self) -> int:
        return len(self._prefetched) + len(self._kept)

    def holds(self, unit: Unit) -> Held | None:
        """How the unit's next demand is already provided for, if it is."""
        if unit in self._prefetched:
            return "prefetched"
        return "kept" if unit in self._kept else None

    @property
    def bytes_ahead(self) -> int:
        return self._bytes_ahead

    def fits(self, unit: Unit) -> bool:
        """Within the byte cap; one unit may always be held even if it alone exceeds it."""
        if self.max_bytes is None or not len(self):
            return True
        return self._bytes_ahead + unit.unsharded_bytes <= self.max_bytes

    def gather_now(self, unit: Unit, *, backward: bool) -> None:
        """Issue the demanded unit's own gather before any prefetch, so it is not queued behind them."""
        with _compat.trace("fsdp_replay::gather_at_demand", unit.fqn):
            _compat.issue_unshard(unit.state, backward=backward)

    def prefetch(self, unit: Unit, *, backward: bool) -> bool:
        """Issue ``unit``'s all-gather ahead of use; False if FSDP2 declined (e.g. no unshard in backward)."""
        with _compat.trace("fsdp_replay::prefetch", unit.fqn):
            _compat.issue_unshard(unit.state, backward=backward)
        if not _compat.is_pending(unit.state):
            return False
        self._prefetched[unit] = None
        self._bytes_ahead += unit.unsharded_bytes
        return True

    def keep(self, unit: Unit) -> bool:
        """Keep the in-use ``unit`` unsharded through its coming reshard; False where that is not possible."""
        with _compat.trace("fsdp_replay::keep", unit.fqn):
            saved = _compat.keep_unsharded(unit.state)
        if saved is None:
            return False
        self._kept[unit] = saved
        self._bytes_ahead += unit.unsharded_bytes
        return True

    def take(self, unit: Unit) -> Held | None:
        """The unit was demanded: it leaves the window. Says how the scheduler had provided for it."""
        if unit in self._prefetched:
            del self._prefetched[unit]
            self._bytes_ahead -= unit.unsharded_bytes
            return "prefetched"
        if unit in self._kept:
            # In use again from here: FSDP2 reshards it after this use, unless a refill keeps it again.
            _compat.stop_keeping(unit.state, self._kept.pop(unit), reshard_now=False)
            self._bytes_ahead -= unit.unsharded_bytes
            return "kept"
        return None

    def release_all(self) -> int:
        """Free every unused prefetch and keep; returns how many were wasted.

        A gather left pending past the scope would make the next unshard a no-op, and a unit left
        unsharded would keep its old values: either way it would run on stale weights after
        ``optimizer.step()``.
        """
        wasted = len(self)
        for unit in self._prefetched:
            state = unit._state()
            if state is not None and _compat.is_pending(state):
                with _compat.trace("fsdp_replay::release", unit.fqn):
                    _compat.release(state)
        for unit, saved in self._kept.items():
            if (state := unit._state()) is not None:
                with _compat.trace("fsdp_replay::release", unit.fqn):
                    _compat.stop_keeping(state, saved, reshard_now=True)
        self._prefetched.clear()
        self._kept.clear()
        self._bytes_ahead = 0
        return wasted
