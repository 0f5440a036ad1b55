"""Time blocked on parameters, measured inside FSDP2's own unshard and wait of a unit's use.

A use blocks in one of two places. On CPU a synchronous all-gather (``async_op=False``, FSDP2's
default) runs the whole collective inside ``unshard``; an asynchronous one is waited for in
``wait_for_unshard``. On an accelerator the compute stream waits in ``wait_for_unshard`` for the
gather's event: there a pair of timing events is recorded around that call, to be read later,
never synchronized per use. Only FSDP2's own uses are timed (the group is in forward or
pre-backward): another party's ``unshard()`` and the scheduler's prefetch are not a use. A gather
already finished when the use comes costs no wait, so nothing is timed then. The timing itself is
the group's :class:`~fsdp_replay._compat.shadows.GroupShadow`, shared by every timer of the group.
"""

from __future__ import annotations

from typing import Any

from fsdp_replay._compat.guard import INTERNALS_OK
from fsdp_replay._compat.shadows import GroupShadow, Timer, Waited, WaitedOnDevice
from fsdp_replay._compat.state import param_groups


def time_waits(state: Any, waited: Waited, waited_on_device: WaitedOnDevice) -> Timer | None:
    """Tell ``waited`` (or ``waited_on_device``) of every use of the unit that blocks on its
    parameters; returns what :func:`stop_timing_waits` takes, or None without FSDP2's internals."""
    if not INTERNALS_OK:
        return None
    timer = (waited, waited_on_device)
    for group in param_groups(state):
        GroupShadow.of(state, group).add_timer(timer)
    return timer


def stop_timing_waits(state: Any, timer: Timer) -> None:
    for group in param_groups(state) if INTERNALS_OK else ():
        if (shadow := GroupShadow.installed(group)) is not None and timer in shadow.timers:
            shadow.remove_timer(timer)
