"""fsdp_replay is never the only driver of FSDP2 state: gradient-accumulation toggles, manual
``unshard()``/``reshard()`` and reentrant checkpointing, each compared bitwise with plain FSDP2
running the same interference (losses, gradients, final parameters, units left unsharded)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_replay import attach
from fsdp_replay.testing.contenders import REUSE, contender_config
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.observer import DemandObserver, held_units
from fsdp_replay.testing.workloads import CallSequenceModel, linear_stack

MODES = ("plain", "demand", "static", "record_and_replay", REUSE)
STEPS = 3


def _local(tensors) -> list[torch.Tensor | None]:
    # A parameter left unsharded across a step is a plain tensor: compared as is, it differs from plain.
    return [None if t is None else (t.to_local() if hasattr(t, "to_local") else t).clone() for t in tensors]


def _train(mesh, model: nn.Module, mode: str, explicit: bool, microbatch) -> dict:
    """``microbatch(model, step, mb)`` runs one forward+backward with its interference; 2 per step."""
    sched = None if mode == "plain" else attach(model, contender_config(mode))
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        scope = sched.iteration("train") if sched is not None and explicit else contextlib.nullcontext()
        before = sched.stats.as_dict() if sched is not None else {}
        with scope:
            losses = [microbatch(model, step, mb) for mb in range(2)]
        steps.append(
            {
                "losses": losses,
                "grads": _local(p.grad for p in model.parameters()),
                "held": held_units(model),
                "observed": observer.take(),
                "stats": {k: v - before.get(k, 0) for k, v in sched.stats.as_dict().items()} if sched else None,
            }
        )
        opt.step()
        opt.zero_grad()
    order = sched.recorded_order("train" if explicit else "auto:grad") if sched is not None else None
    return {"steps": steps, "params": _local(model.parameters()), "order": order}


def _accumulating(sync_too: bool):
    """The standard FSDP2 accumulation: units stay unsharded (and unreduced) until the last microbatch."""

    def microbatch(model, step, mb):
        last = mb == 1
        model.set_reshard_after_backward(last)
        if sync_too:
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
        g = torch.Generator().manual_seed(100 * step + mb + dist.get_rank())
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        return loss.item()

    return microbatch


def _manual(model, step, mb):
    """A user unshards one unit ahead of time and reshards another mid-iteration."""
    g = torch.Generator().manual_seed(100 * step + mb)
    model[2].unshard()
    out = model(torch.randn(4, 8, generator=g))
    model[1].reshard()
    model[3].unshard(async_op=True)
    loss = out.pow(2).mean()
    loss.backward()
    return loss.item()


def _reentrant(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = CallSequenceModel(dim=8, hidden=16, n_blocks=4, calls=[0, 1, 2, 3], checkpoint_spans=[(1, 3)], reentrant=True)
    return model.shard(mesh)


def _reentrant_microbatch(model, step, mb):
    g = torch.Generator().manual_seed(100 * step + mb)
    loss = model(torch.randn(4, 8, generator=g))
    loss.backward()
    return loss.item()


CASES = {
    "accumulation_reshard": (linear_stack, _accumulating(sync_too=False)),
    "accumulation_reshard_sync_last": (linear_stack, _accumulating(sync_too=True)),
    "manual_unshard_reshard": (linear_stack, _manual),
    "reentrant_checkpoint": (_reentrant, _reentrant_microbatch),
}


def _all_runs(mesh, explicit: bool) -> dict:
    return {
        (case, mode): _train(mesh, make(mesh), mode, explicit, microbatch)
        for case, (make, microbatch) in CASES.items()
        for mode in MODES
    }


@pytest.fixture(scope="module", params=[True, False], ids=["explicit", "automatic"])
def runs(request):
    return request.param, spawn(_all_runs, request.param, timeout_s=600)


def _same(a: list, b: list) -> bool:
    """Bitwise, with None (no gradient) equal only to None."""
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x.view(torch.int32), y.view(torch.int32)))
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_equal_to_plain_fsdp2_under_the_same_interference(runs, case):
    _, results = runs
    for rank_result in results:
        plain = rank_result[(case, "plain")]
        for mode in MODES[1:]:
            got = rank_result[(case, mode)]
            for step, (p, g) in enumerate(zip(plain["steps"], got["steps"])):
                where = (case, mode, step)
                assert g["losses"] == p["losses"], where
                assert _same(g["grads"], p["grads"]), where
                assert g["held"] == p["held"], where
            assert _same(got["params"], plain["params"]), (case, mode)


@pytest.mark.parametrize("case", list(CASES))
def test_counters_agree_with_the_observer(runs, case):
    _, results = runs
    for rank_result in results:
        for mode in MODES[1:]:
            for step in rank_result[(case, mode)]["steps"]:
                seen = DemandObserver.counts(step["observed"])
                s = step["stats"]
                assert (s["hits"], s["misses"], s["resident"]) == (
                    seen.get("hit", 0), seen.get("miss", 0), seen.get("resident", 0)
                ), (case, mode, step["observed"], s)


@pytest.mark.parametrize("case", ["accumulation_reshard", "accumulation_reshard_sync_last", "reentrant_checkpoint"])
def test_replay_misses_nothing_after_recording(runs, case):
    explicit, results = runs
    for rank_result in results:
        for step in rank_result[(case, "record_and_replay")]["steps"][1:]:
            observed = step["observed"]
            assert step["stats"]["divergences"] == 0 and step["stats"]["recordings"] == 0, step["stats"]
            if explicit:
                misses = [d for d in observed if d[2] == "miss"]
            else:  # each microbatch is an automatic scope, opened by its first demand
                half = len(observed) // 2
                misses = [d for d in observed[1:half] + observed[half + 1 :] if d[2] == "miss"]
            assert not misses, (case, observed)


def test_the_recorded_order_spans_the_whole_reentrant_backward(runs):
    explicit, results = runs
    for rank_result in results:
        run = rank_result[("reentrant_checkpoint", "record_and_replay")]
        first_scope = run["steps"][0]["observed"][: None if explicit else len(run["steps"][0]["observed"]) // 2]
        # A nested backward's end is not the scope's: the demands after it are recorded too.
        assert run["order"] == [(fqn, phase) for fqn, phase, _ in first_scope]
        assert run["order"][-1][1] == "backward"
