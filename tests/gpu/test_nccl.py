"""The same acceptance checks on CUDA + NCCL (FSDP2's side-stream prefetch path); skipped without 2 GPUs."""

import pytest
import torch

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import run_iteration, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _train(mesh, name, mode):
    w = workload(name).on(torch.device("cuda", torch.cuda.current_device()))
    model = w.make_model().shard(mesh)
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, kinds = [], []
    for step in range(4):
        if sched is None:
            losses.append(run_iteration(model, w, step))
        else:
            with sched.iteration("train"):
                losses.append(run_iteration(model, w, step))
        opt.step()
        opt.zero_grad()
        kinds.append({k for _, _, k in observer.take()})
    return losses, kinds


def _modes(mesh, name):
    return {mode: _train(mesh, name, mode) for mode in ("plain", "demand", "static", "record_and_replay")}


@pytest.mark.parametrize("name", ["sequential", "shared_block", "checkpointed", "interleaved_1f1b"])
def test_nccl_modes_match_plain_and_replay_hits(name):
    for ranks in spawn(_modes, name, backend="nccl", timeout_s=300):
        plain_losses, _ = ranks["plain"]
        for mode, (losses, kinds) in ranks.items():
            assert losses == plain_losses, mode
        assert all(k <= {"hit", "resident"} for k in ranks["record_and_replay"][1][1:])
