import pytest

from fsdp_replay import Phase, PrefetchConfig, PrefetchMode
from fsdp_replay._order import Depth


def test_defaults_are_record_and_replay_depth_one():
    config = PrefetchConfig()
    assert config.mode is PrefetchMode.record_and_replay
    assert (config.forward_prefetch, config.backward_prefetch) == (1, 1)
    assert config.max_prefetch_bytes is None and config.check_ranks and config.on_divergence == "fallback"
    assert config.max_reuse_distance == 0  # plain FSDP2's memory: keeps only within the lookahead


def test_mode_accepts_member_names_as_users_type_them():
    for name in ("static", "record_and_replay", "demand"):
        assert PrefetchConfig(mode=name).mode is PrefetchMode[name]


def test_unknown_mode_names_value_and_valid_modes():
    with pytest.raises(ValueError, match=r"'fast'.*static, record_and_replay, demand"):
        PrefetchConfig(mode="fast")


@pytest.mark.parametrize("field", ["forward_prefetch", "backward_prefetch", "max_reuse_distance"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_negative_or_non_integer_depth_or_distance_is_rejected(field, bad):
    with pytest.raises(ValueError, match=rf"{field} must be an integer >= 0.*{bad!r}"):
        PrefetchConfig(**{field: bad})


@pytest.mark.parametrize("mode", ["static", "demand"])
def test_a_reuse_distance_outside_record_and_replay_is_rejected(mode):
    with pytest.raises(ValueError, match=rf"max_reuse_distance=2 needs mode record_and_replay.*got mode {mode}"):
        PrefetchConfig(mode=mode, max_reuse_distance=2)
    assert PrefetchConfig(mode=mode, max_reuse_distance=0).max_reuse_distance == 0


@pytest.mark.parametrize("bad", [0, -5, 2.0])
def test_non_positive_byte_cap_is_rejected(bad):
    with pytest.raises(ValueError, match="max_prefetch_bytes must be a positive integer"):
        PrefetchConfig(max_prefetch_bytes=bad)


def test_unknown_divergence_policy_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'ignore'.*fallback, raise"):
        PrefetchConfig(on_divergence="ignore")


def test_depth_follows_phase():
    config = PrefetchConfig(forward_prefetch=2, backward_prefetch=3)
    depth = Depth(config.forward_prefetch, config.backward_prefetch)  # as the scheduler builds it
    assert depth.of(Phase.forward) == 2 and depth.of(Phase.backward) == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_record_steps_below_one_or_not_an_integer_is_rejected(bad):
    with pytest.raises(ValueError, match=rf"PrefetchConfig.record_steps must be an integer >= 1.*got {bad!r}"):
        PrefetchConfig(record_steps=bad)
