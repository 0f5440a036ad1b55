"""Checkpoints that resume bit-for-bit, recorded prefetch orders included.

Weights and optimizer state are sharded DTensors, saved by every rank through
``torch.distributed.checkpoint``. The step and the scheduler's recorded orders are small and
identical on every rank, so rank 0 saves them next to the shards with ``torch.save``; restoring
the orders lets the resumed run replay from its first step instead of recording again.
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

    A scheduler given no recorded orders (a plain FSDP2 checkpoint) records them at its first step.
    """
    trainer_file = path / TRAINER_FILE
    if not trainer_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint of recipes/train.py: {TRAINER_FILE} is missing")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = torch.load(trainer_file, weights_only=True)
    if sched is not None and trainer["prefetch"] is not None:
        sched.load_state_dict(trainer["prefetch"])
    return trainer["step"]
