"""Bitwise comparison of training runs with plain FSDP2's: what every "numerics unchanged" test asserts."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


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
