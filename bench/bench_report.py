"""Turn the ranks' raw measurements into figures: medians, ratios, the bound, targets, table and plot."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Callable

from bench_cpu_cost import PLAIN_CONTROL

# Targets of issue 4, checked on every full run and written next to the figures.
TARGET_VS_DEMAND = 1.25
TARGET_SEQUENTIAL_VS_PLAIN = 0.98
TARGET_IRREGULAR = 1.15
IRREGULAR = ("out_of_order", "shared_block")
TARGET_HIDDEN = 0.80
TARGET_CPU_COST = 0.05
# Targets of issue 25 on the workloads whose data skips units: replay after the recordings hits >= 90%
# of the demands that needed a gather and wastes <= 10% of the gathers it issued.
CONDITIONAL = ("moe_dynamic", "layer_drop")
TARGET_CONDITIONAL_HITS = 0.90
TARGET_CONDITIONAL_WASTE = 0.10
# Targets of issue 15 (suite=depths): auto within 3% of the best fixed depth; checkpointed >= 1.25x demand.
TARGET_AUTO_VS_BEST_FIXED = 0.97
AUTO_VS_DEMAND_WORKLOAD = "checkpointed"

RESULTS_BEGIN = "<!-- bench:results:{device} -->"
RESULTS_END = "<!-- /bench:results:{device} -->"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"), float("nan"))
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _exposed_by_unit(per_step: list[list[tuple[str, float]]]) -> dict[str, float]:
    """Rank 0's exposed gather wait per unit (summed over a step's uses), median over steps, in ms."""
    units = {name for exposures in per_step for name, _ in exposures}
    out = {}
    for unit in sorted(units):
        sums = [sum(s for name, s in exposures if name == unit) for exposures in per_step]
        out[unit] = round(_median(sums) * 1e3, 2)
    return out


def _mode_figures(steps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One mode's figures from its timed steps (``steps[i][rank]``): the step time of a step is the
    slowest rank's; times, counts and the scheduler's counters are the ranks' mean (median over
    steps); the peak is the maximum over ranks and steps; losses are every rank's, in rank order."""
    step_s = [max(r["step_s"] for r in s) for s in steps]

    def mean_of(key: str) -> float:
        return _median([statistics.fmean(r[key] for r in s) for s in steps])

    def rank_mean(get: Callable[[dict[str, Any]], float]) -> float:
        return statistics.fmean(statistics.fmean(get(r) for r in s) for s in steps)

    scheduled = "stats" in steps[0][0]  # not for plain FSDP2

    q1, q3 = _quartiles(step_s)
    return {
        "median_step_s": _median(step_s),
        "q1_step_s": q1,
        "q3_step_s": q3,
        "step_s": step_s,
        "exposed_gather_s": mean_of("exposed_gather_s"),
        "first_exposed_s": mean_of("first_exposed_s"),
        "issue_s": mean_of("issue_s"),
        "copy_out_s": mean_of("copy_out_s"),
        "reduce_scatter_s": mean_of("reduce_scatter_s"),
        "gathers": rank_mean(lambda r: r["gathers"]),
        "reduce_scatters": rank_mean(lambda r: r["reduce_scatters"]),
        "hits": rank_mean(lambda r: r["observed"].get("hit", 0)),
        "misses": rank_mean(lambda r: r["observed"].get("miss", 0)),
        "resident": rank_mean(lambda r: r["observed"].get("resident", 0)),
        "prefetches": rank_mean(lambda r: r["stats"]["prefetches"]) if scheduled else None,
        "kept": rank_mean(lambda r: r["stats"]["kept"]) if scheduled else None,
        "wasted": rank_mean(lambda r: r["stats"]["wasted"]) if scheduled else None,
        "wasted_bytes": rank_mean(lambda r: r["stats"]["wasted_bytes"]) if scheduled else None,
        "divergences": sum(max(r["stats"]["divergences"] for r in s) for s in steps) if scheduled else None,
        "peak_unsharded_bytes": max(r["peak_unsharded_bytes"] for s in steps for r in s),
        "losses": [[loss for r in s for loss in r["losses"]] for s in steps],
        "depth_per_step": [s[0]["depth"] for s in steps] if scheduled else None,  # rank 0's; all ranks agree
        "exposed_by_unit_ms": _exposed_by_unit([s[0]["exposures"] for s in steps]),
    }


def _per_step(per_rank: list[dict[str, Any]], mode: str) -> list[list[dict[str, Any]]]:
    """``[step][rank]`` records of ``mode`` from each rank's ``{"modes": {mode: [record per step]}}``."""
    return [[r["modes"][mode][i] for r in per_rank] for i in range(len(per_rank[0]["modes"][mode]))]


def summarize(ranks: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per workload and mode (see ``_mode_figures``), with the bound and the share of the wait hidden."""
    names = list(ranks[0]["workloads"])
    out: dict[str, Any] = {}
    for name in names:
        per_rank = [r["workloads"][name] for r in ranks]
        w0 = per_rank[0]
        figures = {mode: _mode_figures(_per_step(per_rank, mode)) for mode in modes}
        compute = _median([max(wr["compute_only_s"][i] for wr in per_rank) for i in range(len(w0["compute_only_s"]))])
        bounds = {
            owner: _bound(compute, [wr["comm_only"][owner] for wr in per_rank], len(w0["collectives"][owner]))
            for owner in w0["comm_only"]
        }
        demand_hideable = figures["demand"]["exposed_gather_s"] - figures["demand"]["first_exposed_s"]
        for mode, f in figures.items():
            f["bound_of"] = mode if mode in bounds else "demand"
            bound = bounds[f["bound_of"]]
            exposed_after_first = f["exposed_gather_s"] - f["first_exposed_s"]
            f["speedup_vs_demand"] = figures["demand"]["median_step_s"] / f["median_step_s"]
            f["speedup_vs_plain"] = figures["plain"]["median_step_s"] / f["median_step_s"]
            f["bound_s"] = bound["bound_s"]
            f["bound_over_step"] = bound["bound_s"] / f["median_step_s"]
            # Share of the hideable gather wait that this mode hid: demand exposes every gather, so
            # its wait beyond the first gather is what a perfect prefetcher could hide in this run
            # (a gather a mode does not issue at all, a kept unit, counts as hidden).
            f["hidden_share"] = 1 - exposed_after_first / demand_hideable if demand_hideable > 0 else float("nan")
            overlappable = bounds["demand"]["overlappable_comm_s"]
            f["hidden_share_vs_comm_only"] = 1 - exposed_after_first / overlappable if overlappable > 0 else float("nan")
        out[name] = {
            "notes": w0["notes"],
            "unit_bytes": w0["unit_bytes"],
            "max_unit_bytes": max(w0["unit_bytes"]),
            "recorded_demands": w0["recorded_demands"],
            "modes": figures,
            "compute_only_s": compute,
            "bounds": bounds,
            "profile": w0.get("profile"),
            "losses_equal": all(figures[m]["losses"] == figures[modes[0]]["losses"] for m in modes),
            "warmup_steps": w0["warmup_steps"],
            "final_depth": w0["final_depth"],
        }
    return out


def compare_depths(workloads: dict[str, Any], depths: list[str]) -> None:
    """``suite=depths``: add to each contender its ratio to the best fixed depth of its workload
    (the one with the lowest median step): the median over rounds of the best's step time / this
    one's in the same round (above 1: faster; NaN without a fixed depth).

    Contenders take turns step by step, so a round's steps ran under the same load; a ratio of
    medians would also compare the load of different minutes of the run (as the CPU-cost
    protocol does, ``bench_cpu_cost.measure_cpu_cost``).
    """
    from bench_config import AUTO, depth_contender

    fixed = [depth_contender(d) for d in depths if d != AUTO]
    for w in workloads.values():
        best = min(fixed, key=lambda name: w["modes"][name]["median_step_s"]) if fixed else None
        w["best_fixed_depth"] = best
        for f in w["modes"].values():
            f["vs_best_fixed_depth"] = (
                _median([b / s for b, s in zip(w["modes"][best]["step_s"], f["step_s"])]) if best else float("nan")
            )


def check_depth_targets(workloads: dict[str, Any], depths: list[str]) -> list[dict[str, Any]]:
    """Issue 15's targets for ``auto`` (when ``depths`` has it): within 3% of the best fixed depth
    on every workload, and >= 1.25x demand on the checkpointed one."""
    from bench_config import AUTO, depth_contender

    rows: list[dict[str, Any]] = []
    if AUTO not in depths:
        return rows
    auto = depth_contender(AUTO)
    for name, w in workloads.items():
        f = w["modes"][auto]
        if w["best_fixed_depth"] is not None:
            value = f["vs_best_fixed_depth"]
            rows.append({"target": f"auto vs best fixed depth ({w['best_fixed_depth'].split()[-1]}), not >3% slower",
                         "workload": name, "value": value, "threshold": TARGET_AUTO_VS_BEST_FIXED,
                         "met": value >= TARGET_AUTO_VS_BEST_FIXED})
        if name == AUTO_VS_DEMAND_WORKLOAD:
            value = f["speedup_vs_demand"]
            rows.append({"target": "auto speedup vs demand", "workload": name, "value": value,
                         "threshold": TARGET_VS_DEMAND, "met": value >= TARGET_VS_DEMAND})
    return rows


def _bound(compute: float, per_rank: list[list[dict[str, float]]], collectives: int) -> dict[str, Any]:
    """max(compute, all-gathers after the first) + first all-gather + reduce-scatters (synchronous on CPU)."""
    comm = {
        key: _median([max(reps[i][key] for reps in per_rank) for i in range(len(per_rank[0]))])
        for key in ("all_gather_s", "first_all_gather_s", "reduce_scatter_s")
    }
    overlappable = comm["all_gather_s"] - comm["first_all_gather_s"]
    non_overlappable = comm["first_all_gather_s"] + comm["reduce_scatter_s"]
    return {
        "comm_only": comm,
        "collectives": collectives,
        "overlappable_comm_s": overlappable,
        "non_overlappable_comm_s": non_overlappable,
        "bound_s": max(compute, overlappable) + non_overlappable,
    }


PIPELINE_FIGURES = ("gathers", "exposed_gather_s", "peak_unsharded_bytes", "median_step_s")
"""The pipeline table's figures, each also given as a ratio to plain FSDP2's."""


def summarize_pipeline(ranks: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per schedule and mode (see ``_mode_figures``), each of ``PIPELINE_FIGURES`` also as mode / plain."""
    out: dict[str, Any] = {}
    for schedule in ranks[0]["schedules"]:
        per_rank = [r["schedules"][schedule] for r in ranks]
        figures = {mode: _mode_figures(_per_step(per_rank, mode)) for mode in modes}
        for f in figures.values():
            f["vs_plain"] = {k: f[k] / figures["plain"][k] if figures["plain"][k] else float("nan") for k in PIPELINE_FIGURES}
        out[schedule] = {
            "stages_by_rank": [r["stages"] for r in per_rank],
            "unit_bytes": per_rank[0]["unit_bytes"],
            "modes": figures,
            "losses_equal": all(figures[m]["losses"] == figures["plain"]["losses"] for m in modes),
        }
    return out


def check_targets(workloads: dict[str, Any], cpu_cost: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target of the issue: the measured value and whether it holds."""
    rows: list[dict[str, Any]] = []
    rr = "record_and_replay"

    def add(target: str, workload: str, value: float, threshold: float, met: bool) -> None:
        rows.append({"target": target, "workload": workload, "value": value, "threshold": threshold, "met": bool(met)})

    for name, w in workloads.items():
        m = w["modes"]
        if rr not in m:
            continue
        add("record_and_replay speedup vs demand", name, m[rr]["speedup_vs_demand"], TARGET_VS_DEMAND,
            m[rr]["speedup_vs_demand"] >= TARGET_VS_DEMAND)
        if name == "sequential":
            add("record_and_replay vs plain FSDP2 (not >2% slower)", name, m[rr]["speedup_vs_plain"],
                TARGET_SEQUENTIAL_VS_PLAIN, m[rr]["speedup_vs_plain"] >= TARGET_SEQUENTIAL_VS_PLAIN)
        if name in IRREGULAR:
            add("record_and_replay speedup vs plain FSDP2", name, m[rr]["speedup_vs_plain"], TARGET_IRREGULAR,
                m[rr]["speedup_vs_plain"] >= TARGET_IRREGULAR)
            if "static" in m:
                vs_static = m["static"]["median_step_s"] / m[rr]["median_step_s"]
                add("record_and_replay speedup vs static", name, vs_static, TARGET_IRREGULAR, vs_static >= TARGET_IRREGULAR)
        if name in CONDITIONAL:
            f = m[rr]
            hits = f["hits"] / (f["hits"] + f["misses"]) if f["hits"] + f["misses"] else float("nan")
            add("record_and_replay hits among demands that gather", name, hits, TARGET_CONDITIONAL_HITS,
                hits >= TARGET_CONDITIONAL_HITS)
            waste = f["wasted"] / (f["prefetches"] + f["misses"]) if f["prefetches"] + f["misses"] else 0.0
            add("record_and_replay wasted share of gathers issued", name, waste, TARGET_CONDITIONAL_WASTE,
                waste <= TARGET_CONDITIONAL_WASTE)
        add("record_and_replay share of hideable all-gather wait hidden", name, m[rr]["hidden_share"], TARGET_HIDDEN,
            m[rr]["hidden_share"] >= TARGET_HIDDEN)
        limit = m["plain"]["peak_unsharded_bytes"] + w["max_unit_bytes"]
        for mode in m:
            if mode != "plain":
                add(f"{mode} peak unsharded bytes <= plain + one unit", name, m[mode]["peak_unsharded_bytes"], limit,
                    m[mode]["peak_unsharded_bytes"] <= limit)
    if cpu_cost is not None:
        value = cpu_cost["overhead_vs_plain"][rr]
        add("scheduler CPU cost vs plain FSDP2 step (fake backend)", f"{cpu_cost['units']} units, world {cpu_cost['world_size']}",
            value, TARGET_CPU_COST, value <= TARGET_CPU_COST)
    return rows


# --- text ------------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return "n/a" if s is None or math.isnan(s) else f"{s * 1e3:.1f}"


def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _count(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


OVER_BOUND_MARK = "*"
OVER_BOUND_NOTE = (
    f"{OVER_BOUND_MARK} Over 100%: the median step was faster than the bound. The bound is built from the "
    "compute-only and communication-only runs, each timed on its own (median of `bench.bound_steps`), so it is "
    "an estimate with their noise, not a floor; over 100% means the step is at the bound within that noise."
)
"""Printed under a step-time table in which some mode reached more than 100% of its bound."""


def _pct_of_bound(x: float) -> str:
    """The share of the bound a step reached; marked where it is over 100% (see ``OVER_BOUND_NOTE``)."""
    return _pct(x) + (OVER_BOUND_MARK if x is not None and x > 1 else "")


SMOKE_NOTE = (
    "**Smoke run** (`bench.quick=true`): a small model and {steps} timed steps per mode, to show that every "
    "mode runs and computes plain FSDP2's losses. The times are not measurements and no target is judged; "
    "the full run (without `bench.quick`) gives both."
)
"""The first line of every section a quick run writes."""


def is_smoke(report: dict[str, Any]) -> bool:
    return bool(report["config"]["bench"]["quick"])


def _targets_part(report: dict[str, Any]) -> list[str]:
    """The targets table; on a smoke run, one line instead (its times cannot meet or miss a target)."""
    if is_smoke(report):
        return ["Targets: not judged on a smoke run."]
    return [targets_table(report["targets"])]


def _overhead(x: float) -> str:
    return f"{100 * x:+.1f}%"


def markdown_table(workloads: dict[str, Any], modes: list[str]) -> str:
    header = (
        "| workload | mode | median step ms (IQR) | x demand | x plain | exposed AG wait ms | hid | "
        "hits / misses / resident (kept) / wasted | wasted MiB | peak unsharded MiB | bound ms (% of bound reached) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for name, w in workloads.items():
        for mode in modes:
            f = w["modes"][mode]
            lines.append(
                f"| {name} | {mode} | {_ms(f['median_step_s'])} ({_ms(f['q1_step_s'])}-{_ms(f['q3_step_s'])}) | "
                f"{f['speedup_vs_demand']:.2f} | {f['speedup_vs_plain']:.2f} | {_ms(f['exposed_gather_s'])} | "
                f"{_pct(f['hidden_share'])} | {_count(f['hits'])} / {_count(f['misses'])} / {_count(f['resident'])} "
                f"({_count(f['kept'])}) / "
                f"{_count(f['wasted'])} | {_mb(f['wasted_bytes']) if f['wasted_bytes'] is not None else 'n/a'} | "
                f"{_mb(f['peak_unsharded_bytes'])} | {_ms(f['bound_s'])} ({_pct_of_bound(f['bound_over_step'])}) |"
            )
    if any(f["bound_over_step"] > 1 for w in workloads.values() for f in w["modes"].values()):
        lines += ["", OVER_BOUND_NOTE]
    return "\n".join(lines)


def bound_table(workloads: dict[str, Any]) -> str:
    lines = [
        "| workload | collectives of | compute only ms | all-gathers ms (first) | reduce-scatters ms | overlappable ms | "
        "not overlappable ms | bound ms | units x MiB | collectives |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in workloads.items():
        for owner, b in w["bounds"].items():
            c = b["comm_only"]
            lines.append(
                f"| {name} | {owner} | {_ms(w['compute_only_s'])} | {_ms(c['all_gather_s'])} "
                f"({_ms(c['first_all_gather_s'])}) | {_ms(c['reduce_scatter_s'])} | {_ms(b['overlappable_comm_s'])} | "
                f"{_ms(b['non_overlappable_comm_s'])} | {_ms(b['bound_s'])} | "
                f"{len(w['unit_bytes'])} x {_mb(w['max_unit_bytes'])} | {b['collectives']} |"
            )
    return "\n".join(lines)


def _cpu_cost_protocol(placements: int) -> str:
    """How ``bench_cpu_cost`` times its contenders, in the words both of its tables print."""
    return (
        f"each contender in a process of its own (its model the first and only one there, its heap frozen once "
        f"built, its steps on one core), the rounds shared among {placements} sets of fresh processes in turn; "
        f"overhead = mean over sets of the median over their rounds of (contender / plain of the same round) - 1; "
        f"{PLAIN_CONTROL} is a second plain FSDP2, the protocol's own error"
    )


def cpu_cost_table(cpu_cost: dict[str, Any]) -> str:
    lines = [
        f"Fake backend, world size {cpu_cost['world_size']}, {cpu_cost['units']} units, "
        f"{cpu_cost['demands_per_step']} demands per step, {len(cpu_cost['step_s']['plain'])} rounds; "
        f"{cpu_cost['clock']} of each step; {_cpu_cost_protocol(cpu_cost['placements'])}:",
        "",
        "| mode | median step CPU ms | overhead vs plain FSDP2 | per demand µs |",
        "|---|---|---|---|",
    ]
    for mode, s in cpu_cost["median_step_s"].items():
        over = cpu_cost["overhead_vs_plain"].get(mode)
        per = cpu_cost["per_demand_us"].get(mode)
        lines.append(
            f"| {mode} | {s * 1e3:.2f} | {'-' if over is None else f'{100 * over:+.1f}%'} | "
            f"{'-' if per is None else f'{per:.1f}'} |"
        )
    return "\n".join(lines)


HOST_COST_TARGET = 0.03
"""Issue 27: record_and_replay and static cost at most 3% over plain FSDP2 on the fake backend, at every unit count."""


def host_cost_table(scan: list[dict[str, Any]]) -> str:
    """``suite=host_cost``: one row per unit count, each contender's overhead over plain FSDP2."""
    modes = [m for m in scan[0]["overhead_vs_plain"]]
    lines = [
        "| units | demands per step | plain step CPU ms | " + " | ".join(modes) + " | measure_waits over record_and_replay |",
        "|---|---|---|" + "---|" * (len(modes) + 1),
    ]
    for row in scan:
        over = " | ".join(_overhead(row["overhead_vs_plain"][m]) for m in modes)
        lines.append(
            f"| {row['units']} | {row['demands_per_step']} | {row['median_step_s']['plain'] * 1e3:.1f} | {over} | "
            f"{_overhead(row['measure_waits_vs_replay'])} |"
        )
    return "\n".join(lines)


def render_host_cost(report: dict[str, Any]) -> str:
    """The generated section of ``suite=host_cost``."""
    cc = report["config"]["cpu_cost"]
    scan = report["host_cost"]
    worst = {m: max(row["overhead_vs_plain"][m] for row in scan) for m in ("static", "record_and_replay")}
    met = ", ".join(f"{m} {_overhead(v)} ({'met' if v <= HOST_COST_TARGET else 'NOT met'})" for m, v in worst.items())
    parts = _run_lines(report) + [
        f"Fake backend, world size {cc['world_size']}, one thread; units are MLP blocks of dim {cc['dim']}, hidden "
        f"{cc['hidden']}, {cc['rows']} rows. Per unit count: {cc['scan_steps']} rounds of one step per contender (each "
        f"round starts one contender later), each set of processes after {cc['warmup_steps']} warmup rounds; thread CPU "
        f"time per step; {_cpu_cost_protocol(cc['placements'])}. Run took {report['wall_s']:.0f} s.",
        "",
        host_cost_table(scan),
        "",
        f"Worst over the unit counts against the {_overhead(HOST_COST_TARGET)} target: {met}.",
        "",
    ]
    return "\n".join(parts)


def targets_table(targets: list[dict[str, Any]]) -> str:
    lines = ["| target | workload | measured | threshold | met |", "|---|---|---|---|---|"]
    for t in targets:
        bytes_target = "bytes" in t["target"]
        value = _mb(t["value"]) + " MiB" if bytes_target else f"{t['value']:.3f}"
        threshold = _mb(t["threshold"]) + " MiB" if bytes_target else f"{t['threshold']:.3f}"
        lines.append(f"| {t['target']} | {t['workload']} | {value} | {threshold} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines)


def _depth(depth: list[int] | tuple[int, int] | None) -> str:
    return "-" if depth is None else f"{depth[0]}/{depth[1]}"


def depths_table(workloads: dict[str, Any], contenders: list[str]) -> str:
    lines = [
        "| workload | contender | median step ms (IQR) | x demand | x best fixed depth | exposed AG wait ms | "
        "peak unsharded MiB | depth fwd/bwd in timed steps (after) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, w in workloads.items():
        for contender in contenders:
            f = w["modes"][contender]
            after = w["final_depth"].get(contender)  # only for record_and_replay: the others do not prefetch
            timed = " → ".join(dict.fromkeys(_depth(d) for d in f["depth_per_step"] or [None])) if after else "-"
            lines.append(
                f"| {name} | {contender} | {_ms(f['median_step_s'])} ({_ms(f['q1_step_s'])}-{_ms(f['q3_step_s'])}) | "
                f"{f['speedup_vs_demand']:.2f} | {f['vs_best_fixed_depth']:.2f} | {_ms(f['exposed_gather_s'])} | "
                f"{_mb(f['peak_unsharded_bytes'])} | {timed}{f' ({_depth(after)})' if after else ''} |"
            )
    return "\n".join(lines)


def pipeline_table(schedules: dict[str, Any], modes: list[str]) -> str:
    lines = [
        "| schedule | mode | all-gathers per rank (x plain) | exposed AG wait ms (x plain) | peak unsharded MiB (x plain) "
        "| median step ms (IQR) (x plain) | hits / misses / resident (kept) / wasted |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, sch in schedules.items():
        for mode in modes:
            f = sch["modes"][mode]
            r = f["vs_plain"]
            lines.append(
                f"| {name} | {mode} | {_count(f['gathers'])} ({r['gathers']:.2f}) | "
                f"{_ms(f['exposed_gather_s'])} ({r['exposed_gather_s']:.2f}) | "
                f"{_mb(f['peak_unsharded_bytes'])} ({r['peak_unsharded_bytes']:.2f}) | "
                f"{_ms(f['median_step_s'])} ({_ms(f['q1_step_s'])}-{_ms(f['q3_step_s'])}) ({r['median_step_s']:.2f}) | "
                f"{_count(f['hits'])} / {_count(f['misses'])} / {_count(f['resident'])} ({_count(f['kept'])}) / "
                f"{_count(f['wasted'])} |"
            )
    return "\n".join(lines)


def _run_lines(report: dict[str, Any]) -> list[str]:
    """Command, machine and interconnect: the first lines of every generated section."""
    m = report["machine"]
    smoke = [SMOKE_NOTE.format(steps=report["config"]["bench"]["steps"]), ""] if is_smoke(report) else []
    return smoke + [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB, {m['platform']}, "
        f"torch {m['torch']}, backend {report['backend']}, {report['config']['bench']['threads']} compute thread(s) "
        f"per rank, world size {report['world_size']}. Load average before/after: {m['load_before']} / {m['load_after']}.",
        "",
        f"Interconnect: {report['interconnect']}",
        "",
    ]


def render(report: dict[str, Any]) -> str:
    """The generated section of BENCHMARKS.md (and ``table.md``)."""
    modes = report["config"]["bench"]["modes"]
    parts = _run_lines(report) + [
        f"Model: {report['config']['bench']['n_blocks']} blocks of dim {report['config']['bench']['dim']}, "
        f"hidden {report['config']['bench']['hidden']}, {report['config']['bench']['rows']} rows per microbatch; "
        f"{report['config']['bench']['warmup_steps']} warmup + {report['config']['bench']['steps']} timed steps "
        f"per mode, alternating {' '.join(modes)}. Run took {report['wall_s']:.0f} s.",
        "",
        "### Step time per mode",
        "",
        markdown_table(report["workloads"], modes),
        "",
        "### Physical limit",
        "",
        bound_table(report["workloads"]),
        "",
    ]
    if report.get("cpu_cost"):
        parts += ["### Scheduler CPU cost", "", cpu_cost_table(report["cpu_cost"]), ""]
    parts += ["### Targets", "", *_targets_part(report), ""]
    if report.get("plot"):
        parts += [f"![step time per mode and workload, bound drawn in]({report['plot']})", ""]
    return "\n".join(parts)


def render_pipeline(report: dict[str, Any]) -> str:
    """The generated section of the pipeline run (``suite=pipeline``)."""
    run, p = report["config"]["bench"], report["config"]["pipeline"]
    schedules = report["pipeline"]
    stages = ", ".join(f"{name} {len(s['stages_by_rank'][0])}" for name, s in schedules.items())
    unit_mib = _mb(max(max(s["unit_bytes"]) for s in schedules.values()))
    equal = all(s["losses_equal"] for s in schedules.values())
    return "\n".join(
        _run_lines(report)
        + [
            f"Model: pp {p['pp']} x dp {p['world_size'] // p['pp']}; stages per rank: {stages}; "
            f"{p['blocks_per_stage']} blocks of dim {p['dim']} per stage ({unit_mib} MiB per block unit), every "
            f"block and stage a `fully_shard` unit over dp, `reshard_after_forward=True`; {p['rows']} rows per "
            f"step in {p['microbatches']} microbatches; {run['warmup_steps']} warmup + {run['steps']} timed steps "
            f"per mode, alternating {' '.join(run['modes'])}. Run took {report['wall_s']:.0f} s.",
            "",
            "In brackets: mode / plain FSDP2 (below 1: fewer, less, faster). Step time: the slowest rank's, "
            "median over the timed steps; all-gathers, exposed wait, hits/misses: mean over ranks; peak: "
            f"maximum over ranks and steps. Losses identical in every mode: {'yes' if equal else '**no**'}.",
            "",
            pipeline_table(schedules, run["modes"]),
            "",
        ]
    )


def render_depths(report: dict[str, Any]) -> str:
    """The generated section of ``suite=depths``: every contender of every workload, and the targets."""
    run = report["config"]["bench"]
    workloads = report["workloads"]
    contenders = list(next(iter(workloads.values()))["modes"])
    warmup = next(iter(workloads.values()))["warmup_steps"]
    equal = all(w["losses_equal"] for w in workloads.values())
    return "\n".join(
        _run_lines(report)
        + [
            f"Model: {run['n_blocks']} blocks of dim {run['dim']}, hidden {run['hidden']}, {run['rows']} rows per "
            f"microbatch; {warmup} warmup steps ({run['warmup_steps']} + {warmup - run['warmup_steps']} for `auto` to "
            f"settle) + {run['steps']} timed steps per contender, alternating {', '.join(contenders)}; "
            f"`record_and_replay depth d` runs `forward_prefetch=backward_prefetch=d` and "
            f"`max_reuse_distance={run['max_reuse_distance']}`, no byte cap "
            f"(`max_prefetch_bytes=None`). Run took {report['wall_s']:.0f} s.",
            "",
            "x best fixed depth: the median over rounds of the fastest fixed depth's step time / this one's in the same "
            "round (below 1: slower; the fastest by median step). Depth: "
            "rank 0's `sched.prefetch_depth()` at each timed step (every distinct value in order), and after the last "
            f"(all ranks agree by construction). Losses identical in every contender: {'yes' if equal else '**no**'}.",
            "",
            depths_table(workloads, contenders),
            "",
            *_targets_part(report),
            "",
        ]
    )


def render_explain(report: dict[str, Any]) -> str:
    """The generated section of ``suite=explain``: rank 0's ``explain()`` of each workload, as printed."""
    run = report["config"]["bench"]
    parts = _run_lines(report) + [
        f"Model: {run['n_blocks']} blocks of dim {run['dim']}, hidden {run['hidden']}, {run['rows']} rows per "
        f"microbatch; `record_and_replay` with `measure_waits=True`, forward/backward prefetch "
        f"{run['forward_prefetch']}/{run['backward_prefetch']}; the report is of step {run['warmup_steps']} (the first "
        f"replayed step after {run['warmup_steps']} warmup steps, the first of which records). Run took {report['wall_s']:.0f} s.",
        "",
    ]
    for name, explained in report["explain"].items():
        parts += [f"`print(sched.explain())`, {name}, rank 0 (step {_ms(explained['step_s'])} ms):", "", "```text", explained["text"], "```", ""]
        if explained["plot"]:
            parts += [f"![explain() timeline of {name}, rank 0]({explained['plot']})", ""]
    return "\n".join(parts)


def update_markdown(path: Path, section: str, device: str) -> None:
    """Replace the generated region of ``path`` for ``device`` (cpu or cuda), creating it if absent."""
    begin, end = RESULTS_BEGIN.format(device=device), RESULTS_END.format(device=device)
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + f"\n\n{block}\n"
    path.write_text(text)


# --- plot ------------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Grouped bars of median step time (IQR whiskers) per workload, with the bound as a line. None: no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    modes = report["config"]["bench"]["modes"]
    workloads = report["workloads"]
    fig, ax = plt.subplots(figsize=(2.2 * len(workloads) + 2, 4.5))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(workloads))]
        med = [w["modes"][mode]["median_step_s"] * 1e3 for w in workloads.values()]
        lo = [m - w["modes"][mode]["q1_step_s"] * 1e3 for m, w in zip(med, workloads.values())]
        hi = [w["modes"][mode]["q3_step_s"] * 1e3 - m for m, w in zip(med, workloads.values())]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=mode)
    for i, w in enumerate(workloads.values()):
        for owner, style in (("demand", "--"), ("record_and_replay", ":")):
            if owner in w["bounds"]:
                label = f"bound with {owner}'s collectives" if i == 0 else None
                ax.hlines(w["bounds"][owner]["bound_s"] * 1e3, i - 0.45, i + 0.45, colors="black", linestyles=style, label=label)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(list(workloads), rotation=15)
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"fsdp_replay benchmark: {report['backend']}, {report['interconnect_short']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
