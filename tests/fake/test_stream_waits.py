"""On an accelerator a gather waits for the current stream only where FSDP2 has not made it wait already.

The fake backend runs on CPU, where gathers are host-side and nothing waits; these tests take the
accelerator path on CPU (``torch.cpu`` streams, whose waits are no-ops) and count the waits. See
[Note: stream waits before a gather] in ``fsdp_replay/_compat/gathers.py``.
"""

import sys

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay._compat import gathers
from fsdp_replay.testing.workloads import run_iteration, workload


@pytest.fixture
def stream_log(monkeypatch):
    """Takes gathers down the accelerator path; logs each stream wait (and who made it) and each gather started."""
    log: list[tuple[str, str]] = []
    monkeypatch.setitem(gathers._ON_HOST, torch.device("cpu"), False)
    wait_stream, unshard = torch.cpu.Stream.wait_stream, FSDPParamGroup.unshard

    def logged_wait(stream, other):
        log.append(("wait", sys._getframe(1).f_code.co_name))
        return wait_stream(stream, other)

    def logged_wait_event(stream, event):
        log.append(("wait_event", sys._getframe(1).f_code.co_name))

    def logged_unshard(group, async_op=False):
        if group._all_gather_result is None and not group.is_unsharded:
            log.append(("gather", group._module_fqn))
        return unshard(group, async_op)

    monkeypatch.setattr(torch.cpu.Stream, "wait_stream", logged_wait)
    monkeypatch.setattr(torch.cpu.Stream, "wait_event", logged_wait_event)
    monkeypatch.setattr(FSDPParamGroup, "unshard", logged_unshard)
    return log


@pytest.mark.parametrize("name", ["sequential", "checkpointed", "interleaved_1f1b"])
@pytest.mark.parametrize("mode", ["record_and_replay", "static"])
def test_prefetches_inside_a_pass_add_no_stream_waits(mesh8, stream_log, mode, name):
    w = workload(name)
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(mode=mode))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        stream_log.clear()
        prefetches = sched.stats.prefetches
        with sched.iteration("train"):
            run_iteration(model, w, step)
        optimizer.step()
        optimizer.zero_grad()
        ours = [who for kind, who in stream_log if kind == "wait" and who == "_wait_for_optimizer"]
        # Every prefetch once waited twice (both side streams); now only those issued before
        # FSDP2's root pre-forward do: the scope's first refill and the one at the root's demand.
        if step >= w.record_steps:
            assert sched.stats.prefetches - prefetches >= w.microbatches * len(model.blocks)
        assert len(ours) <= 2 * 2 * w.microbatches


@pytest.mark.parametrize("mode", ["record_and_replay", "static", "demand"])
def test_no_gather_reads_the_parameters_before_the_streams_waited_for_the_optimizer(mesh8, stream_log, mode):
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(mode=mode))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        optimizer.step()  # writes the sharded parameters on the current stream
        stream_log.clear()
        with sched.iteration("train"):
            run_iteration(model, w, step)
        optimizer.zero_grad()
        gathers_at = [i for i, (kind, _) in enumerate(stream_log) if kind == "gather"]
        waits_at = [i for i, (kind, _) in enumerate(stream_log) if kind == "wait"]
        assert gathers_at and waits_at and waits_at[0] < gathers_at[0], stream_log[:6]


@pytest.mark.parametrize("mode", ["record_and_replay", "static"])
def test_gathers_before_the_root_pre_forward_wait_for_a_post_optimizer_event(mesh8, stream_log, mode):
    """An optimizer run on another stream, announced with ``set_post_optim_event()``: FSDP2's root
    pre-forward waits for that event, not the current stream, and so must every gather issued
    before it (waiting for the current stream would not order it after the optimizer's writes)."""
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(mode=mode))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        optimizer.step()
        model.set_post_optim_event(torch.Event("cpu"))  # the waits are logged, not made
        stream_log.clear()
        with sched.iteration("train"):
            run_iteration(model, w, step)
        optimizer.zero_grad()
        first_gather = next(i for i, (kind, _) in enumerate(stream_log) if kind == "gather")
        ours = [(i, kind) for i, (kind, who) in enumerate(stream_log) if who == "_wait_for_optimizer"]
        assert all(kind == "wait_event" for _, kind in ours), stream_log[:8]
        if sched.stats.prefetches:  # not while recording
            assert ours and ours[0][0] < first_gather, stream_log[:8]
        assert stream_log.count(("wait_event", "_root_pre_forward")) == 2  # FSDP2 still waits for it, once
