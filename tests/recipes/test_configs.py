"""Every YAML under configs/ composes through Hydra's compose API and validates into dataclasses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from fsdp_replay import PrefetchConfig, PrefetchMode
from fsdp_replay._compat import TORCH_RELEASE
from fsdp_replay.testing import pipelines
from train_lib.config import MicrobatchSchedule, TrainJobConfig, quiet_nonzero_ranks, register_configs, to_job_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
GROUP_FILES = sorted([*CONFIG_DIR.glob("prefetch/*.yaml"), *CONFIG_DIR.glob("model/*.yaml")])
"""The option files of the groups that configs/train.yaml composes."""


@pytest.fixture(scope="module", autouse=True)
def _schemas() -> None:
    register_configs()


def compose_train(*overrides: str, hydra_config: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_config)


def test_defaults_are_record_and_replay_on_the_tiny_model() -> None:
    job = to_job_config(compose_train())
    assert isinstance(job, TrainJobConfig)
    # The library's defaults: waits are not timed (docs/HOST_COST.md: it costs more than 1% of a step).
    assert job.prefetch == PrefetchConfig()
    assert job.prefetch.mode is PrefetchMode.record_and_replay
    assert job.model.name == "tiny"
    assert job.train.schedule is MicrobatchSchedule.sequential


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}={p.stem}")
def test_every_group_yaml_composes_into_its_schema(path: Path) -> None:
    job = to_job_config(compose_train(f"{path.parent.name}={path.stem}"))
    if path.parent.name == "prefetch":
        assert job.prefetch.mode is PrefetchMode[path.stem]
        assert not job.prefetch.measure_waits  # off in every mode: timing waits costs more than 1% (docs/HOST_COST.md)
    else:
        assert job.model.name == path.stem


@pytest.mark.parametrize("path", [CONFIG_DIR / "train.yaml", *GROUP_FILES], ids=lambda p: p.stem)
def test_every_yaml_starts_with_the_command_that_runs_it(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# torchrun --standalone --nproc-per-node "), first
    assert " recipes/train.py" in first
    if path.parent != CONFIG_DIR:
        assert f" {path.parent.name}={path.stem}" in first


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("prefetch=demand", "prefetch.mode", PrefetchMode.demand),
        ("prefetch=static", "prefetch.mode", PrefetchMode.static),
        ("prefetch.mode=static", "prefetch.mode", PrefetchMode.static),
        ("prefetch.forward_prefetch=2", "prefetch.forward_prefetch", 2),
        ("prefetch.backward_prefetch=auto", "prefetch.backward_prefetch", "auto"),
        ("prefetch.max_prefetch_bytes=1048576", "prefetch.max_prefetch_bytes", 1 << 20),
        ("prefetch.max_reuse_distance=3", "prefetch.max_reuse_distance", 3),
        ("prefetch.measure_waits=true", "prefetch.measure_waits", True),
        ("model=small", "model.dim", 256),
        ("model.depth_repeats=2", "model.depth_repeats", 2),
        ("train.steps=50", "train.steps", 50),
        ("train.schedule=interleaved", "train.schedule", MicrobatchSchedule.interleaved),
        ("train.prefetch_scheduler=false", "train.prefetch_scheduler", False),
        ("pipeline.stages=2", "pipeline.stages", 2),
        ("pipeline.schedule=Interleaved1F1B", "pipeline.schedule_class", "ScheduleInterleaved1F1B"),
    ],
)
def test_command_line_overrides_reach_the_dataclasses(override: str, field: str, expected: object) -> None:
    value: object = to_job_config(compose_train(override))
    for name in field.split("."):
        value = getattr(value, name)
    assert value == expected


def test_group_choice_and_field_override_combine() -> None:
    job = to_job_config(compose_train("prefetch=static", "prefetch.forward_prefetch=3", "model=small"))
    assert (job.prefetch.mode, job.prefetch.forward_prefetch, job.model.name) == (PrefetchMode.static, 3, "small")


@pytest.mark.parametrize(
    ("override", "valid"),
    [
        ("prefetch.mode=fast", "static, record_and_replay, demand"),
        ("train.schedule=zigzag", "sequential, interleaved"),
    ],
)
def test_unknown_enum_name_fails_composition_naming_field_and_values(override: str, valid: str) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(override)
    detail = str(err.value.__cause__)
    assert f"full_key: {override.split('=')[0]}" in detail
    assert valid in detail


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prefetch.forward_prefetch=-1", "PrefetchConfig.forward_prefetch must be an integer >= 0"),
        ("prefetch.backward_prefetch=-2", "PrefetchConfig.backward_prefetch must be an integer >= 0"),
        ("prefetch.max_prefetch_bytes=0", "PrefetchConfig.max_prefetch_bytes must be a positive integer"),
        ("prefetch.max_reuse_distance=-1", "PrefetchConfig.max_reuse_distance must be an integer >= 0"),
        ("prefetch.on_divergence=ignore", "valid policies are fallback, raise"),
        ("train.microbatches=0", "TrainConfig.microbatches must be an integer >= 1"),
        ("train.activation_checkpointing=-1", "TrainConfig.activation_checkpointing must be an integer >= 0"),
        ("train.lr=-1", "TrainConfig.lr must be a number >= 0, got -1.0"),
        ("train.lr=nan", "TrainConfig.lr must be a number >= 0, got nan"),
        ("train.seq_len=4096", "exceeds ModelConfig.max_seq_len"),
        ("train.resume_from=/no/such/checkpoint", "TrainConfig.resume_from: no such checkpoint directory"),
        ("model.n_heads=3", "ModelConfig.dim must be a multiple of 2 * n_heads"),
        ("data.path=/no/such/file.txt", "DataConfig.path: no such file '/no/such/file.txt'"),
        ("pipeline.stages=0", "PipelineConfig.stages must be an integer >= 1"),
        ("pipeline.schedule=Zigzag", "unknown pipeline schedule 'Zigzag'; valid schedules are 1F1B, GPipe, "),
        ("pipeline.virtual_stages=2", "PipelineConfig.virtual_stages must be 1 with schedule 1F1B"),
        ("pipeline.schedule=DualPipeV", "PipelineConfig.virtual_stages must be 2 with schedule DualPipeV"
         if TORCH_RELEASE >= (2, 13) else "PipelineConfig.schedule: 'DualPipeV' needs torch 2.13 or newer"),
        ("pipeline.stages=5", "stages * virtual_stages (5) exceeds ModelConfig.n_layers (4)"),
        ("pipeline.stages=2 model.depth_repeats=2", "ModelConfig.depth_repeats must be 1 with pipeline.stages > 1"),
        ("pipeline.stages=2 train.schedule=interleaved", "TrainConfig.schedule does not apply with pipeline.stages"),
        ("pipeline.stages=2 train.save_every=5", "checkpoints are not supported with pipeline.stages > 1"),
    ],
)
def test_out_of_range_value_fails_conversion_naming_the_field(override: str, message: str) -> None:
    cfg = compose_train(*override.split())  # OmegaConf checks types only; ranges are the dataclasses' job
    with pytest.raises(ValueError) as err:
        to_job_config(cfg)
    assert message in str(err.value)


def test_a_v_schedule_on_a_torch_before_2_13_fails_saying_which_release_it_needs(monkeypatch) -> None:
    monkeypatch.setattr(pipelines, "TORCH_RELEASE", (2, 11))
    cfg = compose_train("pipeline.schedule=ZBVZeroBubble", "pipeline.virtual_stages=2")
    with pytest.raises(ValueError) as err:
        to_job_config(cfg)
    assert str(err.value) == (
        "PipelineConfig.schedule: 'ZBVZeroBubble' needs torch 2.13 or newer (before it, plain FSDP2 fails it "
        "on gloo too); valid schedules are 1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble"
    )


def saved_run(run_dir: Path, *steps: int) -> Path:
    """A run folder as recipes/train.py leaves it after saving at ``steps`` (rank 0's file marks each complete)."""
    for step in steps:
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step}" / "trainer.pt").touch()
    return run_dir


def test_resume_from_a_checkpoint_folder_keeps_it(tmp_path: Path) -> None:
    checkpoint = saved_run(tmp_path, 5) / "checkpoints" / "step_5"
    job = to_job_config(compose_train(f"train.resume_from={checkpoint}"))
    assert job.train.resume_from == str(checkpoint.resolve())


def test_resume_from_a_run_folder_takes_its_latest_complete_checkpoint(tmp_path: Path) -> None:
    saved_run(tmp_path, 5, 10, 40)
    (tmp_path / "checkpoints" / "step_50").mkdir()  # being written: no trainer.pt yet
    job = to_job_config(compose_train(f"train.resume_from={tmp_path}"))
    assert job.train.resume_from == str((tmp_path / "checkpoints" / "step_40").resolve())


def test_resume_from_a_folder_without_checkpoints_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)  # incomplete: no trainer.pt
    with pytest.raises(ValueError) as err:
        to_job_config(compose_train(f"train.resume_from={tmp_path}"))
    message = str(err.value)
    assert message.startswith(f"TrainConfig.resume_from: {str(tmp_path)!r} is neither a checkpoint folder")
    assert "no trainer.pt in it" in message and "checkpoints/step_N/" in message and "\n" not in message


def test_pipeline_stages_must_divide_the_number_of_ranks() -> None:
    pipeline = to_job_config(compose_train("pipeline.stages=2")).pipeline
    pipeline.check_world(4)
    with pytest.raises(ValueError, match=r"PipelineConfig.stages \(2\) must divide the number of ranks \(3\)"):
        pipeline.check_world(3)


def test_run_dir_is_a_time_stamped_folder_under_the_run_name() -> None:
    """One folder per run; rank 0's is handed to the other ranks by the recipe (test_launch checks it)."""
    assert re.fullmatch(r"outputs/train/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", compose_train(hydra_config=True).hydra.run.dir)
    assert compose_train("train.run_name=abc", hydra_config=True).hydra.run.dir.startswith("outputs/abc/")


def test_nonzero_ranks_write_no_hydra_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    argv = ["recipes/train.py", "prefetch=demand"]
    quiet_nonzero_ranks(argv)
    cfg = compose_train(*argv[1:], hydra_config=True)
    assert cfg.hydra.output_subdir is None
    assert cfg.hydra.runtime.choices["hydra/job_logging"] == "disabled"
    assert cfg.hydra.job_logging.get("handlers") is None


def test_rank_zero_keeps_hydra_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    argv = ["recipes/train.py"]
    quiet_nonzero_ranks(argv)
    assert argv == ["recipes/train.py"]
    assert compose_train(hydra_config=True).hydra.output_subdir == ".hydra"
