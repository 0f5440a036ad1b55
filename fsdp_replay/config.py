"""User-facing configuration: the prefetch mode enum and the per-scheduler config dataclass."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PrefetchMode", "PrefetchConfig", "DIVERGENCE_POLICIES"]


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


DIVERGENCE_POLICIES = ("fallback", "raise")


@dataclass
class PrefetchConfig:
    """Configuration of one :class:`~fsdp_replay.PrefetchScheduler` (also the Hydra ``prefetch`` schema)."""

    mode: PrefetchMode = PrefetchMode.record_and_replay
    """Scheduling mode; see :class:`PrefetchMode`."""
    forward_prefetch: int = 1
    """All-gathers in flight ahead of use while in forward; 0 disables forward prefetch (and keeps)."""
    backward_prefetch: int = 1
    """All-gathers in flight ahead of use while in backward (activation recompute counts as backward)."""
    max_prefetch_bytes: int | None = None
    """Cap on unsharded bytes held ahead of use (gathered early or kept unsharded); one unit is always allowed."""
    check_ranks: bool = True
    """Compare every new recording across the ranks of the units' process group before replaying it."""
    on_divergence: str = "fallback"
    """``"fallback"``: finish the iteration demand-only and re-record; ``"raise"``: raise an error."""

    def __post_init__(self) -> None:
        self.mode = PrefetchMode.parse(self.mode)
        for name in ("forward_prefetch", "backward_prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"PrefetchConfig.{name} must be an integer >= 0 (0 disables it), got {value!r}"
                )
        cap = self.max_prefetch_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(
                "PrefetchConfig.max_prefetch_bytes must be a positive integer number of bytes "
                f"or None (no cap), got {cap!r}"
            )
        if not isinstance(self.check_ranks, bool):
            raise ValueError(f"PrefetchConfig.check_ranks must be true or false, got {self.check_ranks!r}")
        if self.on_divergence not in DIVERGENCE_POLICIES:
            raise ValueError(
                f"PrefetchConfig.on_divergence: unknown policy {self.on_divergence!r}; "
                f"valid policies are {', '.join(DIVERGENCE_POLICIES)}"
            )
