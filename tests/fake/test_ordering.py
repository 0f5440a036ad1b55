"""Acceptance 7: ordering logic in one process on the fake backend at world size 8 and 64."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.internals import gather_pending, param_groups, window
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import run_iteration, workload


def _replay(mesh, name, config=None, steps=3):
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = attach(model, config or PrefetchConfig())
    observer = DemandObserver(model)
    logs = []
    for step in range(steps):
        with sched.iteration("train"):
            run_iteration(model, w, step)
        logs.append(observer.take())
    return sched, logs


def test_shared_block_records_one_demand_per_call_in_each_direction(mesh):
    sched, _ = _replay(mesh, "shared_block")
    order = sched.recorded_order("train")
    assert order.count(("blocks.1", "forward")) == 3 and order.count(("blocks.1", "backward")) == 3
    forward = [fqn for fqn, phase in order if phase == "forward"]
    assert forward == ["<root>", "blocks.0", "blocks.1", "blocks.1", "blocks.1", "blocks.2", "blocks.3"]


def test_out_of_order_calls_are_recorded_as_called(mesh):
    sched, _ = _replay(mesh, "out_of_order")
    order = sched.recorded_order("train")
    assert [f for f, p in order if p == "forward"] == ["<root>", "blocks.2", "blocks.0", "blocks.3", "blocks.1"]
    assert [f for f, p in order if p == "backward"] == ["<root>", "blocks.1", "blocks.3", "blocks.0", "blocks.2"]


def test_checkpoint_recompute_is_its_own_phase_inside_backward(mesh):
    sched, _ = _replay(mesh, "checkpointed")
    order = sched.recorded_order("train")
    recompute = [f for f, p in order if p == "recompute"]
    assert sorted(recompute) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    first_backward = next(i for i, (_, p) in enumerate(order) if p == "backward")
    assert all(i > first_backward for i, (_, p) in enumerate(order) if p == "recompute")


def test_interleaved_microbatches_form_one_flat_order(mesh):
    sched, logs = _replay(mesh, "interleaved_1f1b")
    phases = [p for _, p in sched.recorded_order("train")]
    runs = [phases[0]]
    for p in phases[1:]:
        if p != runs[-1]:
            runs.append(p)
    assert runs == ["forward", "backward", "forward", "backward"]  # F0 F1 | B0 | F2 | B1 B2
    assert all(kind in ("hit", "resident") for log in logs[1:] for _, _, kind in log)


@pytest.mark.parametrize("name", ["sequential", "out_of_order", "shared_block", "checkpointed", "tied_embedding"])
def test_replay_observed_hits_at_large_world_sizes(mesh, name):
    sched, logs = _replay(mesh, name)
    assert all(kind in ("hit", "resident") for log in logs[1:] for _, _, kind in log), logs[1:]
    assert sched.stats.divergences == 0


def test_depth_zero_prefetches_nothing_but_still_replays(mesh8):
    sched, logs = _replay(mesh8, "sequential", PrefetchConfig(forward_prefetch=0, backward_prefetch=0))
    assert sched.stats.prefetches == 0 and sched.stats.divergences == 0


def test_deeper_window_keeps_more_units_in_flight(mesh8):
    w = workload("sequential", n_blocks=6)
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(forward_prefetch=3))
    in_flight = []

    def count_pending(module, args):
        groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in param_groups(m)]
        in_flight.append(sum(gather_pending(g) for g in set(groups)))

    for step in range(2):
        in_flight.clear()
        handle = model.blocks[1].register_forward_pre_hook(count_pending)
        with sched.iteration("train"):
            run_iteration(model, w, step)
        handle.remove()
    assert in_flight == [3]  # blocks 1, 2, 3 gathered ahead when block 1 is demanded


def test_byte_cap_limits_lookahead_but_keeps_one_unit_in_flight(mesh8):
    w = workload("sequential", n_blocks=6)
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(forward_prefetch=4, backward_prefetch=4, max_prefetch_bytes=1))
    observer = DemandObserver(model)
    for step in range(3):
        with sched.iteration("train"):
            run_iteration(model, w, step)
    log = observer.take()
    assert sched.stats.prefetches > 0
    assert all(kind in ("hit", "resident") for _, _, kind in log[-len(log) // 3 :])
    assert window(sched).bytes_ahead == 0


def test_static_order_is_module_tree_order_and_its_reverse(mesh8):
    w = workload("out_of_order")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(mode="static"))
    assert [u.fqn for u in sched.units] == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    assert sched.stats.wasted > 0 or sched.stats.misses > 1
    assert sched.recorded_order("train") is None


def test_keys_keep_independent_orders_and_no_grad_gets_its_own_auto_key(mesh8):
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())
    for step in range(2):
        with sched.iteration("train"):
            run_iteration(model, w, step)
        with sched.iteration("eval"), torch.no_grad():
            model(w.make_batch(step, 0))
    with torch.no_grad():
        model(w.make_batch(0, 0))
    run_iteration(model, w, 0)
    assert len(sched.recorded_order("eval")) == 5 and len(sched.recorded_order("train")) == 10
    assert sched.recorded_order("auto:no_grad") == sched.recorded_order("eval")
    assert sched.recorded_order("auto:grad") == sched.recorded_order("train")
    assert sched.stats.divergences == 0 and sched.stats.per_key["eval"].hits > 0


def test_rerecord_and_invalidate_force_a_fresh_recording(mesh8):
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    with sched.iteration("train", rerecord=True):
        run_iteration(model, w, 1)
    assert sched.stats.recordings == 2 and sched.stats.hits == 0
    sched.invalidate("train")
    assert sched.recorded_order("train") is None
    with sched.iteration("train"):
        run_iteration(model, w, 2)
    assert sched.stats.recordings == 3


def test_a_scope_that_stops_short_once_keeps_the_order_and_twice_in_a_row_diverges(mesh8, caplog):
    """A step given up after its forward (a loss that is not finite) keeps replaying the order; a
    key whose scopes stop short twice in a row now runs another order ([Note: a scope that stops short])."""
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())

    def forward_only(step: int) -> None:
        with sched.iteration("train"):
            model(w.make_batch(step, 0))  # forward only: the recorded backward never comes
        assert all(not gather_pending(g) for u in sched.units for g in param_groups(u.state))

    with sched.iteration("train"):
        run_iteration(model, w, 0)
    order, recording_misses = sched.recorded_order("train"), sched.stats.misses
    for step in (1, 3):  # stops short, then a whole scope in between: each is tolerated
        forward_only(step)
        assert sched.stats.divergences == 0 and sched.recorded_order("train") == order and sched.stats.wasted >= 1
        assert "replay scope, stopped short of its order" in str(sched.explain("train"))
        with sched.iteration("train"):
            run_iteration(model, w, step + 1)
        assert sched.stats.divergences == 0 and sched.stats.recordings == 1
    assert sched.stats.misses == recording_misses  # every replayed demand was provided for
    forward_only(5)
    forward_only(6)  # the second in a row
    assert sched.stats.divergences == 1 and sched.recorded_order("train") is None
    assert sum("invalidated the recorded order of 'train'" in r.message for r in caplog.records) == 1
    assert "and so did its key's scope before it" in caplog.text
    forward_only(7)
    assert sched.recorded_order("train") == [entry for entry in order if entry[1] == "forward"]


def test_state_dict_restores_orders_for_replay_from_the_first_step(mesh8):
    w = workload("shared_block")
    first = w.make_model().shard(mesh8)
    sched = attach(first, PrefetchConfig())
    with sched.iteration("train"):
        run_iteration(first, w, 0)
    saved = sched.state_dict()
    second = w.make_model().shard(mesh8)
    resumed = attach(second, PrefetchConfig())
    resumed.load_state_dict(saved)
    with resumed.iteration("train"):
        run_iteration(second, w, 1)
    assert resumed.stats.recordings == 0 and resumed.stats.misses == 0 and resumed.stats.divergences == 0


def test_profiler_trace_names_what_was_recorded_prefetched_and_released(mesh8):
    from torch.profiler import ProfilerActivity, profile

    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(forward_prefetch=2))
    with profile(activities=[ProfilerActivity.CPU]) as recording:
        with sched.iteration("train"):
            run_iteration(model, w, 0)
    with profile(activities=[ProfilerActivity.CPU]) as replay:
        with sched.iteration("train"):
            model(w.make_batch(1, 0))  # forward only: backward prefetches are released unused
    recorded = {e.name for e in recording.events()}
    replayed = {e.name for e in replay.events()}
    assert "fsdp_replay::record blocks.0 forward" in recorded
    assert "fsdp_replay::prefetch blocks.1" in replayed
    assert any(name.startswith("fsdp_replay::release ") for name in replayed)


@pytest.mark.parametrize("name", ["shared_block", "checkpointed", "interleaved_1f1b", "tied_embedding"])
def test_public_output_hooks_record_the_same_backward_demands_as_fsdp2s_pre_backward(mesh8, monkeypatch, name):
    """The fallback used without FSDP2's internals must see the backward uses FSDP2's own hook sees."""
    orders = []
    for use_fsdp_hook in (True, False):
        if not use_fsdp_hook:
            monkeypatch.setattr("fsdp_replay._compat.report_pre_backward", lambda state, callback: False)
        sched, logs = _replay(mesh8, name, steps=2)
        orders.append(sched.recorded_order("train"))
        assert all(kind in ("hit", "resident") for _, _, kind in logs[1]) and sched.stats.divergences == 0
    assert orders[0] == orders[1] and ("blocks.1", "backward") in orders[0]


def test_static_wrong_guesses_never_hold_more_than_depth_gathers(mesh8):
    w = workload("out_of_order", n_blocks=6)  # calls [4, 2, 0, 5, 3, 1]: most module-order guesses are wrong
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(mode="static"))
    held = []
    handles = [b.register_forward_pre_hook(lambda m, a: held.append(len(window(sched)))) for b in model.blocks]
    for step in range(2):
        with sched.iteration("train"):
            run_iteration(model, w, step)
    for h in handles:
        h.remove()
    assert max(held) == 1 and sched.stats.prefetches > 0


def test_a_gather_fsdp2_drops_as_it_finalizes_a_backward_is_counted_dropped_in_any_scope(mesh8):
    """Static's last backward guess in ``out_of_order`` is a unit whose backward already ran: FSDP2
    drops its gather as it finalizes the backward. An automatic scope ends at that backward's end,
    which counted the gather wasted; an explicit one, ending later, counted it dropped."""
    counts = []
    for explicit_scope in (True, False):
        w = workload("out_of_order")
        model = w.make_model().shard(mesh8)
        sched = attach(model, PrefetchConfig(mode="static"))
        for step in range(2):
            if explicit_scope:
                with sched.iteration("train"):
                    run_iteration(model, w, step)
            else:
                run_iteration(model, w, step)
        counts.append((sched.stats.dropped, sched.stats.wasted))
    assert counts == [(2, 0), (2, 0)]


def test_prefetches_are_counted_under_their_key_whenever_the_stats_are_read(mesh8):
    """The window counts what it issues and the stats take it in when read (mid-scope too) or when
    the scope ends; ``reset_stats()`` mid-scope forgets what was issued before it."""
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())
    for step in range(2):  # record, then one replay
        with sched.iteration("train"):
            run_iteration(model, w, step)
    per_step = sched.stats.per_key["train"].prefetches
    assert per_step > 0 and sched.stats.prefetches == per_step
    read_after_forward: list[int] = []
    handle = model.register_forward_hook(lambda *_: read_after_forward.append(sched.stats.per_key["train"].prefetches))
    with sched.iteration("train"):
        run_iteration(model, w, 2)
    handle.remove()
    in_forward = read_after_forward[0] - per_step
    assert 0 < in_forward < per_step and sched.stats.prefetches == 2 * per_step
    handle = model.register_forward_hook(lambda *_: sched.reset_stats())
    with sched.iteration("train"):
        run_iteration(model, w, 3)
    handle.remove()
    assert sched.stats.prefetches == sched.stats.per_key["train"].prefetches == per_step - in_forward


def test_demands_are_counted_under_their_key_whenever_the_stats_are_read(mesh8):
    """A scope lists how each demand was served and the stats count that list when read (mid-scope
    too) or when the scope ends, each demand once; ``reset_stats()`` mid-scope forgets the demands
    before it (see [Note: counting a scope's demands])."""
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    per_step = sched.stats.demands
    assert per_step > 0 and sched.stats.per_key["train"].demands == per_step
    read_after_forward: list[dict[str, int]] = []
    handle = model.register_forward_hook(lambda *_: read_after_forward.append(sched.stats.as_dict()))
    with sched.iteration("train"):
        run_iteration(model, w, 1)
    handle.remove()
    in_forward = read_after_forward[0]["demands"] - per_step
    assert 0 < in_forward < per_step
    stats = sched.stats
    assert stats.demands == stats.per_key["train"].demands == 2 * per_step
    assert stats.demands == stats.hits + stats.misses + stats.resident
    assert stats.hits == stats.per_key["train"].hits > 0  # the replayed scope's
    handle = model.register_forward_hook(lambda *_: sched.reset_stats())
    with sched.iteration("train"):
        run_iteration(model, w, 2)
    handle.remove()
    stats = sched.stats
    assert stats.demands == stats.per_key["train"].demands == per_step - in_forward
    assert stats.demands == stats.hits + stats.misses + stats.resident
