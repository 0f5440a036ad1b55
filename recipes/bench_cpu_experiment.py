"""Where the scheduler's CPU time goes: the fake-backend 64-unit step with candidate fixes patched in.

    python recipes/bench_cpu_experiment.py            # as shipped
    python recipes/bench_cpu_experiment.py rf,lazy,grad

An experiment behind BENCHMARKS.md's CPU-cost analysis, not part of the product: each name
monkeypatches one ``fsdp_replay`` internal with the change proposed to the core, so the saving
can be measured before anyone edits the core.

- ``rf``: ``record_function`` ranges only while a profiler is active (about 18 us each otherwise);
- ``lazy``: ``FSDPParamGroup.lazy_init()`` once per group instead of on every issued gather;
- ``grad``: a fast path in ``replace_grad_tensors`` for positional tensor arguments (no pytree).

Prints the per-step thread CPU time overhead of ``demand`` and ``record_and_replay`` relative to
plain FSDP2, median (and min) over alternating steps.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

import fsdp_replay._compat as compat
import fsdp_replay.scheduler as scheduler
import fsdp_replay.window as window
from bench_config import RunConfig
from bench_measure import build_contender
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.workloads import run_iteration, workload


def patch(names: list[str]) -> None:
    if "rf" in names:
        real = window.record_function

        def ranges_when_profiling(name: str):
            return real(name) if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext()

        window.record_function = scheduler.record_function = ranges_when_profiling
    if "lazy" in names:
        initialized: set[int] = set()

        def issue_unshard(state, *, backward: bool) -> None:  # the CPU branch of _compat.issue_unshard
            training_state = TrainingState.PRE_BACKWARD if backward else TrainingState.FORWARD
            for group in state._fsdp_param_groups:
                with group.use_training_state(training_state):
                    if id(group) not in initialized:
                        group.lazy_init()
                        initialized.add(id(group))
                    group.unshard(async_op=True)

        compat.issue_unshard = issue_unshard
    if "grad" in names:
        general = compat.replace_grad_tensors

        def replace_grad_tensors(tree, fn):
            args, kwargs = tree
            if kwargs or type(args) is not tuple or not all(type(a) is torch.Tensor for a in args):
                return general(tree, fn)
            positions = [i for i, a in enumerate(args) if a.requires_grad]
            if not positions:
                return None
            new = list(args)
            for i, t in zip(positions, fn([args[i] for i in positions])):
                new[i] = t
            return tuple(new), kwargs

        compat.replace_grad_tensors = replace_grad_tensors


def main(names: list[str], *, units: int = 64, steps: int = 30, warmup: int = 3) -> None:
    patch(names)
    torch.set_num_threads(1)
    with fake_world(8) as mesh:
        w = workload("sequential", dim=16, hidden=32, n_blocks=units, rows=4)
        contenders = [build_contender(m, w, mesh, RunConfig()) for m in ("plain", "demand", "record_and_replay")]
        times: dict[str, list[float]] = {c.mode: [] for c in contenders}
        for step in range(warmup + steps):
            for c in contenders:
                start = time.thread_time()
                if c.sched is not None:
                    with c.sched.iteration("bench"):
                        run_iteration(c.model, w, step)
                else:
                    run_iteration(c.model, w, step)
                c.optimizer.step()
                c.optimizer.zero_grad()
                if step >= warmup:
                    times[c.mode].append(time.thread_time() - start)
    med, low = statistics.median(times["plain"]), min(times["plain"])
    for mode in ("demand", "record_and_replay"):
        m, lo = statistics.median(times[mode]), min(times[mode])
        print(f"{','.join(names) or 'as shipped'}: {mode} {100 * (m - med) / med:+.1f}% (min {100 * (lo - low) / low:+.1f}%) "
              f"vs plain {1e3 * med:.0f} ms")


if __name__ == "__main__":
    main([n for n in (sys.argv[1].split(",") if len(sys.argv) > 1 else []) if n])
