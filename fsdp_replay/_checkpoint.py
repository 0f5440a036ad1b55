"""The recorded orders in a checkpoint, with what they were recorded on.

An order names units by FQN and says which demands needed a gather; it is only valid for the same
units with the same parameters, sharded over the same world and mesh, under the same torch
release (FSDP2's behaviour, and so the order, may differ between releases). A checkpoint that
differs in any of these is dropped with one line that says what changed, and recorded again:
a resumed run must not stop for a stale prefetch order.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch.distributed as dist

from fsdp_replay import _compat
from fsdp_replay._order import RecordedOrders
from fsdp_replay._units import Unit

logger = logging.getLogger("fsdp_replay")

VERSION = 2
"""2 adds the signature of what the orders were recorded on; 1 is still read."""


def save(orders: RecordedOrders, units: Sequence[Unit]) -> dict[str, Any]:
    return {"version": VERSION, "orders": orders.to_state(), "signature": signature(units)}


def load(state: dict[str, Any], orders: RecordedOrders, units: Sequence[Unit]) -> None:
    """Install the valid orders of ``state`` into ``orders``, saying what was left out and why.

    Raises:
        ValueError: the version is not supported, or an entry is malformed (``orders`` unchanged).
    """
    if not isinstance(state, Mapping):
        raise ValueError(
            f"load_state_dict() takes what PrefetchScheduler.state_dict() returned (a dict), got {type(state).__name__}"
        )
    if state.get("version") not in (1, VERSION):
        raise ValueError(
            f"fsdp_replay state_dict version {state.get('version')!r} is not supported (expected 1 or {VERSION})"
        )
    saved = state.get("orders")
    if not isinstance(saved, Mapping) or not isinstance(state.get("signature", {}), Mapping):
        raise ValueError(
            "fsdp_replay state_dict: 'orders' must be a dict of key -> order and 'signature' (if given) a dict, "
            f"got orders={type(saved).__name__}, signature={type(state.get('signature')).__name__}"
        )
    if "signature" in state and (change := what_changed(state["signature"], signature(units))):
        logger.warning(
            "fsdp_replay: the checkpoint's recorded orders (%s) are for another setup (%s); they are "
            "dropped and recorded again", ", ".join(map(repr, saved)) or "none", change
        )
        saved = {}
    for key, why in orders.load_state(saved, {unit.fqn: unit for unit in units}).items():
        logger.warning("fsdp_replay: dropped the checkpoint's order of %r (%s); it is recorded again", key, why)


def signature(units: Sequence[Unit]) -> dict[str, Any]:
    """The setup the scheduler's orders are recorded on, in a picklable form."""
    params = {unit.fqn: _compat.sharded_params(unit.state) for unit in units}
    first = next((p for unit_params in params.values() for p in unit_params), None)
    return {
        "units": {fqn: [(tuple(p.shape), str(p.dtype)) for p in unit_params] for fqn, unit_params in params.items()},
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "mesh_shape": tuple(first.device_mesh.shape) if first is not None and hasattr(first, "device_mesh") else (),
        "torch": ".".join(map(str, _compat.TORCH_RELEASE)),
    }


def what_changed(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """How the setup of ``saved`` differs from ``current``, in a few words; None if it does not."""
    changes = [
        f"{label} {saved.get(field)} -> {current[field]}"
        for field, label in (("world_size", "world size"), ("mesh_shape", "mesh shape"), ("torch", "torch"))
        if _plain(saved.get(field)) != _plain(current[field])
    ]
    saved_units, current_units = saved.get("units", {}), current["units"]
    if removed := [fqn for fqn in saved_units if fqn not in current_units]:
        changes.append(f"units no longer in the model: {_few(removed)}")
    if added := [fqn for fqn in current_units if fqn not in saved_units]:
        changes.append(f"new units: {_few(added)}")
    if reshaped := [fqn for fqn in current_units if fqn in saved_units and _plain(saved_units[fqn]) != _plain(current_units[fqn])]:
        changes.append(f"parameters of {_few(reshaped)} changed shape or dtype")
    return "; ".join(changes) or None


def _few(names: list[str]) -> str:
    """The first three names, and `` ...`` if there are more: a change stays one short line."""
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def _plain(value: Any) -> Any:
    """Tuples and lists compare equal after a round trip through a checkpoint format."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
