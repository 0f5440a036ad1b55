"""Measured waits: how long each use of a unit blocked on its parameters.

FSDP2's own unshard and wait of a use are timed (``_compat/waits.py``): on CPU by the wall
clock, on an accelerator by timing events that are read only when the waits are taken, so
measuring adds no synchronization per use. :class:`DemandWaits` gives a scheduler's waits to
its demands (``PrefetchConfig(measure_waits=True)``, read through ``explain()``);
:class:`WaitMeter` measures any FSDP2 model, plain FSDP2 included, which is how the benchmark
compares every mode by one measurement.
"""

from __future__ import annotations

import functools
from typing import Any, Hashable

import torch.nn as nn

from fsdp_replay import _compat
from fsdp_replay._units import Unit, discover_units

__all__ = ["WaitMeter"]


class WaitLog:
    """Waits in the order they happened, each under a tag; accelerator waits are read at :meth:`seconds`."""

    def __init__(self) -> None:
        self._waits: list[tuple[Hashable, Any]] = []
        """``(tag, seconds)``, or ``(tag, (start, end))`` for timing events not read yet."""

    def add(self, tag: Hashable, seconds: float) -> None:
        self._waits.append((tag, seconds))

    def add_events(self, tag: Hashable, start: Any, end: Any) -> None:
        self._waits.append((tag, (start, end)))

    def seconds(self) -> list[tuple[Hashable, float]]:
        """Every wait as ``(tag, seconds)``, in order; synchronizes on the last event recorded, once."""
        resolved = []
        for tag, wait in self._waits:
            if isinstance(wait, tuple):
                start, end = wait
                end.synchronize()
                wait = start.elapsed_time(end) / 1e3
            resolved.append((tag, wait))
        self._waits = resolved
        return list(resolved)


class DemandWaits:
    """The open scope's waits by demand row: a unit's wait counts toward its latest demand."""

    def __init__(self, *, on_host: bool) -> None:
        self.log = WaitLog()
        self._row_of: dict[Unit, int] = {}
        self._on_host = on_host

    def issued(self, unit: Unit, seconds: float) -> None:
        """A missed unit's gather was issued at its demand: on the host that much was blocking
        (an accelerator's stall is in its wait's timing events)."""
        if self._on_host:
            self.waited(unit, seconds)

    def demanded(self, unit: Unit, row: int) -> None:
        self._row_of[unit] = row

    def waited(self, unit: Unit, seconds: float) -> None:
        if (row := self._row_of.get(unit)) is not None:
            self.log.add(row, seconds)

    def waited_on_device(self, unit: Unit, start: Any, end: Any) -> None:
        if (row := self._row_of.get(unit)) is not None:
            self.log.add_events(row, start, end)

    def take(self) -> WaitLog:
        """The scope's waits; the next scope starts with none."""
        log, self.log, self._row_of = self.log, WaitLog(), {}
        return log


class WaitMeter:
    """How long each use of each FSDP2 unit under ``root`` blocked on its all-gather.

    Works on plain FSDP2 (no scheduler needed) and beside a scheduler, attached before or after it,
    with or without ``measure_waits``: each timer of a unit is told of the same waits.

    Raises:
        RuntimeError: FSDP2's internals are not used on this torch (see ``PublicAPIFallbackWarning``),
            or ``root`` has no ``fully_shard`` unit with parameters.
    """

    def __init__(self, root: nn.Module) -> None:
        if not _compat.INTERNALS_OK:
            raise RuntimeError("WaitMeter needs FSDP2's internals, which are not used on this torch (see the PublicAPIFallbackWarning)")
        units = discover_units(root)
        if not units:
            raise ValueError(f"WaitMeter: no fully_shard unit with parameters under {type(root).__name__}")
        self._log = WaitLog()
        self._timers = [
            (unit, _compat.time_waits(
                unit.state, functools.partial(self._waited, unit.fqn), functools.partial(self._waited_on_device, unit.fqn)
            ))
            for unit in units
        ]

    def _waited(self, fqn: str, seconds: float) -> None:
        self._log.add(fqn, seconds)

    def _waited_on_device(self, fqn: str, start: Any, end: Any) -> None:
        self._log.add_events(fqn, start, end)

    def take(self) -> list[tuple[str, float]]:
        """``(unit FQN, seconds)`` of every use that blocked since the last take, in order."""
        log, self._log = self._log, WaitLog()
        return log.seconds()

    def remove(self) -> None:
        """Stop timing; FSDP2's methods are as they were once nothing else of fsdp_replay uses them."""
        for unit, timer in self._timers:
            if (state := unit.state_or_none()) is not None:
                _compat.stop_timing_waits(state, timer)
        self._timers = []

    def __enter__(self) -> WaitMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
