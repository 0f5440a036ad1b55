"""FSDP2's public API only: what the fallback reads and holds in place of FSDP2's internals.

Without the internals a unit is the ``FSDPModule`` itself, a prefetch is
``unshard(async_op=True)`` whose handle is kept here until its use, and a unit is resident while
its parameters are plain tensors rather than DTensors.

[Note: the public fallback prefetches on the host only]
FSDP2's public ``unshard(async_op=True)`` runs its copy-in and all-gather on the *current* stream:
on an accelerator that serializes each prefetch with compute, and replay made steps 1.11-1.12x
slower than plain FSDP2 on an H200 (static 1.03-1.09x; issue 24). So on an accelerator the
fallback issues no gather of its own and leaves FSDP2's own prefetch (its side streams) on; only
on the host, where ``async_op=True`` is what lets a gather overlap at all, does it prefetch.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

pending: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
"""The handle of each ``unshard(async_op=True)`` the scheduler issued, until its use."""


def managed_params(module: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters ``fully_shard(module)`` manages: its subtree's, less those of nested
    ``fully_shard`` modules (FSDP2's own definition of a unit's parameters)."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        for param in current.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield param
        stack.extend(child for child in current.children() if not isinstance(child, FSDPModule))


def is_resident(module: nn.Module) -> bool:
    """FSDP2 registers plain tensors on the module while it is unsharded, DTensors while sharded."""
    return not isinstance(next(managed_params(module)), DTensor)


def process_group(module: nn.Module) -> Any:
    for param in managed_params(module):
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return mesh.get_group(mesh.ndim - 1)  # FSDP2 shards over the last mesh dimension
    return None


def prefetches(module: nn.Module) -> bool:
    """Whether the fallback issues gathers for this unit; see [Note: the public fallback prefetches on the host only]."""
    param = next(managed_params(module), None)
    return param is None or param.device.type == "cpu"


def issue_unshard(module: Any, *, use_now: bool) -> None:
    """Start the unit's gather; ``use_now``: its use starts next, and FSDP2's own pre-hook waits on
    it then, so no handle is kept (one kept would make the unit's next demand a false hit, and
    would keep the module alive if that demand never came)."""
    if is_resident(module) or module in pending or not prefetches(module):
        return
    handle = module.unshard(async_op=True)
    if not use_now:
        pending[module] = handle


def release(module: Any) -> None:
    if (handle := pending.pop(module, None)) is not None:
        handle.wait()
        module.reshard()
