"""What each rank does in ``suite=explain``: where a replayed step of a workload still waits.

Per workload of ``bench.workloads``, one ``record_and_replay`` contender with
``PrefetchConfig(measure_waits=True)`` takes the benchmark's timed steps (``bench_measure``: same
model, same sizes, same rate-limited link) until the first replayed step after the warmup; rank 0
then keeps ``sched.explain()`` of that step: its table, its rows and its timeline picture.

The contender has no ``WaitMeter``: an outer meter would take the async waits before the
scheduler's own timing sees them, and the report would show them as free.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bench_config import BenchConfig
from bench_measure import SCOPE_KEY, build_contender, release, timed_step
from fsdp_replay.testing.workloads import workload


def explain_workload(name: str, mesh: DeviceMesh, cfg: BenchConfig, out_dir: Path) -> dict[str, Any]:
    """Step ``name`` through its warmup and one replayed step; rank 0's report of that step (empty elsewhere)."""
    run = cfg.bench
    w = workload(name, dim=run.dim, hidden=run.hidden, n_blocks=run.n_blocks, rows=run.rows)
    c = build_contender("record_and_replay", w, mesh, run, metered=False, measure_waits=True)
    for step in range(run.warmup_steps + 1):  # the first scope records; the last one is explained
        record = timed_step(c, step, None, torch.device("cpu"))
    report = c.sched.explain(SCOPE_KEY)
    release([c])
    del c
    gc.collect()
    if dist.get_rank() != 0:
        return {}
    plot = out_dir / f"explain_{name}.png"
    try:
        report.plot(plot)
    except ImportError:
        plot = None
    return {
        "text": str(report),
        "step_s": record["step_s"],
        "total_wait_s": report.total_wait_s,
        "rows": [dataclasses.asdict(row) for row in report.rows],
        "plot": plot.name if plot is not None else None,
    }


def measure_rank(mesh: DeviceMesh, cfg_dict: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Entry point of each rank: every configured workload, explained on rank 0."""
    cfg = BenchConfig.from_dict(cfg_dict)
    torch.set_num_threads(cfg.bench.threads)
    explained = {name: explain_workload(name, mesh, cfg, Path(out_dir)) for name in cfg.bench.workloads}
    return {"rank": dist.get_rank(), "backend": dist.get_backend(), "explain": explained}
