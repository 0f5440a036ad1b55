"""Python calls per demand each mode adds to plain FSDP2: the scheduler's CPU cost, counted instead of timed.

python bench/bench_calls.py [--steps 5] [--units 64] [--opcodes] [--profile record_and_replay]

The CPU-cost workload of ``configs/bench.yaml`` (fake backend, world 8, 64 tiny units; ``--units``
changes the count, e.g. 1024 to see what grows with the model) under
``cProfile``: unlike a time, the count does not depend on what else runs on the machine, so a
change to the per-demand path can be judged on a loaded machine too (BENCHMARKS.md, CPU cost).
``record_and_replay measure_waits`` is ``record_and_replay`` with ``PrefetchConfig(measure_waits=True)``,
the cost of timing each demand's wait for ``explain()`` (BENCHMARKS.md, CPU cost of explain()).
``--opcodes`` counts Python opcodes instead of calls (``sys.settrace`` opcode events): as exact as
the calls, and closer to what a demand costs, since a call of a one-line function and one of a
loop weigh differently; ``--profile MODE`` then lists the functions whose opcodes per demand
differ most from plain FSDP2's. Without it, ``--profile MODE`` prints where that mode's own time goes: each fsdp_replay function's calls
and time in its own body per demand, under the profiler (which inflates every call alike, so
read the times as shares, not as what a call costs unprofiled). The profiler's clock is the
thread's CPU time, so other processes on the machine do not enter the shares.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import pstats
import sys
import time
import types
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from bench_config import MODES
from bench_cpu_cost import MEASURE_WAITS
from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.workloads import run_iteration, workload


class OpcodeCount:
    """Python opcodes executed per function while entered: exact and repeatable, unlike a time."""

    def __init__(self) -> None:
        self.by_code: collections.Counter[types.CodeType] = collections.Counter()

    def enable(self) -> None:
        counts = self.by_code

        def on_opcode(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[frame.f_code] += 1
            return on_opcode

        def on_call(frame: types.FrameType, event: str, arg: Any) -> Any:
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
            return on_opcode

        sys.settrace(on_call)

    def disable(self) -> None:
        sys.settrace(None)

    def by_function(self) -> collections.Counter[str]:
        names: collections.Counter[str] = collections.Counter()
        for code, n in self.by_code.items():
            names[f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_firstlineno} {code.co_name}"] += n
        return names


def calls_per_step(
    mode: str,
    mesh: DeviceMesh,
    steps: int,
    warmup: int = 3,
    measure_waits: bool = False,
    units: int = 64,
    opcodes: bool = False,
    counter: Any = None,
) -> tuple[pstats.Stats | OpcodeCount | Any, int]:
    """The profile (or, with ``opcodes``, the opcode count) of ``steps`` steps of ``mode`` on
    ``units`` units (after ``warmup`` steps, which record), and demands per step.

    ``counter``: anything with ``enable()`` and ``disable()`` to use instead (bench_cache.py's
    callgrind switch), returned as it is."""
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
    # CPU time: what other processes on the machine take is left out
    profile = counter or (OpcodeCount() if opcodes else cProfile.Profile(time.thread_time))
    profile.enable()
    for i in range(warmup, warmup + steps):
        step(i)
    profile.disable()
    demands = 0
    if sched is not None:
        demands = sched.stats.per_key["train"].demands // (warmup + steps)
        sched.detach()
    return (pstats.Stats(profile) if isinstance(profile, cProfile.Profile) else profile), demands


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


def print_opcodes(counts: OpcodeCount, plain: OpcodeCount, demands: int, steps: int, top: int = 25) -> None:
    """The functions whose opcodes per demand differ most from plain FSDP2's."""
    mine, base = counts.by_function(), plain.by_function()
    per_demand = demands * steps
    diffs = sorted(((mine[k] - base[k]) / per_demand, k) for k in set(mine) | set(base))
    print(f"{'opcodes/demand':>15}  function (against plain FSDP2)")
    for diff, where in diffs[::-1][:top] + [(None, "...")] + diffs[:5]:
        print(f"{diff:15.1f}  {where}" if diff is not None else f"{'':15}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--units", type=int, default=64, help="FSDP units (blocks) of the model")
    parser.add_argument("--opcodes", action="store_true", help="count Python opcodes rather than calls")
    parser.add_argument("--profile", choices=[m for m in MODES if m != "plain"], help="also print where this mode's cost goes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure = functools.partial(calls_per_step, steps=args.steps, units=args.units, opcodes=args.opcodes)
    with fake_world(8) as mesh:
        profiles = {mode: measure(mode, mesh) for mode in MODES}
        profiles[MEASURE_WAITS] = measure("record_and_replay", mesh, measure_waits=True)
    demands = profiles["record_and_replay"][1]
    plain_profile = profiles.pop("plain")[0]
    total = (lambda p: sum(p.by_code.values())) if args.opcodes else (lambda p: p.total_calls)
    plain = total(plain_profile) / args.steps
    what = "opcodes" if args.opcodes else "calls"
    print(f"{demands} demands per step; Python {what} per demand added to plain FSDP2's {plain / demands:.0f}:")
    for name, (profile, _) in profiles.items():
        added = total(profile) / args.steps - plain
        print(f"  {name:32s} {added / demands:6.1f}  ({added / plain:+.2%} of plain's)")
    if args.profile:
        print(f"\n{args.profile}:")
        if args.opcodes:
            print_opcodes(profiles[args.profile][0], plain_profile, demands, args.steps)
        else:
            print_profile(profiles[args.profile][0], demands, args.steps)


if __name__ == "__main__":
    main()
