"""Every touch of FSDP2 internals lives here, behind a torch-version guard.

FSDP2 exposes no public way to read a unit's gather state, to find its param groups or to
issue a prefetch on its side streams. Outside the tested torch range the scheduler still works
through the public ``FSDPModule.unshard(async_op=True)``/``reshard()`` path, but cannot classify
demands precisely, so it warns once.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

logger = logging.getLogger("fsdp_replay")

TESTED_TORCH = ((2, 13),)
"""(major, minor) releases whose FSDP2 internals this module was checked against."""


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


INTERNALS_OK = _torch_release() in TESTED_TORCH
if INTERNALS_OK:
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
else:  # pragma: no cover - exercised only on untested torch releases
    logger.warning(
        "fsdp_replay: torch %s is outside the tested releases %s; using the public FSDP2 API only "
        "(prefetch still works, hit/miss classification is approximate)",
        torch.__version__,
        TESTED_TORCH,
    )


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state object shared by all modules of one ``fully_shard`` call."""
    if not isinstance(module, FSDPModule):
        return None
    if INTERNALS_OK:
        state = _get_module_state(module)
        return state if isinstance(state, FSDPState) else None
    return module  # pragma: no cover


def state_modules(state: Any) -> tuple[nn.Module, ...]:
    return tuple(state._modules) if INTERNALS_OK else (state,)


def param_groups(state: Any) -> list[Any]:
    return list(state._fsdp_param_groups) if INTERNALS_OK else []


def has_params(state: Any) -> bool:
    if INTERNALS_OK:
        return bool(state._fsdp_param_groups)
    return any(True for _ in state.parameters(recurse=False))  # pragma: no cover


def unsharded_bytes(state: Any) -> int:
    """Bytes of the unit's own parameters once all-gathered, in the dtype they are gathered in."""
    total = 0
    for group in param_groups(state):
        for fsdp_param in group.fsdp_params:
            dtype = getattr(fsdp_param, "param_dtype", None) or fsdp_param.sharded_param.dtype
            total += fsdp_param._orig_size.numel() * dtype.itemsize
    return total


def is_root_initialized_as_child(state: Any) -> bool:
    """True once FSDP2's lazy init has decided this state is *not* the root."""
    return INTERNALS_OK and state._is_root is False


def process_group(state: Any) -> Any:
    """The process group the unit all-gathers over (what cross-rank checks must use)."""
    if INTERNALS_OK and state._fsdp_param_groups:
        return state._fsdp_param_groups[0]._all_gather_process_group
    return None


def device(state: Any) -> torch.device:
    if INTERNALS_OK:
        return state._device
    return next(state.parameters()).device  # pragma: no cover


# --- gather state, read at demand time ---------------------------------------------------------


def demand_kind(state: Any) -> str:
    """How a demand finds the unit: ``"hits"`` (gather pending), ``"resident"`` or ``"misses"``."""
    if is_pending(state):
        return "hits"
    return "resident" if is_resident(state) else "misses"


def is_pending(state: Any) -> bool:
    """An all-gather was issued and not yet waited on."""
    if not INTERNALS_OK:
        return False  # pragma: no cover
    groups = state._fsdp_param_groups
    if len(groups) == 1:  # the common case, without a generator per call
        return groups[0]._all_gather_result is not None
    return any(g._all_gather_result is not None for g in groups)


def is_resident(state: Any) -> bool:
    """Parameters are unsharded (no all-gather needed)."""
    return INTERNALS_OK and all(g.is_unsharded for g in state._fsdp_param_groups)


def is_sharded_idle(state: Any) -> bool:
    """Neither resident nor pending: a use now would have to gather."""
    return not is_pending(state) and not is_resident(state)


def opens_forward(state: Any) -> bool:
    """Whether this pre-forward starts a new forward pass of the unit (grouped units fire per module)."""
    return not INTERNALS_OK or state._training_state != TrainingState.FORWARD


def in_pre_backward(state: Any) -> bool:
    return INTERNALS_OK and state._training_state == TrainingState.PRE_BACKWARD


def completes_forward(state: Any, module: nn.Module) -> bool:
    """Whether FSDP2's post-forward for ``module`` is the full one (reshard + pre-backward hooks).

    A grouped ``fully_shard([a, b])`` finishes its forward only on the last module to run.
    """
    if not INTERNALS_OK or len(state._modules) == 1:
        return True
    pending = state._modules_to_run_forward
    return len(pending) == 1 and module in pending


def report_pre_backward(state: Any, on_backward_use: Callable[[], None]) -> bool:
    """Call ``on_backward_use`` just before FSDP2's pre-backward gathers the unit for a backward use.

    FSDP2 registers ``state._pre_backward`` as a tensor hook on every grad-requiring output in its
    post-forward; an instance attribute shadows that method, so the hook it registers is this
    wrapper and no second tensor hook per output is needed. A backward use starts when a param
    group is not already in pre-backward (FSDP2's own test for a no-op). False where FSDP2's
    internals are not available: the caller then hooks the outputs itself.
    """
    if not INTERNALS_OK:  # pragma: no cover
        return False
    fsdp_pre_backward = type(state)._pre_backward.__get__(state)
    groups = state._fsdp_param_groups

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        if any(g._training_state != TrainingState.PRE_BACKWARD for g in groups):
            on_backward_use()
        return fsdp_pre_backward(grad)

    state._pre_backward = pre_backward
    return True


def stop_reporting_pre_backward(state: Any) -> None:
    state.__dict__.pop("_pre_backward", None)


def graph_task_id() -> int:
    """The running autograd graph task, or -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Inside an autograd graph task: a forward here is activation-checkpoint recompute."""
    return graph_task_id() != -1


# --- issuing and releasing all-gathers --------------------------------------------------------


def issue_unshard(state: Any, *, backward: bool) -> None:
    """Start the unit's all-gather without waiting; FSDP2's own pre-hook waits at the point of use.

    On accelerators FSDP2's prefetch path (training state set, side streams) overlaps best; on CPU
    only ``async_op=True`` lets the gather run beside compute.
    """
    if not INTERNALS_OK:  # pragma: no cover
        state.unshard(async_op=True)
        return
    cpu = state._device.type == "cpu"
    if not cpu:
        # Issued outside FSDP2's root pre-forward (e.g. right after optimizer.step()), so the
        # side streams must first see the current stream's writes to the sharded parameters.
        current = state._device_handle.current_stream()
        for name in ("all_gather_copy_in_stream", "all_gather_stream"):
            if (stream := getattr(state._comm_ctx, name, None)) is not None:
                stream.wait_stream(current)
    training_state = TrainingState.PRE_BACKWARD if backward else TrainingState.FORWARD
    for group in state._fsdp_param_groups:
        # What FSDPParamGroup.use_training_state does, without a generator context per gather.
        saved, group._training_state = group._training_state, training_state
        try:
            group.unshard(async_op=True if cpu else group.unshard_async_op)
        finally:
            group._training_state = saved


def release(state: Any) -> None:
    """Finish a pending gather and free it again, so no all-gather outlives its scope."""
    if not INTERNALS_OK:  # pragma: no cover
        return
    for group in state._fsdp_param_groups:
        if group._all_gather_result is not None:
            group.wait_for_unshard()
            group.reshard()


def keep_unsharded(state: Any) -> Any:
    """Skip the unit's next reshard (after its forward or its backward), so its next use gathers nothing.

    Returns what :func:`stop_keeping` restores, or None where FSDP2's internals are not available.
    """
    if not INTERNALS_OK:  # pragma: no cover
        return None
    saved = []
    for group in state._fsdp_param_groups:
        saved.append((group.post_forward_mesh_info, group.reshard_after_backward))
        # FSDP2 reshards after forward only while post_forward_mesh_info is set.
        group.post_forward_mesh_info = None
        group.reshard_after_backward = False
    return saved


def stop_keeping(state: Any, saved: Any, *, reshard_now: bool) -> None:
    """Restore the reshard settings; with ``reshard_now``, also free a kept unit no longer in use.

    A unit mid-use (forward or backward still running) is left to FSDP2's own reshard at its end.
    """
    for group, (post_forward_mesh_info, reshard_after_backward) in zip(state._fsdp_param_groups, saved):
        group.post_forward_mesh_info = post_forward_mesh_info
        group.reshard_after_backward = reshard_after_backward
        idle = group._training_state in (TrainingState.IDLE, TrainingState.POST_BACKWARD)
        if reshard_now and idle and group.is_unsharded:
            group.reshard()


# --- FSDP2's own prefetch, turned off while attached ----------------------------------------


def own_prefetch_lists(state: Any) -> tuple[list[Any], list[Any]]:
    return list(state._states_to_forward_prefetch), list(state._states_to_backward_prefetch)


def disable_own_prefetch(state: Any) -> None:
    """No explicit lists; a backward list holding the unit itself turns the implicit one off too."""
    state._states_to_forward_prefetch = []
    state._states_to_backward_prefetch = [state]


def restore_own_prefetch(state: Any, saved: tuple[list[Any], list[Any]]) -> None:
    state._states_to_forward_prefetch, state._states_to_backward_prefetch = (list(s) for s in saved)


def ensure_lazy_init(root_state: Any) -> None:
    """Run FSDP2's root lazy init (idempotent) so gathers can be issued before the first forward."""
    if INTERNALS_OK:
        root_state._lazy_init()


def reset_iter_state(root: nn.Module) -> None:
    """FSDP2's recovery after an exception aborted a forward or backward mid-flight."""
    state = fsdp_state(root)
    if state is None or not getattr(state, "_is_root", None):
        return
    root.reset_iter_state()
    if INTERNALS_OK:
        # Autograd may already have written .grad to unsharded parameters of units that stay
        # unsharded (the root); reset_iter_state leaves it, so the next backward would add to it.
        for unit_state in state._state_ctx.all_states:
            for group in unit_state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    if (unsharded := getattr(fsdp_param, "_unsharded_param", None)) is not None:
                        unsharded.grad = None


def trace(*label: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range, opened only while a profiler runs: one costs ~20 µs otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(" ".join(label))
    return _NO_TRACE


_NO_TRACE = contextlib.nullcontext()  # stateless, so one instance serves every untraced call


def grad_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Tensors in an (args, kwargs, output) structure that autograd will send gradients to."""
    if isinstance(tree, torch.Tensor):  # the common module output: skip pytree
        if tree.requires_grad:
            yield tree
        return
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            yield leaf

