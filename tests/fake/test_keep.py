"""Replay keeps a unit unsharded when the order needs it again next, instead of re-gathering it."""

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay._window import Held
from fsdp_replay.stats import MissReason
from fsdp_replay.testing.internals import gather_pending, param_groups, window
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import Block, CallSequenceModel, NestedBlock, Workload, run_iteration, workload


def _gathers(log):
    return sum(kind != "resident" for _, _, kind in log)


def _assert_all_sharded_with_settings_restored(model):
    for block in model.blocks:
        for group in param_groups(block):
            assert not group.is_unsharded and not gather_pending(group)
            assert group.post_forward_mesh_info is not None and group.reshard_after_backward


def test_back_to_back_uses_are_kept_unsharded_and_skip_their_all_gathers(mesh):
    w = workload("shared_block")  # blocks.1 called three times in a row
    runs = {}
    for mode in ("demand", "record_and_replay"):
        model = w.make_model().shard(mesh)
        sched = attach(model, PrefetchConfig(mode=mode))
        observer = DemandObserver(model)
        for step in range(3):
            kept_before = sched.stats.kept
            with sched.iteration("train"):
                run_iteration(model, w, step)
            log = observer.take()
        runs[mode] = (log, sched.stats.kept - kept_before, model)
    replay_log, kept, model = runs["record_and_replay"]
    # Calls 2 and 3 of blocks.1 in each direction, and the last forward unit into its backward.
    assert [(f, p) for f, p, kind in replay_log if kind == "resident" and f != "<root>"] == [
        ("blocks.1", "forward"), ("blocks.1", "forward"), ("blocks.3", "backward"),
        ("blocks.1", "backward"), ("blocks.1", "backward"),
    ]
    assert kept == 5 and all(kind in ("hit", "resident") for _, _, kind in replay_log)
    assert _gathers(replay_log) == _gathers(runs["demand"][0]) - kept
    _assert_all_sharded_with_settings_restored(model)


def test_a_keep_takes_no_gather_slot_but_counts_against_the_byte_cap(mesh8):
    w = workload("shared_block", n_blocks=6)
    for cap in (None, "one unit"):
        model = w.make_model().shard(mesh8)
        sched = attach(model, PrefetchConfig())
        if cap:
            sched.detach()
            sched = attach(model, PrefetchConfig(max_prefetch_bytes=max(u.unsharded_bytes for u in sched.units)))
        held = []

        def count_held(module, args):
            held.append((len(window(sched).units(Held.prefetched)), len(window(sched).units(Held.kept))))

        for step in range(3):
            handles = [m.register_forward_pre_hook(count_held) for m in model.blocks]
            with sched.iteration("train"):
                run_iteration(model, w, step)
            for h in handles:
                h.remove()
        assert max(p for p, _ in held) == 1 and max(k for _, k in held) == 1, cap  # depth 1: one gather ahead
        assert max(p + k for p, k in held) == (2 if cap is None else 1), cap
        assert sched.stats.kept > 0 and sched.stats.wasted == 0


def _recorded(mesh, name, config=None):
    """A model with the scheduler attached and its order recorded by one scope."""
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = attach(model, config or PrefetchConfig())
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    return w, model, sched


def test_kept_units_are_resharded_when_their_next_use_is_skipped(mesh8):
    w, model, sched = _recorded(mesh8, "shared_block")
    model.calls = [0, 1, 1, 2, 3]  # blocks.1 is kept for a third call that never comes: replay skips it
    with sched.iteration("train"):
        run_iteration(model, w, 1)
    assert sched.stats.divergences == 0 and sched.stats.wasted >= 1
    assert ("blocks.1", "forward") in [(s.unit, s.phase) for s in sched.explain().skipped]
    _assert_all_sharded_with_settings_restored(model)


def test_kept_units_are_resharded_when_the_scope_diverges(mesh8):
    w, model, sched = _recorded(mesh8, "shared_block")
    model.calls = [0, 2, 1, 1, 1, 3]  # blocks.2 first: blocks.1 is skipped, then comes late
    with sched.iteration("train"):
        run_iteration(model, w, 1)
    assert sched.stats.divergences == 1 and sched.stats.wasted >= 1
    _assert_all_sharded_with_settings_restored(model)


@pytest.mark.parametrize("reuse_distance, kept", [(0, 1), (100, 4)])
def test_a_forward_only_scope_releases_the_units_kept_for_their_backward(mesh8, reuse_distance, kept):
    w, model, sched = _recorded(mesh8, "sequential", PrefetchConfig(max_reuse_distance=reuse_distance))
    with sched.iteration("train"):
        model(w.make_batch(1, 0))  # the last block (every block) is kept for a backward that does not come
    assert sched.stats.kept == kept and sched.stats.wasted >= kept and sched.stats.divergences == 0
    _assert_all_sharded_with_settings_restored(model)



def test_a_users_reshard_and_unshard_of_held_units_hand_them_over_cleanly(mesh8):
    """blocks.1 and blocks.2 are prefetched when blocks.0 runs; the user then reshards one and
    unshards the other by hand: both leave the window (bytes too), the reshard also frees the
    scheduler's pending gather (plain FSDP2 would have none after it), and counters match the observer."""
    w = workload("sequential")
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig(forward_prefetch=2))
    with sched.iteration("train"):
        run_iteration(model, w, 0)  # recording
    observer = DemandObserver(model)
    seen = {}

    def interfere(module, args):
        held_ahead = window(sched)
        units = {u.fqn: u for u in sched.units}
        seen["before"] = (held_ahead.holds(units["blocks.1"]), held_ahead.holds(units["blocks.2"]))
        model.blocks[1].reshard()
        model.blocks[2].unshard()
        held = [*held_ahead.units(Held.prefetched), *held_ahead.units(Held.kept)]
        seen["after"] = (held_ahead.holds(units["blocks.1"]), held_ahead.holds(units["blocks.2"]))
        seen["bytes"] = (held_ahead.bytes_ahead, sum(u.unsharded_bytes for u in held))
        seen["blocks.1"] = [(not gather_pending(g), g.is_sharded) for g in param_groups(model.blocks[1])]

    handle = model.blocks[0].register_forward_pre_hook(interfere)  # runs after FSDP2's pre-forward
    before = sched.stats.as_dict()
    with sched.iteration("train"):
        run_iteration(model, w, 1)
    handle.remove()
    stats = {k: v - before[k] for k, v in sched.stats.as_dict().items()}
    log = observer.take()
    assert seen["before"][0] is not None and seen["before"][1] is not None
    assert seen["after"] == (None, None) and seen["bytes"][0] == seen["bytes"][1]
    assert seen["blocks.1"] == [(True, True)]
    assert stats["dropped"] == 2 and stats["wasted"] == 0 and stats["divergences"] == 0
    observed = DemandObserver.counts(log)
    assert (stats["hits"], stats["misses"], stats["resident"]) == (
        observed.get("hit", 0), observed.get("miss", 0), observed.get("resident", 0)
    )
    assert ("blocks.1", "forward", "miss") in log and ("blocks.2", "forward", "resident") in log


def _replayed_keeps(mesh, config, *, interfere=None):
    """Steps of the checkpointed workload under ``config``; per replayed step, the units kept and the
    most bytes held ahead at any block's forward or recompute (``interfere(model)`` runs as the
    backward starts)."""
    w = workload("checkpointed", n_blocks=6)
    model = w.make_model().shard(mesh)
    sched = attach(model, config)
    held = []
    hooks = [m.register_forward_pre_hook(lambda *_: held.append(window(sched).bytes_ahead)) for m in model.blocks]
    if interfere is not None:
        hooks.append(model.head.register_full_backward_pre_hook(lambda *_: interfere(model)))
    kept = []
    for step in range(3):
        before, held[:] = sched.stats.kept, []
        with sched.iteration("train"):
            run_iteration(model, w, step)
        kept.append((sched.stats.kept - before, max(held)))
    for hook in hooks:
        hook.remove()
    return model, sched, kept[1:]


def test_a_reuse_distance_keeps_a_unit_from_its_forward_into_its_recompute_within_the_byte_cap(mesh8):
    """blocks.3 and blocks.4 run forward, then blocks.5 and its backward, then their recompute:
    three all-gathers from their forward. A distance of 3 keeps both (one keep into the last
    block's backward already happens); a cap of one unit leaves room for the nearest prefetch only."""
    unit = 4 * (32 * 64 * 2 + 64 + 32)  # a block's two linears, fp32
    _, _, kept = _replayed_keeps(mesh8, PrefetchConfig(max_reuse_distance=2))
    assert [k for k, _ in kept] == [1, 1]
    model, sched, kept = _replayed_keeps(mesh8, PrefetchConfig(max_reuse_distance=3))
    assert [k for k, _ in kept] == [3, 3] and max(b for _, b in kept) == 3 * unit
    assert sched.stats.wasted == 0
    _assert_all_sharded_with_settings_restored(model)
    _, _, kept = _replayed_keeps(mesh8, PrefetchConfig(max_reuse_distance=3, max_prefetch_bytes=unit))
    assert [k for k, _ in kept] == [1, 1] and max(b for _, b in kept) == unit


def test_a_unit_kept_for_its_recompute_is_handed_over_to_a_users_reshard(mesh8):
    def reshard_kept(model):
        model.blocks[3].reshard()

    model, sched, kept = _replayed_keeps(mesh8, PrefetchConfig(max_reuse_distance=3), interfere=reshard_kept)
    assert [k for k, _ in kept] == [3, 3] and sched.stats.wasted == 0
    # Dropped once per replayed scope; blocks.3's recompute is then prefetched like any other gather.
    assert sched.stats.dropped == 2
    assert sched.stats.miss_reasons == {MissReason.recording: sched.stats.misses}
    _assert_all_sharded_with_settings_restored(model)



class _OuterAroundAnInnerUnit(CallSequenceModel):
    """blocks.0 encloses a unit of its own (its ``up``) and runs again after blocks.1."""

    def __init__(self) -> None:
        kinds = iter([NestedBlock, Block])
        super().__init__(dim=16, hidden=32, n_blocks=2, calls=[0, 1, 0], block=lambda d, h: next(kinds)(d, h))

    def shard(self, mesh, **kwargs):
        fully_shard(self.blocks[0].up, mesh=mesh, **kwargs)
        return super().shard(mesh, **kwargs)


def test_an_enclosing_unit_in_use_is_kept_when_its_next_call_is_the_refills_last_entry(mesh8):
    # At blocks.0.up's demand the refill looks at blocks.1 (the depth's one gather) and, last,
    # blocks.0's second call: a last entry left unread ([Note: the last entry unread]) unless its unit
    # encloses another, as blocks.0 does; it is in use around blocks.0.up, so it is kept.
    batch = lambda step, mb: torch.randn(4, 16, generator=torch.Generator().manual_seed(step))  # noqa: E731
    w = Workload("outer_around_inner", _OuterAroundAnInnerUnit, batch)
    model = w.make_model().shard(mesh8)
    sched = attach(model, PrefetchConfig())
    encloses = {u.fqn: u.encloses for u in sched.units}
    assert encloses == {"<root>": True, "blocks.0": True, "blocks.0.up": False, "blocks.1": False}
    observer = DemandObserver(model)
    for step in range(3):
        with sched.iteration("train"):
            run_iteration(model, w, step)
        log = observer.take()
    assert [kind for fqn, phase, kind in log if (fqn, phase) == ("blocks.0", "forward")] == ["hit", "resident"]
    assert all(kind in ("hit", "resident") for _, _, kind in log)


@pytest.mark.parametrize("attach_after_first_forward", [False, True])
def test_the_byte_cap_counts_units_in_the_dtype_mixed_precision_gathers_them(mesh8, attach_after_first_forward):
    """FSDP2 sets a parameter's gather dtype at its lazy init: a scheduler attached before it (as
    ``fully_shard(root, prefetch=...)`` always is) counted bf16 gathers in fp32 bytes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    w = workload("sequential")
    model = w.make_model().shard(mesh8, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    if attach_after_first_forward:
        run_iteration(model, w, 0)
    sched = attach(model, PrefetchConfig(max_prefetch_bytes=10**9))
    block = next(u for u in sched.units if u.fqn == "blocks.0")
    assert block.unsharded_bytes == 2 * sum(p.numel() for p in model.blocks[0].parameters())
