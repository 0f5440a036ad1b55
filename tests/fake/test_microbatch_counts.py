"""Steps of one key that run different numbers of microbatches (a batch-size ramp-up, dynamic
batching, an epoch's remainder): replay follows each extra microbatch through the order's last
segment ([Note: more microbatches than recorded] in ``_strategies.py``), at world size 8; read from
the scheduler's stats and, independently, from FSDP2's state (the observer)."""

import pytest
import torch

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.stats import MissReason
from fsdp_replay.testing.observer import DemandObserver, held_units
from fsdp_replay.testing.workloads import workload


def _steps(mesh, name: str, counts: list[int], *, record_steps: int = 1) -> list[dict]:
    """One explicit scope per step, ``counts[step]`` microbatches of forward then backward each."""
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = attach(model, PrefetchConfig(record_steps=record_steps))
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step, count in enumerate(counts):
        before = sched.stats.as_dict()
        with sched.iteration("train"):
            for mb in range(count):
                model.set_requires_gradient_sync(mb == count - 1)
                model(w.make_batch(step, mb)).backward()
        after = sched.stats.as_dict()
        report = sched.explain("train")
        steps.append(
            {
                "count": count,
                "stats": {k: after[k] - before[k] for k in ("demands", "misses", "divergences", "recordings")},
                "observed": DemandObserver.counts(observer.take()),
                "reasons": [row.reason for row in report.rows if row.served.value == "miss"],
                "held": held_units(model),
                "order": len(sched.recorded_order("train") or ()),
            }
        )
        opt.step()
        opt.zero_grad()
    return steps


@pytest.mark.parametrize("name", ["sequential", "checkpointed", "shared_block"])
def test_extra_microbatches_miss_only_their_first_demand(mesh8, name):
    counts = [2, 2, 3, 4, 2, 5, 1]
    steps = _steps(mesh8, name, counts)
    per_microbatch = steps[0]["stats"]["demands"] // 2
    assert steps[0]["stats"]["recordings"] == 1
    for step in steps[1:]:
        extra = max(step["count"] - 2, 0)
        assert step["stats"]["demands"] == per_microbatch * step["count"]
        assert step["stats"]["divergences"] == 0 and step["stats"]["recordings"] == 0, step
        assert step["reasons"] == [MissReason.more_microbatches] * extra, step
        assert step["observed"].get("miss", 0) == step["stats"]["misses"] == extra, step
        assert step["held"] == [], step  # nothing provided for a next microbatch outlives the scope


def test_a_step_with_fewer_microbatches_after_more_keeps_the_order(mesh8):
    steps = _steps(mesh8, "sequential", [3, 5, 3, 2, 3])
    assert [s["stats"]["misses"] for s in steps[1:]] == [2, 0, 0, 0]
    assert sum(s["stats"]["recordings"] for s in steps) == 1


@pytest.mark.parametrize("record_steps", [1, 4])
def test_a_first_replay_with_fewer_microbatches_stops_short_and_keeps_the_order(mesh8, record_steps):
    """Its demands match the order's last segments as well as its first: it used to be taken for the
    order after a one-off prefix, which was trimmed (later steps of 4 then missed a demand each, and
    a merged order's shares moved up a microbatch: its third ran in 25% of the scopes). A second
    short step in a row that ran half the order (2 of 4 microbatches) is tolerated too; it used to
    diverge."""
    counts = [4, 3, 2, 4] if record_steps == 1 else [2, 3, 2, 4, 3, 3, 2]
    steps = _steps(mesh8, "sequential", counts, record_steps=record_steps)
    replayed = steps[record_steps:]
    per_microbatch = steps[0]["stats"]["demands"] // counts[0]
    assert {s["order"] for s in replayed} == {4 * per_microbatch}
    assert [s["stats"]["misses"] for s in replayed] == [0] * len(replayed)
    assert sum(s["stats"]["divergences"] for s in steps) == 0
