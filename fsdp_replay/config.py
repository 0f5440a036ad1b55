"""User-facing configuration: the prefetch mode enum and the per-scheduler config dataclass."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DivergencePolicy", "PrefetchConfig", "PrefetchMode"]


class PrefetchMode(enum.Enum):
    """How unshard calls are scheduled.

    Member names are exactly what users type (Hydra converts strings to enums by *name*).
    """

    static = "static"
    """Order fixed at attach time: module-tree order in forward, its reverse in backward."""
    record_and_replay = "record_and_replay"
    """Record the first iteration's demands, then prefetch ahead through a cursor."""
    demand = "demand"
    """No prefetch at all: every unit is all-gathered at its point of use."""

    @classmethod
    def parse(cls, value: PrefetchMode | str) -> PrefetchMode:
        """Accept a member or its name; reject anything else naming the valid names."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value in cls.__members__:
            return cls[value]
        raise ValueError(
            f"PrefetchConfig.mode: unknown prefetch mode {value!r}; "
            f"valid modes are {', '.join(cls.__members__)}"
        )


def require_at_least(minimum: int, owner: object, *names: str, why: str = "") -> None:
    """Reject integer fields below ``minimum``, naming the field as the user types it.

    Also what the recipe's and the benchmark's configs validate with, so every config error reads
    alike: ``PrefetchConfig.forward_prefetch must be an integer >= 0 (0 disables it), got -1``.
    """
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"{type(owner).__name__}.{name} must be an integer >= {minimum}{f' ({why})' if why else ''}, got {value!r}"
            )


class DivergencePolicy(str, enum.Enum):
    """What a replayed scope does when its demands leave the recorded order.

    Users type the values, ``"fallback"`` and ``"raise"`` (``raise`` is a Python keyword, so its
    member is ``raise_``). A member compares equal to its value.
    """

    fallback = "fallback"
    """Finish the scope demand-only, drop the key's order and re-record at the key's next scope."""
    raise_ = "raise"
    """Raise :class:`~fsdp_replay.PrefetchDivergenceError` naming the position, the expected and the actual entry."""

    @classmethod
    def parse(cls, value: DivergencePolicy | str) -> DivergencePolicy:
        """Accept a member or its value; reject anything else naming the valid values."""
        for policy in cls:
            if isinstance(value, str) and value == policy.value:
                return policy
        raise ValueError(
            f"PrefetchConfig.on_divergence: unknown policy {value!r}; "
            f"valid policies are {', '.join(policy.value for policy in cls)}"
        )


@dataclass
class PrefetchConfig:
    """Configuration of one :class:`~fsdp_replay.PrefetchScheduler` (also the Hydra ``prefetch`` schema)."""

    mode: PrefetchMode = PrefetchMode.record_and_replay
    """Scheduling mode; see :class:`PrefetchMode`."""
    forward_prefetch: int | str = 1
    """All-gathers in flight ahead of use while in forward; 0 disables forward prefetch (and keeps).

    ``"auto"``: from 1, each scope's measured waits decide its key's next depth, agreed across
    ranks (README.md "Adaptive depth"); waits are then measured whatever ``measure_waits`` says.
    """
    backward_prefetch: int | str = 1
    """All-gathers in flight ahead of use while in backward (activation recompute counts as backward); or ``"auto"``."""
    max_prefetch_bytes: int | None = None
    """Cap on unsharded bytes held ahead of use (gathered early or kept unsharded); one unit is always allowed."""
    max_reuse_distance: int = 0
    """``record_and_replay``: keep a unit unsharded from one use to its next where at most this many
    all-gathers come between them in the recorded order, instead of resharding it and gathering it
    again (a forward and its activation-checkpoint recompute, a block called again): one all-gather
    saved for its bytes held over that span (DeepSpeed ZeRO-3's ``stage3_max_reuse_distance``,
    counted in all-gathers). Never across the end of a backward; the byte cap counts kept units.
    0: a unit is kept only for a next use inside the prefetch lookahead."""
    record_steps: int = 1
    """``record_and_replay``: scopes of a key recorded (demand-only) before its order is replayed.
    Above 1 their orders are merged with how often each entry ran, so that units the data runs only
    sometimes (idle MoE experts, dropped layers) are known, and those that ran in fewer than half of
    them are not prefetched speculatively (docs/TOLERANT_REPLAY.md). Also after each divergence."""
    check_ranks: bool = True
    """Compare every new recording across the ranks of the units' process group before replaying it."""
    on_divergence: DivergencePolicy | str = DivergencePolicy.fallback
    """``"fallback"``: finish the iteration demand-only and re-record; ``"raise"``: raise an error.

    A string is turned into a :class:`DivergencePolicy` here, after Hydra has composed the config,
    so that an unknown value is reported with the valid ones (see :meth:`DivergencePolicy.parse`).
    """

    measure_waits: bool = False
    """Time how long each demand blocks on its parameters, for ``explain()`` (CPU: the wall clock;
    CUDA: timing events, read when a report is built, never synchronized per demand)."""

    def __post_init__(self) -> None:
        self.mode = PrefetchMode.parse(self.mode)
        for name in ("forward_prefetch", "backward_prefetch"):
            if getattr(self, name) != "auto":
                require_at_least(0, self, name, why="0 disables it; or 'auto'")
        require_at_least(0, self, "max_reuse_distance", why="all-gathers between two uses; 0 keeps only within the lookahead")
        require_at_least(1, self, "record_steps", why="scopes recorded and merged before replay")
        if self.max_reuse_distance and self.mode is not PrefetchMode.record_and_replay:
            raise ValueError(
                f"PrefetchConfig.max_reuse_distance={self.max_reuse_distance} needs mode record_and_replay (the "
                f"recorded order says when a unit is used next), got mode {self.mode.name}; set it to 0 or change the mode"
            )
        cap = self.max_prefetch_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(
                "PrefetchConfig.max_prefetch_bytes must be a positive integer number of bytes "
                f"or None (no cap), got {cap!r}"
            )
        for name in ("check_ranks", "measure_waits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PrefetchConfig.{name} must be true or false, got {getattr(self, name)!r}")
        self.on_divergence = DivergencePolicy.parse(self.on_divergence)
