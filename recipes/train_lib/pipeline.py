"""Pipeline parallelism for ``recipes/train.py``: this rank's stages of the Llama model, their schedule, one step.

The ranks form a ``(pp, dp)`` mesh: ``pipeline.stages`` pipeline ranks, each stage (a
:class:`~train_lib.llama.PipelineChunk`) sharded with FSDP2 over the ``dp`` ranks. Which stages a
rank holds follows :func:`fsdp_replay.testing.pipelines.stage_indices`; one scheduler covers all
of them (``attach(chunks, config)``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from fsdp_replay import PrefetchScheduler, attach, fully_shard
from fsdp_replay.testing.pipelines import (
    ZERO_BUBBLE_SCHEDULES,
    pipeline_mesh,
    schedule_for,
    schedule_step,
    stage_indices,
)
from train_lib.config import TrainJobConfig
from train_lib.llama import PipelineChunk
from train_lib.tokens import Split, TokenData

log = logging.getLogger("train")


def recipe_mesh(job: TrainJobConfig, device: torch.device) -> DeviceMesh:
    """The ``(pp, dp)`` mesh over every rank (on ``device``'s type, CPU or CUDA)."""
    return pipeline_mesh(dist.get_world_size(), job.pipeline.stages, device.type)


def lm_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's loss on the last stage: next-token cross-entropy over the vocabulary."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class Pipeline:
    """This rank's part of the pipeline."""

    mesh: DeviceMesh
    chunks: list[PipelineChunk]
    """The stages this rank holds, each an FSDP2 root over ``dp``, in the order the rank passes them."""
    stages: list[PipelineStage]
    """Their ``PipelineStage``s, in the same order."""
    schedule: Any
    sched: PrefetchScheduler | None
    """One scheduler over all ``chunks``; None for plain FSDP2."""

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    def model_params(self, device: torch.device) -> int:
        """Parameters of the whole model, all stages (a collective over the pipeline ranks)."""
        count = torch.tensor(sum(p.numel() for chunk in self.chunks for p in chunk.parameters()), device=device)
        dist.all_reduce(count, group=self.mesh.get_group("pp"))
        return int(count.item())

    def describe(self) -> str:
        """E.g. ``pipeline: 2 x 2 FSDP ranks, 4 stages, schedule Interleaved1F1B (this rank holds stages [0, 2])``."""
        n_stages = self.chunks[0].n_stages
        held = [chunk.stage for chunk in self.chunks]
        return (
            f"pipeline: {self.mesh['pp'].size()} x {self.dp_size} FSDP ranks, {n_stages} stages, "
            f"schedule {type(self.schedule).__name__.removeprefix('Schedule')} (this rank holds stages {held})"
        )


def build_pipeline(job: TrainJobConfig, *, mesh: DeviceMesh, device: torch.device) -> Pipeline:
    """Build this rank's stages on meta, shard each over ``dp``, materialise and initialise them, and
    make the schedule; raises ``ValueError`` (the schedule's) when ``train.microbatches`` does not suit it."""
    cfg = job.pipeline
    pp_rank, pp_size = mesh.get_local_rank("pp"), mesh["pp"].size()
    # Known upstream issue: zero-bubble schedules train wrongly in plain FSDP2 when blocks reshard
    # after forward (their split backward re-gathers them), so their stages stay unsharded between
    # forward and backward.
    reshard = cfg.schedule_class not in ZERO_BUBBLE_SCHEDULES
    if not reshard:
        log.info("pipeline.schedule=%s is zero-bubble: stages use reshard_after_forward=False", cfg.schedule)
    chunks = []
    for index in stage_indices(cfg.schedule_class, pp_rank, pp_size, cfg.virtual_stages):
        with torch.device("meta"):
            chunk = PipelineChunk(
                job.model, stage=index, n_stages=cfg.n_stages, checkpoint_group=job.train.activation_checkpointing
            )
        for block in chunk.layers.values():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        if chunk.tok_embeddings is not None:
            fully_shard(chunk.tok_embeddings, mesh=mesh["dp"], reshard_after_forward=reshard)
        if chunk.output is not None:
            fully_shard([chunk.norm, chunk.output], mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=reshard)
        chunk.to_empty(device=device)
        torch.manual_seed(job.train.seed)
        chunk.init_weights()
        chunks.append(chunk)
    stages = [
        PipelineStage(chunk, chunk.stage, cfg.n_stages, device, group=mesh.get_group("pp")) for chunk in chunks
    ]
    schedule = schedule_for(cfg.schedule_class, stages, microbatches=job.train.microbatches, loss_fn=lm_loss_fn)
    sched = attach(chunks, job.prefetch) if job.train.prefetch_scheduler else None
    return Pipeline(mesh=mesh, chunks=chunks, stages=stages, schedule=schedule, sched=sched)


def pipeline_step(
    pipe: Pipeline, data: TokenData, job: TrainJobConfig, *, step: int, device: torch.device
) -> torch.Tensor:
    """One ``schedule.step()``: all forwards and backwards of one optimizer step.

    Each ``dp`` rank's batch is the ``train.microbatches`` microbatches a rank of the same index
    trains on without pipelines. Returns the step's loss (detached), the mean over microbatches,
    on the ranks holding the last stage, and 0 on the others: summed over all ranks, each ``dp``
    rank's loss counts once.
    """
    n = job.train.microbatches
    batches = [data.batch(Split.train, step=step, micro=i, rank=pipe.dp_rank, device=device) for i in range(n)]
    inputs, targets = (torch.cat(parts) for parts in zip(*batches))
    total = torch.zeros((), device=device)
    for loss in schedule_step(pipe.schedule, pipe.stages, inputs, targets, return_outputs=False):  # summed as the recipe sums microbatches without pipelines
        total += loss.detach() / n
    return total
