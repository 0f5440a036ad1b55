"""recipes/train.py launched by torchrun (2 ranks, gloo): modes agree bitwise, every flag acts.

Each distinct launch runs once per session (see ``train_run``); tests share launches where the
same run answers several questions: 10 torchrun and 5 plain launches, about 3.5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from recipe_runs import Run, launch
from train_lib.plot import PLOT_FILE, plot_metrics
from train_lib.report import EXPLAIN_FILE, ORDER_PLOT_FILE

from fsdp_replay import PrefetchMode

STEPS = 4
BASE = (f"train.steps={STEPS}", "train.eval_every=2", "train.save_every=2")
"""Every run evaluates and checkpoints at steps 2 and 4, so the mode runs cover those paths too."""
N_LAYERS = 4
"""Blocks of model/tiny.yaml."""
SHARED_AND_CHECKPOINTED = ("model.depth_repeats=2", "train.activation_checkpointing=2")
"""One launch for both flags (each test asserts what only its flag causes); also their hardest mix:
recompute of blocks that run twice per forward. That recompute leaves losses bitwise unchanged is
pinned without a process group in test_components."""

TrainRun = Callable[..., Run]


PLAIN = "plain"
"""The mode name of train.prefetch_scheduler=false: plain FSDP2, no scheduler attached."""


def baseline(train_run: TrainRun, mode: str = "record_and_replay") -> Run:
    return train_run(*BASE, "train.prefetch_scheduler=false" if mode == PLAIN else f"prefetch={mode}")


def forward_runs(order: list[tuple[str, str]]) -> int:
    """Maximal stretches of consecutive forward demands in a recorded order."""
    return sum(phase == "forward" for phase, _ in itertools.groupby(phase for _, phase in order))


def assert_replays_after_first_step(run: Run) -> None:
    first, *rest = run.metrics
    assert first["recordings"] == 1
    for line in rest:
        assert (line["recordings"], line["misses"], line["divergences"]) == (0, 0, 0), line
        assert line["hits"] > 0, line


def test_every_prefetch_mode_gives_bitwise_equal_losses(train_run: TrainRun) -> None:
    runs = {mode: baseline(train_run, mode) for mode in (PLAIN, *(mode.name for mode in PrefetchMode))}
    reference = runs[PLAIN]
    assert len(reference.losses) == STEPS
    assert reference.losses[-1] < reference.losses[0]
    for mode, run in runs.items():
        assert run.summary["mode"] == mode
        assert run.losses == reference.losses, mode
        assert [m.get("eval_loss") for m in run.metrics] == [m.get("eval_loss") for m in reference.metrics], mode


def test_record_and_replay_records_the_first_step_then_hits(train_run: TrainRun) -> None:
    run = baseline(train_run)
    assert run.metrics[0]["hits"] == 0
    assert_replays_after_first_step(run)
    assert run.summary["hit_rate"] > 0
    assert run.summary["wasted"] == run.summary["divergences"] == 0


def test_demand_mode_never_prefetches(train_run: TrainRun) -> None:
    run = baseline(train_run, "demand")
    assert all(line["hits"] == line["prefetches"] == 0 for line in run.metrics)


def test_static_mode_prefetches_from_the_first_step(train_run: TrainRun) -> None:
    run = baseline(train_run, "static")
    assert all(line["hits"] > 0 and line["recordings"] == 0 for line in run.metrics)


def test_outputs_are_one_metrics_line_per_step_and_a_summary(train_run: TrainRun) -> None:
    run = baseline(train_run)
    assert [line["step"] for line in run.metrics] == list(range(1, STEPS + 1))
    for line in run.metrics:
        assert line["loss"] > 0 and line["step_time_s"] > 0 and line["tokens_per_s"] > 0
        assert 0 <= line["hit_rate"] <= 1
    summary = run.summary
    for name in ("mean_step_time_s", "tokens_per_s", "peak_memory_bytes"):
        assert summary[name] > 0, name
    assert {"hits", "misses", "wasted", "divergences"} <= summary.keys()
    log = (run.dir / "train.log").read_text()
    # Only rank 0 logs: one setup line and one summary, not one per rank.
    assert log.count(" rank(s) on cpu (gloo)") == 1
    assert log.count("mean step time") == 1
    assert (run.dir / ".hydra" / "config.yaml").is_file()


def test_run_folder_has_a_plot_of_every_step_drawn_from_its_metrics(train_run: TrainRun, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = baseline(train_run)
    assert (run.dir / PLOT_FILE).read_bytes().startswith(b"\x89PNG")
    drawn = plot_metrics(run.metrics, tmp_path / PLOT_FILE, title="again")
    assert drawn is not None
    for name in ("loss", "step_time_ms", "hit_rate_pct"):
        assert [step for step, _ in drawn[name]] == list(range(1, STEPS + 1)), name
    assert [step for step, _ in drawn["eval_loss"]] == [2, 4]
    assert "  plot " in (run.dir / "train.log").read_text()


def test_run_folder_explains_the_last_train_step(train_run: TrainRun) -> None:
    pytest.importorskip("matplotlib")
    run = baseline(train_run)
    text = (run.dir / EXPLAIN_FILE).read_text()
    # The last step replays the recorded order; waits are not timed by default (docs/HOST_COST.md).
    assert text.startswith("fsdp_replay explain 'train': replay scope, completed;"), text
    assert "waits not measured" in text, text
    assert (run.dir / ORDER_PLOT_FILE).read_bytes().startswith(b"\x89PNG")
    assert f"{EXPLAIN_FILE}, {ORDER_PLOT_FILE}: rank 0's last 'train' step" in (run.dir / "train.log").read_text()


def test_run_folder_explains_how_long_each_demand_blocked_with_measure_waits(train_run: TrainRun) -> None:
    run = train_run(*BASE, "prefetch.measure_waits=true")
    text = (run.dir / EXPLAIN_FILE).read_text()
    assert "waits not measured" not in text and "blocked " in text, text


def test_plain_fsdp2_has_nothing_to_explain_and_says_so(train_run: TrainRun) -> None:
    run = baseline(train_run, PLAIN)
    assert not (run.dir / EXPLAIN_FILE).exists() and not (run.dir / ORDER_PLOT_FILE).exists()
    log = (run.dir / "train.log").read_text()
    assert log.count("not written: plain FSDP2 has no scheduler to explain (train.prefetch_scheduler=false)") == 1
    assert "hit rate: (hits + resident) / demands  n/a" in log


def test_every_mode_logs_its_exposed_wait_to_metrics_and_tensorboard(train_run: TrainRun) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for mode in (PLAIN, "record_and_replay"):
        run = baseline(train_run, mode)
        assert all(line["exposed_wait_s"] >= 0 for line in run.metrics), mode
        events = EventAccumulator(str(run.dir / "tensorboard"))
        events.Reload()
        waits = [event.value for event in events.Scalars("exposed_wait_ms")]
        assert waits == pytest.approx([line["exposed_wait_s"] * 1e3 for line in run.metrics]), mode
        assert [event.step for event in events.Scalars("loss/train")] == list(range(1, STEPS + 1)), mode
        assert ("prefetch/hit_rate" in events.Tags()["scalars"]) == (mode != PLAIN), mode


def test_evaluation_runs_under_its_own_scope_key(train_run: TrainRun) -> None:
    run = baseline(train_run)
    assert [("eval_loss" in line) for line in run.metrics] == [False, True, False, True]
    assert all(math.isfinite(line.get("eval_loss", 0.0)) for line in run.metrics)
    eval_stats = run.summary["per_key"]["eval"]
    assert eval_stats["demands"] > 0 and eval_stats["hits"] > 0
    # Evaluation is forward-only and kept apart from the training order it would otherwise break.
    assert {phase for _, phase in run.order("eval")} == {"forward"}
    assert "backward" in {phase for _, phase in run.order("train")}


def test_resume_continues_bitwise_and_replays_the_restored_order(train_run: TrainRun) -> None:
    full = baseline(train_run)
    checkpoint = full.dir / "checkpoints" / "step_2"
    resumed = train_run(*BASE, "prefetch=record_and_replay", f"train.resume_from={checkpoint}")
    assert [line["step"] for line in resumed.metrics] == [3, 4]
    assert resumed.losses == full.losses[2:]
    assert resumed.metrics[-1]["eval_loss"] == full.metrics[-1]["eval_loss"]
    first = resumed.metrics[0]
    assert first["recordings"] == 0 and first["misses"] == 0 and first["hits"] > 0
    assert resumed.summary["recordings"] == 0
    assert resumed.summary["resumed_from"] == str(checkpoint.resolve())


def test_resume_from_a_run_folder_takes_its_latest_checkpoint(train_run: TrainRun) -> None:
    full = baseline(train_run)  # saved checkpoints/step_2 and checkpoints/step_4
    resumed = train_run(
        "train.steps=6", "train.eval_every=2", "train.save_every=2", "prefetch=record_and_replay",
        f"train.resume_from={full.dir}",
    )
    assert [line["step"] for line in resumed.metrics] == [5, 6]
    assert resumed.summary["resumed_from"] == str((full.dir / "checkpoints" / "step_4").resolve())
    assert resumed.summary["recordings"] == 0  # the orders came with the checkpoint
    # The resumed run saves into its own folder, and its summary says where.
    assert resumed.summary["checkpoints"] == [str(resumed.dir / "checkpoints" / "step_6")]


def test_gradient_accumulation_runs_every_microbatch_in_one_scope(train_run: TrainRun) -> None:
    plain = baseline(train_run)
    accumulated = train_run(*BASE, "train.microbatches=2")
    assert len(accumulated.order()) == 2 * len(plain.order())
    assert accumulated.metrics[1]["demands"] == 2 * plain.metrics[1]["demands"]
    assert forward_runs(accumulated.order()) == 2  # F0 B0 F1 B1
    assert accumulated.losses != plain.losses
    assert_replays_after_first_step(accumulated)


def test_interleaved_schedule_runs_a_forward_ahead_of_each_backward(train_run: TrainRun) -> None:
    sequential = train_run(*BASE, "train.microbatches=2")
    interleaved = train_run(*BASE, "train.microbatches=2", "train.schedule=interleaved")
    assert forward_runs(interleaved.order()) == 1  # F0 F1 B0 B1
    assert sorted(interleaved.order()) == sorted(sequential.order())
    assert interleaved.losses == sequential.losses  # same gradients, accumulated in the same order
    assert_replays_after_first_step(interleaved)


def test_activation_checkpointing_recomputes_blocks_in_backward(train_run: TrainRun) -> None:
    plain, run = baseline(train_run), train_run(*BASE, *SHARED_AND_CHECKPOINTED)
    # Every use of a block is recomputed once: two uses per forward here.
    assert Counter(phase for _, phase in run.order())["recompute"] == 2 * N_LAYERS
    assert "recompute" not in {phase for _, phase in plain.order()}
    assert_replays_after_first_step(run)


def test_weight_shared_blocks_run_several_times_per_forward(train_run: TrainRun) -> None:
    plain, run = baseline(train_run), train_run(*BASE, *SHARED_AND_CHECKPOINTED)
    uses = Counter(fqn for fqn, phase in run.order() if phase == "forward")
    assert all(uses[f"layers.{i}"] == 2 for i in range(N_LAYERS)), uses
    assert all(n == 1 for n in Counter(fqn for fqn, phase in plain.order() if phase == "forward").values())
    assert run.losses != plain.losses
    assert_replays_after_first_step(run)


def test_text_file_data_trains_on_its_bytes_in_a_world_of_one(
    train_run: TrainRun, tmp_path_factory: pytest.TempPathFactory
) -> None:
    text = tmp_path_factory.mktemp("data") / "corpus.txt"
    text.write_text("".join(f"{i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    run = train_run("train.steps=3", f"data.path={text}", nproc=None)  # plain python: no torchrun
    assert len(run.losses) == 3 and all(math.isfinite(x) for x in run.losses)
    log = (run.dir / "train.log").read_text()
    assert f"data: data.path={text}" in log and " 1 rank(s) on cpu (gloo)" in log


@pytest.mark.parametrize(
    ("override", "message", "nproc"),
    [
        ("prefetch.forward_prefetch=-1", "PrefetchConfig.forward_prefetch must be an integer >= 0", 2),
        ("prefetch.mode=fast", "expected one of [static, record_and_replay, demand]", None),
        ("prefetch=fats", "no such option; prefetch takes one of demand, record_and_replay, static", None),
        ("data.path=/no/such/corpus.txt", "DataConfig.path: no such file '/no/such/corpus.txt'", None),
        (
            "pipeline.schedule=Zigzag",
            "PipelineConfig.schedule: unknown pipeline schedule 'Zigzag'; valid schedules are 1F1B, GPipe, Interleaved1F1B",
            None,
        ),
        ("pipeline.stages=3", "PipelineConfig.stages (3) must divide the number of ranks (2)", 2),
    ],
)
def test_bad_value_fails_once_before_any_process_group_leaving_no_run_folder(
    override: str, message: str, nproc: int | None, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = launch(override, f"hydra.run.dir={run_dir}", nproc=nproc)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count(message) == 1, output  # rank 0 reports, the other ranks only fail
    assert "base_prefetch" not in output  # a schema, not an option
    assert "rank(s) on" not in output  # the first line logged after init_process_group
    assert not run_dir.exists()
