"""Entry points: attach a scheduler to a root, find it again, and the drop-in ``fully_shard``."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_replay import _compat
from fsdp_replay.config import PrefetchConfig
from fsdp_replay.scheduler import PrefetchScheduler

_ATTRIBUTE = "_fsdp_replay_scheduler"
"""The root owns its scheduler (a global registry would keep it alive one gc pass too long)."""
_ATTACHED: weakref.WeakSet[PrefetchScheduler] = weakref.WeakSet()


def attach(
    root: nn.Module | list[nn.Module] | tuple[nn.Module, ...], config: PrefetchConfig | Mapping[str, Any] | None = None
) -> PrefetchScheduler:
    """Schedule the unshards of every ``fully_shard`` unit under ``root``.

    Args:
        root: the outermost ``fully_shard`` module (the one whose forward runs first), after every
            unit under it was sharded; or a list of such roots, one per model chunk (pipeline
            stage) this rank holds, for one scheduler over all of them: one recorded order, one
            prefetch window and byte cap. Units are then named ``"chunk<i>/<FQN>"``, ``i`` being
            the root's position in the list.
        config: a :class:`PrefetchConfig`, a mapping of its fields, or None for the defaults. It is
            copied and validated again, so changing it afterwards has no effect.

    Returns:
        The scheduler, which :func:`scheduler_of` also finds from each root.

    Raises:
        TypeError: a root is not an ``FSDPModule``, or ``config`` is of another type.
        ValueError: a root is not a root FSDP2 module, the list is empty or names one module
            twice or a unit of another, no root has a unit with parameters, or a field of
            ``config`` is invalid (the message names the field and its valid values).
        RuntimeError: a scheduler is already attached to a root, or to an outer root that a
            root is a unit of.

    .. note::
        While attached, FSDP2's own prefetch is off (nothing is gathered twice);
        :meth:`PrefetchScheduler.detach` restores it. With several roots, automatic scopes are
        off: wrap each step (``schedule.step(...)``) in :meth:`PrefetchScheduler.iteration`.
    """
    roots = list(root) if isinstance(root, (list, tuple)) else [root]
    if not roots:
        raise ValueError("attach() got an empty list of roots; pass a fully_shard root module or a list of them")
    for module in roots:
        _check_root(module)
    states = [_compat.fsdp_state(m) for m in roots]
    if len(set(map(id, states))) < len(states):
        raise ValueError("attach() got the same root twice; pass each model chunk once")
    for position, module in enumerate(roots):
        inner = {id(_compat.fsdp_state(m)) for m in module.modules() if m is not module}
        if any(id(state) in inner for state in states):
            raise ValueError(
                f"attach(): root {position} ({type(module).__name__}) contains another root of the list; "
                "pass only the outermost fully_shard module of each chunk"
            )
    scheduler = PrefetchScheduler(roots, _validated(config))
    for module in roots:
        setattr(module, _ATTRIBUTE, scheduler)
    _ATTACHED.add(scheduler)
    return scheduler


def _check_root(root: Any) -> None:
    """One root as ``attach()`` needs it, and no scheduler attached to it or around it yet."""
    if not isinstance(root, FSDPModule):
        raise TypeError(
            f"attach() needs the root module returned by fully_shard (an FSDPModule), got {type(root).__name__}; "
            "apply fully_shard to each block and then to the root first"
        )
    state = _compat.fsdp_state(root)
    if state is None or _compat.is_root_initialized_as_child(state):
        raise ValueError(
            f"attach(): {type(root).__name__} is not a root FSDP2 module (FSDP2 initialized it as a child); "
            "attach to the outermost fully_shard module"
        )
    if (existing := scheduler_of(root)) is not None:
        raise RuntimeError(
            f"a PrefetchScheduler (mode={existing.mode.name}) is already attached to this {type(root).__name__}; "
            "call scheduler_of(root).detach() before attaching another"
        )
    for other in list(_ATTACHED):
        if other.attached and any(u.state_or_none() is state for u in other.units):
            raise RuntimeError("attach(): this module is a unit of a scheduler already attached to an outer root")
    if (outer := _compat.enclosing_unit(root, state)) is not None:
        raise ValueError(
            f"attach(): {type(root).__name__} is not a root FSDP2 module (it is inside a fully_shard "
            f"{type(outer).__name__}); attach to the outermost fully_shard module"
        )


def _validated(config: PrefetchConfig | Mapping[str, Any] | None) -> PrefetchConfig:
    """A private, re-validated copy: a config mutated after construction is checked again."""
    if config is None:
        return PrefetchConfig()
    if isinstance(config, Mapping):
        if unknown := sorted(set(config) - {f.name for f in dataclasses.fields(PrefetchConfig)}):
            valid = ", ".join(f.name for f in dataclasses.fields(PrefetchConfig))
            raise TypeError(f"the prefetch config has no field(s) {', '.join(map(repr, unknown))}; valid fields are {valid}")
        return PrefetchConfig(**config)
    if isinstance(config, PrefetchConfig):
        return dataclasses.replace(config)
    raise TypeError(f"the prefetch config takes a PrefetchConfig, a mapping or None, got {type(config).__name__}")


def scheduler_of(root: nn.Module) -> PrefetchScheduler | None:
    """The scheduler attached to ``root``.

    Args:
        root: a module given to :func:`attach` (or to :func:`fully_shard` with ``prefetch=``);
            every root of a multi-chunk scheduler finds the same one.

    Returns:
        Its scheduler, or None if none is attached (also after ``detach()``).
    """
    scheduler = getattr(root, _ATTRIBUTE, None)
    return scheduler if scheduler is not None and scheduler.attached else None


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    prefetch: PrefetchConfig | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Drop-in for ``torch.distributed.fsdp.fully_shard``; ``prefetch=`` on the root call attaches a scheduler.

    Args:
        module: what torch's ``fully_shard`` takes: a module, or a list of modules forming one unit.
        prefetch: on the root call only, the scheduler's config (as for :func:`attach`); None
            shards without attaching.
        **kwargs: passed to torch's ``fully_shard`` (``mesh``, ``reshard_after_forward``, ...).

    Returns:
        What torch's ``fully_shard`` returns.

    Raises:
        ValueError: ``prefetch`` is given with a list of modules, or one of its fields is
            invalid; checked before anything is sharded.
        TypeError: ``prefetch`` is not a :class:`PrefetchConfig`, a mapping or None.
        RuntimeError: as :func:`attach`.
    """
    if prefetch is not None and not isinstance(module, nn.Module):
        raise ValueError(
            "fully_shard(prefetch=...) belongs on the root call (one module); got a list of modules, "
            "which forms a grouped unit"
        )
    config = _validated(prefetch) if prefetch is not None else None  # before sharding: no half-made root
    sharded = torch_fully_shard(module, **kwargs)
    if config is not None:
        attach(sharded, config)
    return sharded
