"""Methods registered with ``register_fsdp_forward_method`` (RL libraries register ``generate``; a
unit may register its own): FSDP2 gathers for them as for a forward, so the scheduler must see each
call as that unit's demand, although the module's forward hooks never run."""

import pytest

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.internals import fsdp_state
from fsdp_replay.testing.workloads import method_call_workload, run_through_loss

UNITS = ["<root>"] + [f"blocks.{i}" for i in range(4)]


@pytest.mark.parametrize("mode", ["static", "record_and_replay"])
def test_a_unit_run_through_a_registered_method_is_demanded_and_prefetched(mesh8, mode):
    w = method_call_workload()
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(mode=mode))
    for step in range(3):
        with sched.iteration("train"):
            run_through_loss(model, w, step)
    report = sched.explain("train")
    served = {(row.unit, row.phase): row.served for row in report.rows}
    # Every unit's forward is a demand, the root's and the even blocks' (methods) included.
    assert {unit for unit, phase in served if phase == "forward"} == set(UNITS), str(report)
    assert served[("blocks.2", "forward")] == "hit", str(report)  # gathered ahead of its method call
    if mode == "record_and_replay":
        assert [entry for entry in sched.recorded_order("train") if entry[1] == "forward"] == [(u, "forward") for u in UNITS]
        assert list(served.values()).count("miss") <= 1, str(report)  # the scope's first demand only


def test_detach_leaves_registered_methods_to_fsdp2(mesh8):
    w = method_call_workload()
    model = w.make_model().shard(mesh8)
    attach(model).detach()
    assert not any("_pre_forward" in vars(fsdp_state(m)) for m in [model, *model.blocks])
    run_through_loss(model, w, 0)
