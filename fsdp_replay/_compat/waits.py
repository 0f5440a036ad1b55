"""Time blocked on parameters, measured inside FSDP2's own unshard and wait of a unit's use.

A use blocks in one of two places. On CPU a synchronous all-gather (``async_op=False``, FSDP2's
default) runs the whole collective inside ``unshard``; an asynchronous one is waited for in
``wait_for_unshard``. On an accelerator the compute stream waits in ``wait_for_unshard`` for the
gather's event: there a pair of timing events is recorded around that call, to be read later,
never synchronized per use. Only FSDP2's own uses are timed (the group is in forward or
pre-backward): another party's ``unshard()`` and the scheduler's prefetch are not a use. A gather
already finished when the use comes costs no wait, so nothing is timed then.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdp_replay._compat.guard import INTERNALS_OK

if INTERNALS_OK:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    _USE_STATES = (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)

Waited = Callable[[float], None]
"""Told the seconds one use of the unit blocked, on the host."""
WaitedOnDevice = Callable[[Any, Any], None]
"""Told the timing events recorded around one use's wait on the accelerator stream."""

_TIMED = ("unshard", "wait_for_unshard")


def time_waits(state: Any, waited: Waited, waited_on_device: WaitedOnDevice) -> bool:
    """Time every use of the unit that blocks on its parameters; False without FSDP2's internals.

    Wraps whatever the groups' ``unshard`` and ``wait_for_unshard`` are now (FSDP2's, or the
    scheduler's interception of ``unshard``); :func:`stop_timing_waits` puts those back.
    """
    if not INTERNALS_OK:
        return False
    on_host = state._device.type == "cpu"
    for group in state._fsdp_param_groups:
        _time_group(group, on_host, waited, waited_on_device)
    return True


def stop_timing_waits(state: Any) -> None:
    for group in state._fsdp_param_groups if INTERNALS_OK else ():
        if "_fsdp_replay_untimed" not in group.__dict__:
            continue  # not timed
        saved = group.__dict__.pop("_fsdp_replay_untimed")
        for name in _TIMED:
            if name in saved:
                setattr(group, name, saved[name])
            else:
                group.__dict__.pop(name, None)


def _time_group(group: Any, on_host: bool, waited: Waited, waited_on_device: WaitedOnDevice) -> None:
    saved = {name: group.__dict__[name] for name in _TIMED if name in group.__dict__}
    unshard, wait_for_unshard = group.unshard, group.wait_for_unshard

    def timed_unshard(async_op: bool = False) -> None:
        if not on_host or group._training_state not in _USE_STATES or group._all_gather_result is not None or group.is_unsharded:
            return unshard(async_op)
        start = time.perf_counter()
        unshard(async_op)
        seconds = time.perf_counter() - start
        result = group._all_gather_result
        if result is not None and result.all_gather_work is None and _collective(group):
            waited(seconds)  # synchronous: the whole collective ran here

    def timed_wait_for_unshard() -> None:
        result = group._all_gather_result
        if result is None or group._training_state not in _USE_STATES:
            return wait_for_unshard()
        work = result.all_gather_work
        running = isinstance(work, dist.distributed_c10d.Work) and not work.is_completed()
        if on_host:
            if running:
                start = time.perf_counter()
                work.wait()  # FSDP2's own wait on it is then a no-op
                waited(time.perf_counter() - start)
            return wait_for_unshard()
        event = result.all_gather_event
        if not running and (event is None or event.query()):
            return wait_for_unshard()  # finished already: the stream will not wait
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        start.record()
        wait_for_unshard()
        end.record()
        waited_on_device(start, end)

    group._fsdp_replay_untimed = saved
    group.unshard, group.wait_for_unshard = timed_unshard, timed_wait_for_unshard


def _collective(group: Any) -> bool:
    """FSDP2 skips the collective on a world of one (and on a mesh that does not shard)."""
    try:
        return group._all_gather_process_group.size() > 1
    except AssertionError:
        return False
