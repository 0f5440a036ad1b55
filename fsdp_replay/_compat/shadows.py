"""The one set of instance attributes fsdp_replay puts on an FSDP2 param group, whoever needs them.

Two parts of the package watch a group's methods as FSDP2 calls them: a scheduler's interception
(``intercept.py``: its lifecycle reshards, and other parties' reshard/unshard/reset) and any number
of wait timers (``waits.py``: a scheduler's ``measure_waits``, each ``WaitMeter``). If each wrapped
the methods on its own, the one installed later would hide or outlive the other whenever they were
not removed in reverse order, and two timers would split one wait between them. So each group gets
one :class:`GroupShadow`: its methods shadow FSDP2's as instance attributes while anyone uses them,
call whoever is registered at call time, and FSDP2's class methods inside; they are removed when the
last user leaves.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from fsdp_replay._compat.guard import INTERNALS_OK

if INTERNALS_OK:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    _USE_STATES = (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)
    """A group is in one of FSDP2's own uses (pre-forward, pre-backward) in these states."""
    _FORWARD, _IDLE = TrainingState.FORWARD, TrainingState.IDLE
    """Read per use: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""

OtherPartyCall = Literal["reshard", "unshard", "reset"]
"""A call on a unit's FSDP2 state made by someone other than FSDP2's lifecycle or the scheduler."""

Waited = Callable[[float], None]
"""Told the seconds one use of the unit blocked, on the host."""
WaitedOnDevice = Callable[[Any, Any], None]
"""Told the timing events recorded around one use's wait on the accelerator stream."""
Timer = tuple[Waited, WaitedOnDevice]


class Interception:
    """What a scheduler is told of one group (see [Note: fsdp_replay never owns FSDP2's settings])."""

    __slots__ = ("held", "skip_lifecycle_reshard", "on_other_party")

    def __init__(
        self,
        held: Callable[[], object],
        skip_lifecycle_reshard: Callable[[], bool],
        on_other_party: Callable[[OtherPartyCall], None],
    ) -> None:
        self.held = held
        """Not None while the scheduler holds the unit: only then is ``skip_lifecycle_reshard`` asked."""
        self.skip_lifecycle_reshard = skip_lifecycle_reshard
        self.on_other_party = on_other_party


_SHADOWED = tuple(
    name
    for name in ("reshard", "unshard", "_reset_iter_state")  # no group _reset_iter_state before torch 2.13
    if INTERNALS_OK and hasattr(FSDPParamGroup, name)
)
_LIFECYCLE = ("post_forward", "post_backward")
_TIMED = "wait_for_unshard"
"""Shadowed only while a timer is registered: a use costs no extra call otherwise."""
_ATTRIBUTE = "_fsdp_replay_shadow"


class GroupShadow:
    """FSDP2's per-group lifecycle methods, seen by an interception and timed for any timers."""

    def __init__(self, state: Any, group: Any) -> None:
        self._state = state
        self._group = group
        self._on_host = state._device.type == "cpu"
        self._in_lifecycle = False
        """Inside FSDP2's post_forward/post_backward of this group."""
        self.interception: Interception | None = None
        self.timers: list[Timer] = []
        self._cls = type(group)  # FSDP2's methods are looked up at call time, so a later patch of the class still runs
        for name in _SHADOWED:
            setattr(group, name, getattr(self, name))
        for name in _LIFECYCLE:
            setattr(group, name, self._lifecycle(name))
        setattr(group, _ATTRIBUTE, self)

    @staticmethod
    def of(state: Any, group: Any) -> GroupShadow:
        """The group's shadow, installed at first use."""
        return GroupShadow.installed(group) or GroupShadow(state, group)

    @staticmethod
    def installed(group: Any) -> GroupShadow | None:
        """The group's shadow if anyone uses it now."""
        return group.__dict__.get(_ATTRIBUTE)

    def add_timer(self, timer: Timer) -> None:
        self.timers.append(timer)
        self._group.wait_for_unshard = self.wait_for_unshard

    def remove_timer(self, timer: Timer) -> None:
        self.timers.remove(timer)
        if not self.timers:
            self._group.__dict__.pop(_TIMED, None)
        self.release_if_unused()

    def release_if_unused(self) -> None:
        if self.interception is None and not self.timers:
            for name in (*_SHADOWED, *_LIFECYCLE, _TIMED, _ATTRIBUTE):
                self._group.__dict__.pop(name, None)

    # --- the shadowed methods -----------------------------------------------------------------------

    def _lifecycle(self, name: str) -> Callable[..., Any]:
        """FSDP2's ``post_forward``/``post_backward``, noting that the reshards inside are its own."""
        cls, group = self._cls, self._group

        def call(*args: Any) -> Any:
            self._in_lifecycle = True
            try:
                return getattr(cls, name)(group, *args)
            finally:
                self._in_lifecycle = False

        return call

    def reshard(self) -> None:
        group, interception = self._group, self.interception
        if interception is not None:
            if self._in_lifecycle:
                # After a forward FSDP2 reshards only while post_forward_mesh_info is set; after a
                # backward it calls reshard only while reshard_after_backward holds.
                if interception.held() is not None and (
                    (group._training_state is not _FORWARD or group.post_forward_mesh_info is not None)
                    and interception.skip_lifecycle_reshard()
                ):
                    return
            else:
                interception.on_other_party("reshard")
        self._cls.reshard(group)

    def unshard(self, async_op: bool = False) -> None:
        group = self._group
        # FSDP2's own unshards come from pre-forward, pre-backward and recompute, when the unit's
        # state is FORWARD or PRE_BACKWARD; from an idle unit it is someone else's call.
        if self.interception is not None and self._state._training_state is _IDLE:
            self.interception.on_other_party("unshard")
        if not self.timers or not self._on_host or group._training_state not in _USE_STATES:
            return self._cls.unshard(group, async_op)
        if group._all_gather_result is not None or group.is_unsharded:
            return self._cls.unshard(group, async_op)
        start = time.perf_counter()
        self._cls.unshard(group, async_op)
        seconds = time.perf_counter() - start
        result = group._all_gather_result
        if result is not None and result.all_gather_work is None and _collective(group):
            self._waited(seconds)  # synchronous: the whole collective ran here

    def wait_for_unshard(self) -> None:
        group = self._group
        result = group._all_gather_result
        if result is None or group._training_state not in _USE_STATES:
            return self._cls.wait_for_unshard(group)
        work = result.all_gather_work
        running = isinstance(work, dist.distributed_c10d.Work) and not collective_finished(work)
        if self._on_host:
            if running:
                start = time.perf_counter()
                work.wait()  # FSDP2's own wait on it is then a no-op
                self._waited(time.perf_counter() - start)
            return self._cls.wait_for_unshard(group)
        event = result.all_gather_event
        if not running and (event is None or event.query()):
            return self._cls.wait_for_unshard(group)  # finished already: the stream will not wait
        start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
        start.record()
        self._cls.wait_for_unshard(group)
        end.record()
        for _, waited_on_device in self.timers:
            waited_on_device(start, end)

    def _reset_iter_state(self) -> None:
        if self.interception is not None:
            self.interception.on_other_party("reset")
        self._cls._reset_iter_state(self._group)

    def _waited(self, seconds: float) -> None:
        for waited, _ in self.timers:
            waited(seconds)


def collective_finished(work: dist.distributed_c10d.Work) -> bool:
    """Whether ``work``'s collective has finished, asked of its future rather than of the Work.

    [Note: never Work.is_completed()] ``Work.is_completed()`` keeps the GIL while it waits for
    the Work's lock. Gloo's thread holds that lock while it finishes the work, and under the
    profiler it then runs a callback that restores the issuing thread's state, Python objects
    included (the saved-tensor hooks of activation checkpointing): that callback needs the GIL.
    Both ranks of the benchmark's checkpointed workload hung there with ``bench.profile=true``;
    two gloo ranks that poll ``is_completed()`` on gathers issued inside ``saved_tensors_hooks``
    under the profiler hang within 300 gathers, while polling the future's ``done()``, which takes
    only the future's own lock, ran 3000 (tests/gloo/test_gather_poll.py). A Work with no future
    (a third-party backend's) is asked directly.
    """
    try:
        future = work.get_future()
    except RuntimeError:  # "getFuture is not implemented for this Work"
        return work.is_completed()
    return future.done()


def _collective(group: Any) -> bool:
    """FSDP2 skips the collective on a world of one (and on a mesh that does not shard)."""
    try:
        return group._all_gather_process_group.size() > 1
    except AssertionError:
        return False
