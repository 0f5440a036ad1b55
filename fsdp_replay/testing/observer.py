"""An independent witness: reads FSDP2's own state at each demand, without the scheduler's counters.

It reads FSDP2's internals itself rather than through ``fsdp_replay._compat``, so its account does
not rest on the code it checks; it shares only the vocabulary (:class:`~fsdp_replay.stats.Demand`).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from fsdp_replay.stats import Demand
from fsdp_replay.testing.internals import fsdp_state, gather_pending, gather_running, param_groups


def fsdp_units(root: nn.Module) -> dict[str, Any]:
    """Every FSDP2 state with parameters under ``root``, by its module names joined with ``+``."""
    names: dict[Any, list[str]] = {}
    for name, module in root.named_modules():
        if isinstance(module, FSDPModule) and param_groups(state := fsdp_state(module)):
            names.setdefault(state, []).append(name or "<root>")
    return {"+".join(labels): state for state, labels in names.items()}


def held_units(root: nn.Module) -> list[str]:
    """Units with parameters unsharded or an all-gather pending: what an optimizer step would find held."""
    return [
        name
        for name, state in fsdp_units(root).items()
        if any(gather_pending(g) or not g.is_sharded for g in param_groups(state))
    ]


def _gather_state(state: Any) -> Demand:
    groups = param_groups(state)
    if any(gather_pending(g) for g in groups):
        return Demand.hit
    if all(g.is_unsharded for g in groups):
        return Demand.resident
    return Demand.miss


class DemandObserver:
    """Hooks that run before fsdp_replay's and FSDP2's, logging ``(fqn, phase, hit|miss|resident)``.

    Register after attaching the scheduler, so these hooks run first (see
    [Note: hook order and the end of backward] in ``fsdp_replay/_hooks.py``). Module hooks only:
    calls of a method registered with ``register_fsdp_forward_method`` are not logged.
    """

    def __init__(self, root: nn.Module) -> None:
        self.log: list[tuple[str, str, Demand]] = []
        self.must_wait: list[bool] = []
        """Per entry of ``log``: the use had to wait for a gather (a miss, or a hit whose collective
        had not finished when the demand came)."""
        self._handles = []
        for label, state in fsdp_units(root).items():
            for m in state._modules:
                self._handles.append(
                    m.register_forward_pre_hook(functools.partial(self._pre_forward, label, state), prepend=True)
                )
                self._handles.append(
                    m.register_forward_hook(functools.partial(self._output, label, state, m), prepend=True)
                )

    def _pre_forward(self, label: str, state: Any, module: nn.Module, args: Any) -> None:
        if state._training_state == TrainingState.FORWARD:
            return
        phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
        self._observe(label, phase, state)

    def _output(self, label: str, state: Any, owner: nn.Module, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or state._training_state == TrainingState.PRE_BACKWARD:
            return
        if len(state._modules) > 1 and state._modules_to_run_forward != {owner}:
            return
        fired_in: list[int | None] = [None]
        """The backward (autograd graph task) that last saw this forward's outputs: one demand per
        backward, however many outputs it reaches, and another in a second backward through them."""

        def hook(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if fired_in[0] != task:
                fired_in[0] = task
                self._observe(label, "backward", state)

        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    def _observe(self, label: str, phase: str, state: Any) -> None:
        demand = _gather_state(state)
        if phase == "backward" and not all(g.unshard_in_backward for g in param_groups(state)):
            demand = Demand.resident  # set_unshard_in_backward(False): FSDP2 gathers nothing here
        self.log.append((label, phase, demand))
        self.must_wait.append(demand is Demand.miss or any(gather_running(g) for g in param_groups(state)))

    def take(self) -> list[tuple[str, str, Demand]]:
        log, self.log, self.must_wait = self.log, [], []
        return log

    def take_with_waits(self) -> list[tuple[str, str, Demand, bool]]:
        """Like :meth:`take`, each entry with whether the use had to wait for its gather."""
        must_wait = self.must_wait
        return [(*entry, wait) for entry, wait in zip(self.take(), must_wait)]

    @staticmethod
    def counts(log: list[tuple[str, str, Demand]]) -> dict[Demand, int]:
        return dict(collections.Counter(kind for _, _, kind in log))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
