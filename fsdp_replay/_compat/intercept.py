"""FSDP2's own methods seen as they happen, and FSDP2's own prefetch turned off while attached.

Each interception is an instance attribute that shadows one of FSDP2's methods on one state or
param group and calls the class's method inside; ``stop_*`` removes it again (``detach()``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.autograd import Variable

from fsdp_replay._compat import public
from fsdp_replay._compat.guard import INTERNALS_OK, eager
from fsdp_replay._compat.shadows import GroupShadow, Interception, OtherPartyCall
from fsdp_replay._compat.state import in_backward, param_groups

if INTERNALS_OK:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState


def report_pre_backward(state: Any, on_backward_use: Callable[[], None]) -> bool:
    """Call ``on_backward_use`` just before FSDP2's pre-backward gathers the unit for a backward use.

    FSDP2 registers ``state._pre_backward`` as a tensor hook on every grad-requiring output in its
    post-forward; an instance attribute shadows that method, so the hook it registers is this
    wrapper and no second tensor hook per output is needed. A backward use starts when a param
    group is not already in pre-backward (FSDP2's own test for a no-op). False where FSDP2's
    internals are not available: the caller then hooks the outputs itself. See
    [Note: hook order and the end of backward] in ``fsdp_replay/_hooks.py``.
    """
    if not INTERNALS_OK:
        return False
    fsdp_pre_backward = type(state)._pre_backward.__get__(state)
    groups = param_groups(state)
    pre_backward_state = TrainingState.PRE_BACKWARD  # read per use: [Note: Enum members on the per-demand path]

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        for group in groups:
            if group._training_state is not pre_backward_state:
                on_backward_use()
                break
        return fsdp_pre_backward(grad)

    state._pre_backward = pre_backward
    return True


def stop_reporting_pre_backward(state: Any) -> None:
    state.__dict__.pop("_pre_backward", None)


def report_method_forward(state: Any, on_forward: Callable[[nn.Module, Any], None]) -> None:
    """Call ``on_forward(module, args)`` before FSDP2's pre-forward of a method registered with
    ``register_fsdp_forward_method`` (RL libraries register ``generate``; a unit may register one
    of its own), which the module's forward hooks never see.

    Such a method calls ``state._pre_forward`` itself, looked up at each call, while FSDP2's
    forward hook holds the bound method it registered: this instance attribute therefore sees
    method calls only, never a forward the module hooks already report. It is opaque to
    torch.compile, as FSDP2's ``_pre_forward`` is. Without FSDP2's internals nothing sees them.
    """
    if not INTERNALS_OK:
        return
    fsdp_pre_forward = type(state)._pre_forward.__get__(state)

    def pre_forward(module: nn.Module, args: Any, kwargs: Any) -> Any:
        on_forward(module, args)
        return fsdp_pre_forward(module, args, kwargs)

    state._pre_forward = eager(pre_forward)


def stop_reporting_method_forward(state: Any) -> None:
    state.__dict__.pop("_pre_forward", None)


# --- FSDP2's reshards and unshards, seen as they happen ------------------------------------------

# [Note: fsdp_replay never owns FSDP2's settings]
# The user (``set_reshard_after_backward`` for gradient accumulation, ``unshard()``/``reshard()``),
# torch pipelining (``PipelineStage`` toggles reshard/sync per microbatch, the runtime's
# UNSHARD/RESHARD actions) and ``reset_iter_state`` all drive the same FSDP2 state. fsdp_replay
# therefore writes none of FSDP2's settings. To keep a unit unsharded for its next use it skips
# one *lifecycle* reshard (FSDP2's own, after a forward or a backward) at the moment FSDP2 makes
# it, and only if FSDP2 would really reshard then under whatever settings are current. Any other
# party's reshard, unshard or reset of a unit the scheduler holds hands that unit over to them:
# it leaves the window untouched by the scheduler from then on. So whoever sets a field, their
# value is the one FSDP2 acts on, and a unit ends a step sharded or not exactly as plain FSDP2
# would leave it.


_PIPELINING = f"{os.sep}torch{os.sep}distributed{os.sep}pipelining{os.sep}"


def other_party(call: OtherPartyCall) -> str:
    """Whose call it is, as ``explain()`` names it: a pipeline schedule's action (found on the call
    stack), ``reset_iter_state``, or the user's (anything else)."""
    if call == "reset":
        return "reset_iter_state()"
    frame = sys._getframe(1)
    while frame is not None:
        if _PIPELINING in frame.f_code.co_filename:
            return f"a pipeline schedule's {call}()"
        frame = frame.f_back
    return f"a user's {call}()"


def intercept_group_calls(
    state: Any,
    *,
    held: Callable[[], object],
    skip_lifecycle_reshard: Callable[[], bool],
    on_other_party: Callable[[OtherPartyCall], None],
) -> bool:
    """Report FSDP2's per-group lifecycle reshards and other parties' calls to the scheduler.

    ``skip_lifecycle_reshard()`` is asked when FSDP2's own post-forward or post-backward is about
    to reshard the group (only where its current settings make that a real reshard) while
    ``held()`` is not None (the scheduler holds the unit; a C-level call such as a bound
    ``dict.get``, asked at every lifecycle reshard, see [Note: trims of the per-demand path]);
    True skips it. ``on_other_party(call)`` is told of every ``reshard``, ``unshard`` or ``_reset_iter_state``
    that is neither FSDP2's forward/backward lifecycle nor the scheduler's own (which calls the
    class methods directly). See [Note: fsdp_replay never owns FSDP2's settings] and the group's
    :class:`~fsdp_replay._compat.shadows.GroupShadow`. False where FSDP2's internals are not available.
    """
    if not INTERNALS_OK:
        return False
    for group in param_groups(state):
        GroupShadow.of(state, group).interception = Interception(held, skip_lifecycle_reshard, on_other_party)
    return True


def stop_intercepting_group_calls(state: Any) -> None:
    for group in param_groups(state) if INTERNALS_OK else ():
        if (shadow := GroupShadow.installed(group)) is not None:
            shadow.interception = None
            shadow.release_if_unused()


def intercept_backward_end(state: Any, on_backward_end: Callable[[bool], None]) -> bool:
    """Call ``on_backward_end(finalized_by_caller)`` right after FSDP2's root post-backward callback,
    whoever runs it.

    Shadowing it on every state under the root makes the scheduler's end of backward FSDP2's own;
    see [Note: hook order and the end of backward] in ``fsdp_replay/_hooks.py``.
    ``finalized_by_caller`` is True where the callback is not autograd's (torch 2.13 pipelining
    calls it directly) or backward finalization is manual (2.15 pipelining switches it on): the
    backward's caller, not autograd, decides where the iteration ends. False without FSDP2's internals.
    """
    if not INTERNALS_OK:
        return False
    fsdp_callback = state._root_post_backward_final_callback

    def root_post_backward_final_callback() -> None:
        by_caller = not in_backward() or getattr(state._state_ctx, "manual_backward_finalization_active", None) is True
        fsdp_callback()
        on_backward_end(by_caller)

    state._root_post_backward_final_callback = root_post_backward_final_callback
    return True


def stop_intercepting_backward_end(state: Any) -> None:
    state.__dict__.pop("_root_post_backward_final_callback", None)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current autograd graph task ends (the public fallback's end of
    backward; see [Note: hook order and the end of backward] in ``fsdp_replay/_hooks.py``)."""
    Variable._execution_engine.queue_callback(callback)


# --- FSDP2's own prefetch, turned off while attached ----------------------------------------


class _NothingToPrefetch:
    """Stands in FSDP2's backward prefetch list: a non-empty list turns FSDP2's implicit backward
    prefetch off, and a state with no param groups gives FSDP2's loop over it nothing to do (the
    unit itself there would cost a no-op ``_prefetch_unshard``, a profiler range, per backward use)."""

    _fsdp_param_groups: tuple[()] = ()
    _fsdp_param_group: None = None
    """torch 2.11 reads the single group of each state in the list (``state._fsdp_param_group``)."""


_NOTHING_TO_PREFETCH = _NothingToPrefetch()


def disable_own_prefetch(state: Any) -> tuple[Any, Any]:
    """Turn FSDP2's own prefetch off: no explicit forward list, and a backward list FSDP2 finds
    nothing to gather in (which turns the implicit backward prefetch off too).

    Returns ``(saved, installed)`` for :func:`restore_own_prefetch`.
    """
    if not INTERNALS_OK:  # the lists cannot be read publicly: detach() leaves FSDP2's defaults
        if public.prefetches(state):  # see [Note: the public fallback prefetches on the host only]
            state.set_modules_to_forward_prefetch([])
            state.set_modules_to_backward_prefetch([state])
        return None, None
    saved = (state._states_to_forward_prefetch, state._states_to_backward_prefetch)
    installed: tuple[list[Any], list[Any]] = ([], [_NOTHING_TO_PREFETCH])
    state._states_to_forward_prefetch, state._states_to_backward_prefetch = installed
    return saved, installed


def restore_own_prefetch(state: Any, saved: Any, installed: Any) -> None:
    """Put back each list the scheduler replaced, unless someone set a list of their own since.

    FSDP2's setters assign a new list, so identity tells whether ours is still there.
    See [Note: fsdp_replay never owns FSDP2's settings].
    """
    if not INTERNALS_OK:
        if public.prefetches(state):
            state.set_modules_to_forward_prefetch([])
            state.set_modules_to_backward_prefetch([])
        return
    if state._states_to_forward_prefetch is installed[0]:
        state._states_to_forward_prefetch = saved[0]
    if state._states_to_backward_prefetch is installed[1]:
        state._states_to_backward_prefetch = saved[1]

