"""recipes/train.py as a user launches it, again and again, directly and through scripts/dev.sh.

The short runs are launched from a temporary working directory with Hydra's default run folder,
as a user's ``torchrun ... recipes/train.py`` is. About 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from recipe_runs import REPO, TIMEOUT_S, cpu_env, launch

SHORT = ("train.steps=4", "train.eval_every=0")
"""The short run of the exit-code trials: over in seconds, so teardown follows the last collective."""
LAUNCHES = 3


ShortRuns = tuple[Path, list[subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory: pytest.TempPathFactory) -> ShortRuns:
    """``LAUNCHES`` consecutive short 2-rank runs from one working directory."""
    cwd = tmp_path_factory.mktemp("cwd")
    return cwd, [launch(*SHORT, cwd=cwd) for _ in range(LAUNCHES)]


def test_every_short_run_exits_zero(short_runs: ShortRuns) -> None:
    _, procs = short_runs
    failed = [f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}" for p in procs if p.returncode != 0]
    assert not failed, "\n\n".join(failed)


def test_step_one_says_it_records_the_prefetch_order(short_runs: ShortRuns) -> None:
    _, procs = short_runs
    assert all("recording the prefetch order" in p.stderr for p in procs)


def run_folders(cwd: Path) -> list[Path]:
    return sorted(p for p in (cwd / "outputs" / "train").iterdir() if not p.name.startswith("."))


def test_runs_in_a_row_keep_one_folder_each(short_runs: ShortRuns) -> None:
    cwd, procs = short_runs
    folders = run_folders(cwd)
    assert len(folders) == len(procs)
    for folder in folders:
        metrics = (folder / "metrics.jsonl").read_text().splitlines()
        assert len(metrics) == 4 and (folder / "summary.json").is_file(), folder
        # metrics and log written once, by this run's rank 0 (nothing appended by a later run)
        assert (folder / "train.log").read_text().count("mean step time") == 1, folder


def test_outputs_latest_is_the_last_run(short_runs: ShortRuns) -> None:
    cwd, procs = short_runs
    latest = cwd / "outputs" / "latest"
    assert latest.is_symlink() and latest.resolve() == run_folders(cwd)[-1]
    assert f"run dir {latest.resolve()}" in procs[-1].stdout + procs[-1].stderr


def frames_of_our_code(output: str) -> list[str]:
    """Traceback lines through the recipe or the package (torchrun's own report has only torch's)."""
    ours = (f'File "{REPO / "recipes"}', f'File "{REPO / "fsdp_replay"}')
    return [line for line in output.splitlines() if line.strip().startswith(ours)]


def test_bad_override_under_torchrun_ends_every_rank_with_one_line_and_no_folder(tmp_path: Path) -> None:
    message = "recipes/train.py: invalid config: PrefetchConfig.forward_prefetch must be an integer >= 0"
    proc = launch(*SHORT, "prefetch.forward_prefetch=-1", cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert output.count(message) == 1, output
    # torchrun's own ChildFailedError report remains; in it, every rank exited 1 and none was stopped by a signal.
    assert output.count("exitcode  : 1 ") == 2 and "(SIGTERM)" not in output, output
    assert not frames_of_our_code(output), output
    assert list(tmp_path.iterdir()) == []


def test_resume_from_a_folder_without_checkpoints_is_one_line_and_no_folder(tmp_path: Path) -> None:
    empty_run = tmp_path / "outputs" / "train" / "earlier"
    empty_run.mkdir(parents=True)
    proc = launch(*SHORT, f"train.resume_from={empty_run}", cwd=tmp_path)
    assert proc.returncode == 1
    output = (proc.stdout + proc.stderr).strip()
    assert f"recipes/train.py: invalid config: TrainConfig.resume_from: {str(empty_run)!r} is neither" in output
    assert not frames_of_our_code(output), output
    assert sorted(p.name for p in (tmp_path / "outputs").rglob("*")) == ["earlier", "train"]


needs_repo_venv = pytest.mark.skipif(
    Path(sys.prefix).resolve() != (REPO / ".venv").resolve(),
    reason="scripts/dev.sh installs into the checkout's .venv; its tests run only from that interpreter",
)


def dev_sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "dev.sh"), *args],
        env=cpu_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )


@needs_repo_venv
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("prefetch.forward_prefetch=-1", "PrefetchConfig.forward_prefetch must be an integer >= 0"),
        ("prefetch=fats", "prefetch takes one of demand, record_and_replay, static (configs/prefetch/)"),
    ],
)
def test_dev_sh_reports_a_bad_override_once_and_nothing_else(override: str, message: str) -> None:
    proc = dev_sh("train", override)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0
    assert output.count(message) == 1, output
    assert output.startswith("recipes/train.py: invalid config:"), output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    assert "base_prefetch" not in output


@needs_repo_venv
def test_dev_sh_runs_the_number_of_ranks_given_by_nproc(tmp_path: Path) -> None:
    proc = dev_sh("train", "--nproc", "3", *SHORT, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert " 3 rank(s) on cpu (gloo)" in (tmp_path / "train.log").read_text()


@needs_repo_venv
def test_dev_sh_repeat_call_neither_installs_nor_imports() -> None:
    dev_sh()  # brings .venv up to date if pyproject.toml changed since the last call
    # bash -x traces every command dev.sh runs; the usage path stops right after set-up.
    proc = subprocess.run(
        ["bash", "-x", str(REPO / "scripts" / "dev.sh")], env=cpu_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "usage: bash scripts/dev.sh" in proc.stderr
    ran = [line.lstrip("+ ") for line in proc.stderr.splitlines() if line.startswith("+")]
    assert not [command for command in ran if command.startswith((".venv/bin/", "python"))], ran
