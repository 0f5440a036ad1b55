"""The run report's files, summary and pictures, written in one process from made-up step counters
and a made-up explain() report."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from train_lib.plot import NOT_DRAWN, PLOT_FILE, plot_metrics
from train_lib.report import EXPLAIN_FILE, METRICS_FILE, ORDER_PLOT_FILE, RunReport, write_explain

from fsdp_replay import DemandRow, ExplainReport, KeyStats, PrefetchStats, Served
from fsdp_replay.stats import MissReason

STEPS = 5
EVAL_STEPS = (2, 4)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KEY = "train"


def explain(key: str) -> ExplainReport:
    """What ``sched.explain(key)`` returns after a replayed step of one unit: a hit, then a miss."""
    rows = [
        DemandRow(0, "layers.0", "forward", Served.hit, wait_s=0.0, provided_at=-0.5),
        DemandRow(1, "layers.0", "backward", Served.miss, reason=MissReason.depth, wait_s=0.002),
    ]
    return ExplainReport(key, "replay", "completed", rows, waits_measured=True)


def summary_rows(summary: str) -> dict[str, str]:
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in summary.splitlines())


def report_a_run(run_dir: Path, *, resumed_from: Path | None = None, tensorboard: bool = False) -> dict[str, str]:
    """STEPS steps as record_and_replay reports them: step 1 records, the others hit; the summary's rows."""
    report = RunReport(run_dir=run_dir, enabled=True, mode="record_and_replay", start_step=0, steps=STEPS,
                       tokens_per_step=64, resumed_from=resumed_from, tensorboard=tensorboard)
    totals = PrefetchStats()
    for step in range(1, STEPS + 1):
        recording = step == 1
        stats = KeyStats(demands=10, hits=0 if recording else 8, misses=8 if recording else 0, resident=2,
                         recordings=int(recording))
        for name, value in stats.as_dict().items():
            totals.add(name, value)
        eval_loss = 4.0 - step / 10 if step in EVAL_STEPS else None
        report.step(step, loss=5.0 - step / 10, seconds=0.1, stats=stats, eval_loss=eval_loss,
                    exposed_wait_s=0.001 * step)
    sched = SimpleNamespace(stats=totals, recorded_order=lambda key: None, explain=explain)
    return summary_rows(report.finish(sched, device=torch.device("cpu"), explain_key=KEY))


def test_summary_says_what_the_hit_rate_counts_and_where_the_run_is(tmp_path: Path) -> None:
    rows = report_a_run(tmp_path)
    # 8 hits + 2 resident on 4 steps, 0 + 2 on the recording step, over 50 demands
    assert rows["hit rate: (hits + resident) / demands"] == "84.0%"
    assert rows["run folder"] == str(tmp_path)


def test_plot_has_one_point_per_step_and_eval_loss_where_evaluated(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert report_a_run(tmp_path)["plot"] == PLOT_FILE
    assert (tmp_path / PLOT_FILE).read_bytes().startswith(PNG_SIGNATURE)
    metrics = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    drawn = plot_metrics(metrics, tmp_path / "again.png", title="again")
    assert drawn is not None
    for name in ("loss", "step_time_ms", "hit_rate_pct"):
        assert [step for step, _ in drawn[name]] == list(range(1, STEPS + 1)), name
    assert [step for step, _ in drawn["eval_loss"]] == list(EVAL_STEPS)
    assert drawn["hit_rate_pct"][0] == (1, 20.0)  # the recording step: resident demands only


def test_run_folder_explains_the_last_train_step_in_a_table_and_a_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert report_a_run(tmp_path)["explain"] == f"{EXPLAIN_FILE}, {ORDER_PLOT_FILE}: rank 0's last {KEY!r} step"
    assert (tmp_path / EXPLAIN_FILE).read_text() == f"{explain(KEY)}\n"
    assert (tmp_path / ORDER_PLOT_FILE).read_bytes().startswith(PNG_SIGNATURE)


def test_without_matplotlib_the_summary_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    rows = report_a_run(tmp_path)
    assert rows["plot"] == "not drawn: matplotlib is not installed (pip install matplotlib)"
    assert not (tmp_path / PLOT_FILE).exists()
    # The table needs no matplotlib; only the timeline is skipped, with the same words.
    assert rows["explain"] == f"{EXPLAIN_FILE}; {ORDER_PLOT_FILE} {NOT_DRAWN}"
    assert (tmp_path / EXPLAIN_FILE).read_text().startswith("fsdp_replay explain 'train'")
    assert not (tmp_path / ORDER_PLOT_FILE).exists()


def no_finished_scope(key: str) -> ExplainReport:
    """``sched.explain(key)`` before any scope of ``key`` finished."""
    raise ValueError(f"explain({key!r}): no scope of that key has finished")


def test_nothing_to_explain_writes_nothing_and_says_so(tmp_path: Path) -> None:
    # A run resumed at its last step finishes no train scope: explain() raises, the run does not.
    sched = SimpleNamespace(explain=no_finished_scope)
    assert write_explain(sched, tmp_path, key=KEY) == f"not written: no {KEY!r} step ran"
    assert write_explain(None, tmp_path, key=KEY).startswith("not written: plain FSDP2 has no scheduler")
    assert not any(tmp_path.iterdir())


def test_summary_names_the_checkpoint_folder_and_the_one_resumed_from(tmp_path: Path) -> None:
    run_dir, earlier = tmp_path / "run", tmp_path / "earlier" / "checkpoints" / "step_3"
    for step in (10, 5):  # checkpoints/step_10 sorts before step_5 by name; by step it comes last
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step}" / "trainer.pt").touch()
    rows = report_a_run(run_dir, resumed_from=earlier)
    assert rows["checkpoints"].startswith(f"{run_dir / 'checkpoints'}/: step_5, step_10 (train.resume_from=")
    assert rows["resumed from"] == f"{earlier} (step 0)"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoints"] == [str(run_dir / "checkpoints" / f"step_{step}") for step in (5, 10)]
    assert summary["resumed_from"] == str(earlier)


def test_a_run_that_saved_nothing_says_how_to_save(tmp_path: Path) -> None:
    rows = report_a_run(tmp_path)
    assert rows["checkpoints"] == "none saved (train.save_every=N saves every N steps)"
    assert "resumed from" not in rows


def test_plain_fsdp2_summary_shows_na_for_the_schedulers_counters(tmp_path: Path) -> None:
    report = RunReport(run_dir=tmp_path, enabled=True, mode="plain", start_step=0, steps=1, tokens_per_step=64)
    report.step(1, loss=5.0, seconds=0.1, stats=KeyStats(), eval_loss=None)
    rows = summary_rows(report.finish(None, device=torch.device("cpu"), explain_key=KEY))
    assert rows["prefetch hits / misses / resident"] == "n/a (plain FSDP2: no scheduler counts demands)"
    for name in ("hit rate: (hits + resident) / demands", "prefetches / kept / wasted", "divergences"):
        assert rows[name] == "n/a", name


def test_tensorboard_gets_each_steps_loss_eval_loss_step_time_hit_rate_and_exposed_wait(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = report_a_run(tmp_path, tensorboard=True)
    assert rows["tensorboard"] == f"{tmp_path / 'tensorboard'}/"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()

    def points(tag: str) -> list[tuple[int, float]]:
        return [(event.step, round(event.value, 4)) for event in events.Scalars(tag)]

    steps = range(1, STEPS + 1)
    assert points("loss/train") == [(step, round(5.0 - step / 10, 4)) for step in steps]
    assert points("loss/eval") == [(step, round(4.0 - step / 10, 4)) for step in EVAL_STEPS]
    assert points("step_time_ms") == [(step, 100.0) for step in steps]
    assert points("exposed_wait_ms") == [(step, float(step)) for step in steps]
    assert points("prefetch/hit_rate") == [(1, 0.2), *((step, 1.0) for step in steps[1:])]


def test_without_tensorboard_the_summary_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    rows = report_a_run(tmp_path, tensorboard=True)
    assert rows["tensorboard"] == "not written: the tensorboard package is not installed (pip install tensorboard)"
    assert not (tmp_path / "tensorboard").exists()
    (tmp_path / "off").mkdir()
    assert report_a_run(tmp_path / "off")["tensorboard"] == "off (train.tensorboard=false)"
