"""Parameters changed in place inside ``iteration()`` before their unit's demand (a checkpoint
loaded, EMA weights copied in): a gather issued before the change holds the old values, so it is
released and FSDP2 gathers at the demand, as plain FSDP2 does ([Note: parameters changed before a
demand] in ``_window.py``). tests/gloo/test_parameters_changed_bitwise.py compares the numerics."""

import pytest
import torch

from fsdp_replay import attach
from fsdp_replay.stats import MissReason
from fsdp_replay.testing.workloads import run_iteration, workload

CHANGED = "its parameters changed in place before its demand"


def _replaying(mesh, name: str = "sequential"):
    """A model whose key ``train`` is recorded, so each of its scopes prefetches from its start."""
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = attach(model)
    for step in range(2):
        with sched.iteration("train"):
            run_iteration(model, w, step)
    return w, model, sched


def _scale_in_place(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.0)  # values unchanged; an in-place change all the same


@pytest.mark.parametrize("change", ["no_grad", "load_state_dict"])
def test_a_prefetch_issued_before_an_in_place_change_is_released_at_the_first_demand(mesh8, change):
    w, model, sched = _replaying(mesh8)
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with sched.iteration("train"):
        if change == "no_grad":
            _scale_in_place(model)
        else:
            model.load_state_dict(snapshot)
        run_iteration(model, w, 2)
    report = sched.explain("train")
    assert [(u.unit, u.why, u.wasted) for u in report.undone] == [("<root>", CHANGED, True)], str(report)
    first = report.rows[0]
    assert (first.unit, first.served, first.reason) == ("<root>", "miss", MissReason.changed_in_place), str(report)
    assert [row.served for row in report.rows[1:]].count("miss") == 0, str(report)  # the refill prefetches anew


def test_a_prefetch_whose_parameters_are_untouched_or_changed_elsewhere_is_used(mesh8):
    w, model, sched = _replaying(mesh8)
    with sched.iteration("train"):
        _scale_in_place(model.blocks[2])  # not a unit held at the scope's start
        run_iteration(model, w, 2)
    report = sched.explain("train")
    assert report.undone == [] and report.rows[0].served == "hit", str(report)


def test_a_change_between_microbatches_releases_the_prefetch_for_the_next_forward(mesh8):
    w, model, sched = _replaying(mesh8)
    with sched.iteration("accumulate"):  # recorded: two microbatches, each forward then backward
        for mb in range(2):
            model(w.make_batch(0, mb)).backward()
    with sched.iteration("accumulate"):
        model(w.make_batch(1, 0)).backward()
        _scale_in_place(model)  # after the first backward's end, which provided for the next forward
        model(w.make_batch(1, 1)).backward()
    report = sched.explain("accumulate")
    assert [(u.unit, u.why) for u in report.undone] == [("<root>", CHANGED)], str(report)
    second_forward = [row for row in report.rows if row.unit == "<root>" and row.phase == "forward"][1]
    assert (second_forward.served, second_forward.reason) == ("miss", MissReason.changed_in_place), str(report)


@pytest.mark.parametrize("rollback", [True, False])
def test_a_rollback_after_a_step_given_up_releases_what_was_held_for_its_backward(mesh8, rollback):
    # Automatic scopes: a step given up after its forward (its loss was not finite) leaves its scope
    # waiting for a backward, holding the last block kept and the next block's gather; the user
    # rolls back to a checkpoint (or not), and the next step's forward joins that scope.
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model)
    for step in range(2):
        run_iteration(model, w, step)
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model(w.make_batch(2, 0))
    wasted = sched.stats.wasted
    if rollback:
        model.load_state_dict(snapshot)
    run_iteration(model, w, 3)
    # blocks.3 kept and blocks.2's gather: used by the next forward, or released as stale.
    assert sched.stats.wasted - wasted == (2 if rollback else 0)
