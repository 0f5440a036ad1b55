"""The scheduler's CPU cost on the fake backend: each contender in a process of its own, stepped in turn.

Every contender (plain FSDP2, each mode, ``record_and_replay`` with ``measure_waits``, and a second
plain FSDP2 as a control) builds its model first thing in a process of its own, and the parent
steps them one at a time, round by round, each round starting one contender later. A step's cost is
its thread's CPU time. The rounds are shared among ``cpu_cost.placements`` sets of fresh processes,
one set after another; a contender's overhead is the mean over sets of the median over the set's
rounds of its step over plain's step of the same round, minus one.

[Note: a process per contender] Built one after another in one process, identical plain FSDP2
models stepped this way differed by up to 5.6% at 1024 units (the first built fastest: +5.6, +1.7,
+3.7, +3.3% for the four built after it, 10 rounds; a second run +1.1, +0.2, 0.0, 0.0%); at 256
units +0.9 and -0.3%. The contenders were built plain first, so that bias counted as the
scheduler's cost. In a process of its own each model is the first and only one its heap holds, but
a process's placement still moves its steps for its whole life: ``PLAIN_CONTROL`` against plain
was +2.8 and -1.7% at 256 units and -3.4% at 1024 (one set of processes, 10 rounds each). So each
figure is a mean over ``cpu_cost.placements`` sets of fresh processes, and the control's figure,
printed in every run, shows how finely that run can be read.

[Note: a frozen heap] A full garbage collection of a 1024-unit contender's heap (500-600k objects)
took 280-320 ms of a 1.1-1.2 s step, about one step in six, in plain FSDP2 and record_and_replay
alike (30-31 young collections a step in each): a pause that lands in a timed step or not by chance.
Each contender freezes what it holds once built (``gc.freeze``), so a collection walks only what
came after (trainers keep full collections out of their steps too: torchtitan disables the
collector and collects the young generations every few steps); ``gc_collections_per_step`` in the
results shows whether a mode makes the collector run more often.

[Note: one core for every step] Each process sleeps while the others step, and woken on whichever
core was idle, a step of plain FSDP2 at 16 units took 18 ms or 30-36 ms (7 of 20 in one run, on
this 2-vCPU VM); with every contender's steps on one core, 18-26 ms. So each contender builds its
model on any core, then keeps to the first core this process may run on (``_TIMING_CPU``).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import socket
import statistics
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench_config import MODES, BenchConfig
from bench_measure import build_contender, release, timed_step
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.workloads import workload

MEASURE_WAITS = "record_and_replay measure_waits"
"""The CPU-cost run's name for ``record_and_replay`` with ``PrefetchConfig(measure_waits=True)``:
what timing every demand's wait for ``explain()`` costs."""
PLAIN_CONTROL = "plain control"
"""A second plain FSDP2 in a process of its own: its overhead over plain is the protocol's own
error (placement, machine drift), which no mode's figure can be read more finely than."""

_CONTENDERS: tuple[tuple[str, str, bool], ...] = (
    *((mode, mode, False) for mode in MODES),
    (MEASURE_WAITS, "record_and_replay", True),
    (PLAIN_CONTROL, "plain", False),
)
"""(name in the results, mode, measure_waits) of each contender."""
_READY = "ready"
_TIMING_CPU = min(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else None
"""The core every contender's steps run on, where the OS lets a process choose (Linux)."""
_START_TIMEOUT_S = 600
"""How long a contender may take to import torch and build its model (1024 units, 2 busy cores)."""


def measure_cpu_cost(cfg: BenchConfig, *, units: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """CPU time of a step of each scheduler mode against plain FSDP2's, with no-op collectives.

    The fake backend does all of a step's work on one thread, so its CPU time is the step's cost
    without the time other processes on the machine take. The rounds are shared among
    ``cpu_cost.placements`` sets of fresh processes, one set after another; a contender's overhead
    is the mean over sets of its paired overhead there (``overhead_by_placement``).
    ``MEASURE_WAITS`` is also compared with ``record_and_replay`` of the same round
    (``measure_waits_vs_replay``). No contender has the benchmark's wait meter: its cost is not
    the scheduler's. ``units`` and ``steps`` (rounds) default to the ``cpu_cost`` node's.
    """
    cc = cfg.cpu_cost
    units = cc.units if units is None else units
    steps = cc.steps if steps is None else steps
    measured = [_measure_placement(cfg, units, rounds) for rounds in _shares(steps, cc.placements)]
    placements = [times for times, _, _ in measured]
    demands = measured[-1][1]
    names = list(placements[0])
    collections = {
        name: [sum(counts) / steps for counts in zip(*(collected[name] for _, _, collected in measured))] for name in names
    }
    times = {name: [t for placement in placements for t in placement[name]] for name in names}
    by_placement = {
        name: [_paired_overhead(p[name], p["plain"]) for p in placements] for name in names if name != "plain"
    }
    overhead = {name: statistics.fmean(o) for name, o in by_placement.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    plain = medians["plain"]
    return {
        "world_size": cc.world_size,
        "units": units,
        "demands_per_step": demands,
        "clock": "thread CPU time",
        "placements": len(placements),
        "median_step_s": medians,
        "step_s": times,
        "overhead_vs_plain": overhead,
        "overhead_by_placement": by_placement,
        "gc_collections_per_step": collections,
        "per_demand_us": {name: o * plain / demands * 1e6 for name, o in overhead.items() if demands},
        "measure_waits_vs_replay": statistics.fmean(
            _paired_overhead(p[MEASURE_WAITS], p["record_and_replay"]) for p in placements
        ),
    }


def measure_host_cost(cfg: BenchConfig) -> list[dict[str, Any]]:
    """``suite=host_cost``: :func:`measure_cpu_cost` at each of ``cpu_cost.unit_counts``, with
    ``cpu_cost.scan_steps`` rounds each, so a cost that grows with the model shows as a trend."""
    return [measure_cpu_cost(cfg, units=n, steps=cfg.cpu_cost.scan_steps) for n in cfg.cpu_cost.unit_counts]


def _shares(rounds: int, placements: int) -> list[int]:
    """``rounds`` shared among ``placements`` as evenly as they divide, the larger shares first."""
    share, extra = divmod(rounds, placements)
    return [share + (i < extra) for i in range(placements)]


def _measure_placement(cfg: BenchConfig, units: int, rounds: int) -> tuple[dict[str, list[float]], int, dict[str, list[int]]]:
    """``rounds`` timed rounds (after ``cpu_cost.warmup_steps``) of fresh contender processes:
    each contender's step times, a replayed step's demand count, and each contender's garbage
    collections per generation in its timed steps."""
    warmup = cfg.cpu_cost.warmup_steps
    replayed_demands = 0
    with _Contenders(cfg, units) as contenders:
        times: dict[str, list[float]] = {name: [] for name in contenders.names}
        collected = {name: [0] * len(gc.get_stats()) for name in contenders.names}
        for step in range(warmup + rounds):
            # Each round starts with the next contender, so none always runs first (after the
            # previous round's last) or always right after plain.
            first = step % len(contenders.names)
            for name in contenders.names[first:] + contenders.names[:first]:
                cpu_s, demands, collections = contenders.step(name, step)
                if step >= warmup:
                    times[name].append(cpu_s)
                    collected[name] = [total + n for total, n in zip(collected[name], collections)]
                    if name == "record_and_replay":
                        replayed_demands = demands
    return times, replayed_demands, collected


def _paired_overhead(times: list[float], baseline: list[float]) -> float:
    """Median over rounds of (time / the baseline's time of the same round) - 1."""
    return statistics.median(t / b for t, b in zip(times, baseline)) - 1


class _Contenders:
    """One process per contender (``python bench_cpu_cost.py FD``: a fresh interpreter that inherits
    nothing of this heap, whatever the caller's ``__main__``), each stepped on request; all are
    ended on exit, also on error."""

    def __init__(self, cfg: BenchConfig, units: int) -> None:
        self.names = [name for name, _, _ in _CONTENDERS]
        self._cfg, self._units = cfg, units
        self._conns: dict[str, Connection] = {}
        self._processes: list[subprocess.Popen] = []

    def __enter__(self) -> _Contenders:
        try:
            for name, mode, measure_waits in _CONTENDERS:
                ours, theirs = socket.socketpair()
                with theirs:
                    process = subprocess.Popen(
                        [sys.executable, __file__, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
                    )
                self._processes.append(process)
                self._conns[name] = conn = Connection(ours.detach())
                conn.send((self._cfg, self._units, mode, measure_waits, _TIMING_CPU))
            for name in self.names:  # all built before the first timed step
                self._receive(name, timeout=_START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def step(self, name: str, step: int) -> tuple[float, int, list[int]]:
        """Run step ``step`` of contender ``name``: its thread CPU seconds, demands (0 for plain) and
        garbage collections per generation."""
        self._conns[name].send(step)
        return self._receive(name)

    def _receive(self, name: str, timeout: float | None = None) -> Any:
        conn = self._conns[name]
        if timeout is not None and not conn.poll(timeout):
            raise RuntimeError(f"CPU-cost contender {name!r} did not build its model within {timeout} s")
        try:
            kind, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"CPU-cost contender {name!r} exited without a result (killed? out of memory?)") from None
        if kind == "error":
            raise RuntimeError(f"CPU-cost contender {name!r} failed:\n{payload}")
        return payload

    def __exit__(self, *exc: object) -> None:
        for conn in self._conns.values():
            try:
                conn.send(None)
            except OSError:  # the process already ended
                pass
        for process in self._processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for conn in self._conns.values():
            conn.close()


def _contender_process(conn: Connection) -> None:
    """A contender's process: build its model first, then run each step it is sent until None."""
    try:
        cfg, units, mode, measure_waits, timing_cpu = conn.recv()
        torch.set_num_threads(1)
        cc = cfg.cpu_cost
        with fake_world(cc.world_size) as mesh:
            w = workload("sequential", dim=cc.dim, hidden=cc.hidden, n_blocks=units, rows=cc.rows)
            run = dataclasses.replace(cfg.bench, quick=False)
            contender = build_contender(mode, w, mesh, run, metered=False, measure_waits=measure_waits)
            if timing_cpu is not None:  # built on every core, stepped on one: [Note: one core for every step]
                os.sched_setaffinity(0, {timing_cpu})
            gc.collect()
            gc.freeze()  # [Note: a frozen heap]
            conn.send((_READY, None))
            while (step := conn.recv()) is not None:
                before = _collections()
                record = timed_step(contender, step, None, torch.device("cpu"))
                collections = [after - was for after, was in zip(_collections(), before)]
                conn.send(("step", (record["cpu_s"], record.get("stats", {}).get("demands", 0), collections)))
            release([contender])
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _collections() -> list[int]:
    """Garbage collections so far in this process, per generation."""
    return [generation["collections"] for generation in gc.get_stats()]


if __name__ == "__main__":
    _contender_process(Connection(int(sys.argv[1])))
