"""The torch-version guard: whether FSDP2's internals may be used, and the imports of them.

FSDP2 exposes no public way to read a unit's gather state, to find its param groups, to see its
reshards as they happen or to issue a prefetch on its side streams. On a torch release outside
:data:`TESTED_TORCH` (or with ``FSDP_REPLAY_PUBLIC_API=1``) every function of ``_compat`` takes
FSDP2's public API instead (``public.py``). What that costs is said once, as a
:class:`PublicAPIFallbackWarning`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable

import torch
from torch.profiler import record_function

TESTED_TORCH = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
"""(major, minor) releases whose FSDP2 internals this package was checked against."""
PUBLIC_API_ENV = "FSDP_REPLAY_PUBLIC_API"
"""Set to ``1`` to use FSDP2's public API only, also on a tested release (how CI covers the fallback)."""


class PublicAPIFallbackWarning(UserWarning):
    """fsdp_replay runs on FSDP2's public API only; the message says what that loses."""


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_RELEASE = _torch_release()
INTERNALS_OK = TORCH_RELEASE in TESTED_TORCH and os.environ.get(PUBLIC_API_ENV, "") in ("", "0")
if INTERNALS_OK:  # each module of _compat imports the internals it reads under this same test
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    IDLE_STATES = (TrainingState.IDLE, TrainingState.POST_BACKWARD)
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

HOOK_CONTEXT = INTERNALS_OK and getattr(torch.distributed, "_is_spmd_types_available", lambda: False)()
"""Whether FSDP2 runs its hook bodies in a context (:func:`fsdp_hook_context`) on this torch."""
if HOOK_CONTEXT:
    fsdp_hook_context = torch.distributed._spmd_no_typecheck
    """torch 2.14+ runs FSDP2's hook bodies outside spmd type checking; the scheduler's gathers too."""
else:
    def fsdp_hook_context() -> contextlib.AbstractContextManager:
        return _NO_CONTEXT


def trace(*label: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range, opened only while a profiler runs: one costs ~20 µs otherwise."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(" ".join(label))
    return _NO_CONTEXT


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run outside Dynamo, as FSDP2's own hooks are: see [Note: hooks are opaque to
    torch.compile] in ``fsdp_replay/_hooks.py``."""
    return torch.compiler.disable(hook, recursive=True, reason="fsdp_replay's hooks run eagerly, as FSDP2's do")
