"""Python calls per demand each mode adds to plain FSDP2: the scheduler's CPU cost, counted instead of timed.

python bench/bench_calls.py [--steps 5] [--units 64] [--profile record_and_replay]

The CPU-cost workload of ``configs/bench.yaml`` (fake backend, world 8, 64 tiny units; ``--units``
changes the count, e.g. 1024 to see what grows with the model) under
``cProfile``: unlike a time, the count does not depend on what else runs on the machine, so a
change to the per-demand path can be judged on a loaded machine too (BENCHMARKS.md, CPU cost).
``record_and_replay measure_waits`` is ``record_and_replay`` with ``PrefetchConfig(measure_waits=True)``,
the cost of timing each demand's wait for ``explain()`` (BENCHMARKS.md, CPU cost of explain()).
``--profile MODE`` also prints where that mode's own time goes: each fsdp_replay function's calls
and time in its own body per demand, under the profiler (which inflates every call alike, so
read the times as shares, not as what a call costs unprofiled). The profiler's clock is the
thread's CPU time, so other processes on the machine do not enter the shares.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.distributed.device_mesh import DeviceMesh

from bench_config import MODES
from bench_measure import MEASURE_WAITS
from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.workloads import run_iteration, workload


def calls_per_step(
    mode: str, mesh: DeviceMesh, steps: int, warmup: int = 3, measure_waits: bool = False, units: int = 64
) -> tuple[pstats.Stats, int]:
    """The profile of ``steps`` steps of ``mode`` on ``units`` units (after ``warmup`` steps, which
    record), and demands per step."""
    w = workload("sequential", dim=16, hidden=32, n_blocks=units, rows=4)
    model = w.make_model().shard(mesh)
    sched = attach(model, PrefetchConfig(mode=mode, measure_waits=measure_waits)) if mode != "plain" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        if sched is None:
            run_iteration(model, w, i)
        else:
            with sched.iteration("train"):
                run_iteration(model, w, i)
        opt.step()
        opt.zero_grad()

    for i in range(warmup):
        step(i)
    profile = cProfile.Profile(time.thread_time)  # CPU time: what other processes on the machine take is left out
    profile.enable()
    for i in range(warmup, warmup + steps):
        step(i)
    profile.disable()
    demands = 0
    if sched is not None:
        demands = sched.stats.per_key["train"].demands // (warmup + steps)
        sched.detach()
    return pstats.Stats(profile), demands


def print_profile(profile: pstats.Stats, demands: int, steps: int, top: int = 25) -> None:
    """fsdp_replay's functions by time in their own body, per demand."""
    rows = [
        (own_s, calls, f"{path.split('fsdp_replay/', 1)[1]}:{line} {name}")
        for (path, line, name), (_, calls, own_s, _, _) in profile.stats.items()
        if "/fsdp_replay/" in path and "/testing/" not in path
    ]
    per_demand = demands * steps
    print(f"{'µs/demand':>10} {'calls/demand':>13}  function (profiled: read as shares)")
    for own_s, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"{own_s / per_demand * 1e6:10.2f} {calls / per_demand:13.2f}  {where}")
    total = sum(own_s for own_s, _, _ in rows)
    print(f"{total / per_demand * 1e6:10.2f} {sum(c for _, c, _ in rows) / per_demand:13.2f}  all fsdp_replay functions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--units", type=int, default=64, help="FSDP units (blocks) of the model")
    parser.add_argument("--profile", choices=[m for m in MODES if m != "plain"], help="also print where this mode's time goes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with fake_world(8) as mesh:
        profiles = {mode: calls_per_step(mode, mesh, args.steps, units=args.units) for mode in MODES}
        profiles[MEASURE_WAITS] = calls_per_step("record_and_replay", mesh, args.steps, measure_waits=True, units=args.units)
    demands = profiles["record_and_replay"][1]
    plain = profiles.pop("plain")[0].total_calls / args.steps
    print(f"{demands} demands per step; Python calls per demand added to plain FSDP2's {plain / demands:.0f}:")
    for name, (profile, _) in profiles.items():
        print(f"  {name:32s} {(profile.total_calls / args.steps - plain) / demands:6.1f}")
    if args.profile:
        print(f"\n{args.profile}:")
        print_profile(profiles[args.profile][0], demands, args.steps)


if __name__ == "__main__":
    main()
