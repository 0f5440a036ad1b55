"""recipes/train.py with pipeline parallelism: 4 ranks = 2 pipeline stages x 2 FSDP ranks (gloo).

Plain FSDP2 and every prefetch mode under a one-stage-per-rank schedule (1F1B) and a looped one
(Interleaved1F1B, two stages per rank): 8 torchrun launches of 4 ranks, and one that is rejected,
about 4 minutes on 2 CPU cores shared with other work. Bad pipeline settings that are caught
before any process group are in test_train's
``test_bad_value_fails_once_before_any_process_group_leaving_no_run_folder``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from recipe_runs import Run, launch
from train_lib.report import EXPLAIN_FILE, ORDER_PLOT_FILE

from fsdp_replay import PrefetchMode

NPROC = 4
STEPS = 3
PIPELINE = ("pipeline.stages=2", "train.microbatches=2", f"train.steps={STEPS}")
SCHEDULES = {"1F1B": (), "Interleaved1F1B": ("pipeline.virtual_stages=2",)}
"""Schedule name -> its further overrides."""
PLAIN = "plain"
MODES = (PLAIN, *(mode.name for mode in PrefetchMode))

TrainRun = Callable[..., Run]


def pipeline_run(train_run: TrainRun, schedule: str, mode: str) -> Run:
    chosen = "train.prefetch_scheduler=false" if mode == PLAIN else f"prefetch={mode}"
    return train_run(*PIPELINE, f"pipeline.schedule={schedule}", *SCHEDULES[schedule], chosen, nproc=NPROC)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_prefetch_mode_trains_bitwise_like_plain_fsdp2(train_run: TrainRun, schedule: str) -> None:
    runs = {mode: pipeline_run(train_run, schedule, mode) for mode in MODES}
    plain = runs[PLAIN]
    assert [line["step"] for line in plain.metrics] == list(range(1, STEPS + 1))
    assert plain.losses[-1] < plain.losses[0]
    for mode, run in runs.items():
        assert run.summary["mode"] == mode
        assert run.losses == plain.losses, mode
    assert plain.summary["demands"] == 0  # no scheduler: nothing counted


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_record_and_replay_records_the_first_pipeline_step_then_replays_it(train_run: TrainRun, schedule: str) -> None:
    run = pipeline_run(train_run, schedule, PrefetchMode.record_and_replay.name)
    first, *rest = run.metrics
    assert first["recordings"] == 1 and first["hits"] == 0
    for line in rest:
        assert (line["recordings"], line["divergences"], line["wasted"]) == (0, 0, 0), line
        assert line["hits"] > 0, line
    # Rank 0 holds stage 0, and stage 2 too with two stages per rank: one order over both chunks.
    units = {fqn for fqn, _ in run.order()}
    if SCHEDULES[schedule]:
        assert {fqn.split("/")[0] for fqn in units} == {"chunk0", "chunk1"}, units
        assert "chunk0/tok_embeddings" in units and "chunk1/layers.2" in units, units
    else:
        assert {"tok_embeddings", "layers.0", "layers.1"} <= units, units
    log = (run.dir / "train.log").read_text()
    assert log.count(f"{NPROC} rank(s) on cpu (gloo), pipeline: 2 x 2 FSDP ranks") == 1
    assert "evaluation is off with pipeline.stages > 1" in log


def test_rank_0_explains_the_last_step_over_the_chunks_it_holds(train_run: TrainRun) -> None:
    pytest.importorskip("matplotlib")
    run = pipeline_run(train_run, "Interleaved1F1B", PrefetchMode.record_and_replay.name)
    text = (run.dir / EXPLAIN_FILE).read_text()
    assert text.startswith("fsdp_replay explain 'train': replay scope, completed;"), text
    assert "chunk0/tok_embeddings" in text and "chunk1/layers.2" in text, text  # rank 0 holds stages 0 and 2
    assert (run.dir / ORDER_PLOT_FILE).read_bytes().startswith(b"\x89PNG")
    plain = pipeline_run(train_run, "Interleaved1F1B", PLAIN)
    assert not (plain.dir / EXPLAIN_FILE).exists()


def test_too_few_microbatches_for_the_schedule_fail_with_the_schedules_reason(tmp_path: Path) -> None:
    proc = launch("pipeline.stages=2", "train.microbatches=1", f"hydra.run.dir={tmp_path / 'run'}", nproc=NPROC)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = "invalid config: pipeline.schedule=1F1B with train.microbatches=1: Number of microbatches (1)"
    assert output.count(message) == 1, output
