"""FSDP2 instrumentation for the benchmark only: time blocked on parameters, reduce-scatter time,
peak unsharded bytes, and the sequence of collectives a step issues.

FSDP2 has no public hook for "how long did this unit wait for its all-gather". The benchmark
therefore wraps three FSDP2 internals while :meth:`FSDPProbe.installed` is active, and restores
them on exit. That is acceptable in a measurement harness; the product (``fsdp_replay``) never
patches FSDP2.

- ``FSDPParamGroup.unshard``: an ``async_op=False`` gather (plain FSDP2's default on CPU, also for
  its backward prefetch) blocks the compute thread for the whole collective: all of it is exposed
  wait. An ``async_op=True`` gather only launches (copy-in): counted as issue cost, not wait.
- ``foreach_all_gather_copy_out`` (as imported by ``_fsdp_param_group``): the ``Work.wait()`` of an
  async gather happens at its start; we wait first, timed, so the wait and the copy-out are split.
- ``foreach_reduce`` (as imported by ``_fsdp_param_group``): the post-backward reduce-scatter, which
  is synchronous on CPU.

Exposed all-gather wait of a step = blocking gathers + waits on async gathers.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable_state import _get_module_state
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


@dataclass
class StepCounters:
    """What the probe saw during one step on this rank (seconds, bytes, counts)."""

    exposed_gather_s: float = 0.0
    """Compute thread blocked on an all-gather: synchronous gathers plus waits on async ones."""
    first_exposed_s: float = 0.0
    """The part of ``exposed_gather_s`` spent on the step's first gather (it cannot be hidden)."""
    issue_s: float = 0.0
    """Launching async all-gathers (copy-in); CPU time, not waiting."""
    copy_out_s: float = 0.0
    """Copying gathered data into the unsharded parameters (CPU time on the compute thread)."""
    reduce_scatter_s: float = 0.0
    """Post-backward reduce-scatters (synchronous on CPU, so fully exposed)."""
    gathers: int = 0
    """All-gathers actually issued."""
    reduce_scatters: int = 0
    peak_unsharded_bytes: int = 0
    """Maximum, over the step, of the bytes of units that are unsharded or have a gather pending."""
    exposures: list[tuple[str, float]] = field(default_factory=list)
    """``(unit fqn, seconds)`` of every exposed gather, in order: where the wait is."""
    _seen_exposure: bool = field(default=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_seen_exposure")
        return d


class FSDPProbe:
    """Counts what FSDP2 does for the model passed to :meth:`track`; one probe per process."""

    def __init__(self) -> None:
        self.step = StepCounters()
        self.comm_log: list[tuple[str, int, Any]] | None = None
        """When a list, every collective is appended as ``(kind, unsharded numel, dtype)``."""
        self._groups: list[tuple[FSDPParamGroup, int]] = []

    def track(self, model: nn.Module) -> None:
        """Sample peak bytes over ``model``'s param groups; reset the step counters."""
        groups: dict[int, tuple[FSDPParamGroup, int]] = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in _get_module_state(module)._fsdp_param_groups:
                    groups[id(group)] = (group, _unsharded_bytes(group))
        self._groups = list(groups.values())
        self.step = StepCounters()

    def take(self) -> StepCounters:
        step, self.step = self.step, StepCounters()
        return step

    # --- events --------------------------------------------------------------------------------

    def _exposed(self, group: FSDPParamGroup | None, seconds: float) -> None:
        self.step.exposed_gather_s += seconds
        name = (group._module_fqn or "<root>") if group is not None else "?"
        self.step.exposures.append((name, seconds))
        if not self.step._seen_exposure:
            self.step._seen_exposure = True
            self.step.first_exposed_s = seconds

    def _owner(self, fsdp_params: Any) -> FSDPParamGroup | None:
        for group, _ in self._groups:
            if group.fsdp_params is fsdp_params:
                return group
        return None

    def _sample(self) -> None:
        live = sum(b for g, b in self._groups if g.is_unsharded or g._all_gather_result is not None)
        if live > self.step.peak_unsharded_bytes:
            self.step.peak_unsharded_bytes = live

    def _log(self, kind: str, group: FSDPParamGroup) -> None:
        if self.comm_log is not None:
            world = group._all_gather_process_group.size()
            numel = sum(p._sharded_param_data.numel() for p in group.fsdp_params) * world
            self.comm_log.append((kind, numel, group.fsdp_params[0]._sharded_param_data.dtype))

    # --- patching ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[FSDPProbe]:
        probe = self
        orig_unshard = FSDPParamGroup.unshard
        orig_wait = FSDPParamGroup.wait_for_unshard
        orig_copy_out = fsdp_param_group.foreach_all_gather_copy_out
        orig_reduce = fsdp_param_group.foreach_reduce

        @functools.wraps(orig_unshard)
        def unshard(group: FSDPParamGroup, async_op: bool = False) -> None:
            idle = group._all_gather_result is None and not group.is_unsharded
            start = time.perf_counter()
            orig_unshard(group, async_op)
            seconds = time.perf_counter() - start
            if not idle or group._all_gather_result is None:
                return  # FSDP2 declined: already pending/unsharded, or no unshard in backward
            probe.step.gathers += 1
            probe._log("AG", group)
            if group._all_gather_result.all_gather_work is None:
                probe._exposed(group, seconds)  # synchronous: the whole collective ran on this thread
            else:
                probe.step.issue_s += seconds
            probe._sample()

        @functools.wraps(orig_wait)
        def wait_for_unshard(group: FSDPParamGroup) -> None:
            orig_wait(group)
            probe._sample()

        @functools.wraps(orig_copy_out)
        def copy_out(result: Any, fsdp_params: Any, group: Any, **kwargs: Any) -> None:  # 2.15 adds a keyword
            work = result.all_gather_work
            if isinstance(work, dist.distributed_c10d.Work):
                start = time.perf_counter()
                work.wait()  # the original waits again: a no-op on a completed Work
                probe._exposed(probe._owner(fsdp_params), time.perf_counter() - start)
            start = time.perf_counter()
            orig_copy_out(result, fsdp_params, group, **kwargs)
            probe.step.copy_out_s += time.perf_counter() - start

        @functools.wraps(orig_reduce)
        def reduce(fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = orig_reduce(fsdp_params, *args, **kwargs)
            probe.step.reduce_scatter_s += time.perf_counter() - start
            probe.step.reduce_scatters += 1
            if probe.comm_log is not None:
                group = args[1] if len(args) > 1 else kwargs.get("reduce_scatter_group")
                world = group.size() if group is not None else 1
                numel = sum(p._sharded_param_data.numel() for p in fsdp_params) * world
                probe.comm_log.append(("RS", numel, fsdp_params[0]._sharded_param_data.dtype))
            return out

        FSDPParamGroup.unshard = unshard
        FSDPParamGroup.wait_for_unshard = wait_for_unshard
        fsdp_param_group.foreach_all_gather_copy_out = copy_out
        fsdp_param_group.foreach_reduce = reduce
        try:
            yield self
        finally:
            FSDPParamGroup.unshard = orig_unshard
            FSDPParamGroup.wait_for_unshard = orig_wait
            fsdp_param_group.foreach_all_gather_copy_out = orig_copy_out
            fsdp_param_group.foreach_reduce = orig_reduce


def _unsharded_bytes(group: FSDPParamGroup) -> int:
    return sum(p._orig_size.numel() * p._sharded_param_data.dtype.itemsize for p in group.fsdp_params)


def unit_bytes(model: nn.Module) -> list[int]:
    """Unsharded bytes of every param group of ``model`` (one entry per unit here)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in _get_module_state(module)._fsdp_param_groups:
                seen[id(group)] = _unsharded_bytes(group)
    return list(seen.values())
