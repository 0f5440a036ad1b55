"""A pipeline-parallel workload (torch.distributed.pipelining over FSDP2 chunks) and its runner.

The same runner trains plain FSDP2 and every prefetch mode, so tests and the benchmark compare
them step by step: losses, parameters, per-demand observations, all-gathers issued, and which
units a step leaves unsharded.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pipeline_schedules

from fsdp_replay import attach
from fsdp_replay._compat import TORCH_RELEASE
from fsdp_replay.testing.contenders import contender_config
from fsdp_replay.testing.internals import counting_all_gathers
from fsdp_replay.testing.observer import DemandObserver, held_units

SINGLE_STAGE_SCHEDULES = ("Schedule1F1B", "ScheduleGPipe")
"""One stage (model chunk) per rank."""
LOOPED_SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")
"""Several stages per rank, placed round-robin: rank r holds stages r, r + pp, ..."""
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""Two stages per rank in a V: rank r holds stages r and 2 pp - 1 - r."""
ZERO_BUBBLE_SCHEDULES = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
"""Split backward into input and weight passes."""


def available_schedules() -> list[str]:
    """The schedules this torch release has, of those fsdp_replay supports and plain FSDP2 runs on gloo."""
    names = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
    return [name for name in names if hasattr(pipeline_schedules, name) and held_back(name) is None]


def held_back(name: str) -> str | None:
    """Why :func:`available_schedules` leaves out a schedule on this torch release, or None.

    Before torch 2.13 the V-shaped schedules fail on gloo in plain FSDP2 too: the shape-inference
    send/recv of ScheduleZBVZeroBubble raised "Pair is not connected" on torch 2.11 (2 x 2 ranks).
    """
    if name in V_SCHEDULES and TORCH_RELEASE < (2, 13):
        return "needs torch 2.13 or newer (before it, plain FSDP2 fails it on gloo too)"
    return None


def stage_indices(schedule: str, pp_rank: int, pp_size: int, chunks: int) -> list[int]:
    """The pipeline stages (model chunks) a rank holds under ``schedule``, in the order it passes them."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return [pp_rank]
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(chunks)]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


@dataclass(frozen=True)
class PipelineSetup:
    """A pipeline workload: the schedule, the chunks each rank holds, sizes and FSDP2 options."""

    schedule: str
    chunks: int = 2
    """Stages per rank for the looped schedules (V schedules always hold two, single ones one)."""
    blocks_per_stage: int = 2
    dim: int = 16
    rows: int = 8
    microbatches: int = 4
    reshard_after_forward: bool = True
    infer_shapes: bool = True
    """Let the first ``step()`` infer stage shapes (a real forward and backward) instead of giving them."""
    root_params: bool = False
    """Each chunk root holds parameters of its own (a final ``LayerNorm``), not only its blocks' units."""


def pipeline_mesh(world_size: int, pp_size: int = 2, device_type: str = "cpu") -> DeviceMesh:
    """A ``(pp, dp)`` mesh over the initialized process group."""
    return init_device_mesh(device_type, (pp_size, world_size // pp_size), mesh_dim_names=("pp", "dp"))


def build_stages(setup: PipelineSetup, mesh: DeviceMesh) -> tuple[list[nn.Module], list[PipelineStage]]:
    """This rank's chunks, each block and each chunk a ``fully_shard`` unit over ``dp``, and their stages."""
    pp_rank, pp_size = mesh.get_local_rank("pp"), mesh["pp"].size()
    indices = stage_indices(setup.schedule, pp_rank, pp_size, setup.chunks)
    n_stages = pp_size * (1 if setup.schedule in SINGLE_STAGE_SCHEDULES else 2 if setup.schedule in V_SCHEDULES else setup.chunks)
    torch.manual_seed(0)
    every_stage = [
        nn.Sequential(
            *[Block(setup.dim) for _ in range(setup.blocks_per_stage)],
            *([nn.LayerNorm(setup.dim)] if setup.root_params else []),
        )
        for _ in range(n_stages)
    ]
    chunks, stages = [], []
    example = torch.zeros(setup.rows // setup.microbatches, setup.dim)
    for index in indices:
        chunk = every_stage[index]
        for block in chunk[: setup.blocks_per_stage]:  # a LayerNorm after them stays in the chunk root's unit
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=setup.reshard_after_forward)
        fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=setup.reshard_after_forward)
        shapes = {} if setup.infer_shapes else _given_shapes(example, first=index == 0)
        stages.append(
            PipelineStage(chunk, index, n_stages, torch.device("cpu"), group=mesh.get_group("pp"), **shapes)
        )
        chunks.append(chunk)
    return chunks, stages


def _given_shapes(example: torch.Tensor, *, first: bool) -> dict[str, Any]:
    """Every shape a stage would otherwise infer with a real forward and backward in the first
    ``step()``, of those this release's ``PipelineStage`` takes (torch 2.11 takes no gradient shapes)."""
    shapes = {
        "input_args": (example,),
        "output_args": (example,),
        "output_grads": (example,),
        "input_grads": (None,) if first else (example,),
    }
    return {name: shape for name, shape in shapes.items() if name in _STAGE_ARGUMENTS}


_STAGE_ARGUMENTS = frozenset(inspect.signature(PipelineStage.__init__).parameters)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def schedule_for(name: str, stages: list[PipelineStage], *, microbatches: int, loss_fn: Any) -> Any:
    """``torch.distributed.pipelining.schedules.<name>`` over this rank's stages (a single-stage
    schedule takes the one stage, the others the list)."""
    cls = getattr(pipeline_schedules, name)
    return cls(stages[0] if name in SINGLE_STAGE_SCHEDULES else stages, n_microbatches=microbatches, loss_fn=loss_fn)


def make_schedule(setup: PipelineSetup, stages: list[PipelineStage], name: str | None = None) -> Any:
    """``setup``'s schedule (or the one called ``name``, over the same stages)."""
    return schedule_for(name or setup.schedule, stages, microbatches=setup.microbatches, loss_fn=_loss)


def schedule_step(schedule: Any, stages: list[PipelineStage], inputs: Any, target: Any, **kwargs: Any) -> list[Any]:
    """One ``schedule.step()``: the inputs go in on the rank holding the first stage, the target on the
    rank holding the last, which also gets each microbatch's loss (returned; empty elsewhere)."""
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    losses: list[Any] = []
    schedule.step(*((inputs,) if first else ()), target=target if last else None, losses=losses if last else None, **kwargs)
    return losses


def pipeline_batch(setup: PipelineSetup, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded inputs and targets of one step for one ``dp`` rank (the same in every mode)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(setup.rows, setup.dim, generator=g), torch.randn(setup.rows, setup.dim, generator=g)


def run_pipeline(
    setup: PipelineSetup,
    mesh: DeviceMesh,
    mode: str,
    *,
    steps: int = 3,
    explicit: bool = True,
    switch: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps of ``setup`` with plain FSDP2 (``mode="plain"``) or one scheduler (a
    contender of ``fsdp_replay.testing.contenders``) over
    this rank's chunks (each step in ``iteration("train")`` if ``explicit``); ``switch=(step,
    name)`` runs that step with another schedule over the same stages (a divergence). Returns, per
    step, losses, local parameters, the observers' per-demand log, all-gathers issued and the units
    left unsharded, and the scheduler's counters."""
    chunks, stages = build_stages(setup, mesh)
    schedule = make_schedule(setup, stages)
    other = make_schedule(setup, stages, switch[1]) if switch is not None else None
    sched = None if mode == "plain" else attach(chunks, contender_config(mode))
    observers = [DemandObserver(chunk) for chunk in chunks]
    opt = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=0.05)
    dp_rank = mesh.get_local_rank("dp")
    records = []
    for step in range(steps):
        x, y = pipeline_batch(setup, step, dp_rank)
        with counting_all_gathers() as gathers, _scope(sched if explicit else None):
            losses = schedule_step(other if switch is not None and step == switch[0] else schedule, stages, x, y)
        records.append(
            {
                "losses": [loss.item() for loss in losses],
                "observed": [entry for observer in observers for entry in observer.take()],
                "all_gathers": gathers[0],
                "held": [f"{i}:{name}" for i, chunk in enumerate(chunks) for name in held_units(chunk)],
            }
        )
        opt.step()
        opt.zero_grad()
        records[-1]["params"] = [p.to_local().detach().clone() for chunk in chunks for p in chunk.parameters()]
    result = {"steps": records, "stats": sched.stats.as_dict() if sched is not None else None}
    result["order"] = sched.recorded_order("train") if sched is not None else None
    if sched is not None:
        sched.detach()
    dist.barrier()
    return result


@contextlib.contextmanager
def _scope(sched: Any) -> Iterator[None]:
    if sched is None:
        yield
    else:
        with sched.iteration("train"):
            yield
