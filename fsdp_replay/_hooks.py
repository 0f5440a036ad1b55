"""Translate FSDP2 lifecycle points into scheduler events, with hooks only (no subclassing).

Where each hook sits relative to FSDP2's own:
- pre-forward, ``prepend=True`` and registered after FSDP2's, so it runs *before* FSDP2 unshards:
  the demand is classified and the current unit's gather issued first;
- FSDP2's own pre-backward tensor hook reports a backward demand before it gathers (see
  ``_compat.report_pre_backward``); without FSDP2's internals, a post-forward hook
  (``prepend=True``, before FSDP2's ``_post_forward``) adds output tensor hooks ahead of FSDP2's;
- each param group's reshard/unshard/reset, seen as they happen (``_compat.intercept_group_calls``):
  FSDP2's own reshard after a use may be skipped for a keep, anyone else's call hands the unit over;
- FSDP2's root post-backward callback, wherever it runs (``_compat.intercept_backward_end``): the
  end of a backward. Without FSDP2's internals, an autograd-engine callback on the outermost
  graph task stands in for it (a reentrant checkpoint's nested backward is not an end).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from fsdp_replay import _compat
from fsdp_replay._order import Phase
from fsdp_replay._units import Unit


class SchedulerEvents(Protocol):
    """What the hooks report; implemented by :class:`~fsdp_replay.PrefetchScheduler`."""

    def on_demand(self, unit: Unit, phase: Phase) -> None: ...
    def on_lifecycle_reshard(self, unit: Unit) -> bool: ...
    def on_other_party(self, unit: Unit, call: _compat.OtherPartyCall) -> None: ...
    def on_root_pre_forward(self) -> None: ...
    def on_root_post_forward(self, *, backward_follows: bool, failed: bool) -> None: ...
    def on_backward_end(self) -> None: ...


class _BackwardDemand:
    """Shared by the outputs of one forward call: the first gradient to reach any of them is the demand."""

    __slots__ = ("fired",)

    def __init__(self) -> None:
        self.fired = False


class HookSet:
    """All hooks one scheduler registered; ``remove()`` restores the modules as they were."""

    def __init__(self, events: SchedulerEvents) -> None:
        self._events = events
        self._handles: list[RemovableHandle] = []
        # Public fallback only: the graph task whose end-of-backward callback is queued. A backward
        # that raises drops its callbacks, so it is forgotten at the next root forward.
        self._backward_end_task = -1
        self._intercepting = False
        """Whether the end of backward comes from FSDP2's own callback (its internals are available)."""
        self._intercepted_states: list[weakref.ref] = []
        """Every FSDP2 state under the root: their shadowed methods are removed by ``remove``."""

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for ref in self._intercepted_states:
            if (state := ref()) is not None:
                _compat.stop_reporting_pre_backward(state)
                _compat.stop_intercepting_group_calls(state)
                _compat.stop_intercepting_backward_end(state)
        self._intercepted_states.clear()

    # --- registration --------------------------------------------------------------------------

    def register_unit(self, unit: Unit) -> bool:
        """Hooks for one unit; True where FSDP2's reshards of it can be seen (and skipped for keeps)."""
        modules = unit.modules()
        for module in modules:
            self._handles.append(
                module.register_forward_pre_hook(functools.partial(self._on_pre_forward, unit), prepend=True)
            )
        state = unit.state
        intercepted = _compat.intercept_group_calls(
            state,
            skip_lifecycle_reshard=functools.partial(self._events.on_lifecycle_reshard, unit),
            on_other_party=functools.partial(self._events.on_other_party, unit),
        )
        if _compat.report_pre_backward(state, functools.partial(self._on_backward_use, unit)):
            return intercepted
        for module in modules:  # public fallback: one more tensor hook per output
            self._handles.append(
                module.register_forward_hook(functools.partial(self._on_forward_output, unit), prepend=True)
            )
        return intercepted

    def register_root(self, root: nn.Module) -> None:
        """Register last: among prepended pre-hooks the latest runs first, so scopes open before demands."""
        self._handles += [
            root.register_forward_pre_hook(self._on_root_pre_forward, prepend=True),
            # always_call: an automatic scope must learn that its forward raised.
            root.register_forward_hook(self._on_root_post_forward, always_call=True),
        ]
        # Any FSDP2 state under the root (with parameters or not) may queue the root callback.
        for state in dict.fromkeys(filter(None, map(_compat.fsdp_state, root.modules()))):
            self._intercepting = _compat.intercept_backward_end(state, self._on_backward_end)
            self._intercepted_states.append(weakref.ref(state))

    # --- forward -------------------------------------------------------------------------------

    def _on_root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not _compat.in_backward():
            self._backward_end_task = -1
            self._events.on_root_pre_forward()

    def _on_root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if _compat.in_backward():
            return
        failed = output is None and sys.exc_info()[1] is not None
        follows = torch.is_grad_enabled() and any(True for _ in _compat.grad_tensors(output))
        self._events.on_root_post_forward(backward_follows=follows, failed=failed)

    def _on_pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        if _compat.opens_forward(unit.state):  # not a later module of a grouped unit's same pass
            self._events.on_demand(unit, Phase.recompute if _compat.in_backward() else Phase.forward)

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
        if not self._intercepting and self._backward_end_task == -1:
            # Public fallback: the first backward use names the outermost graph task; a nested one
            # (a reentrant checkpoint's backward) comes while that is still running.
            self._backward_end_task = _compat.graph_task_id()
            _compat.queue_backward_callback(self._requeue_backward_end)
        self._events.on_demand(unit, Phase.backward)

    def _requeue_backward_end(self) -> None:
        # Queued before FSDP2's final callback (a backward use is reported before FSDP2's
        # pre-backward queues it); going to the back of the queue once puts the end-of-backward
        # event after FSDP2's last reshards.
        _compat.queue_backward_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._backward_end_task = -1
        self._events.on_backward_end()
