"""FSDP2 instrumentation for the benchmark only: gathers issued, their issue and copy-out time,
reduce-scatter time, peak unsharded bytes, and the sequence of collectives a step issues.

The exposed all-gather wait is not measured here: the benchmark takes it from the package's own
``fsdp_replay.WaitMeter``, one per contender (``bench_measure``). What is left has no public hook
in FSDP2, so the benchmark wraps three FSDP2 internals while :meth:`FSDPProbe.installed` is
active, and restores them on exit. That is acceptable in a measurement harness; the product
(``fsdp_replay``) patches only instances, never FSDP2's classes. Install the probe before any
contender is built: the scheduler's and the meter's instance wrappers call ``unshard`` as it was
when they were installed.

- ``FSDPParamGroup.unshard``: counts the gathers FSDP2 issues (and logs them); an ``async_op=True``
  gather only launches there (copy-in), timed as issue cost. ``wait_for_unshard`` only samples the
  unsharded bytes.
- ``foreach_all_gather_copy_out`` (as imported by ``_fsdp_param_group``): it starts with the
  ``Work.wait()`` of an async gather; we wait first, untimed (the meter times it where a use
  blocks), so ``copy_out_s`` is the copy alone.
- ``foreach_reduce`` (as imported by ``_fsdp_param_group``): the post-backward reduce-scatter, which
  is synchronous on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable_state import _get_module_state
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_param_group
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from fsdp_replay._compat.state import param_groups


@dataclass
class StepCounters:
    """What the probe saw during one step on this rank (seconds, bytes, counts)."""

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
                for group in param_groups(_get_module_state(module)):
                    groups[id(group)] = (group, _unsharded_bytes(group))
        self._groups = list(groups.values())
        self.step = StepCounters()

    def take(self) -> StepCounters:
        step, self.step = self.step, StepCounters()
        return step

    # --- events --------------------------------------------------------------------------------

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
            if group._all_gather_result.all_gather_work is not None:
                probe.step.issue_s += seconds  # async: launched only (a synchronous one is a wait: the meter's)
            probe._sample()

        @functools.wraps(orig_wait)
        def wait_for_unshard(group: FSDPParamGroup) -> None:
            orig_wait(group)
            probe._sample()

        @functools.wraps(orig_copy_out)
        def copy_out(result: Any, fsdp_params: Any, group: Any, **kwargs: Any) -> None:  # 2.15 adds a keyword
            work = result.all_gather_work
            if isinstance(work, dist.distributed_c10d.Work):
                work.wait()  # not copy-out; the original waits again: a no-op on a completed Work
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
            for group in param_groups(_get_module_state(module)):
                seen[id(group)] = _unsharded_bytes(group)
    return list(seen.values())
