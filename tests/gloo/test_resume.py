"""A resumed run whose checkpointed order is stale re-records it, with numerics equal to plain FSDP2."""

import torch

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.workloads import linear_stack


def _train(model, sched, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if sched is not None:
            with sched.iteration("train"):
                loss = model(x).pow(2).mean()
                loss.backward()
        else:
            loss = model(x).pow(2).mean()
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _run(mesh) -> dict:
    first = linear_stack(mesh)
    recorder = attach(first, PrefetchConfig())
    _train(first, recorder, steps=1)
    saved = recorder.state_dict()
    stale = {**saved, "signature": {**saved["signature"], "world_size": 4 * mesh.size()}}
    results = {"plain": _train(linear_stack(mesh), None)}
    for name, state in (("same", saved), ("stale", stale)):
        model = linear_stack(mesh)
        sched = attach(model, PrefetchConfig())
        sched.load_state_dict(state)
        results[name] = _train(model, sched)
        results[name + "_stats"] = sched.stats.as_dict()
    return results


def test_stale_and_matching_orders_resume_with_plain_numerics() -> None:
    for result in spawn(_run):
        assert result["same"] == result["plain"] and result["stale"] == result["plain"]
        assert result["same_stats"]["recordings"] == 0 and result["same_stats"]["misses"] == 0
        assert result["stale_stats"]["recordings"] == 1 and result["stale_stats"]["divergences"] == 0
