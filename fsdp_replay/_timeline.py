"""What one scope did, in order: its demands, and what the window did around them.

The scheduler appends a demand (with how it was served and, for a miss, why); the window appends
each gather it issues ahead and each keep, and the scheduler each release and hand-over. One
append per event and nothing else while the scope runs: ``explain()`` turns a finished scope's
timeline into rows (``explain.py``) only when asked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from fsdp_replay.waits import WaitLog


class Event(enum.Enum):
    demand = "demand"
    """``(Event.demand, unit, phase, Demand, Held | None, Why | None)``: a unit needed its parameters."""
    provided = "provided"
    """``(Event.provided, unit, Held)``: the window issued its gather ahead, or kept it unsharded."""
    released = "released"
    """``(Event.released, unit, Held, why: str)``: the scheduler freed it unused (a wasted gather)."""
    skipped = "skipped"
    """``(Event.skipped, unit, phase, why: str)``: replay passed a recorded entry by; its unit did not run there."""
    taken_over = "taken_over"
    """``(Event.taken_over, unit, Held, who: str)``: another party undid or took over what was provided."""


class Timeline(list):
    """The events of one scope, in the order they happened (tuples led by an :class:`Event`)."""

    __slots__ = ()


@dataclass
class FinishedScope:
    """A scope as ``explain()`` reports it: what it was, how it ended, and what happened in it."""

    key: str
    mode: str
    """What the scope set out to do: ``record``, ``replay``, ``static`` or ``demand``."""
    outcome: str
    """``completed``, or why it did not (a divergence, an exception)."""
    timeline: Timeline
    waits: WaitLog | None
    """Waits by demand position; None where they were not measured."""
