"""Adaptive prefetch depth (``forward_prefetch="auto"`` / ``backward_prefetch="auto"``).

At the end of each scope of a key the ranks agree on what the scope saw (one small all-reduce of
the largest wait per phase, the scope's wall time and whether the byte cap stopped a refill; none
per demand), then every rank runs the same decision on those same figures, so all ranks run the
same depth and issue the same all-gathers in the same order: a rank-local timing never changes
what is gathered. Per phase, from depth 1:

- a significant wait tries one step deeper; if that cut the wait by at least a fifth, and by a
  significant amount itself, it stays (and may go on), otherwise it goes back and never tries
  deeper again (the depth stays put). The second test stops a long climb on gains inside one
  scope's timing noise, each bought with one more unit's bytes;
- a refill the byte cap stopped means the cap cannot hold this depth: one step back, and no deeper;
- with nothing left to wait for, a depth above what a wait was seen at steps back to give memory
  back (after the key's order is recorded again, or the cap changed, what was learnt is forgotten).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from fsdp_replay._order import Depth

logger = logging.getLogger("fsdp_replay")

AUTO = "auto"

SIGNIFICANT_SHARE = 0.02
"""A phase's wait is worth a deeper prefetch above this share of the scope's wall time (and a
step deeper is worth its bytes where it won back as much)..."""
SIGNIFICANT_S = 1e-4
"""...and above this many seconds."""
IMPROVED = 0.8
"""One step deeper is kept where it brought the wait below this share of what it was (and won
back a significant wait)."""
IDLE_SHARE = 0.002
"""Below this share of the scope's time nothing is left to hide."""

Agree = Callable[[list[int]], list[int]]
"""Every rank's values in, the element-wise largest over the ranks out (``_ranks.agree_on_max``)."""


@dataclass(frozen=True)
class ScopeWaits:
    """What a scope that prefetched to its end tells the adaptive depth."""

    waited_s: tuple[float, float]
    """Seconds blocked on parameters in forward, and in backward (recompute included)."""
    scope_s: float
    capped: tuple[bool, bool]
    """Whether the byte cap stopped a refill heading into that phase."""


@dataclass
class _Phase:
    """The adaptive depth of one phase of one key, and what was learnt on the way."""

    depth: int = 1
    floor: int = 1
    """No shallower: a wait was seen below it."""
    ceiling: int | None = None
    """No deeper: the cap stopped a refill, or one step deeper did not help."""
    trying_from: tuple[int, float] | None = None
    """The depth (and its wait) this one step deeper is being tried from."""

    def decide(self, waited_s: float, scope_s: float, capped: bool, deepest: int) -> None:
        if capped:
            self.depth = self.ceiling = max(1, self.depth - 1)
            self.trying_from = None
            return
        if self.trying_from is not None:
            shallower, its_wait = self.trying_from
            self.trying_from = None
            if shallower > self.depth:  # a step back to give memory back
                if self._significant(waited_s, scope_s):
                    self.depth, self.floor = shallower, shallower
                return
            if waited_s >= IMPROVED * its_wait or not self._significant(its_wait - waited_s, scope_s):
                self.depth = self.ceiling = shallower
                return
            self.floor = self.depth
        if self._significant(waited_s, scope_s):
            if self.depth < min(deepest, self.ceiling or deepest):
                self.trying_from = (self.depth, waited_s)
                self.depth += 1
        elif waited_s <= IDLE_SHARE * scope_s and self.depth > self.floor:
            self.trying_from = (self.depth, waited_s)
            self.depth -= 1

    @staticmethod
    def _significant(waited_s: float, scope_s: float) -> bool:
        return waited_s > SIGNIFICANT_S and waited_s > SIGNIFICANT_SHARE * scope_s

    def forget(self) -> None:
        self.floor, self.ceiling, self.trying_from = 1, None, None


class AdaptiveDepth:
    """The prefetch depth each key's next scope runs with: fixed per phase, or adapted (``"auto"``)."""

    def __init__(self, forward: int | str, backward: int | str, *, deepest: int, agree: Agree) -> None:
        self._fixed = (None if forward == AUTO else int(forward), None if backward == AUTO else int(backward))
        self._deepest = deepest
        self._agree = agree
        self._keys: dict[str, tuple[_Phase, _Phase]] = {}

    @property
    def adaptive(self) -> bool:
        return None in self._fixed

    def of(self, key: str) -> Depth:
        phases = self._keys.get(key)
        return Depth(*(
            fixed if fixed is not None else (phases[i].depth if phases is not None else 1)
            for i, fixed in enumerate(self._fixed)
        ))

    def scope_ended(self, key: str, waits: ScopeWaits | None) -> None:
        """Agree on what the scope saw and decide ``key``'s next depth; where :attr:`adaptive`, call
        at every scope end on every rank (``waits`` None where the scope did not prefetch to its end)."""
        mine = [0] * 6 if waits is None else [
            1, round(waits.scope_s * 1e6), *(round(w * 1e6) for w in waits.waited_s), *map(int, waits.capped)
        ]
        prefetched, scope_us, forward_us, backward_us, capped_forward, capped_backward = self._agree(mine)
        if not prefetched:
            return
        phases = self._keys.setdefault(key, (_Phase(), _Phase()))
        for i, (waited_us, capped) in enumerate(((forward_us, capped_forward), (backward_us, capped_backward))):
            if self._fixed[i] is not None:
                continue
            phase, before = phases[i], phases[i].depth
            phase.decide(waited_us / 1e6, scope_us / 1e6, bool(capped), self._deepest)
            if phase.depth != before:
                logger.info("fsdp_replay: %s prefetch depth of %r: %d -> %d", ("forward", "backward")[i], key, before, phase.depth)

    def rerecorded(self, key: str) -> None:
        """The key's order is recorded again: what was learnt about its waits may no longer hold."""
        for phase in self._keys.get(key, ()):
            phase.forget()

    def cap_changed(self) -> None:
        """The byte cap changed: the depths it bounded may now go deeper (or must come down)."""
        for phases in self._keys.values():
            for phase in phases:
                phase.forget()


def phase_waits(rows: Sequence[tuple[bool, float]]) -> tuple[float, float]:
    """Seconds waited in forward and in backward, from ``(in_forward, seconds)`` pairs."""
    forward = sum(seconds for in_forward, seconds in rows if in_forward)
    return forward, sum(seconds for _, seconds in rows) - forward


__all__ = ["AUTO", "AdaptiveDepth", "ScopeWaits", "phase_waits"]
