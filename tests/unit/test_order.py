import weakref

import pytest

from fsdp_replay._order import (
    WARN_EVERY,
    Cursor,
    Depth,
    Entry,
    ExecutionOrder,
    MergedRecordings,
    Phase,
    RecordedOrders,
    Recording,
    first_difference,
)
from fsdp_replay._units import Unit
from fsdp_replay.stats import Count, Demand, KeyStats, PrefetchStats


class _State:
    """Stands in for an FSDP2 state: units only hold it by weak reference."""


def _units(*names):
    states = [_State() for _ in names]
    units = [Unit(n, i, 100, weakref.ref(s), ()) for i, (n, s) in enumerate(zip(names, states))]
    return units, states


def test_order_keeps_repeats_and_mixed_phases_in_sequence():
    (a, b), _ = _units("a", "b")
    order = ExecutionOrder(
        [Entry(a, Phase.forward, True), Entry(b, Phase.forward, True), Entry(a, Phase.forward, True),
         Entry(a, Phase.backward, True), Entry(b, Phase.recompute, False)]
    )
    assert order.as_list() == [("a", "forward"), ("b", "forward"), ("a", "forward"), ("a", "backward"), ("b", "recompute")]


def test_cursor_checks_and_advances_monotonically():
    (a, b), _ = _units("a", "b")
    cursor = Cursor(ExecutionOrder([Entry(a, Phase.forward, True), Entry(b, Phase.backward, True)]))
    assert cursor.expected.matches(a, Phase.forward) and not cursor.expected.matches(a, Phase.backward)
    cursor.advance()
    assert [e.unit for e in cursor.lookahead().entries] == [b]
    cursor.advance()
    assert cursor.done and cursor.expected is None and cursor.lookahead().entries == ()


def test_lookahead_takes_the_phase_depth_skips_resident_and_stops_at_repeats_and_segments():
    (a, b, c, d, r), _ = _units("a", "b", "c", "d", "root")
    order = ExecutionOrder(
        [Entry(r, Phase.forward, False), Entry(a, Phase.forward, True), Entry(b, Phase.forward, True),
         Entry(a, Phase.forward, True), Entry(c, Phase.backward, True), Entry(r, Phase.backward, False),
         Entry(b, Phase.backward, True), Entry(d, Phase.backward, True), Entry(c, Phase.forward, True, 1)]
    )
    ahead = order.lookahead(Depth(3, 1))
    names = [[e.unit.fqn for e in lookahead.entries] for lookahead in ahead]
    # One entry beyond the depth: a unit in use is kept rather than gathered, and takes no gather slot.
    assert names[0] == ["a", "b"]  # root takes no slot; one use of a unit at a time
    assert names[2] == ["b", "a", "c"] and ahead[2].gathers == 3  # forward depth 3, then the segment ends
    assert names[4] == ["c", "b"] and ahead[4].gathers == 1  # backward depth 1, past the resident root
    assert names[6] == ["b", "d"]
    assert names[7] == ["d"]  # c's forward is in the next segment
    assert names[9] == [] and ahead[9].gathers == 0  # past the end
    assert all(lookahead.entries == () for lookahead in order.lookahead(Depth(0, 0)))  # depth 0 holds nothing
    assert order.lookahead(Depth(3, 1)) is ahead  # computed once per depths


def test_reuse_reaches_a_units_next_gathered_use_within_the_distance_and_its_segment():
    (a, b, c, d), _ = _units("a", "b", "c", "d")
    order = ExecutionOrder(
        [Entry(a, Phase.forward, True), Entry(b, Phase.forward, True), Entry(c, Phase.forward, True),
         Entry(d, Phase.backward, False), Entry(b, Phase.recompute, True), Entry(a, Phase.recompute, True),
         Entry(c, Phase.backward, False), Entry(d, Phase.forward, True, 1), Entry(d, Phase.backward, True, 1)]
    )

    def reuses(distance):
        return [(e.unit.fqn, e.phase.value) if e else None for e in (x.reuse for x in order.lookahead(Depth(1, 1), distance))]

    # Position p's reuse is for the demand at p - 1. b's recompute has one gather before it (c's
    # forward), a's three (d's backward was resident when recorded); c's next use is resident,
    # and nothing is kept across the end of a backward (d's forward and backward in segment 1:
    # no gather between).
    last = [None, None, None, None, None, ("d", "backward"), None]
    assert reuses(0) == [None] * 10
    assert reuses(1) == reuses(2) == [None, None, ("b", "recompute"), *last]
    assert reuses(3) == reuses(9) == [None, ("a", "recompute"), ("b", "recompute"), *last]
    assert order.lookahead(Depth(1, 1), 3) is order.lookahead(Depth(1, 1), 3)  # computed once
    assert all(x.reuse is None for x in order.lookahead(Depth(0, 0), 5))  # depth 0: nothing held


def test_state_round_trip_and_digest_are_stable():
    (a, b), _ = _units("a", "b")
    order = ExecutionOrder([Entry(a, Phase.forward, True, 0), Entry(b, Phase.backward, False, 1)])
    restored = ExecutionOrder.from_state(order.to_state(), {"a": a, "b": b})
    assert restored.to_state() == order.to_state()
    assert restored.digest() == order.digest() and 0 <= order.digest() < 2**62


def test_digest_sees_phase_and_gather_need():
    (a,), _ = _units("a")
    base = ExecutionOrder([Entry(a, Phase.forward, True)]).digest()
    assert ExecutionOrder([Entry(a, Phase.recompute, True)]).digest() != base
    assert ExecutionOrder([Entry(a, Phase.forward, False)]).digest() != base


def test_from_state_says_why_an_order_naming_an_unknown_unit_is_stale():
    (a,), _ = _units("a")
    assert "'zz'" in ExecutionOrder.from_state([("a", "forward", True, 0), ("zz", "forward", True, 0)], {"a": a})


def test_from_state_rejects_malformed_entries():
    (a,), _ = _units("a")
    with pytest.raises(ValueError, match="phase 'sideways'; valid phases are forward, backward, recompute"):
        ExecutionOrder.from_state([("a", "sideways", True, 0)], {"a": a})
    with pytest.raises(ValueError, match="expected \\(fqn, phase, needs_gather, segment\\[, share\\]\\)"):
        ExecutionOrder.from_state([("a", "forward")], {"a": a})


def test_first_difference_handles_prefixes():
    assert first_difference([(1,), (2,)], [(1,), (3,)]) == 1
    assert first_difference([(1,)], [(1,), (2,)]) == 1


def test_units_hold_their_state_weakly():
    (a,), states = _units("a")
    del states[:]
    with pytest.raises(RuntimeError, match="garbage collected"):
        a.state


def test_stats_keep_totals_and_per_key_breakdown():
    stats = PrefetchStats()
    stats.count("train", "demands", 3)
    stats.count("train", "hits", 2)
    stats.count("eval", "demands")
    stats.count("eval", "resident")
    assert stats.demands == 4 and stats.per_key["train"].hits == 2 and stats.per_key["eval"].resident == 1
    assert stats.hit_rate == pytest.approx(0.75)


def test_counters_name_every_stats_field_and_each_demand_class_its_counter():
    assert [c.value for c in Count] == list(KeyStats().as_dict())
    assert {d: d.counter for d in Demand} == {Demand.hit: Count.hits, Demand.miss: Count.misses, Demand.resident: Count.resident}


def _recording(*entries):
    recording = Recording(units=len(entries))
    for unit, phase in entries:
        recording.append(unit, phase, needs_gather=True)
    return recording


def test_merged_recordings_keep_every_entry_once_with_the_share_of_scopes_it_ran_in():
    (a, b, c, d), _ = _units("a", "b", "c", "d")
    f = Phase.forward
    merged = MergedRecordings()
    for ran in ([a, b, c, d], [a, c, d], [a, b, d], [a, b, c, d]):
        merged.add(_recording(*[(u, f) for u in ran]))
    order = merged.order()
    assert order.as_list() == [("a", "forward"), ("b", "forward"), ("c", "forward"), ("d", "forward")]
    assert [e.share for e in order.entries] == [1.0, 0.75, 0.75, 1.0] and order.conditional


def test_a_unit_demanded_a_varying_number_of_times_in_a_row_counts_its_first_demands_most():
    """A block looped 3, 3, 5 and 2 times: the stretch's first two entries ran in every scope, its
    last two in one. difflib alone matches the 5-loop's extra demands to the stretch's first
    entries in forward (part of a longer block running into the backward), which made them look
    rare and stopped the refill before the unit after the loop."""
    (a, b, c), _ = _units("a", "b", "c")
    f, bw = Phase.forward, Phase.backward
    merged = MergedRecordings()
    for loops in (3, 3, 5, 2):
        merged.add(_recording(*([(a, f)] + [(b, f)] * loops + [(c, f), (c, bw)] + [(b, bw)] * loops + [(a, bw)])))
    order = merged.order()
    stretches = [[e.share for e in order.entries if e.unit is b and e.phase is phase] for phase in (f, bw)]
    assert stretches == [[1.0, 1.0, 0.75, 0.25, 0.25]] * 2
    # After three loops, the refill passes the two rare entries and provides for c.
    after_third = [e.unit.fqn for e in order.lookahead(Depth(1, 1))[4].entries]
    assert after_third[0] == "c"


def test_lookahead_leaves_unread_only_a_last_entry_that_always_ran_and_encloses_no_unit():
    (a, b, c), states = _units("a", "b", "c")
    outer = Unit("outer", 3, 100, weakref.ref(states[0]), (), encloses=True)
    entries = [Entry(a, Phase.forward, True), Entry(b, Phase.forward, True), Entry(outer, Phase.forward, True),
               Entry(a, Phase.backward, True), Entry(c, Phase.backward, True, share=0.75)]
    ahead = ExecutionOrder(entries).lookahead(Depth(1, 1))
    assert [([e.unit.fqn for e in la.entries], la.unread) for la in ahead] == [
        (["a", "b"], entries[1]),  # once a takes the slot, the refill may stop at b unread
        (["b", "outer"], None),  # outer may be in use around the unit just demanded: read
        (["outer", "a"], entries[3]),
        (["a", "c"], None),  # c did not run in every recorded scope: it takes no slot, never a mere stop
        (["c"], None),
        ([], None),  # past the end
    ]


def test_lookahead_passes_rarely_run_entries_and_sometimes_run_ones_take_no_depth_slot():
    (a, b, c, d, e), _ = _units("a", "b", "c", "d", "e")
    f = Phase.forward
    order = ExecutionOrder(
        [Entry(a, f, True), Entry(b, f, True, share=0.25), Entry(c, f, True, share=0.75), Entry(d, f, True),
         Entry(e, f, True)]
    )
    # From a's position at depth 1: b is rare (not provided for), c takes no slot, d and the one spare.
    assert [x.unit.fqn for x in order.lookahead(Depth(1, 1))[1].entries] == ["c", "d", "e"]
    assert [x.unit.fqn for x in ExecutionOrder(order.entries[:1] + order.entries[3:]).lookahead(Depth(1, 1))[1].entries] == ["d", "e"]


def test_cursor_finds_a_demand_further_on_in_its_segment_only():
    (a, b, c), _ = _units("a", "b", "c")
    order = ExecutionOrder([Entry(a, Phase.forward, True), Entry(b, Phase.forward, True), Entry(c, Phase.backward, True, 1)])
    cursor = Cursor(order)
    assert cursor.find(b, Phase.forward) == 1 and cursor.find(c, Phase.backward) is None
    cursor.end_backward()
    assert cursor.find(c, Phase.backward) == 2


def test_cursor_repeats_the_last_segment_only_past_the_end_after_the_last_backward():
    (a, b, c), _ = _units("a", "b", "c")
    F, B = Phase.forward, Phase.backward
    # Two microbatches: a, b forward then b, a backward in each; c only in the first.
    order = ExecutionOrder(
        [Entry(c, F, True), Entry(a, F, True), Entry(b, F, True), Entry(b, B, True), Entry(a, B, True)]
        + [Entry(a, F, True, 1), Entry(b, F, True, 1), Entry(b, B, True, 1), Entry(a, B, True, 1)]
    )
    assert order.last_segment_start == 5
    cursor = Cursor(order)
    assert cursor.repeat(a, F) is None  # not past the end
    cursor.position = 5
    assert not cursor.between_segments  # the first segment's backward has not ended
    cursor.end_backward()
    assert cursor.between_segments
    cursor.segment = 0
    cursor.position = len(order)
    cursor.end_backward()
    assert cursor.repeat(a, F) is None and cursor.position == len(order)  # the last backward has not ended
    cursor.end_backward()
    assert cursor.repeat(c, F) is None and cursor.position == len(order)  # not in the last segment
    assert cursor.repeat(b, F) == 6  # found further on: the caller skips the entry before it
    assert (cursor.position, cursor.segment) == (5, 1)
    assert [e.unit for e in cursor.lookahead().entries] == [a, b]
    assert ExecutionOrder([]).last_segment_start == 0


def test_an_order_dropped_again_within_warn_every_scopes_warns_once(caplog):
    (a,), _ = _units("a")
    orders = RecordedOrders()
    with caplog.at_level("INFO", logger="fsdp_replay"):
        for scope in range(WARN_EVERY + 2):
            orders.began("train")
            orders.install("train", _recording((a, Phase.forward)))
            orders.drop("train", reason=f"drop {scope}")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and "drop 0" in warnings[0] and f"drop {WARN_EVERY}" in warnings[1]


def test_entries_a_scope_found_sharded_need_gathers_from_then_on():
    (a, b), _ = _units("a", "b")
    order = ExecutionOrder(
        [Entry(a, Phase.forward, False), Entry(b, Phase.forward, False), Entry(b, Phase.backward, True, segment=0)]
    )
    assert order.needing_gathers([False, False, False]) is order
    assert order.needing_gathers([False, False, True]) is order  # already needs one: nothing changes
    marked = order.needing_gathers([True, False, False])
    assert [e.needs_gather for e in marked.entries] == [True, False, True]
    assert marked.as_list() == order.as_list() and [e.segment for e in marked.entries] == [0, 0, 0]
    with pytest.raises(ValueError):
        order.needing_gathers([True])  # one flag per entry
