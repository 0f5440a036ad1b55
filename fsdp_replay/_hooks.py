"""Translate FSDP2 lifecycle points into scheduler events, with hooks only (no subclassing).

Where each hook sits relative to FSDP2's own, and where a backward ends: see
[Note: hook order and the end of backward] below.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from fsdp_replay import _compat
from fsdp_replay._order import Phase
from fsdp_replay._units import Unit
from fsdp_replay.waits import DemandWaits

_FORWARD, _RECOMPUTE, _BACKWARD = Phase.forward, Phase.recompute, Phase.backward
"""Read per demand: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""

# [Note: hook order and the end of backward]
# A demand must reach the scheduler before FSDP2 acts on it, a scope must open before its first
# demand, and a backward ends after FSDP2's last reshard of it. Lifecycle point by point:
# - Root pre-forward: ``register_root`` runs after every unit's registration, and among prepended
#   hooks the one registered last runs first, so an automatic scope opens before any demand of
#   that forward (the root unit's own included) is reported.
# - Unit pre-forward: prepended, and registered after ``fully_shard`` registered FSDP2's, so it
#   runs before FSDP2's pre-forward unshards: the demand is classified from FSDP2's state as the
#   demand finds it, and its missing gather is issued before any prefetch. A grouped unit reports
#   one demand per pass (``_compat.opens_forward``). A method registered with
#   ``register_fsdp_forward_method`` runs no module hook: FSDP2's ``_pre_forward``, shadowed per
#   state (``_compat.report_method_forward``), reports it as the same demand. A root's method opens
#   no automatic scope (RL libraries register ``generate``, which calls the root's forward once per
#   token, each forward its own scope).
# - Root post-forward: appended with ``always_call``, so it runs after FSDP2's own post-forward and
#   also when the forward raised: an automatic scope learns whether a backward follows.
# - Backward use: FSDP2's own pre-backward tensor hook, shadowed per state
#   (``_compat.report_pre_backward``), reports it just before FSDP2 gathers. Without FSDP2's
#   internals a prepended post-forward hook (before FSDP2's ``_post_forward``) puts a tensor hook
#   on each output ahead of FSDP2's; the first gradient to reach any of them is the demand.
# - FSDP2's reshard after a use, and anyone else's reshard/unshard/reset: each param group's
#   methods, shadowed (``_compat.intercept_group_calls``); see
#   [Note: fsdp_replay never owns FSDP2's settings].
# - End of backward: FSDP2's root post-backward callback, shadowed on every state under the root
#   (any of them may queue it; ``_compat.intercept_backward_end``). The scheduler's event runs
#   right after FSDP2's callback, so after FSDP2's last reshards and after it dropped any gather
#   still pending. FSDP2 queues it once per backward on the outermost graph task (a reentrant
#   checkpoint's nested backward is not an end); torch pipelining calls it directly when a stage
#   finalizes. A callback not run by autograd, or run under manual backward finalization (2.15
#   pipelining), is reported as finalized by its caller: automatic scopes stop there
#   (``fsdp_replay/_automatic.py``). Without FSDP2's internals an autograd-engine callback, queued at the first backward
#   use of the outermost graph task, stands in: it is queued before FSDP2's (the use is reported
#   before FSDP2's pre-backward queues its own), so it requeues itself once to run after it. A
#   backward that raises drops its callbacks, so that task is forgotten at the next root forward.
# - An observer (``fsdp_replay.testing.observer.DemandObserver``) registers after ``attach()``:
#   its prepended hooks then run before the scheduler's and FSDP2's, seeing what the demand found.

# [Note: hooks are opaque to torch.compile]
# ``block.compile()`` (torchtitan's default, one compile per transformer block) compiles the
# block's ``_call_impl``, whose frame Dynamo skips; each hook it calls is then a frame Dynamo
# tries to compile on its own. FSDP2 wraps its hooks in ``torch._dynamo.disable``
# (``_fsdp_common._dynamo_disable``); a hook of ours left traceable was compiled instead, and
# broke the graph on ``torch._C._current_graph_task_id`` (2 breaks in a 3-block model). Every
# module hook registered here is therefore wrapped once, at registration, in
# ``torch.compiler.disable`` (recursive: nothing the scheduler calls from it is traced either),
# and runs eagerly as FSDP2's do. The wrapper costs 0.3 µs per call (0.53 against 0.23 µs for a
# bare call, torch 2.13, this 2-core machine, load ~7), once per forward demand; tensor hooks and
# FSDP2's shadowed methods run from autograd or from FSDP2's own disabled hooks, so they need none;
# the ``_pre_forward`` shadow is the exception (a registered method's wrapper calls it, traced
# wherever the method is), so it is wrapped too.


class SchedulerEvents(Protocol):
    """What the hooks report, in the order of [Note: hook order and the end of backward];
    implemented by :class:`~fsdp_replay.PrefetchScheduler`."""

    def on_demand(self, unit: Unit, phase: Phase, state: Any) -> None: ...
    def on_lifecycle_reshard(self, unit: Unit) -> bool: ...
    def on_other_party(self, unit: Unit, call: _compat.OtherPartyCall) -> None: ...
    def on_root_pre_forward(self) -> None: ...
    def on_root_post_forward(self, *, backward_follows: bool, failed: bool) -> None: ...
    def on_backward_end(self, *, finalized_by_caller: bool) -> None: ...


class _BackwardDemand:
    """Shared by the outputs of one forward call: the first gradient to reach any of them is the demand."""

    __slots__ = ("fired",)

    def __init__(self) -> None:
        self.fired = False


class HookSet:
    """All hooks one scheduler registered; ``remove()`` restores the modules as they were."""

    def __init__(self, events: SchedulerEvents, *, held: Callable[[Unit], object]) -> None:
        self._events = events
        self._held = held
        """How the scheduler holds a unit, if it does (the window's ``holds``): FSDP2's reshard of a
        unit not held skips no reshard, so it asks the scheduler nothing."""
        self._handles: list[RemovableHandle] = []
        # Public fallback only: an end-of-backward callback is queued on the outermost graph task
        # (see [Note: hook order and the end of backward]); a raised backward drops it, so the next
        # root forward clears this.
        self._backward_end_queued = False
        self._intercepting = False
        """Whether the end of backward comes from FSDP2's own callback (its internals are available)."""
        self._intercepted_states: list[weakref.ref] = []
        """Every FSDP2 state under the root: their shadowed methods are removed by ``remove``."""
        self._timers: list[tuple[weakref.ref, Any]] = []
        """Each unit state whose waits are timed, and its timer (``measure_waits``)."""

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for ref, timer in self._timers:
            if (state := ref()) is not None:
                _compat.stop_timing_waits(state, timer)
        self._timers.clear()
        for ref in self._intercepted_states:
            if (state := ref()) is not None:
                _compat.stop_reporting_pre_backward(state)
                _compat.stop_reporting_method_forward(state)
                _compat.stop_intercepting_group_calls(state)
                _compat.stop_intercepting_backward_end(state)
        self._intercepted_states.clear()

    # --- registration --------------------------------------------------------------------------

    def register_unit(self, unit: Unit) -> bool:
        """Hooks for one unit; True where FSDP2's reshards of it can be seen (and skipped for keeps).

        Call before :meth:`register_root` (see [Note: hook order and the end of backward]).
        """
        modules = unit.modules()
        for module in modules:
            self._handles.append(
                module.register_forward_pre_hook(_compat.eager(functools.partial(self._on_pre_forward, unit)), prepend=True)
            )
        state = unit.state
        _compat.report_method_forward(state, functools.partial(self._on_pre_forward, unit))
        intercepted = _compat.intercept_group_calls(
            state,
            held=functools.partial(self._held, unit),
            skip_lifecycle_reshard=functools.partial(self._events.on_lifecycle_reshard, unit),
            on_other_party=functools.partial(self._events.on_other_party, unit),
        )
        if _compat.report_pre_backward(state, functools.partial(self._on_backward_use, unit)):
            return intercepted
        for module in modules:  # public fallback: one more tensor hook per output
            self._handles.append(
                module.register_forward_hook(_compat.eager(functools.partial(self._on_forward_output, unit)), prepend=True)
            )
        return intercepted

    def time_waits(self, unit: Unit, waits: DemandWaits) -> bool:
        """Time each of ``unit``'s uses that blocks on its parameters (``measure_waits``); call after
        :meth:`register_unit`. False without FSDP2's internals."""
        state = unit.state
        timer = _compat.time_waits(state, functools.partial(waits.waited, unit), functools.partial(waits.waited_on_device, unit))
        if timer is not None:
            self._timers.append((weakref.ref(state), timer))
        return timer is not None

    def register_root(self, root: nn.Module) -> None:
        """Register last, so scopes open before demands (see [Note: hook order and the end of backward])."""
        self._handles += [
            root.register_forward_pre_hook(_compat.eager(self._on_root_pre_forward), prepend=True),
            # always_call: an automatic scope must learn that its forward raised.
            root.register_forward_hook(_compat.eager(self._on_root_post_forward), always_call=True),
        ]
        # Any FSDP2 state under the root (with parameters or not) may queue the root callback. Not
        # filter(None, ...): with the public fallback a state is its module, and a compiled module
        # (OptimizedModule) raises on bool().
        states = (state for state in map(_compat.fsdp_state, root.modules()) if state is not None)
        for state in dict.fromkeys(states):
            self._intercepting = _compat.intercept_backward_end(state, self._on_backward_end)
            self._intercepted_states.append(weakref.ref(state))

    # --- forward -------------------------------------------------------------------------------

    def _on_root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not _compat.in_backward():
            self._backward_end_queued = False
            self._events.on_root_pre_forward()

    def _on_root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if _compat.in_backward():
            return
        failed = output is None and sys.exc_info()[1] is not None
        follows = torch.is_grad_enabled() and any(True for _ in _compat.grad_tensors(output))
        self._events.on_root_post_forward(backward_follows=follows, failed=failed)

    def _on_pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        state = unit.state
        if _compat.opens_forward(state):  # not a later module of a grouped unit's same pass
            self._events.on_demand(unit, _RECOMPUTE if _compat.in_backward() else _FORWARD, state)

    def _on_forward_output(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        state = unit.state
        if not torch.is_grad_enabled() or _compat.in_pre_backward(state):
            return  # FSDP2 skips its pre-backward hooks here, so there is no backward demand
        if not _compat.completes_forward(state, module):
            return
        demand = _BackwardDemand()
        for tensor in _compat.grad_tensors(output):
            tensor.register_hook(functools.partial(self._on_output_grad, unit, demand))

    # --- backward ------------------------------------------------------------------------------

    def _on_output_grad(self, unit: Unit, demand: _BackwardDemand, grad: torch.Tensor) -> None:
        if not demand.fired:
            demand.fired = True
            self._on_backward_use(unit)

    def _on_backward_use(self, unit: Unit) -> None:
        if not self._intercepting and not self._backward_end_queued:
            # Public fallback: the first backward use names the outermost graph task; a nested one
            # (a reentrant checkpoint's backward) comes while that is still running. See
            # [Note: hook order and the end of backward].
            self._backward_end_queued = True
            _compat.queue_backward_callback(self._requeue_backward_end)
        self._events.on_demand(unit, _BACKWARD, unit.state)

    def _requeue_backward_end(self) -> None:
        # After FSDP2's own final callback: see [Note: hook order and the end of backward].
        _compat.queue_backward_callback(self._on_backward_end)

    def _on_backward_end(self, finalized_by_caller: bool = False) -> None:
        self._backward_end_queued = False
        self._events.on_backward_end(finalized_by_caller=finalized_by_caller)
