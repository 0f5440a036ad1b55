"""How much of record_and_replay's L2 misses a leaner scheduler could save: counted against what
prefetching costs without any scheduler (docs/HOST_COST.md, "The floor: what a leaner demand path could save").

    bash scripts/dev.sh python docs/repro/prefetch_floor.py 16 4 3   # units, counted steps, seeds; 5 min on 2 cores (9 with 6 seeds)

Six contenders, each run once per seed under callgrind as ``bench/bench_cache.py`` runs its own
(same workload, switch, cache model and pairing with plain's run of the same seed):

- ``plain``: plain FSDP2;
- ``plain + user prefetch``: plain FSDP2 plus the few lines a user would write to prefetch by hand
  (each block's forward pre-hook issues the next block's ``unshard(async_op=True)``): the cost of
  asynchronous gathers themselves, with no scheduler, in forward only;
- ``plain + FSDP2 forward prefetch``: plain FSDP2 told to prefetch the next block in forward
  (``set_modules_to_forward_prefetch``): FSDP2's own prefetch, with no code of anyone else's per demand;
- ``replay, no bookkeeping``: record_and_replay whose replayed demands only classify, leave the
  window, move the cursor and refill (``Replay.provide``), a throwaway patch that drops the scope's
  log, counters and checks (``explain()``, stats, divergence): the most a leaner demand path saves;
- ``replay, synchronous gathers``: record_and_replay whose gathers are issued with
  ``async_op=False`` (a throwaway patch: on CPU nothing then overlaps): what FSDP2's asynchronous
  path (its Work and future objects) costs;
- ``record_and_replay``: as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_cache  # noqa: E402

def _user_prefetch() -> None:
    """Each block's forward pre-hook starts the next block's gather (FSDP2's public API)."""
    _prefetch_in_forward(lambda block, following: block.register_forward_pre_hook(_prefetches(following)))


def _fsdp2_prefetch() -> None:
    """FSDP2 prefetches the next block in forward itself."""
    _prefetch_in_forward(lambda block, following: block.set_modules_to_forward_prefetch([following]))


def _prefetch_in_forward(arrange: Any) -> None:
    """The workload's model, once sharded, has ``arrange(block, next_block)`` done for each block."""
    import bench_calls

    make_workload = bench_calls.workload

    def workload(*args: Any, **kwargs: Any) -> Any:
        w = make_workload(*args, **kwargs)
        make_model = w.make_model

        def model_that_prefetches() -> Any:
            model = make_model()
            shard = model.shard

            def shard_and_prefetch(mesh: Any, **options: Any) -> Any:
                root = shard(mesh, **options)
                blocks = list(model.blocks)
                for block, following in zip(blocks, blocks[1:]):
                    arrange(block, following)
                return root

            model.shard = shard_and_prefetch
            return model

        return dataclasses.replace(w, make_model=model_that_prefetches)

    bench_calls.workload = workload


def _prefetches(following: Any) -> Any:
    def prefetch(module: Any, args: Any) -> None:
        following.unshard(async_op=True)

    return prefetch


def _no_bookkeeping() -> None:
    """A replayed demand: classify, leave the window, gather a miss, move the cursor, refill; nothing logged."""
    from fsdp_replay import _compat
    from fsdp_replay._order import Phase
    from fsdp_replay._strategies import Replay, gather_at_demand
    from fsdp_replay.scheduler import PrefetchScheduler
    from fsdp_replay.stats import Demand

    on_demand = PrefetchScheduler.on_demand

    def lean_on_demand(self: PrefetchScheduler, unit: Any, phase: Phase, state: Any) -> None:
        scope = self._scopes.open
        if scope is None or type(scope.strategy) is not Replay:
            return on_demand(self, unit, phase, state)  # recording scopes as they are
        demand = _compat.classify_demand(state, backward=phase is Phase.backward)
        self._window.take(unit)
        scope.served.append(demand)  # the scope's end counts its demands from this
        if demand is Demand.miss:
            self._window.gathered(unit)
            gather_at_demand(unit, phase)
        scope.strategy.cursor.take(unit, phase)
        scope.strategy.provide(demanded=unit)

    PrefetchScheduler.on_demand = lean_on_demand


def _synchronous_gathers() -> None:
    """The scheduler's gathers as FSDP2 issues one at a use: ``async_op=False``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    unshard = FSDPParamGroup.unshard
    FSDPParamGroup.unshard = lambda group, async_op=False: unshard(group, async_op=False)


_VARIANTS: dict[str, tuple[str, Callable[[], None] | None]] = {
    "plain": ("plain", None),
    "plain + user prefetch": ("plain", _user_prefetch),
    "plain + FSDP2 forward prefetch": ("plain", _fsdp2_prefetch),
    "replay, no bookkeeping": ("record_and_replay", _no_bookkeeping),
    "replay, synchronous gathers": ("record_and_replay", _synchronous_gathers),
    "record_and_replay": ("record_and_replay", None),
}
"""Name in the table -> the mode its child runs, and the patch applied first (None: as it is)."""


def _child(variant: str, units: int, steps: int, library: str) -> None:
    mode, patch = _VARIANTS[variant]
    if patch is not None:
        patch()
    bench_cache._child(mode, False, units, steps, library)


def _child_command(variant: str, units: int, steps: int, library: str) -> list[str]:
    return [__file__, "--child", variant, str(units), str(steps), library]


def main(units: int, steps: int, seeds: int) -> None:
    children = {name: functools.partial(_child_command, name, units, steps) for name in _VARIANTS}
    results = bench_cache.count_each(children, seeds=seeds, l2_kib=1024, jobs=os.cpu_count() or 1)
    print(bench_cache.table(results, steps))
    replay, lean = (statistics.mean(r.counts["L2 misses"] for r in results[n]) for n in ("record_and_replay", "replay, no bookkeeping"))
    plain = statistics.mean(r.counts["L2 misses"] for r in results["plain"])
    print(f"no bookkeeping keeps {(lean - plain) / (replay - plain):.0%} of record_and_replay's L2 misses over plain's")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        name, units, steps, library = sys.argv[2:]
        _child(name, int(units), int(steps), library)
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        for flag, default in (("units", 16), ("steps", 4), ("seeds", 3)):
            parser.add_argument(flag, type=int, nargs="?", default=default)
        args = parser.parse_args()
        for flag in ("units", "steps", "seeds"):
            if getattr(args, flag) < 1:
                parser.error(f"{flag} must be at least 1, got {getattr(args, flag)}")
        main(args.units, args.steps, args.seeds)
