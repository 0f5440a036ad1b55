"""``explain()``'s API on the fake backend: errors, the table, the picture, and what it keeps."""

import gc
import os
import re
import weakref

import pytest
import torch

from fsdp_replay import MissReason, PrefetchConfig, Served, WaitMeter, attach
from fsdp_replay.testing.internals import param_groups
from fsdp_replay.testing.workloads import linear_stack


def _step(model, sched=None, key="train"):
    if sched is None:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        return
    with sched.iteration(key):
        model(torch.randn(4, 8)).pow(2).mean().backward()


def test_explain_names_the_unknown_key_and_the_known_ones(mesh8):
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig())
    with pytest.raises(ValueError, match=r"explain\('train'\): no scope of that key has finished; .*none yet"):
        sched.explain("train")
    _step(model, sched)
    with pytest.raises(ValueError, match=r"explain\('trian'\).*'train'"):
        sched.explain("trian")


def test_measure_waits_must_be_a_bool():
    with pytest.raises(ValueError, match="PrefetchConfig.measure_waits must be true or false, got 'yes'"):
        PrefetchConfig(measure_waits="yes")


def test_rows_count_every_demand_and_the_table_sums_them(mesh8):
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig())
    for _ in range(2):
        before = sched.stats.demands
        _step(model, sched)
    report = sched.explain("train")
    assert len(report.rows) == sched.stats.demands - before == 8
    assert [r.position for r in report.rows] == list(range(8))
    assert report.mode == "replay" and report.outcome == "completed"
    assert all(r.wait_s is None for r in report.rows) and report.total_wait_s is None
    assert {r.served for r in report.rows} <= {Served.hit, Served.kept}
    assert all(r.provided_at is not None and r.provided_at < r.position for r in report.rows)
    table = str(report)
    assert table.startswith("fsdp_replay explain 'train': replay scope, completed; 8 demands: 7 hit, 1 kept, 0 resident, 0 miss")
    assert "waits not measured" in table
    assert re.search(r"^  3 +backward +1 +0 +1 +0 +0 +-$", table, re.M), table  # uses, hit, kept, resident, miss, wait


def test_the_recording_scope_is_explained_and_counted(mesh8):
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig())
    _step(model, sched)
    report = sched.explain("train")
    assert report.mode == "record"
    assert report.miss_reasons == {MissReason.recording: 8}
    assert sched.stats.miss_reasons == {MissReason.recording: 8}
    assert "     8  recording scope  (#0 0 forward, #1 1 forward, #2 2 forward, #3 3 forward, ...)" in str(report)


def test_a_failed_scope_is_explained_with_its_failure(mesh8):
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig())
    _step(model, sched)
    with pytest.raises(ZeroDivisionError), sched.iteration("train"):
        model(torch.randn(4, 8))
        1 / 0
    report = sched.explain("train")
    assert report.outcome == "failed: its iteration() block exited with an exception"
    assert len(report.rows) == 4
    # What the forward's end provided for the backward that never came: 3 kept, 2's gather issued.
    assert [(u.unit, u.held, u.wasted) for u in report.undone] == [("2", "prefetched", True), ("3", "kept", True)]
    assert {u.why for u in report.undone} == {"the scope failed: its iteration() block exited with an exception"}


def test_the_picture_is_written(mesh8, tmp_path):
    pytest.importorskip("matplotlib")
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig(measure_waits=True))
    for _ in range(2):
        _step(model, sched)
    path = sched.explain("train").plot(tmp_path / "order.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_reports_keep_no_module_alive(mesh8):
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig(measure_waits=True))
    _step(model, sched)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert sched.explain("train").rows[0].unit == "0"


def test_wait_meter_rejects_a_model_without_units_and_restores_fsdp2(mesh8):
    with pytest.raises(ValueError, match="WaitMeter: no fully_shard unit with parameters under Linear"):
        WaitMeter(torch.nn.Linear(2, 2))
    model = linear_stack(mesh8)
    group = param_groups(model[0])[0]
    with WaitMeter(model) as meter:
        assert "wait_for_unshard" in group.__dict__
        _step(model)
        assert all(isinstance(fqn, str) and seconds >= 0 for fqn, seconds in meter.take())
    assert "wait_for_unshard" not in group.__dict__ and "unshard" not in group.__dict__


def test_a_pipeline_schedules_call_is_named_as_such(mesh8):
    """Whose call undid a prefetch is read off the call stack: code under torch/distributed/pipelining/."""
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig())
    _step(model, sched)
    namespace: dict = {}
    exec(compile("def action(unit):\n    unit.reshard()\n", os.path.join(os.sep, "site", "torch", "distributed", "pipelining", "schedules.py"), "exec"), namespace)
    handle = model[0].register_forward_hook(lambda *_: namespace["action"](model[1]))  # 1's gather is pending then
    _step(model, sched)
    handle.remove()
    report = sched.explain("train")
    assert [(u.unit, u.why, u.wasted) for u in report.undone] == [("1", "a pipeline schedule's reshard()", False)]
    assert (report.rows[1].reason, report.rows[1].detail) == (MissReason.dropped, "a pipeline schedule's reshard()")
