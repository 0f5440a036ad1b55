"""Callbacks that reach the scheduler through a weak reference: a global hook must not keep a model alive."""

from __future__ import annotations

import weakref
from typing import Any, Callable

from fsdp_replay.stats import Count


def weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` for the global optimizer hook, holding the scheduler (and its model) weakly."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        if (live := ref()) is not None:
            live(*args)

    return call


def prefetch_counter(scheduler: Any, key: str) -> Callable[[], None]:
    """Counts a prefetch in the scheduler's stats of the moment (``reset_stats()`` replaces them),
    holding it weakly; allocates nothing per call (a bound method or ``*args`` would feed the GC)."""
    ref = weakref.ref(scheduler)

    def count() -> None:
        if (live := ref()) is not None:
            live.stats.count(key, Count.prefetches)

    return count
