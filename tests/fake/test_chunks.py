"""One scheduler over several FSDP2 roots (the model chunks a pipeline rank holds), and the prefix rule."""

import logging

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

from fsdp_replay import PrefetchConfig, attach, scheduler_of
from fsdp_replay.stats import Demand
from fsdp_replay.testing.internals import HAS_RESET_ITER_STATE
from fsdp_replay.testing.observer import DemandObserver, held_units
from fsdp_replay.testing.workloads import linear_stack


def _chunks(mesh, n=2):
    return [linear_stack(mesh) for _ in range(n)]


def _step(chunks, x):
    for chunk in chunks:
        x = chunk(x)
    x.pow(2).mean().backward()


def test_one_scheduler_serves_every_chunk(mesh8):
    chunks = _chunks(mesh8)
    sched = attach(chunks, PrefetchConfig(mode="record_and_replay"))
    assert scheduler_of(chunks[0]) is sched and scheduler_of(chunks[1]) is sched
    assert [u.fqn for u in sched.units] == [f"chunk{c}/{i}" for c in (0, 1) for i in range(4)]
    sched.detach()
    assert scheduler_of(chunks[0]) is None and scheduler_of(chunks[1]) is None


def test_attach_rejects_bad_lists_of_roots(mesh8):
    chunks = _chunks(mesh8)
    with pytest.raises(ValueError, match="empty list"):
        attach([])
    with pytest.raises(ValueError, match="same root twice"):
        attach([chunks[0], chunks[0]])
    with pytest.raises(TypeError, match="got Linear"):
        attach([chunks[0], torch.nn.Linear(2, 2)])
    attach([chunks[1]])
    with pytest.raises(RuntimeError, match="already attached"):
        attach(chunks)


def test_replay_provides_across_chunks(mesh8):
    chunks = _chunks(mesh8)
    sched = attach(chunks, PrefetchConfig(mode="record_and_replay"))
    observers = [DemandObserver(chunk) for chunk in chunks]
    for step in range(3):
        with sched.iteration("train"):
            _step(chunks, torch.randn(4, 8))
        observed = [entry for observer in observers for entry in observer.take()]
        if step:  # chunk 1's first gather went out while chunk 0 computed
            assert all(kind is not Demand.miss for _, _, kind in observed), observed
    order = sched.recorded_order("train")
    assert order[3:5] == [("chunk0/3", "forward"), ("chunk1/0", "forward")]
    assert sched.stats.as_dict()["divergences"] == 0


def test_several_roots_have_no_automatic_scopes_and_say_so_once(mesh8, caplog):
    chunks = _chunks(mesh8)
    sched = attach(chunks, PrefetchConfig(mode="record_and_replay"))
    with caplog.at_level(logging.WARNING, logger="fsdp_replay"):
        for _ in range(3):
            _step(chunks, torch.randn(4, 8))
    said = [r.getMessage() for r in caplog.records if "no automatic scopes" in r.getMessage()]
    assert len(said) == 1 and "several roots" in said[0] and "iteration" in said[0]
    assert sched.stats.as_dict()["prefetches"] == 0 and sched.recorded_order("auto:grad") is None


def _reshard_everything(model):
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@pytest.mark.parametrize("mode", ["record_and_replay"])
def test_a_one_off_prefix_is_skipped_at_the_first_replay(mesh8, mode):
    """As a pipeline's shape inference: a forward and backward, then every unit resharded, in step 1 only."""
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig(mode=mode))
    observer = DemandObserver(model)
    for step in range(3):
        with sched.iteration("train"):
            if step == 0:
                model(torch.randn(4, 8)).sum().backward()
                _reshard_everything(model)
            for _ in range(2):
                model(torch.randn(4, 8)).pow(2).mean().backward()
        observed = observer.take()
        if step:
            assert all(kind is not Demand.miss for _, _, kind in observed), (step, observed)
            assert len(sched.recorded_order("train")) == len(observed)
    assert sched.stats.as_dict()["divergences"] == 0 and sched.stats.as_dict()["recordings"] == 1


def test_what_a_one_off_prefix_left_unsharded_is_prefetched_in_later_steps(mesh8):
    """As torch 2.11's pipeline shape inference: a forward only, that nothing reshards after
    (``reshard_after_forward=False``), so while recording the real forward found every unit resident."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh8, reshard_after_forward=False)
    fully_shard(model, mesh=mesh8, reshard_after_forward=False)
    sched = attach(model, PrefetchConfig(mode="record_and_replay"))
    observer = DemandObserver(model)
    for step in range(4):
        with sched.iteration("train"):
            if step == 0:
                with torch.no_grad():
                    model(torch.randn(4, 8))
            model(torch.randn(4, 8)).pow(2).mean().backward()
        observed = observer.take()
        if step >= 1:  # the first replay realigns past the prefix at its first backward demand
            assert [kind for _, phase, kind in observed if phase == "forward"] == [Demand.hit] * 4, (step, observed)
    assert len(sched.recorded_order("train")) == 8
    assert sched.stats.as_dict()["divergences"] == 0 and sched.stats.as_dict()["recordings"] == 1


def test_a_reshard_of_everything_that_every_step_makes_is_not_a_prefix(mesh8):
    """The likely start is only a guess: a user's reshard between microbatches realigns to the whole order."""
    model = linear_stack(mesh8)
    sched = attach(model, PrefetchConfig(mode="record_and_replay"))
    lengths = []
    for _ in range(3):
        with sched.iteration("train"):
            for mb in range(2):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                if mb == 0:
                    _reshard_everything(model)
        lengths.append(len(sched.recorded_order("train")))
    assert lengths[0] == lengths[1] == lengths[2]
    assert sched.stats.as_dict()["divergences"] == 0


@pytest.mark.skipif(not HAS_RESET_ITER_STATE, reason="torch 2.11/2.12 have no reset_iter_state")
def test_an_exception_in_an_iteration_resets_every_chunk(mesh8):
    chunks = _chunks(mesh8)
    sched = attach(chunks, PrefetchConfig(mode="record_and_replay"))
    with sched.iteration("train"):
        _step(chunks, torch.randn(4, 8))
    def boom(module, args):  # after FSDP2's pre-forward gathered chunk 1's unit 2
        raise RuntimeError("boom")

    handle = chunks[1][2].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        with sched.iteration("train"):
            _step(chunks, torch.randn(4, 8))
    handle.remove()
    assert not [name for chunk in chunks for name in held_units(chunk)]  # the second root was reset too
    assert sched.recorded_order("train") is None  # the failed replay dropped it
    for _ in range(2):
        with sched.iteration("train"):
            _step(chunks, torch.randn(4, 8))
    assert sched.recorded_order("train") is not None
