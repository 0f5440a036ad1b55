"""What tests read of FSDP2's internals and of the scheduler's, in one place.

FSDP2's are read directly, not through ``fsdp_replay._compat``, so a check does not rest on the
code it checks (as in :mod:`fsdp_replay.testing.observer`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch.nn as nn
from torch.distributed._composable_state import _get_module_state
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from fsdp_replay._compat.shadows import collective_finished
from fsdp_replay._window import PrefetchWindow
from fsdp_replay.scheduler import PrefetchScheduler


HAS_RESET_ITER_STATE = hasattr(FSDPModule, "reset_iter_state")
"""torch 2.13+: FSDP2 recovers from an exception mid-iteration; 2.11/2.12 have no such call, so
tests of recovery are skipped there."""


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state of a ``fully_shard`` module (shared by the modules of a grouped unit)."""
    return _get_module_state(module)


def param_groups(unit: nn.Module | Any) -> Sequence[Any]:
    """FSDP2's param groups of a ``fully_shard`` module, or of an FSDP2 state (e.g. ``Unit.state``).

    FSDP2's own list where it keeps one (torch 2.12+; the observer reads it at every demand): do
    not modify it.
    """
    state = _get_module_state(unit) if isinstance(unit, nn.Module) else unit
    if (groups := getattr(state, "_fsdp_param_groups", None)) is not None:
        return groups
    group = state._fsdp_param_group  # torch 2.11: at most one group per state
    return () if group is None else (group,)


def gather_pending(group: Any) -> bool:
    """An all-gather of this param group was issued and not yet waited on."""
    return group._all_gather_result is not None


def gather_running(group: Any) -> bool:
    """An all-gather of this param group is pending and its collective has not finished yet."""
    result = group._all_gather_result
    if result is None:
        return False
    work = result.all_gather_work
    if work is not None:
        return not collective_finished(work)  # [Note: never Work.is_completed()]
    return result.all_gather_event is not None and not result.all_gather_event.query()


def window(scheduler: PrefetchScheduler) -> PrefetchWindow:
    """The scheduler's prefetch window: the units it holds ahead of their use."""
    return scheduler._window


@contextlib.contextmanager
def counting_all_gathers() -> Iterator[list[int]]:
    """Counts FSDP2's all-gathers issued inside the block (by anyone): ``with ... as n: ...; n[0]``.

    FSDP2's param groups call ``foreach_all_gather`` by their module's global name, once per
    gather of a group, so wrapping that name sees each one.
    """
    issued = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        issued[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        yield issued
    finally:
        _fsdp_param_group.foreach_all_gather = original


def fsdp_params(state: Any) -> Iterator[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of a unit's state."""
    for group in param_groups(state):
        yield from group.fsdp_params


def unsharded_grad(fsdp_param: Any) -> Any:
    """The gradient autograd left on a parameter's *unsharded* tensor, if it has one (else None)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return unsharded.grad if unsharded is not None else None


def clear_unsharded_grad(fsdp_param: Any) -> None:
    if (unsharded := getattr(fsdp_param, "_unsharded_param", None)) is not None:
        unsharded.grad = None


def iteration_bookkeeping(root_state: Any, states: list[Any]) -> int:
    """Entries in FSDP2's per-iteration lists (the post-forward order and each group's indices):
    they must not grow from one iteration to the next."""
    return len(root_state._comm_ctx.post_forward_order) + sum(
        len(g._post_forward_indices) for s in states for g in param_groups(s)
    )
