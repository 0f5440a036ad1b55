"""Acceptance 3-5: divergence mid-replay, exceptions inside a scope, rank-divergent recordings."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_replay import PrefetchConfig, PrefetchDivergenceError, RankMismatchError, attach
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.internals import HAS_RESET_ITER_STATE, gather_pending, param_groups
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import run_iteration, workload

BRANCH_STEP = 3
STEPS = 6


def _train_with_branch(mesh, policy: str | None, skip_branch: bool = False) -> dict:
    """Step 3 takes a branch (blocks 1 and 2 swap) that no recording has seen."""
    w = workload("sequential")
    model = w.make_model()
    model = model.shard(mesh)
    sched = None if policy is None else attach(model, PrefetchConfig(on_divergence=policy))
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, kinds, errors, recordings = {}, {}, {}, {}
    for step in range(STEPS):
        model.calls = [0, 2, 1, 3] if step == BRANCH_STEP else [0, 1, 2, 3]
        if skip_branch and step == BRANCH_STEP:
            continue
        try:
            if sched is None:
                losses[step] = run_iteration(model, w, step)
            else:
                with sched.iteration("train"):
                    losses[step] = run_iteration(model, w, step)
        except PrefetchDivergenceError as e:
            errors[step] = str(e)
        opt.step()
        opt.zero_grad()
        kinds[step] = DemandObserver.counts(observer.take())
        if sched is not None:
            recordings[step] = sched.stats.recordings
    return {
        "losses": losses,
        "kinds": kinds,
        "errors": errors,
        "recordings": recordings,
        "divergences": sched.stats.divergences if sched else 0,
    }


def _branch_runs(mesh):
    runs = {policy: _train_with_branch(mesh, policy) for policy in (None, "fallback", "raise")}
    runs["plain_skipping_branch"] = _train_with_branch(mesh, None, skip_branch=True)
    return runs


@pytest.fixture(scope="module")
def branch_runs():
    return spawn(_branch_runs, timeout_s=300)


def test_fallback_counts_divergence_keeps_numerics_and_rerecords(branch_runs):
    for ranks in branch_runs:
        plain, run = ranks[None], ranks["fallback"]
        assert run["losses"] == plain["losses"]
        assert run["divergences"] == 1 and not run["errors"]
        assert run["recordings"][BRANCH_STEP] == 1  # the diverged scope installs nothing
        assert run["recordings"][BRANCH_STEP + 1] == 2  # the next scope re-records
        assert set(run["kinds"][BRANCH_STEP + 2]) <= {"hit", "resident"}  # and then hits again


@pytest.mark.skipif(not HAS_RESET_ITER_STATE, reason="torch 2.11/2.12 have no reset_iter_state")
def test_raise_names_position_expected_and_actual_then_recovers(branch_runs):
    for ranks in branch_runs:
        plain, run = ranks["plain_skipping_branch"], ranks["raise"]
        message = run["errors"][BRANCH_STEP]
        assert "diverged at demand 2" in message
        assert "expected ('blocks.1', 'forward')" in message and "got ('blocks.2', 'forward')" in message
        assert set(run["errors"]) == {BRANCH_STEP} and run["divergences"] == 1
        # The failed step ran no backward: the rest matches plain FSDP2 that skipped it, bitwise.
        assert run["losses"] == plain["losses"]
        assert run["recordings"][BRANCH_STEP + 1] == 2
        assert set(run["kinds"][BRANCH_STEP + 2]) <= {"hit", "resident"}


class _Injected(Exception):
    pass


def _train_with_failures(mesh, attach_scheduler: bool, fail_at: dict) -> dict:
    """``fail_at`` maps step -> where to raise: "loss" (after forward) or "backward" (mid-backward)."""
    w = workload("shared_block")
    model = w.make_model().shard(mesh)
    sched = attach(model, PrefetchConfig()) if attach_scheduler else None
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, orders, kinds = {}, {}, {}
    for step in range(len(fail_at) + 4):
        where = fail_at.get(step)
        try:
            scope = sched.iteration("train") if sched else torch.enable_grad()
            with scope:
                loss = model(w.make_batch(step, 0))
                if where == "loss":
                    raise _Injected
                if where == "backward":
                    loss.register_hook(lambda g: (_ for _ in ()).throw(_Injected()))
                loss.backward()
                losses[step] = loss.item()
        except _Injected:
            if sched is None:
                model.reset_iter_state()  # what a plain FSDP2 user does; the scope does it for us
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
        kinds[step] = DemandObserver.counts(observer.take())
        if sched is not None:
            orders[step] = sched.recorded_order("train") is not None
    pending = [
        gather_pending(g) or g.is_unsharded
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in param_groups(m)
    ]
    return {"losses": losses, "orders": orders, "kinds": kinds, "leaked": any(pending)}


FAILURES = {0: "loss", 2: "backward", 4: "loss"}


def _failure_runs(mesh):
    return {flag: _train_with_failures(mesh, flag, FAILURES) for flag in (False, True)}


@pytest.mark.skipif(not HAS_RESET_ITER_STATE, reason="torch 2.11/2.12 have no reset_iter_state")
def test_failed_scopes_keep_no_recording_and_training_continues(tmp_path):
    for ranks in spawn(_failure_runs, timeout_s=300):
        plain, run = ranks[False], ranks[True]
        assert run["losses"] == plain["losses"]
        assert not run["leaked"]
        assert run["orders"][0] is False  # failed recording scope installs nothing
        assert run["orders"][1] is True  # the next one records
        assert run["orders"][2] is False  # a failed replay invalidates its order
        assert run["orders"][4] is False
        assert set(run["kinds"][6]) <= {"hit", "resident"}


def _rank_divergent_recording(mesh):
    import torch.distributed as dist

    w = workload("sequential")
    model = w.make_model().shard(mesh)
    sched = attach(model, PrefetchConfig())
    model.calls = [0, 1, 2, 3] if dist.get_rank() == 0 else [0, 2, 1, 3]  # same sizes: gloo will not notice
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    try:
        with sched.iteration("train"):
            run_iteration(model, w, 1)
    except RankMismatchError as e:
        return str(e)
    return None


def test_check_ranks_raises_on_every_rank_with_first_difference():
    messages = spawn(_rank_divergent_recording, timeout_s=120)
    for message in messages:
        assert message is not None
        assert "first difference at demand 2: rank 0 has ('blocks.1', 'forward'), rank 1 has ('blocks.2', 'forward')" in message


def _rank_divergent_skips(mesh, forward_prefetch: int, backward_prefetch: int):
    import torch.distributed as dist

    w = workload("sequential")
    model = w.make_model().shard(mesh)
    config = PrefetchConfig(record_steps=2, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
    sched = attach(model, config)
    # Recorded: block 3 runs in one of two steps, so the order is conditional.
    for step, skip in enumerate([set(), {3}]):
        model.skip = skip
        with sched.iteration("train"):
            run_iteration(model, w, step)
    # Replayed: rank 0 skips block 2, rank 1 block 1 (same sizes: gloo pairs the gathers anyway).
    model.skip = {2} if dist.get_rank() == 0 else {1}
    try:
        with sched.iteration("train"):
            run_iteration(model, w, 2)
    except RankMismatchError as e:
        return str(e), sched.recorded_order("train")
    return None, sched.recorded_order("train")


@pytest.mark.parametrize("depths", [(1, 0), (0, 1)], ids=["forward-prefetch", "backward-prefetch"])
def test_ranks_that_skip_different_units_fail_with_one_clear_error_on_every_rank(depths):
    """Compared as the backward begins (before its prefetches) and at the scope's end. (With prefetch
    in both phases the forward's own gathers already differ in number here: gloo reports the
    collective mismatch first; docs/TOLERANT_REPLAY.md.)"""
    for message, order in spawn(_rank_divergent_skips, *depths, timeout_s=120):
        assert message is not None and order is None
        assert "ranks ran different units in iteration 'train'" in message
        assert "first difference at demand 2: rank 0 has ('blocks.1', 'forward'), rank 1 has ('blocks.2', 'forward')" in message
