"""The fully_shard units under a root, held by weak reference."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from fsdp_replay import _compat


@dataclass(eq=False, slots=True)
class Unit:
    """One ``fully_shard`` call's parameter group(s); grouped ``fully_shard([a, b])`` is one unit."""

    fqn: str
    """Module name(s) under the root, e.g. ``"layers.0"`` or ``"tok_embeddings+output"``; with several
    roots, qualified by the root's position in ``attach()``'s list: ``"chunk1/layers.0"``."""
    index: int
    """Position in module-tree order (the ``static`` mode's forward order)."""
    unsharded_bytes: int
    """Bytes the unit occupies once all-gathered (what ``max_prefetch_bytes`` budgets)."""
    _state: weakref.ref
    _modules: tuple[weakref.ref, ...]
    root: int = 0
    """Position of the unit's root in ``attach()``'s list (its model chunk)."""
    encloses: bool = False
    """Another unit's module lies inside one of its modules, so its forward (and backward) may run
    around that unit's: it may be in use at another unit's demand (what a refill may skip reading,
    ``Lookahead.unread``)."""

    @property
    def state(self) -> Any:
        """The unit's FSDP2 state; raises if it was garbage collected (a use of a dead model)."""
        state = self._state()
        if state is None:
            raise RuntimeError(f"fsdp_replay: unit {self.fqn!r} was garbage collected")
        return state

    def state_or_none(self) -> Any:
        """The unit's FSDP2 state, or None once garbage collected (for teardown, which must not raise)."""
        return self._state()

    def modules(self) -> list[nn.Module]:
        return [m for ref in self._modules if (m := ref()) is not None]

    def __repr__(self) -> str:
        return f"Unit({self.fqn!r})"


def discover_units(root: nn.Module, *, position: int = 0, prefix: str = "", first_index: int = 0) -> list[Unit]:
    """Every FSDP2 unit with parameters in ``root``'s tree, in module-tree order, deduplicated.

    Units without parameters of their own need no all-gather, so they are not scheduled. With
    several roots, ``position`` is the root's, ``prefix`` qualifies each FQN and ``first_index``
    starts the indices.
    """
    names: dict[Any, list[str]] = {}
    order: list[Any] = []
    for name, module in root.named_modules():
        state = _compat.fsdp_state(module)
        if state is None:
            continue
        if state not in names:
            names[state] = []
            order.append(state)
        names[state].append(name or "<root>")
    with_params = [state for state in order if _compat.has_params(state)]
    scheduled = set(with_params)
    units = []
    for state in with_params:
        modules = _compat.state_modules(state)
        units.append(
            Unit(
                fqn=prefix + "+".join(names[state]),
                index=first_index + len(units),
                unsharded_bytes=_compat.unsharded_bytes(state),
                _state=weakref.ref(state),
                _modules=tuple(weakref.ref(m) for m in modules),
                root=position,
                encloses=_encloses(modules, state, scheduled),
            )
        )
    return units


def _encloses(modules: tuple[nn.Module, ...], state: Any, unit_states: set[Any]) -> bool:
    """Whether a module of another unit with parameters lies below one of ``modules`` (``state``'s)."""
    return any(
        (inner := _compat.fsdp_state(sub)) is not None and inner is not state and inner in unit_states
        for module in modules
        for sub in module.modules()
    )

