"""The FSDP2 roots one scheduler serves: one model, or every model chunk (pipeline stage) of a rank.

Held by weak reference, like the units: the scheduler never keeps a model alive. With several
roots each unit's FQN is qualified by its root's position in ``attach()``'s list
(``"chunk0/layers.3"``), so one recorded order names units of every chunk unambiguously.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator, Sequence

import torch.nn as nn

from fsdp_replay import _compat
from fsdp_replay._units import Unit, discover_units


_NOT_A_ROOT = (
    "fsdp_replay was attached to a module that FSDP2 treats as a child unit; attach to the outermost "
    "fully_shard module (the one whose forward runs first)"
)


def chunk_prefix(position: int) -> str:
    """How a unit of the ``position``-th root is named when a scheduler serves several."""
    return f"chunk{position}/"


class Roots:
    """The root modules and their FSDP2 states, in the order given to ``attach()``."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        self._states = [weakref.ref(_compat.fsdp_state(m)) for m in modules]

    def __len__(self) -> int:
        return len(self._modules)

    def modules(self) -> list[nn.Module]:
        return [m for ref in self._modules if (m := ref()) is not None]

    def states(self) -> Iterator[Any]:
        return (s for ref in self._states if (s := ref()) is not None)

    def discover_units(self) -> list[Unit]:
        """Every unit of every root, root by root in module-tree order; FQNs qualified when several."""
        units: list[Unit] = []
        several = len(self._modules) > 1
        for position, module in enumerate(self.modules()):
            prefix = chunk_prefix(position) if several else ""
            units += discover_units(module, position=position, prefix=prefix, first_index=len(units))
        return units

    def check_still_roots(self) -> None:
        """Raise if FSDP2's lazy init made one of them a child unit (attached to the wrong module)."""
        if any(_compat.is_root_initialized_as_child(state) for state in self.states()):
            raise RuntimeError(_NOT_A_ROOT)

    def lazy_init(self) -> None:
        """FSDP2's root lazy init, so a scope may gather before a root's first forward; never of a
        module another unit encloses (``fully_shard(block, prefetch=...)`` given to a block, its
        model sharded later), which that init would make a root for good."""
        for module, state in zip(self.modules(), self.states()):
            if (outer := _compat.enclosing_unit(module, state)) is not None:
                raise RuntimeError(
                    f"{_NOT_A_ROOT}: this {type(module).__name__} is inside a fully_shard {type(outer).__name__}"
                )
            _compat.ensure_lazy_init(state)

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after an exception, on every root."""
        for module in self.modules():
            _compat.reset_iter_state(module)
