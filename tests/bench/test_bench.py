"""The benchmark harness (bench/bench.py bench.quick=true) runs end to end and its invariants hold.

Timings are not checked here (CI machines are noisy); what is checked is that every mode computes
the same losses, that the counters mean what the table says, and that the rate-limited namespace
is removed afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdp_replay import WaitMeter
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.workloads import workload

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import bench_cpu_cost  # noqa: E402
import bench_measure  # noqa: E402
import bench_report  # noqa: E402
import bench_netns  # noqa: E402
from bench_config import (  # noqa: E402
    CONDITIONAL_WORKLOADS, DEPTH_SETTLE_STEPS, MODES, WORKLOADS, BenchConfig, RunConfig, depth_contender
)
from bench_probe import FSDPProbe, StepCounters  # noqa: E402


def _namespaces() -> set[str]:
    if bench_netns.available() is not None:
        return set()
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _run_bench(run_dir: Path, *overrides: str) -> tuple[dict, str, set[str]]:
    """``bench/bench.py bench.quick=true`` with ``overrides``, writing into ``run_dir`` (its BENCHMARKS.md
    too); the report, stdout, and the network namespaces the run left behind."""
    md = run_dir / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nhand-written analysis stays\n")
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "bench.py"), "bench.quick=true", f"hydra.run.dir={run_dir}",
         f"bench.update_benchmarks_md={md}", *overrides],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    # Only this run's namespaces (named after its pid): other benchmark runs may share the machine.
    leaked = {name for name in _namespaces() if name.startswith(f"fsdpbench-{proc.pid}-")}
    return json.loads((run_dir / "results.json").read_text()), stdout, leaked


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench")
    report, stdout, leaked = _run_bench(run_dir)
    return report, run_dir, stdout, leaked


@pytest.fixture(scope="module")
def explain_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench_explain")
    report, stdout, leaked = _run_bench(run_dir, "suite=explain", "bench.workloads=[checkpointed]")
    return report, run_dir, stdout, leaked


@pytest.fixture(scope="module")
def host_cost_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench_host_cost")
    report, stdout, leaked = _run_bench(run_dir, "suite=host_cost")
    return report, run_dir, stdout, leaked


@pytest.fixture(scope="module")
def depths_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench_depths")
    report, stdout, leaked = _run_bench(run_dir, "suite=depths", "bench.workloads=[sequential,checkpointed]")
    return report, run_dir, stdout, leaked


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench_pipeline")
    report, stdout, leaked = _run_bench(run_dir, "suite=pipeline")
    return report, run_dir, stdout, leaked


def test_quick_run_writes_table_json_plot_and_markdown_section(quick_run):
    report, run_dir, stdout, _ = quick_run
    assert "| workload | mode | median step ms" in stdout
    table = (run_dir / "table.md").read_text()
    assert table.split("![")[0].strip() in stdout  # the printed section is table.md (image link aside)
    assert set(report["workloads"]) == set(WORKLOADS)
    md = (run_dir / "BENCHMARKS.md").read_text()
    assert "hand-written analysis stays" in md and "<!-- bench:results:cpu -->" in md
    pytest.importorskip("matplotlib")
    assert (run_dir / "bench.png").stat().st_size > 0 and (run_dir / "bench_cpu.png").exists()


def test_quick_run_says_it_is_a_smoke_run_and_judges_no_target(quick_run):
    report, run_dir, stdout, _ = quick_run
    assert stdout.count("**Smoke run** (`bench.quick=true`)") == 1
    assert "| target |" not in stdout and "**no**" not in stdout
    assert "Targets: not judged on a smoke run." in (run_dir / "table.md").read_text()
    full = json.loads(json.dumps(report))  # the same figures as a full run reports them
    full["config"]["bench"]["quick"] = False
    section = bench_report.render(full)
    assert "Smoke run" not in section and "| target | workload | measured | threshold | met |" in section


def test_share_of_the_bound_over_100_percent_is_marked_and_explained(quick_run):
    workloads = json.loads(json.dumps(quick_run[0]["workloads"]))
    for w in workloads.values():
        for f in w["modes"].values():
            f["bound_over_step"] = 0.9
    table = bench_report.markdown_table(workloads, MODES)
    assert "(90%) |" in table and bench_report.OVER_BOUND_NOTE not in table
    next(iter(workloads.values()))["modes"]["demand"]["bound_over_step"] = 1.44
    table = bench_report.markdown_table(workloads, MODES)
    assert table.count("(144%*) |") == 1 and table.endswith(bench_report.OVER_BOUND_NOTE)


def test_every_mode_computes_the_same_losses_as_plain_fsdp2(quick_run):
    report = quick_run[0]
    for name, w in report["workloads"].items():
        plain = w["modes"]["plain"]["losses"]
        for mode in MODES:
            assert w["modes"][mode]["losses"] == plain, (name, mode)


def test_replay_hits_every_gather_and_demand_prefetches_nothing(quick_run):
    for name, w in quick_run[0]["workloads"].items():
        rr, demand = w["modes"]["record_and_replay"], w["modes"]["demand"]
        assert rr["misses"] == 0 and rr["wasted"] == 0 and rr["divergences"] == 0, name
        assert rr["hits"] == rr["gathers"] > 0, name
        assert demand["hits"] == 0 and demand["prefetches"] == 0, name
        assert w["recorded_demands"] == rr["hits"] + rr["resident"], name


def test_peak_unsharded_bytes_with_prefetch_one_stays_within_plain_plus_one_unit(quick_run):
    for name, w in quick_run[0]["workloads"].items():
        limit = w["modes"]["plain"]["peak_unsharded_bytes"] + w["max_unit_bytes"]
        assert w["modes"]["record_and_replay"]["peak_unsharded_bytes"] <= limit, name
        assert w["modes"]["demand"]["peak_unsharded_bytes"] <= w["modes"]["plain"]["peak_unsharded_bytes"], name


def test_bound_is_built_from_compute_and_each_modes_own_communication(quick_run):
    for name, w in quick_run[0]["workloads"].items():
        assert set(w["bounds"]) == {"demand", "record_and_replay"}, name
        for owner, b in w["bounds"].items():
            comm = b["comm_only"]
            assert w["compute_only_s"] > 0 and comm["all_gather_s"] > 0 and comm["reduce_scatter_s"] > 0
            assert b["bound_s"] == pytest.approx(max(w["compute_only_s"], b["overlappable_comm_s"]) + b["non_overlappable_comm_s"])
            # comm-only replays exactly that mode's collectives: its gathers and reduce-scatters
            mode = w["modes"][owner]
            assert b["collectives"] == mode["gathers"] + mode["reduce_scatters"], (name, owner)
        assert w["modes"]["static"]["bound_s"] == w["bounds"]["demand"]["bound_s"], name
        demand, rr = w["modes"]["demand"], w["modes"]["record_and_replay"]
        assert demand["gathers"] == demand["misses"], name
        # units kept unsharded for their next use skip their all-gathers, and nothing else changes
        assert rr["gathers"] == demand["gathers"] - rr["kept"] and rr["reduce_scatters"] == demand["reduce_scatters"], name


def test_cpu_cost_and_targets_are_reported(quick_run):
    report = quick_run[0]
    cost = report["cpu_cost"]
    assert cost["world_size"] == 8 and cost["demands_per_step"] > cost["units"]
    assert set(cost["overhead_vs_plain"]) == {
        "demand", "static", "record_and_replay", bench_cpu_cost.MEASURE_WAITS, bench_cpu_cost.PLAIN_CONTROL
    }
    assert any(t["target"].startswith("scheduler CPU cost") for t in report["targets"])


def test_a_cpu_cost_contender_that_fails_raises_its_error_and_every_contender_process_ends(monkeypatch):
    """Each contender runs in a process of its own ([Note: a process per contender]): one that fails
    raises its traceback, named, in the caller, and none is left running."""
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recorded(*args: Any, **kwargs: Any) -> subprocess.Popen:
        started.append(process := popen(*args, **kwargs))
        return process

    monkeypatch.setattr(bench_cpu_cost.subprocess, "Popen", recorded)
    monkeypatch.setattr(bench_cpu_cost, "_CONTENDERS", (("plain", "plain", False), ("no such mode", "bogus", False)))
    with pytest.raises(RuntimeError, match=r"(?s)contender 'no such mode' failed:.*'bogus'"):
        bench_cpu_cost.measure_cpu_cost(BenchConfig(bench=RunConfig(quick=True)), units=2, steps=1)
    assert len(started) == 2 and all(process.poll() is not None for process in started)


def test_rate_limited_namespace_is_used_as_root_and_removed(quick_run):
    report, _, _, leaked = quick_run
    if bench_netns.available() is None:
        assert report["rate_limited"] and "tbf" in report["interconnect"]
        assert not leaked
    else:
        assert not report["rate_limited"] and "plain loopback" in report["interconnect"]


def _plain_fsdp2_step(mesh: DeviceMesh) -> dict[str, Any]:
    """One timed step of the benchmark's plain-FSDP2 contender (quick sizes) under the probe."""
    run = RunConfig(quick=True)
    w = workload("sequential", dim=run.dim, hidden=run.hidden, n_blocks=run.n_blocks, rows=run.rows)
    probe = FSDPProbe()
    with probe.installed():
        c = bench_measure.build_contender("plain", w, mesh, run)
        record = bench_measure.timed_step(c, 0, probe, torch.device("cpu"))
        bench_measure.release([c])
    return dict(record, metered=isinstance(c.meter, WaitMeter))


def test_exposed_wait_is_measured_by_the_wait_meter_not_the_probe():
    assert not {"exposed_gather_s", "first_exposed_s", "exposures"} & {f.name for f in dataclasses.fields(StepCounters)}
    for record in spawn(_plain_fsdp2_step, world_size=2):
        assert record["metered"] and record["gathers"] > 0
        # plain FSDP2 gathers synchronously on CPU: every use that gathers blocks, the root's first
        waits = record["exposures"]
        assert len(waits) == record["gathers"] and waits[0][0] == "<root>", waits
        assert record["exposed_gather_s"] == pytest.approx(sum(s for _, s in waits)) and record["exposed_gather_s"] > 0
        assert record["first_exposed_s"] == waits[0][1]


@pytest.mark.skipif(bench_netns.available() is not None, reason="creating a network namespace needs root and iproute2")
def test_namespace_is_deleted_when_the_run_inside_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with bench_netns.rate_limited_namespace(rate="2gbit", burst="256kb", latency="100ms", prefix="fsdpbenchtest") as name:
            assert bench_netns.exists(name) and "tbf" in bench_netns.qdisc(name)
            raise RuntimeError("boom")
    assert not bench_netns.exists(name)


# --- suite=pipeline: Schedule1F1B and ScheduleInterleaved1F1B on pp 2 x dp 2 -------------------------


def test_pipeline_run_reports_every_schedule_and_mode_in_its_own_markdown_region(pipeline_run):
    report, run_dir, stdout, leaked = pipeline_run
    schedules = report["config"]["pipeline"]["schedules"]
    assert report["world_size"] == 4 and set(report["pipeline"]) == set(schedules) == {"Schedule1F1B", "ScheduleInterleaved1F1B"}
    table = (run_dir / "table.md").read_text()
    assert table.strip() in stdout
    for name in schedules:
        for mode in MODES:
            assert f"| {name} | {mode} |" in table, (name, mode)
    md = (run_dir / "BENCHMARKS.md").read_text()
    assert "hand-written analysis stays" in md and "<!-- bench:results:pipeline:cpu -->" in md
    assert "<!-- bench:results:cpu -->" not in md  # the standard region is left alone
    assert not leaked


def test_pipeline_modes_issue_no_more_all_gathers_than_plain_and_compute_the_same_losses(pipeline_run):
    for name, sch in pipeline_run[0]["pipeline"].items():
        plain = sch["modes"]["plain"]
        assert plain["gathers"] > 0 and plain["vs_plain"]["gathers"] == 1, name
        for mode in MODES:
            f = sch["modes"][mode]
            assert f["gathers"] <= plain["gathers"], (name, mode)
            assert f["vs_plain"]["gathers"] == pytest.approx(f["gathers"] / plain["gathers"]), (name, mode)
            assert f["losses"] == plain["losses"] and f["losses"][0], (name, mode)  # the last stage's ranks report losses
        rr = sch["modes"]["record_and_replay"]
        assert rr["misses"] == 0 and rr["divergences"] == 0, name
        assert sch["losses_equal"], name


# --- suite=explain: rank 0's explain() of a replayed checkpointed step --------------------------------


def test_explain_run_prints_the_report_and_publishes_its_picture_next_to_the_markdown(explain_run):
    report, run_dir, stdout, leaked = explain_run
    explained = report["explain"]["checkpointed"]
    assert "fsdp_replay explain 'bench': replay scope, completed" in explained["text"] and "blocked" in explained["text"]
    assert explained["text"] in stdout and not leaked
    assert explained["total_wait_s"] == pytest.approx(sum(row["wait_s"] for row in explained["rows"]))
    assert {row["phase"] for row in explained["rows"]} == {"forward", "backward", "recompute"}
    md = (run_dir / "BENCHMARKS.md").read_text()
    assert "hand-written analysis stays" in md and "<!-- bench:results:explain:cpu -->" in md
    pytest.importorskip("matplotlib")
    assert "](docs/explain_checkpointed.png)" in md and (run_dir / "docs" / "explain_checkpointed.png").stat().st_size > 0


# --- suite=depths: record_and_replay at depths 1, 2, 3 and auto beside plain and demand ---------------


def test_depths_run_reports_every_depth_and_auto_with_the_depth_it_ran_at(depths_run):
    report, run_dir, stdout, leaked = depths_run
    table = (run_dir / "table.md").read_text()
    assert table.strip() in stdout and not leaked
    contenders = ["plain", "demand"] + [depth_contender(d) for d in ("1", "2", "3", "auto")]
    for name, w in report["workloads"].items():
        assert list(w["modes"]) == contenders and w["losses_equal"], name
        for d in (1, 2, 3):  # a fixed depth runs at that depth in both phases, every step
            assert w["final_depth"][depth_contender(str(d))] == [d, d], name
            assert f"| {name} | {depth_contender(str(d))} |" in table
        auto = w["modes"][depth_contender("auto")]
        forward, backward = w["final_depth"][depth_contender("auto")]
        assert forward >= 1 and backward >= 1 and all(len(depth) == 2 for depth in auto["depth_per_step"]), name
        assert f"| {name} | record_and_replay depth auto |" in table and f"({forward}/{backward}) |" in table
        best = w["modes"][w["best_fixed_depth"]]
        assert best["vs_best_fixed_depth"] == 1 and auto["vs_best_fixed_depth"] > 0, name
        assert w["warmup_steps"] == report["config"]["bench"]["warmup_steps"] + DEPTH_SETTLE_STEPS, name
    assert {t["workload"] for t in report["targets"]} == set(report["workloads"])
    assert any(t["target"] == "auto speedup vs demand" for t in report["targets"])
    md = (run_dir / "BENCHMARKS.md").read_text()
    assert "hand-written analysis stays" in md and "<!-- bench:results:depths:cpu -->" in md
    assert "<!-- bench:results:cpu -->" not in md  # the standard region is left alone


@pytest.mark.parametrize(("depths", "bad"), [(["1", "Auto"], "'Auto'"), (["-1", "auto"], "'-1'"), (["2", "2"], "repeated")])
def test_depths_reject_anything_but_whole_numbers_and_auto_naming_the_bad_value(depths, bad):
    with pytest.raises(ValueError, match=r"RunConfig.depths: got .*whole number >= 0 or 'auto'") as err:
        RunConfig(depths=depths)
    assert f"(bad: {bad}" in str(err.value) or bad in str(err.value)


@pytest.fixture(scope="module")
def gpu_link_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench_gpu_link")
    report, stdout, leaked = _run_bench(
        run_dir, "suite=gpu_link", "gpu_link.bandwidth_gbps=[50,100]", "gpu_link.workloads=[checkpointed,host_sync,interleaved_2mb]"
    )
    return report, run_dir, stdout, leaked


def test_gpu_link_runs_its_plumbing_without_a_gpu_and_fills_its_own_region(gpu_link_run):
    report, run_dir, stdout, _ = gpu_link_run
    if not torch.cuda.is_available():
        assert report["device"] == "cpu" and report["link"].startswith("none: no CUDA device")
    assert "### 50 GB/s" in stdout and "### 100 GB/s" in stdout
    md = (run_dir / "BENCHMARKS.md").read_text()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"<!-- bench:results:gpu_link:{device} -->" in md and "hand-written analysis stays" in md
    for name, w in report["workloads"].items():
        for bandwidth, b in w["bandwidths"].items():
            rows = b["contenders"]
            assert list(rows) == ["plain", "demand", "static", "record_and_replay", "record_and_replay depth 2"]
            assert rows["plain"]["x_plain"] == 1.0 and rows["demand"]["x_demand"] == 1.0
            assert rows["record_and_replay"]["misses"] == 0 and rows["record_and_replay depth 2"]["misses"] == 0, name
            assert rows["record_and_replay"]["depth"] == [1, 1] and rows["record_and_replay depth 2"]["depth"] == [2, 2]
            assert rows["demand"]["depth"] is None and rows["demand"]["misses"] > 0
            bound = b["bound"]
            assert bound["bound_s"] == max(bound["compute_s"], bound["link_s"]) > 0
            if not torch.cuda.is_available():
                assert bound["link_s"] == 0.0 and rows["plain"]["peak_bytes"] is None  # no link, no CUDA allocator


def test_gpu_link_rejects_a_bandwidth_that_is_not_a_positive_number():
    from bench_config import GpuLinkConfig

    with pytest.raises(ValueError, match=r"GpuLinkConfig.bandwidth_gbps .* got \[50, 0\]"):
        GpuLinkConfig(bandwidth_gbps=[50, 0])
    assert GpuLinkConfig(bandwidth_gbps=100).bandwidth_gbps == [100.0]


def test_the_calls_profile_names_the_refill_per_demand(capsys):
    """``bench_calls.py --profile``: one refill and one scheduler demand call per demand, and a total."""
    import bench_calls
    from fsdp_replay.testing.distributed import fake_world

    with fake_world(8) as mesh:
        profile, demands = bench_calls.calls_per_step("record_and_replay", mesh, steps=2)
    bench_calls.print_profile(profile, demands, steps=2)
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[-1]: line.split() for line in lines[1:-1]}
    assert demands == 130
    assert float(rows["provide"][1]) == pytest.approx(1.0, abs=0.05)  # refills at the scope's start and per demand
    assert float(rows["on_demand"][1]) >= 1.0  # the scheduler's and the strategy's, once each per demand
    assert lines[-1].endswith("all fsdp_replay functions") and float(lines[-1].split()[0]) > 0


def test_host_cost_run_reports_every_mode_at_every_unit_count_against_plain(host_cost_run):
    """``suite=host_cost`` (quick: 4 and 16 units): one row per count, every contender's paired overhead."""
    report, run_dir, stdout, leaked = host_cost_run
    table = (run_dir / "table.md").read_text()
    assert table.strip() in stdout and not leaked and "workloads" not in report
    scan = report["host_cost"]
    assert [row["units"] for row in scan] == report["config"]["cpu_cost"]["unit_counts"] == [4, 16]
    contenders = [m for m in MODES if m != "plain"] + [bench_cpu_cost.MEASURE_WAITS, bench_cpu_cost.PLAIN_CONTROL]
    for row in scan:
        assert list(row["overhead_vs_plain"]) == contenders and all(len(t) == 3 for t in row["step_s"].values())
        assert all(math.isfinite(x) for x in [*row["overhead_vs_plain"].values(), row["measure_waits_vs_replay"]])
        assert f"| {row['units']} | {row['demands_per_step']} |" in table
    assert scan[0]["demands_per_step"] < scan[1]["demands_per_step"]
    assert "Worst over the unit counts" in table
    md = (run_dir / "BENCHMARKS.md").read_text()
    assert "hand-written analysis stays" in md and "<!-- bench:results:host_cost:cpu -->" in md


@pytest.mark.parametrize("counts", [[], [16, 1], [16, True]])
def test_host_cost_unit_counts_reject_anything_but_integers_from_2_naming_the_value(counts):
    from bench_config import CpuCostConfig

    with pytest.raises(ValueError, match=r"CpuCostConfig.unit_counts must be one or more integers >= 2, got "):
        CpuCostConfig(unit_counts=counts)


@pytest.mark.parametrize("fields", [{"placements": 0}, {"placements": 5, "scan_steps": 4}, {"placements": 3, "steps": 2}])
def test_cpu_cost_placements_must_leave_each_placement_a_round_naming_the_values(fields):
    from bench_config import CpuCostConfig

    with pytest.raises(ValueError, match=r"CpuCostConfig\.placements must be"):
        CpuCostConfig(**fields)


def test_cpu_cost_rounds_are_shared_among_placements_as_evenly_as_they_divide():
    assert bench_cpu_cost._shares(20, 4) == [5, 5, 5, 5]
    assert bench_cpu_cost._shares(3, 2) == [2, 1]
    assert bench_cpu_cost._shares(7, 3) == [3, 2, 2]


@pytest.fixture(scope="module")
def conditional_run(tmp_path_factory) -> tuple[dict, Path, str, set[str]]:
    run_dir = tmp_path_factory.mktemp("bench_conditional")
    report, stdout, leaked = _run_bench(run_dir, f"bench.workloads=[{','.join(CONDITIONAL_WORKLOADS)}]")
    return report, run_dir, stdout, leaked


def test_conditional_workloads_report_ratios_wasted_bytes_and_their_targets(conditional_run):
    report, _, stdout, leaked = conditional_run
    assert set(report["workloads"]) == set(CONDITIONAL_WORKLOADS) and not leaked
    assert "| wasted MiB |" in stdout
    for name, w in report["workloads"].items():
        assert w["warmup_steps"] >= workload(name).record_steps + 1, name
        rr = w["modes"]["record_and_replay"]
        assert rr["speedup_vs_plain"] > 0 and rr["speedup_vs_demand"] > 0 and rr["wasted_bytes"] is not None, name
        assert (rr["wasted_bytes"] > 0) == (rr["wasted"] > 0), name
        for mode in MODES:
            assert w["modes"][mode]["losses"] == w["modes"]["plain"]["losses"], (name, mode)
    targets = {t["target"] for t in report["targets"] if t["workload"] in CONDITIONAL_WORKLOADS}
    assert {"record_and_replay hits among demands that gather", "record_and_replay wasted share of gathers issued"} <= targets
