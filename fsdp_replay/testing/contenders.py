"""What the tests compare with plain FSDP2: each mode, and replay keeping units for later uses."""

from __future__ import annotations

from fsdp_replay import PrefetchConfig

REUSE = "record_and_replay, max_reuse_distance"
"""``record_and_replay`` keeping every unit from one use to its next within a backward segment."""
DEEP_REUSE = "record_and_replay, depth 2, max_reuse_distance 3"
"""``record_and_replay`` two gathers ahead in both phases, keeping a unit for a next use at most 3 gathers away."""
AUTO_MEASURED = "record_and_replay, auto depth, measure_waits"
"""``record_and_replay`` whose depth its measured waits decide, with ``explain()``'s waits on."""

_CONFIGS = {
    REUSE: lambda: PrefetchConfig(max_reuse_distance=1_000_000),
    DEEP_REUSE: lambda: PrefetchConfig(forward_prefetch=2, backward_prefetch=2, max_reuse_distance=3),
    AUTO_MEASURED: lambda: PrefetchConfig(forward_prefetch="auto", backward_prefetch="auto", measure_waits=True),
}


def contender_config(contender: str) -> PrefetchConfig:
    """The scheduler config of a test contender: a prefetch mode's name, or one of the names above."""
    return _CONFIGS[contender]() if contender in _CONFIGS else PrefetchConfig(mode=contender)
