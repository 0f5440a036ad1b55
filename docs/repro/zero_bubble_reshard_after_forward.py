"""Plain FSDP2 under a zero-bubble pipeline schedule with reshard_after_forward=True: wrong gradients.

torchrun --standalone --nproc-per-node 2 docs/repro/zero_bubble_reshard_after_forward.py [ScheduleName]

Two ranks, two stages each (V placement), FSDP2 over a 1-rank dp mesh, no fsdp_replay. One step is
run twice from the same weights and data, with reshard_after_forward False then True; a correct
run gives the same gradients both times. Zero-bubble schedules (ScheduleZBVZeroBubble,
ScheduleInterleavedZeroBubble, ScheduleDualPipeV) split backward into an input pass and a weight
pass; with reshard_after_forward=True the parameters are resharded between the two, and the weight
pass loses (grad None) or changes gradients. Schedule1F1B-style schedules are unaffected.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, schedules


def grads_after_one_step(schedule_name: str, reshard_after_forward: bool) -> list:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    every_stage = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(4)]
    indices = [rank, 3 - rank] if "V" in schedule_name else [rank, rank + 2]
    stages = []
    for index in indices:
        chunk = every_stage[index]
        for layer in chunk:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        stages.append(PipelineStage(chunk, index, 4, torch.device("cpu"), group=mesh.get_group("pp")))
    schedule = getattr(schedules, schedule_name)(stages, n_microbatches=4, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x, target = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 8)
    holds_first, holds_last = 0 in indices, 3 in indices
    schedule.step(*((x,) if holds_first else ()), target=target if holds_last else None)
    return [None if p.grad is None else p.grad.to_local().clone() for i in indices for p in every_stage[i].parameters()]


def main() -> None:
    dist.init_process_group("gloo")
    name = sys.argv[1] if len(sys.argv) > 1 else "ScheduleZBVZeroBubble"
    right = grads_after_one_step(name, reshard_after_forward=False)
    wrong = grads_after_one_step(name, reshard_after_forward=True)
    missing = sum(g is None for g in wrong)
    differ = sum(a is not None and b is not None and not torch.equal(a, b) for a, b in zip(right, wrong))
    print(f"rank {dist.get_rank()} {name} torch {torch.__version__}: reshard_after_forward=True leaves "
          f"{missing} of {len(wrong)} gradients None and {differ} different", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
