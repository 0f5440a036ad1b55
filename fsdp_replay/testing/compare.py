"""Training runs compared bitwise with plain FSDP2's: what every "numerics unchanged" test runs and asserts."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import Workload, run_iteration


Iterate = Callable[[nn.Module, Workload, int], list[float]]
"""``(model, workload, step) -> losses``: one step's forwards and backwards (default :func:`run_iteration`)."""


def train(
    model: nn.Module,
    w: Workload,
    sched: Any,
    steps: int,
    *,
    scoped: bool = True,
    observer: DemandObserver | None = None,
    iterate: Iterate = run_iteration,
) -> dict[str, list]:
    """``steps`` SGD steps of workload ``w`` on the sharded ``model``, each ``iterate`` inside
    ``sched.iteration("train")`` where a scheduler is given and ``scoped`` (else automatic scopes, or
    plain FSDP2 with ``sched=None``); returns what :func:`assert_trains_like_plain` compares.

    ``{"losses": [...], "grads": [...]}`` per step, gradients as local shards copied to the CPU (None
    where a parameter got none: data skipped its unit); with ``observer``, also ``"observed"``: what
    it saw of each step's demands.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run: dict[str, list] = {"losses": [], "grads": []} | ({"observed": []} if observer is not None else {})
    for step in range(steps):
        if sched is not None and scoped:
            with sched.iteration("train"):
                run["losses"].append(iterate(model, w, step))
        else:
            run["losses"].append(iterate(model, w, step))
        run["grads"].append([None if p.grad is None else p.grad.to_local().to("cpu", copy=True) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if observer is not None:
            run["observed"].append(observer.take())
    return run


def assert_trains_like_plain(
    runs: Mapping[tuple[str, str], Mapping[str, Any]], name: str, contenders: Sequence[str], *, plain: str = "plain"
) -> None:
    """Each of ``contenders`` trained workload ``name`` bitwise like ``plain``: equal losses and, step by
    step, equal gradients (a parameter without a gradient has none in both).

    ``runs`` maps ``(workload, contender)`` to ``{"losses": [...], "grads": [[Tensor | None, ...] per step]}``.
    """
    want = runs[(name, plain)]
    for contender in contenders:
        got = runs[(name, contender)]
        assert got["losses"] == want["losses"], (name, contender)
        for step, (grads, expected) in enumerate(zip(got["grads"], want["grads"])):
            assert all(_same(g, w) for g, w in zip(grads, expected)), (name, contender, step)


def _same(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return torch.equal(got, want)
