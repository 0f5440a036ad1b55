"""The all-gathers issued ahead of use: issuing, budgeting and releasing them."""

from __future__ import annotations


from fsdp_replay import _compat
from fsdp_replay.units import Unit


class PrefetchWindow:
    """Units whose all-gather the scheduler issued before their demand (insertion ordered).

    Every decision here depends only on the recorded order and on unit sizes, which all ranks
    share, so all ranks issue the same all-gathers in the same order.
    """

    def __init__(self, *, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._ahead: dict[Unit, None] = {}
        self._bytes_ahead = 0

    def __len__(self) -> int:
        return len(self._ahead)

    def __contains__(self, unit: Unit) -> bool:
        return unit in self._ahead

    @property
    def bytes_ahead(self) -> int:
        return self._bytes_ahead

    def fits(self, unit: Unit) -> bool:
        """Within the byte cap; one unit may always be in flight even if it alone exceeds it."""
        if self.max_bytes is None or not self._ahead:
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
        self._ahead[unit] = None
        self._bytes_ahead += unit.unsharded_bytes
        return True

    def take(self, unit: Unit) -> bool:
        """The unit was demanded: it leaves the window. True if the scheduler had prefetched it."""
        if unit not in self._ahead:
            return False
        del self._ahead[unit]
        self._bytes_ahead -= unit.unsharded_bytes
        return True

    def release_all(self) -> int:
        """Wait for and free every unused prefetch; returns how many were wasted.

        A gather left pending past the scope would make the next unshard a no-op, so the unit
        would run on stale weights after ``optimizer.step()``.
        """
        wasted = len(self._ahead)
        for unit in self._ahead:
            state = unit._state()
            if state is not None and _compat.is_pending(state):
                with _compat.trace("fsdp_replay::release", unit.fqn):
                    _compat.release(state)
        self._ahead.clear()
        self._bytes_ahead = 0
        return wasted
