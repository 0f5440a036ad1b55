"""Tolerant replay on the conditional workloads (idle MoE experts, LayerDrop) at world size 8.

After ``record_steps`` merged recordings, 60 replayed steps: at least 90% of the demands that need a
gather find it issued ahead, at most one divergence per 50 steps, at most 10% of the gathers issued
are wasted; read from the scheduler's stats and, independently, from FSDP2's state (the observer).
"""

import pytest
import torch

from fsdp_replay import PrefetchConfig, PrefetchDivergenceError, attach
from fsdp_replay.stats import MissReason
from fsdp_replay.testing.internals import gather_pending, param_groups
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import CallSequenceModel, conditional_workloads, run_iteration, workload

RECORD_STEPS = 4
STEPS = 60
assert all(w.record_steps == RECORD_STEPS for w in conditional_workloads())


def _replayed(mesh, name: str) -> tuple:
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = attach(model, PrefetchConfig(record_steps=RECORD_STEPS))
    observer = DemandObserver(model)
    skipped = 0
    for step in range(RECORD_STEPS + STEPS):
        if step == RECORD_STEPS:
            sched.reset_stats()
            observer.take()
        with sched.iteration("train"):
            run_iteration(model, w, step)
        if step >= RECORD_STEPS:
            skipped += len(sched.explain("train").skipped)
    return sched, observer.take(), skipped


@pytest.mark.parametrize("name", [w.name for w in conditional_workloads()])
def test_replay_keeps_prefetching_through_data_dependent_skips(mesh8, name):
    sched, observed, skipped = _replayed(mesh8, name)
    s = sched.stats
    seen = DemandObserver.counts(observed)
    assert skipped > 0, "the data skipped no unit: the workload does not exercise tolerance"
    assert (s.hits, s.misses, s.resident) == (seen.get("hit", 0), seen.get("miss", 0), seen.get("resident", 0))
    assert s.recordings == 0 and s.divergences <= STEPS // 50, s
    assert seen["hit"] >= 0.9 * (seen["hit"] + seen["miss"]), (seen, s)
    assert s.wasted <= 0.1 * (s.prefetches + s.misses), s
    assert (s.wasted_bytes > 0) == (s.wasted > 0), s
    assert set(s.miss_reasons) <= {MissReason.skipped_ahead, MissReason.not_in_order, MissReason.speculative}, s


def test_merged_recording_knows_how_often_each_expert_ran(mesh8):
    w = workload("moe_dynamic")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(record_steps=RECORD_STEPS))
    ran: dict[str, int] = {}
    observer = DemandObserver(model)
    for step in range(RECORD_STEPS):
        with sched.iteration("train"):
            run_iteration(model, w, step)
        for fqn in {fqn for fqn, phase, _ in observer.take() if phase == "forward"}:
            ran[fqn] = ran.get(fqn, 0) + 1
        assert (sched.recorded_order("train") is None) == (step < RECORD_STEPS - 1)
    order = sched._orders.get("train")
    shares = {e.unit.fqn: e.share for e in order.entries if e.phase.value == "forward"}
    assert shares == {fqn: n / RECORD_STEPS for fqn, n in ran.items()}
    assert any(share < 1 for share in shares.values())


def test_a_swap_of_two_units_still_diverges_once_and_rerecords(mesh8):
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())
    reports = []
    for step, calls in enumerate([[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]):
        model.calls = calls
        with sched.iteration("train"):
            run_iteration(model, w, step)
        reports.append(sched.explain())
    assert (sched.stats.divergences, sched.stats.recordings) == (1, 2)
    swapped = reports[2]
    assert swapped.outcome.startswith("diverged")
    assert "diverged at demand 2: expected ('blocks.1', 'forward'), got ('blocks.2', 'forward')" in swapped.rows[2].detail
    assert {row.served for row in reports[4].rows} <= {"hit", "kept", "resident"}


def _blocks_model(mesh, n_blocks: int) -> CallSequenceModel:
    torch.manual_seed(0)
    model = CallSequenceModel(dim=8, hidden=16, n_blocks=n_blocks, calls=range(n_blocks))
    return model.shard(mesh)


def _step(model: CallSequenceModel, sched, calls, step: int) -> None:
    model.calls = list(calls)
    with sched.iteration("train"):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).backward()


def test_units_no_recorded_scope_ran_together_are_not_taken_for_a_reordering(mesh8):
    """LayerDrop recordings of blocks 0, 1, 3 and of 0, 2 merge with 3 before 2 (no scope showed
    which comes first); a step running all four replays ([Note: skips of entries that ran in some
    scopes]). Two blocks that ran in every recorded scope, swapped, still diverge."""
    model = _blocks_model(mesh8, 4)
    sched = attach(model, PrefetchConfig(record_steps=2, on_divergence="raise"))
    _step(model, sched, [0, 1, 3], 0)
    _step(model, sched, [0, 2], 1)
    forward = [fqn for fqn, phase in sched.recorded_order("train") if phase == "forward"]
    assert forward.index("blocks.3") < forward.index("blocks.2"), forward  # the premise
    for step in (2, 3, 4):
        _step(model, sched, [0, 1, 2, 3], step)
        assert sched.explain("train").outcome == "completed", sched.explain("train")
    assert (sched.stats.divergences, sched.stats.recordings) == (0, 1)
    with pytest.raises(PrefetchDivergenceError, match=r"expected \('blocks.0', 'forward'\), got \('blocks.1', 'forward'\)"):
        _step(model, sched, [1, 0, 2, 3], 5)


def test_a_step_that_exits_early_keeps_the_order_and_two_in_a_row_record_again(mesh8, caplog):
    """An early-exit step runs 2 of 6 blocks, every demand in the order: tolerated once ([Note: a
    scope that stops short]); a second in a row diverges and the next scope records."""
    model = _blocks_model(mesh8, 6)
    sched = attach(model, PrefetchConfig())
    for step, calls in enumerate([range(6), range(6), [0, 1], range(6), [0, 1], [0, 1], [0, 1]]):
        _step(model, sched, calls, step)
        if step == 3:
            assert (sched.stats.divergences, sched.stats.recordings) == (0, 1)
            assert {row.served for row in sched.explain("train").rows} <= {"hit", "kept", "resident"}
    assert (sched.stats.divergences, sched.stats.recordings) == (1, 2)
    assert "and so did its key's scope before it" in caplog.text
    assert [fqn for fqn, phase in sched.recorded_order("train") if phase == "forward"] == ["<root>", "blocks.0", "blocks.1"]


def _one_expert_a_step(mesh, steps: int, experts: int = 8) -> tuple:
    """Blocks 0-1, one of ``experts`` experts (blocks 2..) picked per step alike on every rank, blocks 2-3 after."""
    model = _blocks_model(mesh, 4 + experts)
    sched = attach(model, PrefetchConfig(record_steps=RECORD_STEPS, on_divergence="raise"))
    picks = torch.randint(0, experts, (steps,), generator=torch.Generator().manual_seed(0)).tolist()
    for step, expert in enumerate(picks):
        _step(model, sched, [0, 1, 4 + expert, 2, 3], step)
    return sched


def test_skipped_experts_that_ran_in_some_recorded_scopes_do_not_make_the_scope_diverge(mesh8):
    """Top-1 of 8 experts: each step skips the experts recorded in other steps, as many entries as
    it runs. Those skips were expected and do not count against the scope (MIN_MATCHED): it used to
    diverge at 6 of 40 steps and record most others."""
    sched = _one_expert_a_step(mesh8, 40)
    s = sched.stats
    assert (s.divergences, s.recordings) == (0, 1), s
    assert set(s.miss_reasons) <= {
        MissReason.recording, MissReason.not_in_order, MissReason.speculative, MissReason.skipped_ahead
    }, s


def test_units_run_in_only_some_scopes_are_gathered_at_most_depth_ahead(mesh8):
    """16 experts each run in about 70% of the steps ([Note: sometimes-run entries ahead]): at
    depth 1 no more than 3 units are unsharded or gathering at any use (the one in use, one gather
    for an entry that always ran, one for an entry that ran sometimes); it was 10-11."""
    experts = 16
    model = _blocks_model(mesh8, 4 + experts)
    sched = attach(model, PrefetchConfig(record_steps=RECORD_STEPS))
    units = list(model.blocks)
    peak = [0]

    def probe(*_) -> None:
        peak[0] = max(peak[0], sum(not g.is_sharded or gather_pending(g) for u in units for g in param_groups(u)))

    for unit in units:
        unit.register_forward_pre_hook(probe)
        unit.register_full_backward_pre_hook(probe)
    rng = torch.Generator().manual_seed(3)
    peaks = []
    for step in range(12):
        chosen = [4 + e for e in range(experts) if torch.rand((), generator=rng) < 0.7]
        peak[0] = 0
        _step(model, sched, [0, 1, *chosen, 2, 3], step)
        peaks.append(peak[0])
    assert sched.stats.recordings == 1 and sched.stats.prefetches > 0
    assert max(peaks[RECORD_STEPS:]) <= 3, peaks


@pytest.mark.parametrize("record_steps", [1, RECORD_STEPS])
def test_an_order_keeps_every_microbatch_whatever_its_first_replay_runs(mesh8, record_steps):
    """Gradient accumulation with LayerDrop: every recorded step ran microbatch 0 without block 0.
    A first replay that runs it there used to be taken for an order after a one-off prefix (the
    prefix rule), trimming the order to its last microbatch for good. A merged order has no one-off
    prefix to skip; a single recording is trimmed only where the first replay ran the suffix
    exactly (``Replay.followed_order``)."""
    model = _blocks_model(mesh8, 3)
    sched = attach(model, PrefetchConfig(record_steps=record_steps))
    for step in range(record_steps + 3):
        model.calls = [1, 2] if step < record_steps else [0, 1, 2]
        with sched.iteration("train"):
            for mb in range(2):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + mb))).backward()
                model.calls = [0, 1, 2]
        if step == record_steps - 1:
            order = sched.recorded_order("train")
    assert sched.recorded_order("train") == order and sched.stats.divergences == 0
    assert sched.stats.miss_reasons[MissReason.more_microbatches] <= (record_steps == 1)  # the first replay's
