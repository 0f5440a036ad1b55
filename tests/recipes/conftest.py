"""Shared launches of recipes/train.py, and the recipe's helper modules on the import path."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from recipe_runs import REPO, Run, launch

# As when the recipe runs: train.py and its train_lib package import from the script's folder.
sys.path.insert(0, str(REPO / "recipes"))


@pytest.fixture(scope="session")
def train_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """Run the recipe once per distinct set of overrides in the session; later calls reuse it."""
    runs: dict[tuple[tuple[str, ...], int | None], Run] = {}

    def run(*overrides: str, nproc: int | None = 2) -> Run:
        if (overrides, nproc) not in runs:
            run_dir = tmp_path_factory.mktemp("run")
            proc = launch(*overrides, f"hydra.run.dir={run_dir}", nproc=nproc)
            assert proc.returncode == 0, f"recipe failed:\n{proc.stdout}\n{proc.stderr}"
            runs[(overrides, nproc)] = Run.load(run_dir)
        return runs[(overrides, nproc)]

    return run
