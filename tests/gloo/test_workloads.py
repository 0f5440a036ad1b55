"""Acceptance 1-2: every workload, every mode, bitwise equal to plain FSDP2; replay hits everything
(on the conditional workloads, whose data skips units, numerics and counters only)."""

import dataclasses

import pytest

from fsdp_replay import attach
from fsdp_replay.testing.contenders import REUSE, contender_config
from fsdp_replay.testing.compare import assert_trains_like_plain, train
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import (
    canonical_workloads,
    conditional_workloads,
    method_call_workload,
    multi_head_workload,
    nested_workloads,
    run_iteration,
    run_through_loss,
    workload,
)

MODES = ("plain", "demand", "static", "record_and_replay", REUSE)
WORKLOADS = [w.name for w in canonical_workloads()]
CONDITIONAL = [w.name for w in conditional_workloads()]
NESTED = [w.name for w in nested_workloads()]
"""Units inside units: each block's two linears are units within the block's unit."""
STEPS = 4


CONDITIONAL_RECORD_STEPS = 2
"""Fewer than the workloads' own (4), so that 4 steps also replay a merged order (and compare each
replayed scope's demands across the two ranks)."""


def _config(name: str, mode: str):
    config = contender_config(mode)
    if name in CONDITIONAL and config.mode.name == "record_and_replay":
        config = dataclasses.replace(config, record_steps=CONDITIONAL_RECORD_STEPS)
    return config


def _train(mesh, name: str, mode: str, explicit_scope: bool) -> dict:
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = None if mode == "plain" else attach(model, _config(name, mode))
    run = train(model, w, sched, STEPS, scoped=explicit_scope, observer=DemandObserver(model))
    return run | {
        "stats": sched.stats.as_dict() if sched else None,
        "order": sched.recorded_order("train" if explicit_scope else "auto:grad") if sched else None,
    }


def _all_modes(mesh, names, explicit_scope):
    return {(n, m): _train(mesh, n, m, explicit_scope) for n in names for m in MODES}


@pytest.fixture(scope="module")
def explicit_runs():
    return spawn(_all_modes, WORKLOADS + CONDITIONAL + NESTED, True, timeout_s=600)


@pytest.fixture(scope="module")
def automatic_runs():
    return spawn(_all_modes, WORKLOADS + NESTED, False, timeout_s=600)


def _bitwise_equal_to_plain(results, name):
    for rank_result in results:
        assert_trains_like_plain(rank_result, name, MODES[1:])


@pytest.mark.parametrize("name", WORKLOADS + CONDITIONAL + NESTED)
def test_every_mode_is_bitwise_equal_to_plain_fsdp2(explicit_runs, name):
    _bitwise_equal_to_plain(explicit_runs, name)


@pytest.mark.parametrize("mode", ["record_and_replay", REUSE])
@pytest.mark.parametrize("name", WORKLOADS + NESTED)
def test_replay_makes_every_demand_a_hit_or_resident(explicit_runs, name, mode):
    for rank_result in explicit_runs:
        run = rank_result[(name, mode)]
        recorded = run["observed"][0]
        assert [(fqn, phase) for fqn, phase, _ in recorded] == run["order"]
        for step, observed in enumerate(run["observed"][1:], start=1):
            kinds = {kind for _, _, kind in observed}
            assert kinds <= {"hit", "resident"}, (name, step, observed)
        stats = run["stats"]
        assert stats["recordings"] == 1 and stats["divergences"] == 0 and stats["wasted"] == 0
        assert stats["demands"] == stats["hits"] + stats["misses"] + stats["resident"]
        assert stats["misses"] == sum(k == "miss" for _, _, k in recorded)  # all misses are in the recording


@pytest.mark.parametrize("name", CONDITIONAL)
def test_replay_of_a_merged_order_tolerates_the_skips_without_diverging(explicit_runs, name):
    for rank_result in explicit_runs:
        run = rank_result[(name, "record_and_replay")]
        assert run["stats"]["recordings"] == 1 and run["stats"]["divergences"] == 0, run["stats"]
        replayed = [kind for observed in run["observed"][CONDITIONAL_RECORD_STEPS:] for _, _, kind in observed]
        assert replayed.count("hit") > 4 * replayed.count("miss"), replayed


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_reuse_distance_keeps_units_for_later_uses_and_saves_their_gathers(explicit_runs, name):
    """Each unit is kept from a use to its next within the same backward segment (forward into
    recompute or backward, one microbatch's forward into the next's): one gather fewer per keep."""
    for rank_result in explicit_runs:
        near, far = rank_result[(name, "record_and_replay")], rank_result[(name, REUSE)]
        gathered = [
            [sum(kind != "resident" for _, _, kind in observed) for observed in run["observed"][1:]] for run in (near, far)
        ]
        saved = far["stats"]["kept"] - near["stats"]["kept"]
        assert saved > 0 and [a - b for a, b in zip(*gathered)] == [saved // (STEPS - 1)] * (STEPS - 1), (name, gathered)


def _assert_counters_agree_with_the_observer(results, names):
    for rank_result in results:
        for name in names:
            for mode in MODES[1:]:
                run = rank_result[(name, mode)]
                seen = DemandObserver.counts([d for observed in run["observed"] for d in observed])
                stats = run["stats"]
                assert (stats["hits"], stats["misses"], stats["resident"]) == (
                    seen.get("hit", 0), seen.get("miss", 0), seen.get("resident", 0)
                ), (name, mode, stats, seen)


def test_counters_agree_with_the_observer_in_explicit_scopes(explicit_runs):
    _assert_counters_agree_with_the_observer(explicit_runs, WORKLOADS + CONDITIONAL + NESTED)


def test_counters_agree_with_the_observer_in_automatic_scopes(automatic_runs):
    _assert_counters_agree_with_the_observer(automatic_runs, {n for n, _ in automatic_runs[0]})


@pytest.mark.parametrize("name", ["out_of_order", "shared_block"])
def test_static_guess_misses_or_wastes_where_order_is_irregular(explicit_runs, name):
    for rank_result in explicit_runs:
        run = rank_result[(name, "static")]
        later = [kind for observed in run["observed"][1:] for _, _, kind in observed]
        assert "miss" in later or run["stats"]["wasted"] > 0


def test_demand_mode_issues_nothing_ahead(explicit_runs):
    for rank_result in explicit_runs:
        for name in WORKLOADS + CONDITIONAL + NESTED:
            run = rank_result[(name, "demand")]
            assert run["stats"]["prefetches"] == 0 and run["stats"]["hits"] == 0
            assert all(k != "hit" for observed in run["observed"] for _, _, k in observed)


@pytest.mark.parametrize("name", WORKLOADS + NESTED)
def test_automatic_scopes_replay_with_at_most_the_first_demand_missing(automatic_runs, name):
    """interleaved_1f1b (F0 F1 B0 F2 B1 B2) too: forwards that come before the backwards they wait
    for join the open scope, so each step is one scope (it was one per forward, each diverging)."""
    _bitwise_equal_to_plain(automatic_runs, name)
    for rank_result in automatic_runs:
        run = rank_result[(name, "record_and_replay")]
        assert run["stats"]["recordings"] == 1 and run["stats"]["divergences"] == 0, run["stats"]
        assert [(fqn, phase) for fqn, phase, _ in run["observed"][0]] == run["order"]
        for observed in run["observed"][1:]:
            assert {kind for _, _, kind in observed[1:]} <= {"hit", "resident"}, observed


def _two_forwards_per_loss(model, w, step: int) -> list[float]:
    """One step: two root forwards, one backward of their summed losses."""
    loss = model(w.make_batch(step, 0)) + model(w.make_batch(step, 1))
    loss.backward()
    return [loss.item()]


def _two_backwards_through_one_graph(model, w, step: int) -> list[float]:
    """One step: one root forward, then two losses of it backwarded one after the other."""
    loss = model(w.make_batch(step, 0))
    loss.backward(retain_graph=True)
    (loss * 0.5).backward()
    return [loss.item()]


def _every_other_step_given_up(model, w, step: int) -> list[float]:
    """Odd steps stop after their forward (a loss that is not finite: no backward)."""
    if step % 2:
        return [model(w.make_batch(step, 0)).item()]
    return run_iteration(model, w, step)


MICROBATCHES = [3, 2, 1, 4]
"""Microbatches per step of ``varying_microbatches`` (dynamic batching, an epoch's remainder, a
batch-size ramp-up)."""


def _varying_microbatches(model, w, step: int) -> list[float]:
    """Gradient accumulation over ``MICROBATCHES[step]`` microbatches, reduced at the last."""
    count = MICROBATCHES[step]
    losses = []
    for mb in range(count):
        model.set_requires_gradient_sync(mb == count - 1)
        loss = model(w.make_batch(step, mb))
        loss.backward()
        losses.append(loss.item())
    return losses


LOOPS = {
    "two_forwards": _two_forwards_per_loss,
    "two_backwards": _two_backwards_through_one_graph,
    "given_up": _every_other_step_given_up,
    "varying_microbatches": _varying_microbatches,
}
"""Steps whose forwards and backwards do not pair one to one."""


def _train_loop(mesh, loop: str, mode: str, explicit_scope: bool) -> dict:
    w = workload("sequential")
    model = w.make_model().shard(mesh)
    sched = None if mode == "plain" else attach(model, contender_config(mode))
    run = train(model, w, sched, STEPS, scoped=explicit_scope, observer=DemandObserver(model), iterate=LOOPS[loop])
    orders = {key: sched.recorded_order(key) for key in ("train", "auto:grad", "auto:backward")} if sched else None
    return run | {"stats": sched.stats.as_dict() if sched else None, "orders": orders}


def _loop_all_modes(mesh, loop: str, explicit_scope: bool = False) -> dict:
    return {(loop, mode): _train_loop(mesh, loop, mode, explicit_scope) for mode in MODES}


def test_two_forwards_per_loss_are_one_automatic_scope_replayed_bitwise():
    """The second forward joins the first's scope; the backward that covers both leaves one forward
    waiting by the count, and the optimizer step closes the scope as completed."""
    for rank_result in spawn(_loop_all_modes, "two_forwards", timeout_s=300):
        assert_trains_like_plain(rank_result, "two_forwards", MODES[1:])
        run = rank_result[("two_forwards", "record_and_replay")]
        assert run["stats"]["recordings"] == 1 and run["stats"]["divergences"] == 0, run["stats"]
        for observed in run["observed"][1:]:
            assert {kind for _, _, kind in observed[1:]} <= {"hit", "resident"}, observed


def test_a_second_backward_through_a_retained_graph_is_an_automatic_scope_of_its_own():
    """The first backward ends the forward's scope; the second, with no scope open, opens
    ``auto:backward`` (it used to run outside any scope: no prefetch at all, where plain FSDP2
    prefetches its backward), which records once and replays, missing only its first demand."""
    for rank_result in spawn(_loop_all_modes, "two_backwards", timeout_s=300):
        assert_trains_like_plain(rank_result, "two_backwards", MODES[1:])
        run = rank_result[("two_backwards", "record_and_replay")]
        assert run["stats"]["recordings"] == 2 and run["stats"]["divergences"] == 0, run["stats"]
        orders = run["orders"]
        assert orders["auto:backward"] == [entry for entry in orders["auto:grad"] if entry[1] == "backward"]
        second_backward = len(orders["auto:grad"])
        for observed in run["observed"][1:]:
            after_first_demands = [kind for i, (_, _, kind) in enumerate(observed) if i not in (0, second_backward)]
            assert set(after_first_demands) <= {"hit", "resident"}, observed
            assert "hit" in {kind for _, _, kind in observed[second_backward:]}, observed  # the second backward prefetches


def test_steps_given_up_after_their_forward_keep_replaying_the_order():
    """Steps 1 and 3 stop after their forward inside ``iteration()``: each stops short of the order
    and is tolerated ([Note: a scope that stops short]); it used to drop the order and re-record."""
    for rank_result in spawn(_loop_all_modes, "given_up", True, timeout_s=300):
        assert_trains_like_plain(rank_result, "given_up", MODES[1:])
        run = rank_result[("given_up", "record_and_replay")]
        assert run["stats"]["recordings"] == 1 and run["stats"]["divergences"] == 0, run["stats"]
        for observed in run["observed"][1:]:
            assert {kind for _, _, kind in observed} <= {"hit", "resident"}, observed


def test_steps_running_more_or_fewer_microbatches_than_recorded_keep_replaying_the_order():
    """Recorded with 3 microbatches, then steps of 2, 1 and 4 inside ``iteration()``: the shorter
    ones stop short of the order, and each extra microbatch replays the order's last segment again,
    missing only its first demand ([Note: more microbatches than recorded]). The first replay used
    to trim the order to its last 2 microbatches (a one-off prefix, it thought), the step of 1 then
    diverged (a second short step in a row), and every demand past the order's end missed."""
    for rank_result in spawn(_loop_all_modes, "varying_microbatches", True, timeout_s=300):
        assert_trains_like_plain(rank_result, "varying_microbatches", MODES[1:])
        run = rank_result[("varying_microbatches", "record_and_replay")]
        assert run["stats"]["recordings"] == 1 and run["stats"]["divergences"] == 0, run["stats"]
        assert len(run["orders"]["train"]) == len(run["observed"][0])  # as recorded
        for count, observed in zip(MICROBATCHES[1:], run["observed"][1:]):
            per_microbatch = len(observed) // count
            misses = [i for i, (_, _, kind) in enumerate(observed) if kind == "miss"]
            assert misses == [per_microbatch * mb for mb in range(MICROBATCHES[0], count)], observed


BOTH_SCOPES = {"method_calls": (method_call_workload, run_through_loss), "multi_head": (multi_head_workload, run_iteration)}
"""Workloads run in explicit and automatic scopes alike: how each is built, and one step of it."""


def _both_scopes_all_modes(mesh, name: str) -> dict:
    make_workload, iterate = BOTH_SCOPES[name]
    w = make_workload()
    runs = {}
    for explicit_scope in (True, False):
        for mode in MODES:
            model = w.make_model().shard(mesh)
            sched = None if mode == "plain" else attach(model, contender_config(mode))
            run = train(model, w, sched, STEPS, scoped=explicit_scope, iterate=iterate)
            runs[(explicit_scope, mode)] = run | {"stats": sched.stats.as_dict() if sched else None}
    return runs


def _runs_in(rank_result: dict, name: str, explicit_scope: bool) -> dict:
    return {(name, mode): run for (scoped, mode), run in rank_result.items() if scoped is explicit_scope}


def test_units_run_through_registered_forward_methods_train_bitwise():
    """The root and the even blocks run through ``register_fsdp_forward_method`` methods, in explicit
    and automatic scopes (a root's method opens none: its forward demands are only counted)."""
    per_step = 2 * 5  # a forward and a backward demand of each unit (the root and 4 blocks)
    for rank_result in spawn(_both_scopes_all_modes, "method_calls", timeout_s=300):
        for explicit_scope in (True, False):
            runs = _runs_in(rank_result, "method_calls", explicit_scope)
            assert_trains_like_plain(runs, "method_calls", MODES[1:])
            # every demand seen, the method calls' forwards included
            assert runs[("method_calls", "demand")]["stats"]["demands"] == STEPS * per_step
        stats = rank_result[(True, "record_and_replay")]["stats"]
        assert stats["recordings"] == 1 and stats["divergences"] == 0, stats
        assert stats["misses"] < per_step, stats  # in its recording step only


def test_microbatches_through_different_heads_train_bitwise():
    """Multi-task training: each of a step's 3 microbatches runs the head its batch picks. Replay
    records once, in explicit scopes too: a head skipped in one microbatch and run in the next used
    to be taken for a changed order, and the key re-recorded (tests/fake/test_segments.py)."""
    for rank_result in spawn(_both_scopes_all_modes, "multi_head", timeout_s=300):
        for explicit_scope in (True, False):
            runs = _runs_in(rank_result, "multi_head", explicit_scope)
            assert_trains_like_plain(runs, "multi_head", MODES[1:])
            stats = runs[("multi_head", "record_and_replay")]["stats"]
            assert stats["recordings"] == 1 and stats["divergences"] == 0, stats
