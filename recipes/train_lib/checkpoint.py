"""Checkpoints that resume bit-for-bit, recorded prefetch orders included.

Weights and optimizer state are sharded DTensors, saved by every rank through
``torch.distributed.checkpoint``. The step and the scheduler's recorded orders are small and
identical on every rank, so rank 0 saves them next to the shards with ``torch.save``; restoring
the orders lets the resumed run replay from its first step instead of recording again.
``train.resume_from`` names a checkpoint folder or a run folder; :func:`find_checkpoint` turns
either into a checkpoint folder while the config is validated, before any run folder exists.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_replay import PrefetchScheduler

TRAINER_FILE = "trainer.pt"
"""Rank 0's file, written last: a folder holding it is a complete checkpoint."""
CHECKPOINTS_DIR = "checkpoints"
"""Where a run saves, under its run folder: ``checkpoints/step_N``."""
STEP_PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS_DIR / f"{STEP_PREFIX}{step}"


def find_checkpoint(path: Path) -> Path:
    """The checkpoint folder ``path`` names: itself, or a run folder's latest complete checkpoint.

    Resolved to an absolute path now, so ``outputs/latest`` means the run it points at when the
    command is given, not the new run that the link will point at once it starts.

    Raises:
        ValueError: saying what is missing, for a config error of one line.
    """
    if not path.is_dir():
        raise ValueError(f"no such checkpoint directory {str(path)!r} (relative to {Path.cwd()})")
    if (path / TRAINER_FILE).is_file():
        return path.resolve()
    saved = saved_checkpoints(path)
    if not saved:
        raise ValueError(
            f"{str(path)!r} is neither a checkpoint folder (no {TRAINER_FILE} in it) nor a run folder with a "
            f"complete {CHECKPOINTS_DIR}/{STEP_PREFIX}N/ (a run saves them with train.save_every=N)"
        )
    return saved[-1].resolve()


def saved_checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's complete checkpoints, oldest step first."""
    steps = {
        int(folder.name.removeprefix(STEP_PREFIX)): folder
        for folder in (run_dir / CHECKPOINTS_DIR).glob(f"{STEP_PREFIX}*")
        if folder.name.removeprefix(STEP_PREFIX).isdigit() and (folder / TRAINER_FILE).is_file()
    }
    return [steps[step] for step in sorted(steps)]


def save_checkpoint(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, sched: PrefetchScheduler | None, step: int
) -> None:
    """``sched``: None for plain FSDP2, which has no recorded orders to save."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    if dist.get_rank() == 0:
        prefetch = sched.state_dict() if sched is not None else None
        torch.save({"step": step, "prefetch": prefetch}, path / TRAINER_FILE)
    # A checkpoint is complete only once rank 0's file is there too.
    dist.barrier()


def load_checkpoint(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, sched: PrefetchScheduler | None
) -> int:
    """Restore everything :func:`save_checkpoint` wrote; returns the step the checkpoint was taken at.

    ``path``: a checkpoint folder, as :func:`find_checkpoint` returns it. A scheduler given no
    recorded orders (a plain FSDP2 checkpoint) records them at its first step.
    """
    trainer_file = path / TRAINER_FILE
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = torch.load(trainer_file, weights_only=True)
    if sched is not None and trainer["prefetch"] is not None:
        sched.load_state_dict(trainer["prefetch"])
    return trainer["step"]
