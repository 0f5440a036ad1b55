"""Callbacks that reach the scheduler through a weak reference: a global hook must not keep a model alive."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

from torch.optim.optimizer import register_optimizer_step_pre_hook


def weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` for the global optimizer hook, holding the scheduler (and its model) weakly."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        if (live := ref()) is not None:
            live(*args)

    return call


class OptimizerSteps:
    """Calls ``on_step(concerned)`` before each ``optimizer.step()``; ``concerned``: the optimizer holds
    one of ``params`` (else it steps another model's).

    The hook is global (torch has no per-module one), so it holds the scheduler weakly
    (:func:`weakly`) and is removed when this object is collected or :meth:`remove` is called.
    """

    def __init__(self, params: Iterable[Any], on_step: Callable[[bool], None]) -> None:
        self._param_ids = {id(p) for p in params}
        self._concerned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """Optimizer -> whether it steps any of the parameters (asked once per optimizer)."""
        self._on_step = weakref.WeakMethod(on_step)
        self._hook = register_optimizer_step_pre_hook(weakly(self._step))
        weakref.finalize(self, self._hook.remove)

    def _step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer not in self._concerned:
            params = (p for group in optimizer.param_groups for p in group["params"])
            self._concerned[optimizer] = any(id(p) in self._param_ids for p in params)
        if (on_step := self._on_step()) is not None:
            on_step(self._concerned[optimizer])

    def remove(self) -> None:
        self._hook.remove()
