"""What each rank measures in the pipeline workload (``suite=pipeline``): pp x dp gloo ranks.

The stages come from ``fsdp_replay.testing.pipelines`` (every block and every chunk a
``fully_shard`` unit over ``dp``, resharded after forward). Per schedule every mode gets its own
stages and ``torch.distributed.pipelining`` schedule (same seed, same data), one scheduler over
all chunks of the rank (``attach(chunks)``), and the modes are stepped in alternation with the
standard workloads' timed step (``bench_measure.timed_step``): a barrier over all ranks, then
``schedule.step()`` inside ``sched.iteration()``, then the optimizer step. The exposed wait is
measured, as there, by one ``fsdp_replay.WaitMeter`` per contender over all chunks of the rank.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from bench_config import BenchConfig, PipelineConfig, RunConfig
from bench_measure import Contender, prefetch_config, release, timed_step
from bench_probe import FSDPProbe, unit_bytes
from fsdp_replay import WaitMeter, attach
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.pipelines import (
    PipelineSetup,
    build_stages,
    make_schedule,
    pipeline_batch,
    pipeline_mesh,
    schedule_step,
    stage_indices,
)


def setup_for(schedule: str, p: PipelineConfig) -> PipelineSetup:
    return PipelineSetup(
        schedule=schedule,
        chunks=p.chunks,
        blocks_per_stage=p.blocks_per_stage,
        dim=p.dim,
        rows=p.rows,
        microbatches=p.microbatches,
        reshard_after_forward=True,
    )


def build_contender(mode: str, setup: PipelineSetup, mesh: DeviceMesh, run: RunConfig) -> Contender:
    chunks, stages = build_stages(setup, mesh)  # seeded: every mode starts from the same weights
    schedule = make_schedule(setup, stages)
    model = nn.ModuleList(chunks)  # a container for the probe, the observer and the meter; not a unit itself
    sched = attach(chunks, prefetch_config(mode, run)) if mode != "plain" else None
    observer = DemandObserver(model)  # after attach: its hooks run first
    meter = WaitMeter(model)
    dp_rank = mesh.get_local_rank("dp")

    def iterate(step: int) -> list[float]:
        x, y = pipeline_batch(setup, step, dp_rank)
        return [loss.item() for loss in schedule_step(schedule, stages, x, y)]

    return Contender(mode, model, torch.optim.SGD(model.parameters(), lr=1e-3), sched, observer, meter, iterate)


def measure_schedule(setup: PipelineSetup, mesh: DeviceMesh, run: RunConfig, probe: FSDPProbe) -> dict[str, Any]:
    contenders = [build_contender(mode, setup, mesh, run) for mode in run.modes]
    records: dict[str, list[dict[str, Any]]] = {c.mode: [] for c in contenders}
    for step in range(run.warmup_steps + run.steps):
        for c in contenders:
            record = timed_step(c, step, probe, torch.device("cpu"))
            if step >= run.warmup_steps:
                records[c.mode].append(record)
    result = {
        "stages": stage_indices(setup.schedule, mesh.get_local_rank("pp"), mesh["pp"].size(), setup.chunks),
        "unit_bytes": unit_bytes(contenders[0].model),
        "modes": records,
    }
    release(contenders)
    del contenders
    gc.collect()
    dist.barrier()
    return result


def measure_rank(mesh: DeviceMesh, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Entry point of each rank: every configured schedule, every mode."""
    cfg = BenchConfig.from_dict(cfg_dict)
    torch.set_num_threads(cfg.bench.threads)
    mesh = pipeline_mesh(mesh.size(), cfg.pipeline.pp)
    probe = FSDPProbe()
    results: dict[str, Any] = {}
    with probe.installed():
        for schedule in cfg.pipeline.schedules:
            start = time.perf_counter()
            results[schedule] = measure_schedule(setup_for(schedule, cfg.pipeline), mesh, cfg.bench, probe)
            if dist.get_rank() == 0:
                print(f"bench: pipeline {schedule} measured in {time.perf_counter() - start:.1f} s", flush=True)
    return {
        "rank": dist.get_rank(),
        "pp_rank": mesh.get_local_rank("pp"),
        "dp_rank": mesh.get_local_rank("dp"),
        "backend": dist.get_backend(),
        "schedules": results,
    }
