"""FSDP2's public API only: what the fallback reads and holds in place of FSDP2's internals.

Without the internals a unit is the ``FSDPModule`` itself, a prefetch is
``unshard(async_op=True)`` whose handle is kept here until its use, and a unit is resident while
its parameters are plain tensors rather than DTensors.
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


def issue_unshard(module: Any) -> None:
    if not is_resident(module) and module not in pending:
        pending[module] = module.unshard(async_op=True)


def release(module: Any) -> None:
    if (handle := pending.pop(module, None)) is not None:
        handle.wait()
        module.reshard()
