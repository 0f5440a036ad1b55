"""Waits measured on a GPU: ``explain()`` rows and ``WaitMeter`` on plain FSDP2 time the compute
stream's stall with CUDA events.

A world of one has no all-gather to wait for, so these run on the fake backend (rank 0 of 4 on
the one GPU) with an emulated link (``fsdp_replay.testing.link``): every gather holds the link
for a known time while the host runs ahead, so a use really stalls on the device and the host
is never blocked. A wait measured on the host would be near 0; one measured by events is about
the link's time.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from fsdp_replay import PrefetchConfig, WaitMeter, _compat, attach
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.link import EmulatedLink
from fsdp_replay.testing.observer import fsdp_units
from fsdp_replay.testing.workloads import run_iteration, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not _compat.INTERNALS_OK,
        reason=f"torch {torch.__version__} runs the public-API fallback, which measures no waits (WaitMeter raises)",
    ),
]

WORLD = 4
BANDWIDTH_GBPS = 0.005
"""5 MB/s: a block of the small workload (~17 KB) holds the link ~2.5 ms, far above launch noise."""


@contextlib.contextmanager
def linked_world() -> Iterator[tuple[object, EmulatedLink]]:
    device = torch.device("cuda", torch.cuda.current_device())
    with fake_world(WORLD, "cuda") as mesh:
        link = EmulatedLink(device, world_size=WORLD, bandwidth_gbps=BANDWIDTH_GBPS)
        with link.installed():
            yield mesh, link


def test_explain_rows_carry_the_device_stall_of_each_missed_gather():
    with linked_world() as (mesh, link):
        w = workload("sequential").on(link.device)
        model = w.make_model().shard(mesh)
        sched = attach(model, PrefetchConfig(measure_waits=True))
        meter = WaitMeter(model)
        link.log = []
        with sched.iteration("train"):  # the recording: every gather is issued at its use
            run_iteration(model, w, 0)
        torch.cuda.synchronize()
        gathers = [nbytes for kind, nbytes in link.log if kind == "AG"]
        report = sched.explain("train")
        metered = sum(s for _, s in meter.take())
        meter.remove()
        sched.detach()
    misses = [row for row in report.rows if row.served == "miss"]
    assert report.waits_measured and len(misses) == len(gathers) > 0
    assert all(row.wait_s > 0 for row in misses), [(r.unit, r.phase, r.wait_s) for r in misses]
    # The link holds each gather this long, and the host never blocked: only events see it.
    link_s = sum(link.seconds(n) for n in gathers)
    assert report.total_wait_s >= 0.5 * link_s, (report.total_wait_s, link_s)
    assert metered == pytest.approx(report.total_wait_s, rel=1e-6)


def test_wait_meter_times_plain_fsdp2_on_the_device():
    with linked_world() as (mesh, link):
        w = workload("sequential").on(link.device)
        model = w.make_model().shard(mesh)
        units = set(fsdp_units(model))
        with WaitMeter(model) as meter:
            run_iteration(model, w, 0)
            torch.cuda.synchronize()
            waits = meter.take()
    assert waits and {fqn for fqn, _ in waits} <= units, waits
    assert {fqn for fqn, _ in waits} >= {f"blocks.{i}" for i in range(4)}, waits  # each block's forward gather
    assert all(seconds > 0 for _, seconds in waits), waits
