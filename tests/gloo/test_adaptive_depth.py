"""``"auto"`` prefetch depth on 2 gloo ranks whose timings differ on purpose: the ranks agree on every
depth, issue the same all-gathers in the same order, and train bitwise like plain FSDP2."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.workloads import run_iteration, workload

STEPS = 8


def _gathers_issued(log: list[str]):
    """Log the FQN of each all-gather FSDP2 issues (the same name ``counting_all_gathers`` wraps)."""
    original = _fsdp_param_group.foreach_all_gather

    def logged(fsdp_params, *args, **kwargs):
        log.append(fsdp_params[0]._param_fqn)
        return original(fsdp_params, *args, **kwargs)

    _fsdp_param_group.foreach_all_gather = logged
    return original


def _train(mesh, mode: str) -> dict:
    w = workload("checkpointed")
    model = w.make_model().shard(mesh)
    if dist.get_rank() == 1:  # rank 1 computes slower: the ranks measure different waits
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: time.sleep(0.005))
    sched = None if mode == "plain" else attach(model, PrefetchConfig(forward_prefetch="auto", backward_prefetch="auto"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step in range(STEPS):
        log: list[str] = []
        original = _gathers_issued(log)
        try:
            if sched is None:
                losses = run_iteration(model, w, step)
            else:
                with sched.iteration("train"):
                    losses = run_iteration(model, w, step)
        finally:
            _fsdp_param_group.foreach_all_gather = original
        steps.append({"losses": losses, "gathers": log, "depth": sched.prefetch_depth("train") if sched else None})
        opt.step()
        opt.zero_grad()
    return {"steps": steps, "params": [p.to_local().clone() for p in model.parameters()]}


def test_auto_depth_is_agreed_and_changes_nothing_but_when_gathers_go_out() -> None:
    plain = spawn(_train, "plain")
    auto = spawn(_train, "auto")
    for rank in range(2):
        assert [s["losses"] for s in auto[rank]["steps"]] == [s["losses"] for s in plain[rank]["steps"]]
        assert all(torch.equal(a, b) for a, b in zip(auto[rank]["params"], plain[rank]["params"]))
    depths = [[s["depth"] for s in auto[rank]["steps"]] for rank in range(2)]
    assert depths[0] == depths[1], depths
    assert any(d != (1, 1) for d in depths[0]), f"rank 0 waits for rank 1 every step, so a deeper depth is tried: {depths}"
    for step in range(STEPS):
        assert auto[0]["steps"][step]["gathers"] == auto[1]["steps"][step]["gathers"], f"step {step}"
