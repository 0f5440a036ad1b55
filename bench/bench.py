"""Benchmark plain FSDP2 and the three fsdp_replay modes side by side, against the physical limit.

    bash scripts/dev.sh bench bench.update_benchmarks_md=BENCHMARKS.md   # the full run (~10 min on 2 cores)
    bash scripts/dev.sh bench bench.quick=true                           # smoke run (~1 min), no verdicts
    bash scripts/dev.sh bench suite=pipeline bench.update_benchmarks_md=BENCHMARKS.md   # pipeline parallelism
    bash scripts/dev.sh bench suite=explain 'bench.workloads=[checkpointed]'           # where a replayed step waits
    bash scripts/dev.sh bench suite=depths bench.update_benchmarks_md=BENCHMARKS.md    # auto beside fixed depths
    bash scripts/dev.sh bench suite=gpu_link 'gpu_link.bandwidth_gbps=[50,100]'        # one GPU, emulated link
    bash scripts/dev.sh bench suite=host_cost                                          # CPU cost from 16 to 1024 units

(``scripts/dev.sh bench`` is ``python bench/bench.py`` in the checkout's venv, set up on first use.)

One run measures every workload of ``bench.workloads`` in every mode (plain FSDP2, demand, static,
record_and_replay), stepping the modes in alternation, then the compute-only and
communication-only runs that give the bound, then the scheduler's CPU cost on the fake backend.
``suite=pipeline`` instead measures the ``pipeline`` node: Schedule1F1B and ScheduleInterleaved1F1B
on pp x dp gloo ranks, every mode, as ratios to plain FSDP2 (``bench_pipeline``; CPU only).
``suite=explain`` prints rank 0's ``sched.explain()`` of the first replayed ``record_and_replay``
step of each of ``bench.workloads``, with ``measure_waits=True``, and draws its timeline
(``bench_explain``; CPU only; with ``bench.update_benchmarks_md`` the pictures go to ``docs/``).
``suite=depths`` steps plain, demand and ``record_and_replay`` at each prefetch depth of
``bench.depths`` (default 1, 2, 3, auto; both phases) in alternation on every workload, with
``DEPTH_SETTLE_STEPS`` more warmup steps for ``auto`` to settle, and reports each one's ratio to
demand and to the best fixed depth, and the depth each ran with (no bound, no CPU cost).
``suite=gpu_link`` runs in this process on one GPU: the fake backend's rank 0 of ``gpu_link.world_size``
with an emulated link (``bench_gpu_link``, docs/GPU.md); with ``bench.quick=true`` and no GPU it runs
its plumbing on CPU, with no link.
``suite=host_cost`` runs only the CPU-cost protocol, at each of ``cpu_cost.unit_counts`` (default
16, 64, 256, 1024 units; ``cpu_cost.scan_steps`` rounds each), one row per count, so a cost that
grows with the model shows (``bench_cpu_cost.measure_host_cost``; docs/HOST_COST.md).

On CPU as root, both ranks run inside a network namespace whose loopback is rate limited
(``netns.rate``, tbf), so communication costs wall time as on a cluster link; the namespace is
deleted afterwards, also on failure. Without root it runs on plain loopback and says so. With
GPUs it runs the same measurement on NCCL (``netns`` is not used).

Outputs in ``outputs/bench/`` (Hydra's run dir): ``results.json`` (every figure, raw step times),
``table.md`` (also printed), ``bench.png`` (``explain_<workload>.png`` for ``suite=explain``) and,
with ``bench.profile=true``, ``traces/``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import bench_gpu_link
import bench_netns
import bench_report
from bench_config import BenchConfig
from bench_cpu_cost import measure_cpu_cost, measure_host_cost
from bench_ranks import run_ranks

BENCH = Path(__file__).resolve().parent


def machine(load_before: tuple[float, ...]) -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (OSError, ValueError):
        memory_gib = float("nan")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu if gpu is None else f"{cpu} + {torch.cuda.device_count()}x {gpu}",
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def publish_figures(section: str, run_dir: Path, figures: dict[str, Path], md: Path) -> str:
    """Copy each figure of the run (its name in ``run_dir`` -> where it goes) next to ``md`` and point
    the section's links at the copies: the pictures travel with the markdown that shows them."""
    for name, target in figures.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((run_dir / name).read_bytes())
        section = section.replace(f"]({name})", f"]({target.relative_to(md.parent).as_posix()})")
    return section


def use_namespace(job: BenchConfig, device: str) -> tuple[bool, str]:
    """Whether to run the ranks in a rate-limited namespace, and a line saying what they run on."""
    if device == "cuda":
        return False, "NCCL between GPUs (no emulated link)"
    if job.netns.enabled == "false":
        return False, "plain loopback, no rate limit (netns.enabled=false): communication is nearly free"
    why_not = bench_netns.available()
    if why_not is not None:
        if job.netns.enabled == "true":
            raise SystemExit(f"bench/bench.py: netns.enabled=true but a namespace cannot be created: {why_not}")
        return False, f"plain loopback, no rate limit ({why_not}): communication is nearly free, prefetch has little to hide"
    return True, ""


def measure_in_namespace(job: BenchConfig, run_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """Start both ranks inside a fresh rate-limited namespace; it is deleted however this ends."""
    config_path, raw_path = run_dir / "bench_config.json", run_dir / "ranks_raw.json"
    config_path.write_text(json.dumps(job.to_dict()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")])))
    with bench_netns.rate_limited_namespace(rate=job.netns.rate, burst=job.netns.burst, latency=job.netns.latency) as name:
        qdisc = bench_netns.qdisc(name)
        argv = [sys.executable, str(BENCH / "bench_ranks.py"), str(config_path), str(raw_path), str(run_dir)]
        subprocess.run(bench_netns.exec_argv(name, argv), check=True, env=env, timeout=job.bench.timeout_s + 60)
    ranks = json.loads(raw_path.read_text())
    raw_path.unlink()
    config_path.unlink()
    return ranks, f"network namespace {name} (deleted after the run), loopback `{qdisc}`"


@hydra.main(config_path="../configs", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # --- setup: config errors surface before any process starts ---------------------------------
    try:
        job = OmegaConf.to_object(cfg)
    except ValueError as err:
        raise SystemExit(f"bench/bench.py: invalid config: {err}") from None
    if not isinstance(job, BenchConfig):
        raise SystemExit(f"bench/bench.py: expected a config built on 'bench_schema', got {type(job).__name__}")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = " ".join(HydraConfig.get().overrides.task)
    command = f"bash scripts/dev.sh bench {overrides}".strip()
    standard = job.suite == "standard"
    device = "cuda" if torch.cuda.is_available() and job.suite in ("standard", "depths", "gpu_link") else "cpu"
    load_before = os.getloadavg()
    if job.suite == "gpu_link":
        return measure_gpu_link(job, run_dir, command, device, load_before)
    if job.suite == "host_cost":
        namespaced, interconnect = False, "none: fake backend in one process, collectives are no-ops"
    else:
        namespaced, interconnect = use_namespace(job, device)
    print(f"bench/bench.py: {device}, interconnect: {interconnect or 'rate-limited namespace ' + job.netns.rate}", flush=True)

    # --- measure ----------------------------------------------------------------------------------
    start = time.perf_counter()
    ranks: list[dict[str, Any]] = []
    if job.suite == "host_cost":
        host_cost = measure_host_cost(job)
    elif namespaced:
        ranks, interconnect = measure_in_namespace(job, run_dir)
    else:
        ranks = run_ranks(job, run_dir)
    cpu_cost = measure_cpu_cost(job) if standard else None
    wall_s = time.perf_counter() - start

    # --- report -----------------------------------------------------------------------------------
    report: dict[str, Any] = {
        "command": command,
        "config": job.to_dict(),
        "machine": machine(load_before),
        "backend": ranks[0]["backend"] if ranks else "fake",
        "world_size": len(ranks) if ranks else job.cpu_cost.world_size,
        "interconnect": interconnect,
        "interconnect_short": f"tbf {job.netns.rate} loopback" if namespaced else interconnect.split(",")[0].split("(")[0].strip(),
        "rate_limited": namespaced,
        "wall_s": wall_s,
    }
    if job.suite == "pipeline":
        report["pipeline"] = bench_report.summarize_pipeline(ranks, job.bench.modes)
        report["plot"] = None
        section = bench_report.render_pipeline(report)
    elif job.suite == "depths":
        contenders = list(job.bench.contenders(job.suite))
        report["workloads"] = workloads = bench_report.summarize(ranks, contenders)
        bench_report.compare_depths(workloads, job.bench.depths)
        report["targets"] = bench_report.check_depth_targets(workloads, job.bench.depths)
        report["plot"] = None
        section = bench_report.render_depths(report)
    elif job.suite == "host_cost":
        report["host_cost"] = host_cost
        report["plot"] = None
        section = bench_report.render_host_cost(report)
    elif job.suite == "explain":
        report["explain"] = ranks[0]["explain"]
        report["plot"] = None
        section = bench_report.render_explain(report)
    else:
        report["workloads"] = workloads = bench_report.summarize(ranks, job.bench.modes)
        report["cpu_cost"] = cpu_cost
        report["targets"] = bench_report.check_targets(workloads, cpu_cost)
        report["plot"] = bench_report.plot(report, run_dir / "bench.png") if job.bench.plot else None
        section = bench_report.render(report)
    figures = {}
    if job.bench.update_benchmarks_md:
        md = Path(job.bench.update_benchmarks_md)
        figures = {report["plot"]: md.parent / f"bench_{device}.png"} if report["plot"] else {}
        figures.update({w["plot"]: md.parent / "docs" / w["plot"] for w in report.get("explain", {}).values() if w["plot"]})
    publish(job, report, section, run_dir, device if standard else f"{job.suite}:{device}", figures)
    if job.bench.plot and report["plot"] is None and standard:
        print("bench/bench.py: matplotlib is not installed; no plot (pip install matplotlib)")


def publish(
    job: BenchConfig, report: dict[str, Any], section: str, run_dir: Path, region: str, figures: dict[str, Path]
) -> None:
    """Write ``results.json`` and ``table.md``, replace ``region`` of BENCHMARKS.md when asked, print the section."""
    (run_dir / "results.json").write_text(json.dumps(report, indent=1))
    (run_dir / "table.md").write_text(section + "\n")
    if job.bench.update_benchmarks_md:
        md = Path(job.bench.update_benchmarks_md)
        section = publish_figures(section, run_dir, figures, md)
        bench_report.update_markdown(md, section, region)
    print(section)
    print(f"bench/bench.py: results in {run_dir}")


def measure_gpu_link(job: BenchConfig, run_dir: Path, command: str, device: str, load_before: tuple[float, ...]) -> None:
    """``suite=gpu_link``: one process, one GPU, an emulated link (no ranks to start, no namespace)."""
    if device == "cpu" and not job.bench.quick:
        raise SystemExit(
            "bench/bench.py: suite=gpu_link needs a CUDA device at its sizes; bench.quick=true runs its plumbing on CPU"
        )
    print(f"bench/bench.py: {device}, suite=gpu_link, emulated world {job.gpu_link.world_size}", flush=True)
    start = time.perf_counter()
    measured = bench_gpu_link.measure(job)
    report = {
        "command": command, "config": job.to_dict(), "machine": machine(load_before),
        "wall_s": time.perf_counter() - start, **measured,
    }
    publish(job, report, bench_gpu_link.render(report), run_dir, f"gpu_link:{device}", {})


if __name__ == "__main__":
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    main()
