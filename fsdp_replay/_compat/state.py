"""Reads of FSDP2 state: which units exist, their sizes, and how a unit stands at a demand."""

from __future__ import annotations

import enum
import operator
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from fsdp_replay._compat import public
from fsdp_replay._compat.guard import INTERNALS_OK, TORCH_RELEASE
from fsdp_replay.stats import Demand

if INTERNALS_OK:
    from torch.distributed._composable_state import _get_module_state, _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from fsdp_replay._compat.guard import IDLE_STATES


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state object shared by all modules of one ``fully_shard`` call (public API: the module)."""
    if not isinstance(module, FSDPModule):
        return None
    if INTERNALS_OK:
        state = _get_module_state(module)
        return state if isinstance(state, FSDPState) else None
    return module


if TORCH_RELEASE >= (2, 12):
    param_groups: Callable[[Any], Sequence[Any]] = operator.attrgetter("_fsdp_param_groups")
    """FSDP2's param groups of a state, in order: FSDP2's own list (do not modify it)."""
else:

    def param_groups(state: Any) -> Sequence[Any]:
        """FSDP2's param groups of a state: torch 2.11 holds at most one, ``_fsdp_param_group``."""
        group = state._fsdp_param_group
        return () if group is None else (group,)


def state_modules(state: Any) -> tuple[nn.Module, ...]:
    return tuple(state._modules) if INTERNALS_OK else (state,)


def has_params(state: Any) -> bool:
    if INTERNALS_OK:
        return bool(param_groups(state))
    return any(True for _ in public.managed_params(state))


def fsdp_params(state: Any) -> Iterator[Any]:
    """FSDP2's record (``FSDPParam``) of each of the unit's own parameters, group by group."""
    for group in param_groups(state):
        yield from group.fsdp_params


def unsharded_bytes(state: Any) -> int:
    """Bytes of the unit's own parameters once all-gathered, in the dtype they are gathered in."""
    if not INTERNALS_OK:  # the parameters' own dtype: a mixed-precision policy is not public
        return sum(p.numel() * p.element_size() for p in public.managed_params(state))
    return sum(
        fp._orig_size.numel() * _gathered_dtype(group, fp).itemsize
        for group in param_groups(state)
        for fp in group.fsdp_params
    )


def _gathered_dtype(group: Any, fp: Any) -> torch.dtype:
    """The dtype FSDP2 all-gathers a parameter in. Its lazy init sets ``param_dtype`` (None: no cast);
    before it, the mixed-precision policy says what it will set (a scheduler attached at
    ``fully_shard`` time counted bf16 gathers in fp32 bytes, letting half the units a byte cap allows)."""
    if hasattr(fp, "param_dtype"):
        return fp.param_dtype or fp.sharded_param.dtype
    policy = getattr(fp, "mp_policy", None) or group.mp_policy  # per parameter from torch 2.15
    dtype = fp.sharded_param.dtype
    return policy.param_dtype if policy.param_dtype is not None and dtype.is_floating_point else dtype


def sharded_params(state: Any) -> list[Any]:
    """The unit's own parameters as FSDP2 holds them between uses: DTensors with the full shape."""
    if not INTERNALS_OK:
        return list(public.managed_params(state))
    return [fsdp_param.sharded_param for fsdp_param in fsdp_params(state)]


def param_versions(state: Any) -> int:
    """The version counters of the unit's sharded parameters and of their local shards, summed.

    Every in-place change made through autograd's view of a parameter raises it:
    ``load_state_dict``, DCP's ``set_model_state_dict``, an update under ``torch.no_grad()``, an
    optimizer (a step is also seen by its own hook). A change made through ``.data`` or by a
    ``torch._foreach_*`` in-place op on the DTensors bumps no counter (torch 2.13), so it is not
    seen. (An in-place op on the DTensor bumps its own counter only, one on its local shard the
    shard's: both are read. FSDP2's padded shard ``_sharded_param_data`` shares its counter with
    the local shard, a view of the same storage.)
    """
    if not INTERNALS_OK:
        with torch.no_grad():  # to_local() is then the local shard itself, not an autograd view
            return sum(p._version + p.to_local()._version for p in public.managed_params(state) if isinstance(p, DTensor))
    return sum(fp.sharded_param._version + fp._sharded_param_data._version for fp in fsdp_params(state))


def is_root_initialized_as_child(state: Any) -> bool:
    """True once FSDP2's lazy init has decided this state is *not* the root."""
    return INTERNALS_OK and state._is_root is False


def enclosing_unit(module: nn.Module, state: Any) -> nn.Module | None:
    """Another ``fully_shard`` module containing ``module``, before FSDP2's lazy init (None after it).

    FSDP2 decides which module is the root only at its lazy init, from the forward that runs
    first; run on a child first, it makes the child a root, and the real root's forward then
    fails for good. So before it, the scheduler asks FSDP2's registry of composable modules
    whether another unit encloses ``module``. None without the internals: there only the lazy
    init's outcome tells (``Roots.check_still_roots``).
    """
    if not INTERNALS_OK or state._is_root is not None:
        return None
    for other in list(_module_state_mapping.keys()):
        if other is not module and isinstance(other, FSDPModule) and any(m is module for m in other.modules()):
            return other
    return None


def process_group(state: Any) -> Any:
    """The process group the unit all-gathers over (what cross-rank checks must use)."""
    if INTERNALS_OK:
        return groups[0]._all_gather_process_group if (groups := param_groups(state)) else None
    return public.process_group(state)


def device(state: Any) -> torch.device:
    if INTERNALS_OK:
        return state._device
    return next(public.managed_params(state)).device


# --- gather state, read at demand time ---------------------------------------------------------


_HIT, _RESIDENT, _MISS = Demand.hit, Demand.resident, Demand.miss
"""Read per demand: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""


def classify_demand(state: Any, *, backward: bool) -> Demand:
    """How a demand finds the unit: a gather pending (hit), unsharded (resident), or neither (miss).

    ``backward``: a backward use (not recompute), which needs no gather where FSDP2 does not
    unshard the unit in backward (``set_unshard_in_backward(False)``, an embedding's): resident.
    """
    if INTERNALS_OK and len(groups := param_groups(state)) == 1:  # the common case, in one call
        group = groups[0]
        if group._all_gather_result is not None:
            return _HIT
        if group.is_unsharded or (backward and not group.unshard_in_backward):
            return _RESIDENT
        return _MISS
    if is_pending(state):
        if not INTERNALS_OK:
            del public.pending[state]  # FSDP2's pre-hook waits on it now
        return Demand.hit
    if is_resident(state) or (backward and INTERNALS_OK and not all(g.unshard_in_backward for g in param_groups(state))):
        return Demand.resident
    return Demand.miss


def is_pending(state: Any) -> bool:
    """An all-gather was issued and not yet waited on (public API: only the scheduler's own)."""
    if not INTERNALS_OK:
        return state in public.pending
    groups = param_groups(state)
    if len(groups) == 1:  # the common case, without a generator per call
        return groups[0]._all_gather_result is not None
    return any(g._all_gather_result is not None for g in groups)


def is_resident(state: Any) -> bool:
    """Parameters are unsharded (no all-gather needed)."""
    if not INTERNALS_OK:
        return public.is_resident(state)
    return all(g.is_unsharded for g in param_groups(state))


def is_sharded_idle(state: Any) -> bool:
    """Neither resident nor pending: a use now would have to gather."""
    if INTERNALS_OK and len(groups := param_groups(state)) == 1:  # [Note: trims of the per-demand path]
        group = groups[0]
        return group._all_gather_result is None and not group.is_unsharded
    return not is_pending(state) and not is_resident(state)


def in_use(state: Any) -> bool:
    """A forward or backward of the unit is running, so FSDP2 reshards it when that use ends."""
    return INTERNALS_OK and any(g._training_state not in IDLE_STATES for g in param_groups(state))


class Standing(enum.Enum):
    """How a unit stands when a refill considers it, read in one pass over FSDP2's state."""

    in_use = "in_use"
    """A forward or backward of it runs: FSDP2 reshards it when that use ends (a keep may skip that)."""
    sharded = "sharded"
    """Sharded with no gather pending: a use now would have to gather."""
    provided = "provided"
    """Unsharded or gathering already, by someone's doing: nothing to provide."""


_IN_USE, _PROVIDED, _SHARDED = Standing.in_use, Standing.provided, Standing.sharded
"""Read per refill entry: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""


def standing(state: Any) -> Standing:
    """:class:`Standing` of the unit (the refill asks this for every entry it looks at)."""
    if not INTERNALS_OK:
        return Standing.provided if is_pending(state) or is_resident(state) else Standing.sharded
    groups = param_groups(state)
    if len(groups) == 1:  # the common case, without generators or Enum member lookups
        group = groups[0]
        if group._training_state not in IDLE_STATES:
            return _IN_USE
        return _PROVIDED if group._all_gather_result is not None or group.is_unsharded else _SHARDED
    if any(g._training_state not in IDLE_STATES for g in groups):
        return Standing.in_use
    return Standing.provided if is_pending(state) or is_resident(state) else Standing.sharded


def may_gather(state: Any) -> bool:
    """False while a torch 2.15 asynchronous gradient reduction is pending.

    FSDP2's own forward refuses to run then, and the reduction's ``wait()`` drops any gather issued
    in that window, so the scheduler issues none there.
    """
    if not INTERNALS_OK or not ASYNC_REDUCTION:
        return True
    if getattr(state._comm_ctx, "active_gradient_reduction", None) is not None:
        return False
    return not getattr(state._state_ctx, "gradient_reduction_pending", False)


ASYNC_REDUCTION = hasattr(FSDPModule, "set_manual_backward_finalization")
"""torch 2.15+: a gradient reduction may be pending asynchronously (``finalize_backward(async_op=True)``)."""


# --- where a hook fires in FSDP2's lifecycle ----------------------------------------------------


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


def graph_task_id() -> int:
    """The running autograd graph task, or -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Inside an autograd graph task: a forward here is activation-checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1  # not through graph_task_id(): this runs per demand


def grad_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Tensors in an (args, kwargs, output) structure that autograd will send gradients to."""
    if isinstance(tree, torch.Tensor):  # the common module output: skip pytree
        if tree.requires_grad:
            yield tree
        return
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            yield leaf
