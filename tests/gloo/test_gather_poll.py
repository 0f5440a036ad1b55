"""Asking whether a gather finished never deadlocks with gloo's thread ([Note: never Work.is_completed()]).

Under the profiler, gloo's thread finishes a Work holding its lock and then needs the GIL when the
Work was issued inside ``saved_tensors_hooks`` (activation checkpointing); ``Work.is_completed()``
holds the GIL while it takes that lock. The scheduler's wait timing and the test observer poll
gathers on every use, so both ask the Work's future instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_replay._compat.shadows import collective_finished
from fsdp_replay.testing.distributed import spawn

GATHERS = 300
"""Polling ``is_completed()`` instead hung both ranks within this many gathers, every time it was tried."""


def _poll_gathers(mesh: DeviceMesh) -> int:
    x, out = torch.randn(1 << 14), torch.empty(mesh.size() << 14)
    finished = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        for _ in range(GATHERS):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                work = dist.all_gather_into_tensor(out, x, async_op=True)
            while not collective_finished(work):
                pass
            work.wait()
            finished += 1
    return finished


def test_polling_gathers_issued_under_checkpoint_hooks_and_the_profiler_does_not_hang():
    assert spawn(_poll_gathers, timeout_s=120) == [GATHERS, GATHERS]


def test_a_work_without_a_future_is_asked_directly():
    class NoFuture(dist.distributed_c10d.Work):  # the base Work's get_future() raises
        def is_completed(self) -> bool:
            return True

    assert collective_finished(NoFuture())
