"""recipes/train.py as a user launches it, again and again: every launch exits 0.

The short runs are launched from a temporary working directory with Hydra's default run folder,
as a user's ``torchrun ... recipes/train.py`` is. About 1 minute on 2 CPU cores.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from recipe_runs import launch

SHORT = ("train.steps=4", "train.eval_every=0")
"""The short run of the exit-code trials: over in seconds, so teardown follows the last collective."""
LAUNCHES = 3


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """``LAUNCHES`` consecutive short 2-rank runs from one working directory."""
    cwd = tmp_path_factory.mktemp("cwd")
    return cwd, [launch(*SHORT, cwd=cwd) for _ in range(LAUNCHES)]


def test_every_short_run_exits_zero(short_runs: tuple[Path, list[subprocess.CompletedProcess[str]]]) -> None:
    _, procs = short_runs
    failed = [f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}" for p in procs if p.returncode != 0]
    assert not failed, "\n\n".join(failed)
