"""Every touch of FSDP2 internals lives in this package, behind a torch-version guard.

FSDP2 exposes no public way to read a unit's gather state, to find its param groups, to see its
reshards as they happen or to issue a prefetch on its side streams. On a torch release outside
:data:`TESTED_TORCH` (or with ``FSDP_REPLAY_PUBLIC_API=1``) every function here takes FSDP2's
public API instead: a unit is the ``FSDPModule`` itself, a prefetch is
``unshard(async_op=True)``, and a unit is resident while its parameters are plain tensors rather
than DTensors. What that costs is said once, as a :class:`PublicAPIFallbackWarning`.

The modules, by concern (callers use the names re-exported here, ``_compat.<name>``):

- ``guard``: the version guard (:data:`INTERNALS_OK`), profiler ranges, FSDP2's hook context;
- ``state``: reads of FSDP2 state (units, sizes, how a unit stands at a demand, lifecycle points);
- ``gathers``: issuing and releasing all-gathers, FSDP2's lazy init and recovery;
- ``intercept``: FSDP2's methods seen as they happen, with
  ``[Note: fsdp_replay never owns FSDP2's settings]``, and FSDP2's own prefetch turned off;
- ``shadows``: the one set of instance attributes on each param group, shared by the interception
  and every wait timer;
- ``waits``: FSDP2's own unshard and wait of a use, timed (``measure_waits``, ``WaitMeter``);
- ``public``: what the public-API fallback reads and holds instead of FSDP2's internals.
"""

from fsdp_replay._compat.gathers import ensure_lazy_init, issue_unshard, release, reset_iter_state, reshard_if_idle
from fsdp_replay._compat.guard import (
    INTERNALS_OK,
    PUBLIC_API_ENV,
    TESTED_TORCH,
    TORCH_RELEASE,
    PublicAPIFallbackWarning,
    eager,
    trace,
)
from fsdp_replay._compat.intercept import (
    OtherPartyCall,
    disable_own_prefetch,
    intercept_backward_end,
    intercept_group_calls,
    other_party,
    queue_backward_callback,
    report_method_forward,
    report_pre_backward,
    restore_own_prefetch,
    stop_intercepting_backward_end,
    stop_intercepting_group_calls,
    stop_reporting_method_forward,
    stop_reporting_pre_backward,
)
from fsdp_replay._compat.state import (
    Standing,
    classify_demand,
    completes_forward,
    device,
    enclosing_unit,
    fsdp_state,
    grad_tensors,
    graph_task_id,
    has_params,
    in_backward,
    in_pre_backward,
    in_use,
    is_pending,
    is_resident,
    is_root_initialized_as_child,
    is_sharded_idle,
    opens_forward,
    param_versions,
    process_group,
    sharded_params,
    standing,
    state_modules,
    unsharded_bytes,
)
from fsdp_replay._compat.waits import stop_timing_waits, time_waits
