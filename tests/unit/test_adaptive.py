"""The adaptive depth's decisions on made-up waits: convergence, no oscillation, the byte cap.

The agreement across ranks runs on real ranks in ``tests/gloo/test_adaptive_depth.py``."""

import random

import pytest

from fsdp_replay import PrefetchConfig
from fsdp_replay._adaptive import AdaptiveDepth, ScopeWaits

SCOPE_S = 0.1


def _waits(forward_s: float, backward_s: float = 0.0, *, capped=(False, False)) -> ScopeWaits:
    return ScopeWaits(waited_s=(forward_s, backward_s), scope_s=SCOPE_S, capped=capped)


def _run(depths: AdaptiveDepth, wait_at, scopes: int, *, capped_at=lambda d: False) -> list[int]:
    """Feed ``scopes`` scopes whose forward wait at depth ``d`` is ``wait_at(d)``; the forward depth after each."""
    seen = []
    for _ in range(scopes):
        d = depths.of("train").forward
        depths.scope_ended("train", _waits(wait_at(d), capped=(capped_at(d), False)))
        seen.append(depths.of("train").forward)
    return seen


def _alone(values: list[int]) -> list[int]:
    return values


def test_goes_deeper_while_it_helps_then_stays_put():
    depths = AdaptiveDepth("auto", 1, deepest=8, agree=_alone)
    # Each step deeper hides 8 ms of a 20 ms wait, until nothing is left at depth 4.
    seen = _run(depths, lambda d: max(0.0, 0.020 - 0.008 * (d - 1)), 40)
    assert seen[:3] == [2, 3, 4] and set(seen[3:]) == {4}
    assert depths.of("train").backward == 1, "a fixed phase is never changed"


def test_a_step_deeper_that_does_not_help_is_undone_and_not_tried_again():
    depths = AdaptiveDepth("auto", "auto", deepest=8, agree=_alone)
    seen = _run(depths, lambda d: 0.010, 40)  # a wait no depth hides (e.g. the first gather)
    assert seen[:2] == [2, 1] and set(seen[2:]) == {1}


def test_a_step_deeper_must_win_back_a_significant_wait_not_only_a_fifth():
    depths = AdaptiveDepth("auto", 1, deepest=8, agree=_alone)
    # Each step deeper cuts a 4 ms wait by a quarter, 1 ms of a 100 ms scope: inside one scope's
    # timing noise, so the depth goes back to 1 rather than climbing a unit's bytes at a time.
    seen = _run(depths, lambda d: 0.004 * 0.75 ** (d - 1), 20)
    assert seen[:2] == [2, 1] and set(seen[2:]) == {1}, seen


def test_noisy_waits_change_the_depth_a_bounded_number_of_times():
    rng = random.Random(0)
    depths = AdaptiveDepth("auto", 1, deepest=8, agree=_alone)
    seen = _run(depths, lambda d: max(0.0, 0.012 - 0.004 * d) + rng.uniform(0, 0.004), 200)
    changes = sum(a != b for a, b in zip(seen, seen[1:]))
    assert changes <= 2 * 8 and len(set(seen[-100:])) == 1, seen


def test_the_byte_cap_bounds_the_depth_and_a_new_cap_is_relearnt():
    depths = AdaptiveDepth("auto", 1, deepest=8, agree=_alone)
    capped_above = [2]
    seen = _run(depths, lambda d: max(0.0, 0.020 - 0.004 * d), 12, capped_at=lambda d: d > capped_above[0])
    assert max(seen) == 3 and set(seen[3:]) == {2}, seen
    capped_above[0] = 5
    depths.cap_changed()
    seen = _run(depths, lambda d: max(0.0, 0.020 - 0.004 * d), 12, capped_at=lambda d: d > capped_above[0])
    assert max(seen) <= 6 and seen[-1] == 5, seen


def test_memory_is_given_back_once_the_order_is_recorded_again():
    depths = AdaptiveDepth("auto", 1, deepest=8, agree=_alone)
    _run(depths, lambda d: max(0.0, 0.020 - 0.008 * (d - 1)), 10)
    assert depths.of("train").forward == 4
    depths.rerecorded("train")  # a new workload, which nothing waits in
    seen = _run(depths, lambda d: 0.0, 10)
    assert seen[-1] == 1


def test_auto_is_accepted_and_other_strings_are_not():
    assert PrefetchConfig(forward_prefetch="auto", backward_prefetch="auto").forward_prefetch == "auto"
    with pytest.raises(ValueError, match=r"forward_prefetch must be an integer >= 0 \(0 disables it; or 'auto'\), got 'Auto'"):
        PrefetchConfig(forward_prefetch="Auto")
