"""Recorded orders in a checkpoint know what they were recorded on: a stale one is re-recorded, not replayed."""

import logging

import torch

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.workloads import linear_stack


def _recorded_state(world: int, layers: int = 4) -> dict:
    with fake_world(world) as mesh:
        model = linear_stack(mesh, layers=layers)
        sched = attach(model, PrefetchConfig())
        with sched.iteration("train"):
            model(torch.randn(4, 8)).sum().backward()
        return sched.state_dict()


def _resume(world: int, state: dict, caplog, layers: int = 4) -> tuple[dict, list[str]]:
    with fake_world(world) as mesh, caplog.at_level(logging.WARNING, logger="fsdp_replay"):
        model = linear_stack(mesh, layers=layers)
        sched = attach(model, PrefetchConfig())
        caplog.clear()
        sched.load_state_dict(state)
        said = [r.getMessage() for r in caplog.records]
        with sched.iteration("train"):
            model(torch.randn(4, 8)).sum().backward()
        return sched.stats.as_dict(), said


def test_the_same_setup_replays_from_the_first_step(caplog):
    stats, said = _resume(8, _recorded_state(8), caplog)
    assert said == [] and stats["recordings"] == 0 and stats["misses"] == 0


def test_a_changed_world_size_is_said_in_one_line_and_recorded_again(caplog):
    stats, said = _resume(16, _recorded_state(8), caplog)
    assert len(said) == 1 and "world size 8 -> 16" in said[0] and "recorded again" in said[0]
    assert stats["recordings"] == 1 and stats["divergences"] == 0


def test_a_changed_model_is_said_in_one_line_and_recorded_again(caplog):
    stats, said = _resume(8, _recorded_state(8, layers=4), caplog, layers=5)
    assert len(said) == 1 and "new units: 4" in said[0]
    assert stats["recordings"] == 1 and stats["divergences"] == 0


def test_another_torch_release_is_said_and_recorded_again(caplog):
    state = _recorded_state(8)
    state["signature"]["torch"] = "2.10"  # a release no CI leg runs
    stats, said = _resume(8, state, caplog)
    assert len(said) == 1 and "torch 2.10 -> " in said[0] and stats["recordings"] == 1


def test_a_version_1_state_still_loads(caplog):
    state = _recorded_state(8)
    state = {"version": 1, "orders": state["orders"]}
    stats, said = _resume(8, state, caplog)
    assert said == [] and stats["recordings"] == 0
