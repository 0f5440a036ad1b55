"""Issuing and releasing all-gathers, and FSDP2's own recovery and lazy init."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_replay._compat import public
from fsdp_replay._compat.guard import HOOK_CONTEXT, INTERNALS_OK, TORCH_RELEASE, fsdp_hook_context, trace
from fsdp_replay._compat.state import ASYNC_REDUCTION, fsdp_params, fsdp_state, in_backward, may_gather, param_groups

if INTERNALS_OK:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from fsdp_replay._compat.guard import IDLE_STATES

    _FORWARD, _PRE_BACKWARD = TrainingState.FORWARD, TrainingState.PRE_BACKWARD
    """Read per gather: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""

_ON_HOST: dict[torch.device, bool] = {}
"""Whether gathers on a device are host-side (CPU), per device seen."""


def issue_unshard(state: Any, *, backward: bool, fqn: str, use_now: bool = False) -> bool:
    """Start the unit's all-gather without waiting; FSDP2's own pre-hook waits at the point of use.

    On accelerators FSDP2's prefetch path (training state set, side streams) overlaps best; on CPU
    only ``async_op=True`` lets the gather run beside compute. ``use_now``: a missed demand's
    gather, whose use starts next (the public fallback keeps no handle of it). Returns whether a
    gather is pending now: none where FSDP2 would refuse or drop it (:func:`may_gather`), or leaves
    none (a world of one). ``fqn`` names its profiler range, opened only while a profiler runs.
    See [Note: one call per gather].
    """
    if not INTERNALS_OK:
        with trace("fsdp_replay::gather_at_demand" if use_now else "fsdp_replay::prefetch", fqn):
            public.issue_unshard(state, use_now=use_now)
        return state in public.pending
    if ASYNC_REDUCTION and not may_gather(state):
        return False
    if HOOK_CONTEXT or torch.autograd.profiler._is_profiler_enabled:
        with trace("fsdp_replay::gather_at_demand" if use_now else "fsdp_replay::prefetch", fqn), fsdp_hook_context():
            return _unshard_groups(state, backward)
    return _unshard_groups(state, backward)  # no context manager per gather


# [Note: one call per gather]
# A prefetch used to be four Python calls from the window (``may_gather``, ``profiling``,
# ``issue_unshard``, then the profiler range or not): now the window makes one, which checks
# ``may_gather`` only where a torch release may refuse a gather (2.15's asynchronous reduction)
# and opens no context manager unless a profiler runs or FSDP2 runs its hooks in one (2.14+).
# bench_calls.py --opcodes, 16 units, torch 2.13: see [Note: trims of the per-demand path].


# [Note: stream waits before a gather]
# A gather reads the sharded parameters on FSDP2's all-gather streams, so those streams must have
# waited for the optimizer's writes on the current stream. FSDP2 makes them wait once per forward,
# in its root pre-forward, and not before a backward gather (a backward follows its forward with
# no step between; FSDP2 leaves a TODO there). A gather issued inside either pass therefore needs
# no wait of its own, and waiting again cost two cross-stream waits (an event record and a stream
# wait each, a few µs of host time on CUDA) per prefetch, which FSDP2's own prefetch never pays.
# Only a gather issued before the root pre-forward of its root (a scope's first refill, the refill
# at the root unit's demand, which comes before FSDP2's root pre-forward) waits, and for what the
# root pre-forward would wait for: the event of ``set_post_optim_event()`` where one is set (the
# optimizer ran on another stream, which the current stream knows nothing of), else the current
# stream. Where torch 2.15
# leaves ``iter_forward_root`` set past a forward (chunked loss), FSDP2's own root pre-forward skips
# its wait too, so no gather waits less than plain FSDP2's. On CPU nothing waits (host gathers).


def _wait_for_optimizer(state: Any) -> None:
    """Make the all-gather streams wait as FSDP2's root pre-forward does: for the event a user set
    with ``set_post_optim_event()`` (an optimizer run on another stream), else the current stream.
    The event stays set: FSDP2's own root pre-forward still waits for it and clears it."""
    event = state._state_ctx.post_optim_event
    current = state._device_handle.current_stream() if event is None else None
    for name in ("all_gather_copy_in_stream", "all_gather_stream"):
        if (stream := getattr(state._comm_ctx, name, None)) is not None:
            if event is not None:
                stream.wait_event(event)
            else:
                stream.wait_stream(current)


def _streams_synced(state: Any) -> bool:
    """FSDP2 made the unit's all-gather streams wait for the current stream in this pass already."""
    return state._state_ctx.iter_forward_root is not None or in_backward()


def _unshard_groups(state: Any, backward: bool) -> bool:
    """The body of :func:`issue_unshard`, inside its context where it opens one."""
    device = state._device
    cpu = _ON_HOST.get(device)
    if cpu is None:
        cpu = _ON_HOST[device] = device.type == "cpu"  # reading .type costs ~0.25 µs: once per device
    if not cpu and not _streams_synced(state):
        # Issued before FSDP2's root pre-forward (at a scope's start, right after
        # optimizer.step()): the side streams must first see the optimizer's writes to the sharded
        # parameters, on the current stream or where set_post_optim_event() says. See
        # [Note: stream waits before a gather].
        _wait_for_optimizer(state)
    training_state = _PRE_BACKWARD if backward else _FORWARD
    pending = False
    for group in param_groups(state):
        # What FSDPParamGroup.use_training_state does, without a generator context per gather.
        saved, group._training_state = group._training_state, training_state
        try:
            FSDPParamGroup.unshard(group, async_op=True if cpu else group.unshard_async_op)
        finally:
            group._training_state = saved
        pending = pending or group._all_gather_result is not None
    return pending


def release(state: Any) -> None:
    """Finish a pending gather and free it again, so no all-gather outlives its scope."""
    if not INTERNALS_OK:
        public.release(state)
        return
    with fsdp_hook_context():
        for group in param_groups(state):
            if group._all_gather_result is not None:
                group.wait_for_unshard()
                FSDPParamGroup.reshard(group)  # the class method: our own call, not another party's


def reshard_if_idle(state: Any) -> None:
    """Do the reshard a keep skipped, now that its next use will not come (scope end, divergence).

    A unit mid-use is left to FSDP2's own reshard at the end of that use, and so is one whose
    gradients torch 2.15's manual backward finalization has not reduced yet (FSDP2 reshards it
    when it finalizes).
    """
    with fsdp_hook_context():
        for group in param_groups(state):
            pending_reduction = getattr(group, "_post_backward_pending", False)
            if group._training_state in IDLE_STATES and group.is_unsharded and not pending_reduction:
                FSDPParamGroup.reshard(group)  # the class method: our own call, not another party's


def ensure_lazy_init(root_state: Any) -> None:
    """Run FSDP2's root lazy init (idempotent) so gathers can be issued before the first forward."""
    if INTERNALS_OK:
        root_state._lazy_init()


def reset_iter_state(root: nn.Module) -> None:
    """FSDP2's recovery after an exception aborted a forward or backward mid-flight.

    torch 2.11 and 2.12 have no ``reset_iter_state``: there FSDP2's state is left as plain FSDP2
    leaves it after the exception (the scheduler has released its own gathers already).
    """
    if not hasattr(root, "reset_iter_state"):
        return
    if not INTERNALS_OK:
        root.reset_iter_state()
        return
    state = fsdp_state(root)
    if state is None or not state._is_root:
        return
    root.reset_iter_state()
    if TORCH_RELEASE >= (2, 15):
        return  # torch 2.15's reset clears sharded and unsharded gradients itself
    # Autograd may already have written .grad to unsharded parameters of units that stay
    # unsharded (the root); reset_iter_state leaves it, so the next backward would add to it.
    for unit_state in state._state_ctx.all_states:
        for fsdp_param in fsdp_params(unit_state):
            if (unsharded := getattr(fsdp_param, "_unsharded_param", None)) is not None:
                unsharded.grad = None
