"""fsdp_replay: prefetch FSDP2 parameters in the order the model actually runs."""

from fsdp_replay._order import Phase
from fsdp_replay.api import attach, fully_shard, scheduler_of
from fsdp_replay.config import DivergencePolicy, PrefetchConfig, PrefetchMode
from fsdp_replay.explain import DemandRow, ExplainReport, Served
from fsdp_replay.scheduler import PrefetchDivergenceError, PrefetchScheduler, RankMismatchError
from fsdp_replay.stats import KeyStats, MissReason, PrefetchStats
from fsdp_replay.waits import WaitMeter

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
