"""Every touch of FSDP2 internals lives here, behind a torch-version guard.

FSDP2 exposes no public way to read a unit's gather state, to find its param groups, to see its
reshards as they happen or to issue a prefetch on its side streams. On a torch release outside
:data:`TESTED_TORCH` (or with ``FSDP_REPLAY_PUBLIC_API=1``) every function here takes FSDP2's
public API instead: a unit is the ``FSDPModule`` itself, a prefetch is
``unshard(async_op=True)``, and a unit is resident while its parameters are plain tensors rather
than DTensors. What that costs is said once, as a :class:`PublicAPIFallbackWarning`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from typing import Any, Callable, Iterator, Literal

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves

logger = logging.getLogger("fsdp_replay")

TESTED_TORCH = ((2, 13), (2, 14), (2, 15))
"""(major, minor) releases whose FSDP2 internals this module was checked against."""
PUBLIC_API_ENV = "FSDP_REPLAY_PUBLIC_API"
"""Set to ``1`` to use FSDP2's public API only, also on a tested release (how CI covers the fallback)."""


class PublicAPIFallbackWarning(UserWarning):
    """fsdp_replay runs on FSDP2's public API only; the message says what that loses."""


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_RELEASE = _torch_release()
INTERNALS_OK = TORCH_RELEASE in TESTED_TORCH and os.environ.get(PUBLIC_API_ENV, "") in ("", "0")
if INTERNALS_OK:
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    _IDLE_STATES = (TrainingState.IDLE, TrainingState.POST_BACKWARD)
    """Group states between uses of the unit."""
else:
    _why = (
        f"{PUBLIC_API_ENV} is set"
        if TORCH_RELEASE in TESTED_TORCH
        else f"torch {torch.__version__} is outside the tested releases "
        + ", ".join(f"{major}.{minor}" for major, minor in TESTED_TORCH)
    )
    warnings.warn(
        f"fsdp_replay: {_why}, so only FSDP2's public API is used. Still working: recording, replay, "
        "prefetch through unshard(async_op=True), divergence handling, numerics equal to plain FSDP2. "
        "Lost: keeps (a unit needed again next is gathered again), prefetch on FSDP2's side streams "
        "(on GPU the gather uses the current stream), telling FSDP2's own reshards from other calls, "
        "grouped fully_shard([a, b]) scheduled as one unit, and restoring FSDP2 prefetch lists set "
        "before attach() (detach() leaves FSDP2's defaults).",
        PublicAPIFallbackWarning,
        stacklevel=2,
    )

_NO_CONTEXT = contextlib.nullcontext()  # stateless, so one instance serves every call

if INTERNALS_OK and getattr(torch.distributed, "_is_spmd_types_available", lambda: False)():
    _fsdp_hook_context = torch.distributed._spmd_no_typecheck
    """torch 2.14+ runs FSDP2's hook bodies outside spmd type checking; the scheduler's gathers too."""
else:
    def _fsdp_hook_context() -> contextlib.AbstractContextManager:
        return _NO_CONTEXT


_public_pending: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
"""Public API only: the handle of each ``unshard(async_op=True)`` the scheduler issued, until its use."""


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state object shared by all modules of one ``fully_shard`` call (public API: the module)."""
    if not isinstance(module, FSDPModule):
        return None
    if INTERNALS_OK:
        state = _get_module_state(module)
        return state if isinstance(state, FSDPState) else None
    return module


def state_modules(state: Any) -> tuple[nn.Module, ...]:
    return tuple(state._modules) if INTERNALS_OK else (state,)


def _managed_params(module: nn.Module) -> Iterator[nn.Parameter]:
    """Public API: the parameters ``fully_shard(module)`` manages: its subtree's, less those of
    nested ``fully_shard`` modules (FSDP2's own definition of a unit's parameters)."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        for param in current.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield param
        stack.extend(child for child in current.children() if not isinstance(child, FSDPModule))


def has_params(state: Any) -> bool:
    if INTERNALS_OK:
        return bool(state._fsdp_param_groups)
    return any(True for _ in _managed_params(state))


def unsharded_bytes(state: Any) -> int:
    """Bytes of the unit's own parameters once all-gathered, in the dtype they are gathered in."""
    if not INTERNALS_OK:  # the parameters' own dtype: a mixed-precision policy is not public
        return sum(p.numel() * p.element_size() for p in _managed_params(state))
    total = 0
    for group in state._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            dtype = getattr(fsdp_param, "param_dtype", None) or fsdp_param.sharded_param.dtype
            total += fsdp_param._orig_size.numel() * dtype.itemsize
    return total


def is_root_initialized_as_child(state: Any) -> bool:
    """True once FSDP2's lazy init has decided this state is *not* the root."""
    return INTERNALS_OK and state._is_root is False


def process_group(state: Any) -> Any:
    """The process group the unit all-gathers over (what cross-rank checks must use)."""
    if INTERNALS_OK:
        return state._fsdp_param_groups[0]._all_gather_process_group if state._fsdp_param_groups else None
    for param in _managed_params(state):
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return mesh.get_group(mesh.ndim - 1)  # FSDP2 shards over the last mesh dimension
    return None


def device(state: Any) -> torch.device:
    if INTERNALS_OK:
        return state._device
    return next(_managed_params(state)).device


# --- gather state, read at demand time ---------------------------------------------------------


def demand_kind(state: Any) -> str:
    """How a demand finds the unit: ``"hits"`` (gather pending), ``"resident"`` or ``"misses"``."""
    if is_pending(state):
        if not INTERNALS_OK:
            del _public_pending[state]  # FSDP2's pre-hook waits on it now
        return "hits"
    return "resident" if is_resident(state) else "misses"


def is_pending(state: Any) -> bool:
    """An all-gather was issued and not yet waited on (public API: only the scheduler's own)."""
    if not INTERNALS_OK:
        return state in _public_pending
    groups = state._fsdp_param_groups
    if len(groups) == 1:  # the common case, without a generator per call
        return groups[0]._all_gather_result is not None
    return any(g._all_gather_result is not None for g in groups)


def is_resident(state: Any) -> bool:
    """Parameters are unsharded (no all-gather needed)."""
    if not INTERNALS_OK:  # FSDP2 registers plain tensors on the module while it is unsharded
        return not isinstance(next(_managed_params(state)), DTensor)
    return all(g.is_unsharded for g in state._fsdp_param_groups)


def is_sharded_idle(state: Any) -> bool:
    """Neither resident nor pending: a use now would have to gather."""
    return not is_pending(state) and not is_resident(state)


def in_use(state: Any) -> bool:
    """A forward or backward of the unit is running, so FSDP2 reshards it when that use ends."""
    return INTERNALS_OK and any(g._training_state not in _IDLE_STATES for g in state._fsdp_param_groups)


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
    if not INTERNALS_OK:
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


def may_gather(state: Any) -> bool:
    """False while a torch 2.15 asynchronous gradient reduction is pending.

    FSDP2's own forward refuses to run then, and the reduction's ``wait()`` drops any gather issued
    in that window, so the scheduler issues none there.
    """
    if not INTERNALS_OK:
        return True
    if getattr(state._comm_ctx, "active_gradient_reduction", None) is not None:
        return False
    return not getattr(state._state_ctx, "gradient_reduction_pending", False)


def issue_unshard(state: Any, *, backward: bool) -> None:
    """Start the unit's all-gather without waiting; FSDP2's own pre-hook waits at the point of use.

    On accelerators FSDP2's prefetch path (training state set, side streams) overlaps best; on CPU
    only ``async_op=True`` lets the gather run beside compute. The caller checks :func:`may_gather`.
    """
    if not INTERNALS_OK:
        if not is_resident(state) and state not in _public_pending:
            _public_pending[state] = state.unshard(async_op=True)
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
    with _fsdp_hook_context():
        for group in state._fsdp_param_groups:
            # What FSDPParamGroup.use_training_state does, without a generator context per gather.
            saved, group._training_state = group._training_state, training_state
            try:
                FSDPParamGroup.unshard(group, async_op=True if cpu else group.unshard_async_op)
            finally:
                group._training_state = saved


def release(state: Any) -> None:
    """Finish a pending gather and free it again, so no all-gather outlives its scope."""
    if not INTERNALS_OK:
        if (handle := _public_pending.pop(state, None)) is not None:
            handle.wait()
            state.reshard()
        return
    with _fsdp_hook_context():
        for group in state._fsdp_param_groups:
            if group._all_gather_result is not None:
                group.wait_for_unshard()
                FSDPParamGroup.reshard(group)  # the class method: our own call, not another party's


# --- FSDP2's reshards and unshards, seen as they happen ------------------------------------------

# [Note: fsdp_replay never owns FSDP2's settings]
# The user (``set_reshard_after_backward`` for gradient accumulation, ``unshard()``/``reshard()``),
# torch pipelining (``PipelineStage`` toggles reshard/sync per microbatch, the runtime's
# UNSHARD/RESHARD actions) and ``reset_iter_state`` all drive the same FSDP2 state. fsdp_replay
# therefore writes none of FSDP2's settings. To keep a unit unsharded for its next use it skips
# one *lifecycle* reshard (FSDP2's own, after a forward or a backward) at the moment FSDP2 makes
# it, and only if FSDP2 would really reshard then under whatever settings are current. Any other
# party's reshard, unshard or reset of a unit the scheduler holds hands that unit over to them:
# it leaves the window untouched by the scheduler from then on. So whoever sets a field, their
# value is the one FSDP2 acts on, and a unit ends a step sharded or not exactly as plain FSDP2
# would leave it.


OtherPartyCall = Literal["reshard", "unshard", "reset"]
"""A call on a unit's FSDP2 state made by someone other than FSDP2's lifecycle or the scheduler."""


def intercept_group_calls(
    state: Any, *, skip_lifecycle_reshard: Callable[[], bool], on_other_party: Callable[[OtherPartyCall], None]
) -> bool:
    """Shadow FSDP2's per-group lifecycle methods with instance attributes that report to the scheduler.

    ``skip_lifecycle_reshard()`` is asked when FSDP2's own post-forward or post-backward is about
    to reshard the group (only where its current settings make that a real reshard); True skips
    it. ``on_other_party(call)`` is told of every ``reshard``, ``unshard`` or ``_reset_iter_state``
    that is neither FSDP2's forward/backward lifecycle nor the scheduler's own (which calls the
    class methods directly). See [Note: fsdp_replay never owns FSDP2's settings].
    False where FSDP2's internals are not available.
    """
    if not INTERNALS_OK:
        return False
    for group in state._fsdp_param_groups:
        _intercept_group(state, group, skip_lifecycle_reshard, on_other_party)
    return True


_INTERCEPTED = ("post_forward", "post_backward", "reshard", "unshard", "_reset_iter_state")


def _intercept_group(
    state: Any,
    group: Any,
    skip_lifecycle_reshard: Callable[[], bool],
    on_other_party: Callable[[OtherPartyCall], None],
) -> None:
    cls = type(group)  # FSDP2's methods are looked up at call time, so a later patch of the class still runs
    in_lifecycle = [False]  # inside FSDP2's post_forward/post_backward of this group

    def lifecycle(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            in_lifecycle[0] = True
            try:
                return getattr(cls, name)(group, *args)
            finally:
                in_lifecycle[0] = False

        return call

    def reshard() -> None:
        if in_lifecycle[0]:
            # After a forward FSDP2 reshards only while post_forward_mesh_info is set; after a
            # backward it calls reshard only while reshard_after_backward holds.
            real = group._training_state is not TrainingState.FORWARD or group.post_forward_mesh_info is not None
            if real and skip_lifecycle_reshard():
                return
        else:
            on_other_party("reshard")
        cls.reshard(group)

    def unshard(async_op: bool = False) -> None:
        # FSDP2's own unshards come from pre-forward, pre-backward and recompute, when the unit's
        # state is FORWARD or PRE_BACKWARD; from an idle unit it is someone else's call.
        if state._training_state is TrainingState.IDLE:
            on_other_party("unshard")
        cls.unshard(group, async_op)

    def reset_iter_state() -> None:
        on_other_party("reset")
        cls._reset_iter_state(group)

    group.post_forward, group.post_backward = lifecycle("post_forward"), lifecycle("post_backward")
    group.reshard, group.unshard, group._reset_iter_state = reshard, unshard, reset_iter_state


def stop_intercepting_group_calls(state: Any) -> None:
    for group in state._fsdp_param_groups if INTERNALS_OK else ():
        for name in _INTERCEPTED:
            group.__dict__.pop(name, None)


def reshard_if_idle(state: Any) -> None:
    """Do the reshard a keep skipped, now that its next use will not come (scope end, divergence).

    A unit mid-use is left to FSDP2's own reshard at the end of that use, and so is one whose
    gradients torch 2.15's manual backward finalization has not reduced yet (FSDP2 reshards it
    when it finalizes).
    """
    with _fsdp_hook_context():
        for group in state._fsdp_param_groups:
            pending_reduction = getattr(group, "_post_backward_pending", False)
            if group._training_state in _IDLE_STATES and group.is_unsharded and not pending_reduction:
                FSDPParamGroup.reshard(group)  # the class method: our own call, not another party's


def intercept_backward_end(state: Any, on_backward_end: Callable[[], None]) -> bool:
    """Call ``on_backward_end`` right after FSDP2's root post-backward callback, whoever runs it.

    FSDP2 queues that callback once per backward on the outermost graph task (a reentrant
    checkpoint's nested backward finds it queued already); torch pipelining calls it directly when
    a stage finalizes its gradients. Shadowing it on every state under the root (any of them may
    queue it) makes the scheduler's end of backward FSDP2's own. False without FSDP2's internals.
    """
    if not INTERNALS_OK:
        return False
    fsdp_callback = state._root_post_backward_final_callback

    def root_post_backward_final_callback() -> None:
        fsdp_callback()
        on_backward_end()

    state._root_post_backward_final_callback = root_post_backward_final_callback
    return True


def stop_intercepting_backward_end(state: Any) -> None:
    state.__dict__.pop("_root_post_backward_final_callback", None)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current autograd graph task ends (public-fallback end of backward)."""
    Variable._execution_engine.queue_callback(callback)


# --- FSDP2's own prefetch, turned off while attached ----------------------------------------


def disable_own_prefetch(state: Any) -> tuple[Any, Any]:
    """Turn FSDP2's own prefetch off: no explicit lists, and a backward list holding the unit itself
    (which turns the implicit backward prefetch off too).

    Returns ``(saved, installed)`` for :func:`restore_own_prefetch`.
    """
    if not INTERNALS_OK:  # the lists cannot be read publicly: detach() leaves FSDP2's defaults
        state.set_modules_to_forward_prefetch([])
        state.set_modules_to_backward_prefetch([state])
        return None, None
    saved = (state._states_to_forward_prefetch, state._states_to_backward_prefetch)
    installed: tuple[list[Any], list[Any]] = ([], [state])
    state._states_to_forward_prefetch, state._states_to_backward_prefetch = installed
    return saved, installed


def restore_own_prefetch(state: Any, saved: Any, installed: Any) -> None:
    """Put back each list the scheduler replaced, unless someone set a list of their own since.

    FSDP2's setters assign a new list, so identity tells whether ours is still there.
    See [Note: fsdp_replay never owns FSDP2's settings].
    """
    if not INTERNALS_OK:
        state.set_modules_to_forward_prefetch([])
        state.set_modules_to_backward_prefetch([])
        return
    if state._states_to_forward_prefetch is installed[0]:
        state._states_to_forward_prefetch = saved[0]
    if state._states_to_backward_prefetch is installed[1]:
        state._states_to_backward_prefetch = saved[1]


def ensure_lazy_init(root_state: Any) -> None:
    """Run FSDP2's root lazy init (idempotent) so gathers can be issued before the first forward."""
    if INTERNALS_OK:
        root_state._lazy_init()


def reset_iter_state(root: nn.Module) -> None:
    """FSDP2's recovery after an exception aborted a forward or backward mid-flight."""
    if not INTERNALS_OK:
        root.reset_iter_state()
        return
    state = fsdp_state(root)
    if state is None or not state._is_root:
        return
    root.reset_iter_state()
    if TORCH_RELEASE >= (2, 15):
        return  # torch 2.15's reset clears sharded and unsharded gradients itself
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
    return _NO_CONTEXT




def grad_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Tensors in an (args, kwargs, output) structure that autograd will send gradients to."""
    if isinstance(tree, torch.Tensor):  # the common module output: skip pytree
        if tree.requires_grad:
            yield tree
        return
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            yield leaf

