"""What each rank of the benchmark measures.

Per workload every mode gets its own model (same seed), stepped in alternation A B C D A B C D so
machine drift hits all modes alike. The same rank process then measures the physical limit:
compute-only (the model unsharded, no communication) and communication-only (the demand-mode
step's all-gathers and reduce-scatters, same sizes and order, no compute).

``bench_ranks`` starts the ranks; ``bench_pipeline`` measures the pipeline workload with the
same contenders and timed step.

The exposed all-gather wait of every contender, plain FSDP2 included, is measured by the
package's own ``fsdp_replay.WaitMeter``; ``bench_probe`` counts the rest (gathers, copy-out,
reduce-scatters, peak bytes, the collectives).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from bench_config import DEPTH_SETTLE_STEPS, BenchConfig, RunConfig
from bench_probe import FSDPProbe, unit_bytes
from fsdp_replay import PrefetchConfig, WaitMeter, attach
from fsdp_replay.stats import Demand
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import Workload, run_iteration, workload

SCOPE_KEY = "bench"
OWN_COMMUNICATION = ("demand", "record_and_replay")
"""Modes whose own collectives give a bound; the others issue demand's (one gather per use)."""


# --- one step of one mode ---------------------------------------------------------------------------


@dataclasses.dataclass
class Contender:
    """One mode's model, optimizer, scheduler (None for plain FSDP2), demand observer, wait meter
    (None where waits are not measured), and step.

    ``iterate(step)`` runs one optimizer step's forwards and backwards and returns the losses it
    computed on this rank (the pipeline workload builds its own, in ``bench_pipeline``).
    ``mode`` names the contender in the results: its prefetch mode, or in ``suite=depths``
    ``depth_contender(depth)``.
    """

    mode: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    sched: Any
    observer: DemandObserver
    meter: WaitMeter | None
    iterate: Callable[[int], list[float]]


def prefetch_config(
    mode: str, run: RunConfig, *, depth: int | str | None = None, measure_waits: bool = False, record_steps: int = 1
) -> PrefetchConfig:
    """The scheduler's config of ``mode``: ``depth`` in both phases (None: the run's prefetch depths),
    the run's reuse distance and the workload's ``record_steps`` for ``record_and_replay``, the
    package's defaults otherwise."""
    forward, backward = (run.forward_prefetch, run.backward_prefetch) if depth is None else (depth, depth)
    replays = mode == "record_and_replay"
    return PrefetchConfig(
        mode=mode,
        forward_prefetch=forward,
        backward_prefetch=backward,
        max_reuse_distance=run.max_reuse_distance if replays else 0,
        record_steps=record_steps if replays else 1,
        measure_waits=measure_waits,
    )


def build_contender(
    mode: str,
    w: Workload,
    mesh: DeviceMesh,
    run: RunConfig,
    *,
    name: str | None = None,
    depth: int | str | None = None,
    metered: bool = True,
    measure_waits: bool = False,
) -> Contender:
    """``mode`` on a fresh model of ``w``, called ``name`` (default: the mode) in the results, at
    prefetch ``depth`` (see ``prefetch_config``); ``metered=False`` leaves the wait meter out (the
    CPU-cost run times the scheduler, not the meter), ``measure_waits`` turns the scheduler's own on.
    A meter beside an ``auto`` depth's own timing sees the same waits (one shadow per param group).
    """
    model = w.make_model().shard(mesh)  # make_model seeds: every mode starts from the same weights
    sched = None
    if mode != "plain":
        config = prefetch_config(mode, run, depth=depth, measure_waits=measure_waits, record_steps=w.record_steps)
        sched = attach(model, config)
    observer = DemandObserver(model)  # after attach: its hooks run first, so it sees FSDP2's state untouched
    meter = WaitMeter(model) if metered else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    iterate = lambda step: run_iteration(model, w, step)  # noqa: E731
    return Contender(name or mode, model, optimizer, sched, observer, meter, iterate)


def release(contenders: list[Contender]) -> None:
    """Remove every meter, then detach every scheduler (the order they were installed in reverse),
    and remove every observer: the models stay usable as plain FSDP2."""
    for c in contenders:
        if c.meter is not None:
            c.meter.remove()
        if c.sched is not None:
            c.sched.detach()
        c.observer.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exposed_waits(waits: list[tuple[str, float]], demands: list[tuple[str, str, Demand]]) -> dict[str, Any]:
    """A step's exposed all-gather wait from its meter's waits (``demands``: the observer's log).

    The first gather of a step has nothing before it to hide behind, so the report sets its wait
    apart; it is the first wait only if that wait is the first demanded unit's (a scheduler may
    have hidden the first gather, and a later wait is then not the unhideable one).
    """
    first = waits[0][1] if waits and demands and waits[0][0] == demands[0][0] else 0.0
    return {"exposed_gather_s": sum(s for _, s in waits), "first_exposed_s": first, "exposures": waits}


def timed_step(c: Contender, step: int, probe: FSDPProbe | None, device: torch.device) -> dict[str, Any]:
    """One optimizer step of ``c``; barrier first so all ranks start together."""
    if probe is not None:
        probe.track(c.model)
    before = c.sched.stats.as_dict() if c.sched is not None else None
    depth = c.sched.prefetch_depth(SCOPE_KEY) if c.sched is not None else None  # what this step runs with
    c.observer.take()
    if c.meter is not None:
        c.meter.take()
    dist.barrier()
    _sync(device)
    start, cpu_start = time.perf_counter(), time.thread_time()
    if c.sched is not None:
        with c.sched.iteration(SCOPE_KEY):
            losses = c.iterate(step)
    else:
        losses = c.iterate(step)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    _sync(device)
    seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu_start
    record: dict[str, Any] = {"step_s": seconds, "cpu_s": cpu_seconds, "losses": losses}
    if probe is not None:
        record.update(probe.take().as_dict())
    demands = c.observer.take()
    if c.meter is not None:
        record.update(exposed_waits(c.meter.take(), demands))
    record["observed"] = DemandObserver.counts(demands)
    if before is not None:
        after = c.sched.stats.as_dict()
        record["stats"] = {k: after[k] - before[k] for k in after}
        record["depth"] = depth
    return record


# --- the physical limit -----------------------------------------------------------------------------


def compute_only(w: Workload, run: RunConfig, device: torch.device) -> list[float]:
    """The same iteration on the unsharded model: no communication at all."""
    model = w.make_model().to(device)
    run_iteration(model, w, 0)
    model.zero_grad(set_to_none=True)
    times = []
    for rep in range(run.bound_steps):
        dist.barrier()  # both ranks compute at once, as in the real run (they share the cores)
        _sync(device)
        start = time.perf_counter()
        run_iteration(model, w, rep + 1)
        model.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def comm_only(log: list[tuple[str, int, Any]], run: RunConfig, device: torch.device) -> list[dict[str, float]]:
    """Replay the step's collectives back to back, synchronously, with no compute in between."""
    world = dist.get_world_size()
    buffers: dict[tuple[str, int, Any], tuple[torch.Tensor, torch.Tensor]] = {}
    for kind, numel, dtype in log:
        if (kind, numel, dtype) not in buffers:
            full = torch.zeros(numel, dtype=dtype, device=device)
            shard = torch.zeros(numel // world, dtype=dtype, device=device)
            buffers[(kind, numel, dtype)] = (full, shard)

    def issue(kind: str, full: torch.Tensor, shard: torch.Tensor) -> None:
        if kind == "AG":
            dist.all_gather_single(full, shard)
        else:
            dist.reduce_scatter_single(shard, full)

    for key in buffers:  # warm the connections for every size
        issue(key[0], *buffers[key])
    reps = []
    for _ in range(run.bound_steps):
        dist.barrier()
        ag = rs = first = 0.0
        for i, (kind, numel, dtype) in enumerate(log):
            _sync(device)
            start = time.perf_counter()
            issue(kind, *buffers[(kind, numel, dtype)])
            _sync(device)
            seconds = time.perf_counter() - start
            if kind == "AG":
                ag += seconds
                if i == 0:
                    first = seconds
            else:
                rs += seconds
        reps.append({"all_gather_s": ag, "first_all_gather_s": first, "reduce_scatter_s": rs})
    return reps


# --- per workload -----------------------------------------------------------------------------------


def measure_workload(
    mesh: DeviceMesh,
    w: Workload,
    run: RunConfig,
    probe: FSDPProbe,
    device: torch.device,
    out_dir: Path,
    specs: dict[str, tuple[str, int | str | None]],
    warmup_steps: int,
) -> dict[str, Any]:
    """Step the contenders of ``specs`` (``RunConfig.contenders``) in alternation, ``warmup_steps``
    then ``run.steps`` timed, then measure the bound."""
    contenders = [build_contender(mode, w, mesh, run, name=name, depth=depth) for name, (mode, depth) in specs.items()]
    records: dict[str, list[dict[str, Any]]] = {c.mode: [] for c in contenders}
    # The collectives of step 1 (the first replayed scope): demand's (one gather per non-resident
    # demand, one reduce-scatter per backward use) are what plain, demand and static must do;
    # record_and_replay's own are fewer where it keeps a unit unsharded for its next use.
    comm_logs: dict[str, list[tuple[str, int, Any]]] = {m: [] for m in OWN_COMMUNICATION if m in specs}
    for step in range(warmup_steps + run.steps):
        for c in contenders:
            probe.comm_log = comm_logs.get(c.mode) if step == 1 else None
            record = timed_step(c, step, probe, device)
            if step >= warmup_steps:
                records[c.mode].append(record)
    probe.comm_log = None
    result: dict[str, Any] = {
        "notes": w.notes,
        "unit_bytes": unit_bytes(contenders[0].model),
        "modes": records,
        "recorded_demands": {
            c.mode: len(c.sched.recorded_order(SCOPE_KEY) or []) for c in contenders if c.mode == "record_and_replay"
        }.get("record_and_replay"),
        "collectives": {m: [(k, n, str(d)) for k, n, d in log] for m, log in comm_logs.items()},
        "warmup_steps": warmup_steps,
        # the (forward, backward) depth each prefetching contender's next scope would run with, after the last step
        "final_depth": {
            c.mode: c.sched.prefetch_depth(SCOPE_KEY) for c in contenders if specs[c.mode][0] == "record_and_replay"
        },
    }
    if run.profile:
        result["profile"] = {c.mode: profile_step(c, w, warmup_steps + run.steps, device, out_dir) for c in contenders}
    release(contenders)
    del contenders
    gc.collect()
    result["compute_only_s"] = compute_only(w, run, device)
    result["comm_only"] = {m: comm_only(log, run, device) for m, log in comm_logs.items()}
    return result


def profile_step(c: Contender, w: Workload, step: int, device: torch.device, out_dir: Path) -> dict[str, Any]:
    """One extra step under torch.profiler (rank 0 records): a trace plus totals per range family."""
    from torch.profiler import ProfilerActivity, profile

    if dist.get_rank() != 0:
        timed_step(c, step, None, device)
        return {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_step(c, step, None, device)
    traces = out_dir / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(traces / f"{w.name}_{c.mode}_rank0.json"))
    families: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        if event.key.startswith(("fsdp_replay::", "FSDP::")):
            family = event.key.split(" ")[0].split("(")[0].strip()
            entry = families.setdefault(family, {"count": 0, "cpu_ms": 0.0})
            entry["count"] += event.count
            entry["cpu_ms"] += event.cpu_time_total / 1e3
    return families


def measure_rank(mesh: DeviceMesh, cfg_dict: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Entry point of each rank: every configured workload, then the bound runs."""
    cfg = BenchConfig.from_dict(cfg_dict)
    run = cfg.bench
    torch.set_num_threads(run.threads)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    probe = FSDPProbe()
    specs = run.contenders(cfg.suite)
    warmup_steps = run.warmup_steps + (DEPTH_SETTLE_STEPS if cfg.suite == "depths" else 0)
    results: dict[str, Any] = {}
    with probe.installed():
        for name in run.workloads:
            w = workload(name, dim=run.dim, hidden=run.hidden, n_blocks=run.n_blocks, rows=run.rows).on(device)
            start = time.perf_counter()
            warmup = max(warmup_steps, w.record_steps + 1)  # every recording, then one replayed scope
            results[name] = measure_workload(mesh, w, run, probe, device, Path(out_dir), specs, warmup)
            if dist.get_rank() == 0:
                print(f"bench: {name} measured in {time.perf_counter() - start:.1f} s", flush=True)
    return {"rank": dist.get_rank(), "backend": dist.get_backend(), "workloads": results}
