"""The training recipe on one GPU: ``recipes/train.py model=base``, 1 rank on NCCL, a few steps."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from recipe_runs import Run, launch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 6


def test_recipe_trains_the_base_model_on_one_gpu_and_writes_its_files(tmp_path: Path):
    gpu_env = {**os.environ, "OMP_NUM_THREADS": "4"}  # launch() defaults to hiding the GPUs
    proc = launch(
        "model=base", f"train.steps={STEPS}", "train.eval_every=3", f"hydra.run.dir={tmp_path}", nproc=1, env=gpu_env
    )
    assert proc.returncode == 0, f"recipe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "1 rank(s) on cuda (nccl)" in proc.stdout + proc.stderr
    run = Run.load(tmp_path)
    assert len(run.losses) == STEPS and all(math.isfinite(loss) for loss in run.losses)
    assert run.summary["steps"] == STEPS and run.summary["memory_kind"] == "CUDA allocated"
    assert (tmp_path / "explain.txt").stat().st_size > 0
