"""Attach/detach, weak references, and bad input on the Python API."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

import fsdp_replay
from fsdp_replay import PrefetchConfig, attach, scheduler_of
from fsdp_replay.testing.internals import fsdp_state, gather_pending, param_groups
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import run_iteration, workload


def _sharded(mesh, name="sequential"):
    w = workload(name)
    return w, w.make_model().shard(mesh)


def _hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_fully_shard_wrapper_attaches_on_the_root_call(mesh8):
    w = workload("sequential")
    model = w.make_model()
    for block in model.blocks:
        fsdp_replay.fully_shard(block, mesh=mesh8)
    root = fsdp_replay.fully_shard(model, mesh=mesh8, prefetch=PrefetchConfig(mode="static"))
    assert scheduler_of(root).mode.name == "static"
    assert scheduler_of(root.blocks[0]) is None


def test_prefetch_on_a_grouped_call_is_rejected(mesh8):
    with pytest.raises(ValueError, match="root call"):
        fsdp_replay.fully_shard([nn.Linear(2, 2), nn.Linear(2, 2)], mesh=mesh8, prefetch=PrefetchConfig())


def test_attach_rejects_non_fsdp_modules_twice_attached_and_children(mesh8):
    with pytest.raises(TypeError, match="got Linear"):
        attach(nn.Linear(2, 2))
    w, model = _sharded(mesh8)
    attach(model)
    with pytest.raises(RuntimeError, match="already attached"):
        attach(model)
    with pytest.raises(RuntimeError, match="is a unit of a scheduler already attached"):
        attach(model.blocks[0])
    with pytest.raises(TypeError, match="takes a PrefetchConfig"):
        attach(_sharded(mesh8)[1], config="static")


def test_attach_to_a_child_is_caught_once_fsdp2_has_picked_the_root(mesh8):
    w, model = _sharded(mesh8)
    run_iteration(model, w, 0)  # FSDP2 lazy init: the outer module is the root
    with pytest.raises(ValueError, match="not a root FSDP2 module"):
        attach(model.blocks[1])


def test_attach_to_a_child_before_fsdp2_picked_the_root_is_refused_and_leaves_the_model_working(mesh8):
    """Before the first forward FSDP2 has not decided which module is the root; running its lazy
    init on the child (as a scope start does) would make it one and break the real root for good."""
    w, model = _sharded(mesh8)
    with pytest.raises(ValueError, match="not a root FSDP2 module .*inside a fully_shard"):
        attach(model.blocks[1])
    # The drop-in wrapper given prefetch= on a block, the model sharded after it: caught at the scope's start.
    w = workload("sequential")
    model = w.make_model()
    fsdp_replay.fully_shard(model.blocks[0], mesh=mesh8, prefetch=PrefetchConfig())
    for block in model.blocks[1:]:
        fsdp_replay.fully_shard(block, mesh=mesh8)
    fsdp_replay.fully_shard(model, mesh=mesh8)
    sched = scheduler_of(model.blocks[0])
    with pytest.raises(RuntimeError, match="treats as a child unit.*inside a fully_shard"):
        with sched.iteration("train"):
            run_iteration(model, w, 0)
    sched.detach()
    run_iteration(model, w, 1)  # plain FSDP2 again, the real root's lazy init untouched


def test_malformed_state_dicts_and_a_rerecord_that_is_not_a_bool_get_one_clear_error(mesh8):
    w, model = _sharded(mesh8)
    sched = attach(model)
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    saved = sched.state_dict()
    for bad in (None, [], {**saved, "orders": []}, {**saved, "signature": None}, {k: v for k, v in saved.items() if k != "orders"}):
        with pytest.raises(ValueError, match="state_dict"):
            sched.load_state_dict(bad)
    assert sched.recorded_order("train") is not None  # left as it was
    with pytest.raises(ValueError, match=r"iteration\(rerecord=...\) must be True or False, got 'false'"):
        with sched.iteration("train", rerecord="false"):
            pass
    assert sched.stats.recordings == 1
    for read in (sched.recorded_order, sched.explain, sched.prefetch_depth, sched.invalidate):
        with pytest.raises(ValueError, match=rf"{read.__name__}\(key=...\) must be a string.*got 5"):
            read(5)


def test_attach_accepts_a_mapping_and_validates_it(mesh8):
    w, model = _sharded(mesh8)
    with pytest.raises(ValueError, match="forward_prefetch must be an integer >= 0"):
        attach(model, {"forward_prefetch": -1})
    with pytest.raises(TypeError, match="no field.* 'bogus'; valid fields are mode, forward_prefetch"):
        attach(model, {"bogus": 1})
    assert attach(model, {"mode": "demand"}).mode.name == "demand"


def test_nested_scopes_and_reserved_keys_are_rejected(mesh8):
    w, model = _sharded(mesh8)
    sched = attach(model)
    with pytest.raises(RuntimeError, match=r"iteration\(key='inner'\) opened inside iteration\(key='outer'\)"):
        with sched.iteration("outer"), sched.iteration("inner"):
            pass
    for bad in ("", "auto:grad", 3):
        with pytest.raises(ValueError, match="non-empty string"):
            with sched.iteration(bad):
                pass


def test_detach_restores_hooks_and_fsdp2_prefetch_settings(mesh8):
    w, model = _sharded(mesh8)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    before_hooks = _hook_counts(model)
    state0 = model.blocks[0]._get_fsdp_state()
    before_lists = (list(state0._states_to_forward_prefetch), list(state0._states_to_backward_prefetch))
    sched = attach(model)
    # No forward list, and a backward list FSDP2 finds nothing to gather in (implicit prefetch off).
    backward = state0._states_to_backward_prefetch
    assert state0._states_to_forward_prefetch == [] and backward and not any(param_groups(s) for s in backward)
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    sched.detach()
    assert _hook_counts(model) == before_hooks
    assert (state0._states_to_forward_prefetch, state0._states_to_backward_prefetch) == before_lists
    assert scheduler_of(model) is None
    with pytest.raises(RuntimeError, match="detached"):
        with sched.iteration("train"):
            pass
    attach(model).detach()  # attaching again after detach is allowed


def test_detached_model_behaves_like_plain_fsdp2(mesh8):
    w, plain = _sharded(mesh8)
    w, model = _sharded(mesh8)
    attach(model).detach()
    logs = []
    for m in (plain, model):
        observer = DemandObserver(m)
        run_iteration(m, w, 0)
        logs.append(observer.take())
    assert logs[0] == logs[1]  # FSDP2's own implicit backward prefetch is back


@pytest.mark.parametrize(
    "config",
    [
        PrefetchConfig(mode="demand"),
        PrefetchConfig(mode="static"),
        PrefetchConfig(),
        PrefetchConfig(measure_waits=True),
        PrefetchConfig(forward_prefetch="auto", backward_prefetch="auto"),
        PrefetchConfig(max_reuse_distance=3),
        PrefetchConfig(record_steps=3),
    ],
    ids=["demand", "static", "record_and_replay", "measure_waits", "auto_depth", "reuse_distance", "record_steps"],
)
def test_deleting_the_model_frees_it_and_its_scheduler(mesh8, config):
    w, model = _sharded(mesh8, "shared_block")
    sched = attach(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        with sched.iteration("train"):
            run_iteration(model, w, step)
        opt.step()
    run_iteration(model, w, 2)  # an automatic scope too
    model_ref, sched_ref = weakref.ref(model), weakref.ref(sched)
    del model, sched, opt
    gc.collect()
    assert model_ref() is None and sched_ref() is None


def test_optimizer_step_inside_a_scope_releases_pending_prefetches(mesh8, caplog):
    w, model = _sharded(mesh8, "interleaved_1f1b")
    sched = attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    with sched.iteration("train"):
        losses = {mb: model(w.make_batch(1, mb)) for mb in range(2)}
        losses[0].backward()
        opt.step()  # misuse: would otherwise leave the next forward's gathers pending across the step
        assert all(not gather_pending(g) for u in sched.units for g in param_groups(u.state))
        losses[1].backward()
    assert any("optimizer.step() inside iteration" in r.message for r in caplog.records)


def test_detach_leaves_no_shadowed_fsdp2_method_and_keeps_lists_set_while_attached(mesh8):
    w, model = _sharded(mesh8)
    sched = attach(model)
    with sched.iteration("train"):
        run_iteration(model, w, 0)
    model.blocks[2].set_modules_to_forward_prefetch([model.blocks[3]])  # the user's, set while attached
    sched.detach()
    assert fsdp_state(model.blocks[2])._states_to_forward_prefetch == [fsdp_state(model.blocks[3])]  # theirs wins
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = fsdp_state(module)
        assert not {"_pre_forward", "_pre_backward", "_root_post_backward_final_callback"} & set(vars(state)), module
        for group in param_groups(state):
            shadowed = {"post_forward", "post_backward", "reshard", "unshard", "_reset_iter_state"} & set(vars(group))
            assert not shadowed, (module, shadowed)
