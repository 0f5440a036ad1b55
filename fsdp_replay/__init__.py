"""fsdp_replay: prefetch FSDP2 parameters in the order the model actually runs."""

from importlib.metadata import version

from fsdp_replay._order import Phase
from fsdp_replay.api import attach, fully_shard, scheduler_of
from fsdp_replay.config import DivergencePolicy, PrefetchConfig, PrefetchMode
from fsdp_replay.explain import DemandRow, ExplainReport, Served
from fsdp_replay.scheduler import PrefetchDivergenceError, PrefetchScheduler, RankMismatchError
from fsdp_replay.stats import KeyStats, MissReason, PrefetchStats
from fsdp_replay.waits import WaitMeter

__version__ = version("fsdp_replay")
"""The installed distribution's version: pyproject.toml's, read from the package metadata so it is written once."""

__all__ = [
    "DemandRow",
    "DivergencePolicy",
    "ExplainReport",
    "KeyStats",
    "MissReason",
    "Phase",
    "PrefetchConfig",
    "PrefetchDivergenceError",
    "PrefetchMode",
    "PrefetchScheduler",
    "PrefetchStats",
    "RankMismatchError",
    "Served",
    "WaitMeter",
    "attach",
    "fully_shard",
    "scheduler_of",
]
