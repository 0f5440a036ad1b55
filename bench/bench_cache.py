"""Instructions and simulated L2 misses per demand each mode adds to plain FSDP2: the CPU cost, counted.

python bench/bench_cache.py [--units 16] [--steps 4] [--seeds 3] [--l2-kib 1024] [--jobs N]

Each contender runs ``bench_calls.calls_per_step``'s workload (fake backend, world 8, tiny MLP
units) in a process of its own under valgrind's callgrind, which counts every machine instruction
of the timed steps (Python's interpreter, torch's C++, the scheduler) and simulates the caches,
the last level sized as one core's L2 (``--l2-kib``, this machine's EPYC: 1 MiB). A time moves
with what else the host runs; these counts barely do: address randomization off and
``PYTHONHASHSEED`` fixed, two runs of a seed differ by at most a few instructions in a hundred thousand
and a few misses in a hundred thousand (up to 198 of 11.1 M and 1 of 43.8 k at 2 units; 60 of 264 M
and 8 of 546 k at 16). Where the heap lands still moves the
misses by a few percent, so each contender runs once per seed (0 .. ``--seeds``-1) and the table
shows the mean and the range over seeds. Needs valgrind with its ``callgrind.h`` and a C compiler
(``$CC``, default ``cc``) for the switch that limits counting to the timed steps.

Why it exists (docs/HOST_COST.md, "What the cost is"): on the fake backend record_and_replay's
steps take 2–5% more CPU time than plain FSDP2's, with 5% more Python opcodes, but this counts
fewer instructions for them than for plain's and more L2 misses; the misses are the cost.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import functools
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench_calls import calls_per_step
from bench_config import MODES
from bench_cpu_cost import MEASURE_WAITS
from fsdp_replay.testing.distributed import fake_world

_SWITCH_C = """\
#include <valgrind/callgrind.h>
void counting_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void counting_off(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
_CONTENDERS: dict[str, tuple[str, bool]] = {
    **{mode: (mode, False) for mode in MODES},
    MEASURE_WAITS: ("record_and_replay", True),
}
"""Name in the table -> (mode, measure_waits)."""
_COUNTS = {
    "instructions": r"I\s+refs:\s+([\d,]+)",
    "L1 misses": r"I1\s+misses:\s+([\d,]+)",
    "L1d misses": r"D1\s+misses:\s+([\d,]+)",
    "L2 misses": r"LL misses:\s+([\d,]+)",
}


class CallgrindSwitch:
    """Turns callgrind's counting on for the timed steps only (``calls_per_step``'s counter):
    the heap is frozen first, as in the CPU-cost protocol, so no collection of the build lands in them."""

    def __init__(self, library: str) -> None:
        self._lib = ctypes.CDLL(library)

    def enable(self) -> None:
        gc.collect()
        gc.freeze()
        self._lib.counting_on()

    def disable(self) -> None:
        self._lib.counting_off()


@dataclass(frozen=True)
class Counted:
    """One contender's run: its counts over the timed steps, and demands per step."""

    counts: dict[str, int]
    demands: int


def build_switch(directory: str) -> str:
    """Compile the counting switch; its path. Raises RuntimeError naming what is missing."""
    compiler = os.environ.get("CC", "cc")
    missing = [tool for tool in ("valgrind", compiler, "setarch") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"bench_cache.py needs valgrind, a C compiler and setarch on PATH; missing: {missing}")
    source, library = Path(directory, "switch.c"), str(Path(directory, "libswitch.so"))
    source.write_text(_SWITCH_C)
    built = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", library, str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"could not build the callgrind switch (is valgrind/callgrind.h installed?):\n{built.stderr}")
    return library


def parse_counts(valgrind_stderr: str) -> dict[str, int]:
    """The totals callgrind prints at exit. Raises ValueError if one is missing (the run failed)."""
    counts = {}
    for name, pattern in _COUNTS.items():
        if (found := re.search(pattern, valgrind_stderr)) is None:
            raise ValueError(f"no {name!r} in callgrind's output:\n{valgrind_stderr[-3000:]}")
        counts[name] = int(found.group(1).replace(",", ""))
    counts["L1 misses"] += counts.pop("L1d misses")
    return counts


def run_contender(name: str, *, units: int, steps: int, seed: int, l2_kib: int, library: str) -> Counted:
    """``name``'s steps under callgrind in a fresh process, repeatable for a given ``seed``."""
    return count_under_callgrind(name, _child_command(name, units, steps, library), seed=seed, l2_kib=l2_kib)


def _child_command(name: str, units: int, steps: int, library: str) -> list[str]:
    mode, measure_waits = _CONTENDERS[name]
    return [__file__, "--child", mode, str(int(measure_waits)), str(units), str(steps), library]


def count_under_callgrind(name: str, child: list[str], *, seed: int, l2_kib: int) -> Counted:
    """Run ``python *child`` under callgrind; the child counts through the switch and prints
    ``{"demands": n}`` last (as :func:`_child` does). ``name`` only labels an error."""
    command = [
        *("setarch", platform.machine(), "-R"),  # no address randomization: the same seed gives the same counts
        *("valgrind", "--tool=callgrind", "--cache-sim=yes", f"--LL={l2_kib * 1024},8,64"),
        *("--instr-atstart=no", "--callgrind-out-file=/dev/null"),
        sys.executable,
        *child,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": str(seed)})
    if done.returncode != 0:
        raise RuntimeError(f"{name!r} (seed {seed}) failed under callgrind, rc {done.returncode}:\n{done.stderr[-3000:]}")
    return Counted(parse_counts(done.stderr), json.loads(done.stdout.strip().splitlines()[-1])["demands"])


def measure(units: int, steps: int, seeds: int, l2_kib: int, jobs: int) -> dict[str, list[Counted]]:
    """Every contender once per seed, ``jobs`` at a time."""
    children = {name: functools.partial(_child_command, name, units, steps) for name in _CONTENDERS}
    return count_each(children, seeds=seeds, l2_kib=l2_kib, jobs=jobs)


def count_each(children: dict[str, Callable[[str], list[str]]], *, seeds: int, l2_kib: int, jobs: int) -> dict[str, list[Counted]]:
    """Each child once per seed, ``jobs`` at a time (counts do not depend on what runs beside);
    ``children[name](library)`` is its command line, given the switch library it counts through."""
    with tempfile.TemporaryDirectory() as directory, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        library = build_switch(directory)
        runs = {
            (name, seed): pool.submit(count_under_callgrind, name, child(library), seed=seed, l2_kib=l2_kib)
            for seed in range(seeds)
            for name, child in children.items()
        }
        return {name: [runs[name, seed].result() for seed in range(seeds)] for name in children}


def table(results: dict[str, list[Counted]], steps: int) -> str:
    """Per demand, what each mode adds to plain's instructions and misses of the same seed: mean over seeds and range."""
    plain = results["plain"]
    demands = results["record_and_replay"][0].demands
    names = list(plain[0].counts)
    lines = [
        f"{demands} demands a step; per demand, added to plain FSDP2's (plain's own per demand in the first row);"
        f" [min, max] over {len(plain)} seeds:",
        f"| contender | {' | '.join(names)} |",
        f"|---|{'---|' * len(names)}",
        "| plain | "
        + " | ".join(f"{statistics.mean(r.counts[n] for r in plain) / steps / demands:,.0f}" for n in names)
        + " |",
    ]
    for name, runs in results.items():
        if name == "plain":
            continue
        cells = []
        for n in names:
            added = [(r.counts[n] - p.counts[n]) / steps / demands for r, p in zip(runs, plain)]
            share = [(r.counts[n] / p.counts[n] - 1) * 100 for r, p in zip(runs, plain)]
            cells.append(f"{statistics.mean(added):+,.0f} ({statistics.mean(share):+.1f}% [{min(share):+.1f}, {max(share):+.1f}])")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _child(mode: str, measure_waits: bool, units: int, steps: int, library: str) -> None:
    torch.set_num_threads(1)
    with fake_world(8) as mesh:
        _, demands = calls_per_step(
            mode, mesh, steps=steps, units=units, measure_waits=measure_waits, counter=CallgrindSwitch(library)
        )
    print(json.dumps({"demands": demands}))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        mode, measure_waits, units, steps, library = sys.argv[2:]
        _child(mode, measure_waits == "1", int(units), int(steps), library)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=16, help="FSDP units (blocks) of the model")
    parser.add_argument("--steps", type=int, default=4, help="counted steps, after 3 that record")
    parser.add_argument("--seeds", type=int, default=3, help="runs of each contender, PYTHONHASHSEED 0 .. seeds-1")
    parser.add_argument("--l2-kib", type=int, default=1024, help="the simulated last-level cache: one core's L2")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="contender runs at once")
    args = parser.parse_args()
    for flag in ("units", "steps", "seeds", "l2_kib", "jobs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    print(table(measure(args.units, args.steps, args.seeds, args.l2_kib, args.jobs), args.steps))


if __name__ == "__main__":
    main()
