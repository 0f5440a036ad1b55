"""What differs between the supported torch releases, each compared with plain FSDP2 on the same release.

torch 2.15 adds manual backward finalization (``set_manual_backward_finalization``,
``finalize_backward(async_op=...)``; pipeline stages switch it on), refuses a forward while an
asynchronous gradient reduction is pending, and adds ``set_keep_unsharded_storage``. The tests
skip on releases without the feature; CI runs this file on 2.13, 2.14 and 2.15.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay._compat import TORCH_RELEASE
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.internals import HAS_RESET_ITER_STATE
from fsdp_replay.testing.observer import DemandObserver, held_units
from fsdp_replay.testing.workloads import linear_stack

MODES = ("plain", "demand", "static", "record_and_replay")
STEPS = 3
needs_2_15 = pytest.mark.skipif(
    not hasattr(FSDPModule, "set_manual_backward_finalization"), reason=f"torch {torch.__version__} has no manual finalization"
)


def _batch(step: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + mb + dist.get_rank())
    return torch.randn(4, 8, generator=g)


def _run(mesh, mode: str, finalize: str, keep_storage: bool) -> dict:
    """Two microbatches per step as a pipeline stage runs them: no sync, no reshard, then finalize."""
    model = linear_stack(mesh)
    if keep_storage:
        model.set_keep_unsharded_storage(True)
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        model.set_manual_backward_finalization(True)
        with sched.iteration("train") if sched is not None else contextlib.nullcontext():
            losses = []
            for mb in range(2):
                model.set_requires_gradient_sync(mb == 1)
                model.set_reshard_after_backward(mb == 1)
                loss = model(_batch(step, mb)).pow(2).mean()
                loss.backward()
                losses.append(loss.item())
            if finalize == "async":
                handle = model.finalize_backward(async_op=True)
                handle.wait()
            else:
                model.finalize_backward()
        steps.append(
            {
                "losses": losses,
                "grads": [p.grad.to_local().clone() for p in model.parameters()],
                "held": held_units(model),
                "observed": observer.take(),
            }
        )
        opt.step()
        opt.zero_grad()
    return {"steps": steps, "stats": sched.stats.as_dict() if sched else None}


def _all(mesh) -> dict:
    return {
        (mode, finalize, keep): _run(mesh, mode, finalize, keep)
        for mode in MODES
        for finalize in ("sync", "async")
        for keep in (False, True)
    }


@pytest.fixture(scope="module")
def manual_runs():
    return spawn(_all, timeout_s=600)


@needs_2_15
@pytest.mark.parametrize("finalize", ["sync", "async"])
@pytest.mark.parametrize("keep_storage", [False, True], ids=["free_storage", "keep_unsharded_storage"])
def test_manual_backward_finalization_is_bitwise_equal_to_plain_fsdp2(manual_runs, finalize, keep_storage):
    for rank_result in manual_runs:
        plain = rank_result[("plain", finalize, keep_storage)]
        for mode in MODES[1:]:
            run = rank_result[(mode, finalize, keep_storage)]
            for step, (p, g) in enumerate(zip(plain["steps"], run["steps"])):
                where = (mode, finalize, keep_storage, step)
                assert g["losses"] == p["losses"], where
                assert all(torch.equal(a, b) for a, b in zip(g["grads"], p["grads"])), where
                assert g["held"] == p["held"], where  # nothing resharded whose reduction FSDP2 still owed


@needs_2_15
def test_replay_under_manual_finalization_hits_and_issues_nothing_fsdp2_drops(manual_runs):
    for rank_result in manual_runs:
        for finalize in ("sync", "async"):
            run = rank_result[("record_and_replay", finalize, False)]
            stats = run["stats"]
            assert stats["divergences"] == 0 and stats["dropped"] == 0 and stats["wasted"] == 0, stats
            for step in run["steps"][1:]:
                assert all(kind != "miss" for _, _, kind in step["observed"]), step["observed"]


def _reset_after_failure(mesh, mode: str) -> dict:
    """An exception mid-backward, FSDP2's documented recovery, then a clean step (grads as plain leaves them)."""
    model = linear_stack(mesh)
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    out = []
    for step in range(STEPS):
        try:
            with sched.iteration("train") if sched is not None else contextlib.nullcontext():
                loss = model(_batch(step, 0)).pow(2).mean()
                if step == 1:
                    loss.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")))
                loss.backward()
        except RuntimeError:
            if sched is None:
                model.reset_iter_state()
        out.append([None if p.grad is None else p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad()
    return {"grads": out, "held": held_units(model)}


def _reset_runs(mesh) -> dict:
    return {mode: _reset_after_failure(mesh, mode) for mode in MODES}


@pytest.mark.skipif(not HAS_RESET_ITER_STATE, reason="torch 2.11/2.12 have no reset_iter_state")
def test_reset_iter_state_after_a_failed_backward_matches_plain_fsdp2_on_this_release():
    results = spawn(_reset_runs, timeout_s=300)
    for rank_result in results:
        plain = rank_result["plain"]
        for mode in MODES[1:]:
            got = rank_result[mode]
            for step, (a, b) in enumerate(zip(got["grads"], plain["grads"])):
                assert [x is None for x in a] == [y is None for y in b], (mode, step, TORCH_RELEASE)
                assert all(x is None or torch.equal(x, y) for x, y in zip(a, b)), (mode, step)
            assert got["held"] == plain["held"], mode
