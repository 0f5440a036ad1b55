"""What the tests compare with plain FSDP2: each mode, and replay keeping units for later uses."""

from __future__ import annotations

from fsdp_replay import PrefetchConfig

REUSE = "record_and_replay, max_reuse_distance"
"""``record_and_replay`` keeping every unit from one use to its next within a backward segment."""


def contender_config(contender: str) -> PrefetchConfig:
    """The scheduler config of a test contender: a prefetch mode's name, or :data:`REUSE`."""
    return PrefetchConfig(max_reuse_distance=1_000_000) if contender == REUSE else PrefetchConfig(mode=contender)
