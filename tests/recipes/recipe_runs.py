"""Launch recipes/train.py the way a user does, and read back what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

TIMEOUT_S = 300
"""Per launch; a tiny 4-step run takes 10-20 s on 2 CPU cores, nearly all of it start-up."""


def launch(
    *overrides: str, nproc: int | None = 2, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node <nproc> recipes/train.py``; plain python if ``nproc`` is None.

    ``cwd`` is where Hydra's default run folders (``outputs/...``) go; ``env`` defaults to
    :func:`cpu_env` (tests/gpu passes one that keeps the GPUs visible).
    """
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else []
    return subprocess.run(
        [sys.executable, *launcher, str(REPO / "recipes" / "train.py"), *overrides],
        cwd=cwd, env=env if env is not None else cpu_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )


def cpu_env() -> dict[str, str]:
    """CPU + gloo on every machine, and one thread per rank so two ranks fit on two cores."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@dataclass
class Run:
    """What one finished run left in its run directory."""

    dir: Path
    metrics: list[dict[str, Any]]
    """One dict per step, from metrics.jsonl."""
    summary: dict[str, Any]
    """summary.json."""

    @classmethod
    def load(cls, run_dir: Path) -> Run:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return cls(run_dir, [json.loads(line) for line in lines], json.loads((run_dir / "summary.json").read_text()))

    @property
    def losses(self) -> list[float]:
        return [line["loss"] for line in self.metrics]

    def order(self, key: str = "train") -> list[tuple[str, str]]:
        """The recorded ``(unit FQN, phase)`` order of a scope key."""
        return [tuple(entry) for entry in self.summary["recorded_orders"][key]]
