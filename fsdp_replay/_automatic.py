"""Automatic scopes: outside ``iteration()``, root forwards up to the end of their backwards are a scope.

One forward and its backward, or several forwards before the backwards they wait for (two forwards
per loss, microbatches interleaved): the scheduler counts them (``Scope.backwards_pending``). A
backward that comes after its scope ended (a second backward through a retained graph) is a scope
of its own, up to its end. Automatic scopes need one root whose backwards autograd ends. With
several roots (pipeline chunks), or once a root's backward is finalized by its caller (a pipeline
stage), microbatches interleave and no forward/backward pair delimits an optimizer step:
automatic scopes are then off, which is said once, with what to do instead.
"""

from __future__ import annotations

import logging

import torch

from fsdp_replay.stats import MissReason, Why

logger = logging.getLogger("fsdp_replay")

AUTO_KEY_GRAD = "auto:grad"
AUTO_KEY_NO_GRAD = "auto:no_grad"
AUTO_KEY_BACKWARD = "auto:backward"
"""A backward that starts with no scope open: another backward of a graph whose scope already
ended (``loss_a.backward(retain_graph=True)``, then ``loss_b.backward()``). It records apart from
``auto:grad``: sharing its key, the key's scopes would alternate between two shapes."""
AUTO_KEYS = (AUTO_KEY_GRAD, AUTO_KEY_NO_GRAD, AUTO_KEY_BACKWARD)


def automatic_key() -> str:
    """The key of an automatic scope opening now: forwards with and without grad record apart."""
    return AUTO_KEY_GRAD if torch.is_grad_enabled() else AUTO_KEY_NO_GRAD


class AutomaticScopes:
    """Whether forwards outside ``iteration()`` open scopes, and why not."""

    def __init__(self, roots: int) -> None:
        self.off_reason: str | None = "it serves several roots (model chunks)" if roots > 1 else None
        self._said = False

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def why_no_scope(self) -> Why:
        """Why a demand outside ``iteration()`` found no scope open."""
        why = f"automatic scopes are off: {self.off_reason}" if self.off_reason else "no iteration() was open"
        return Why(MissReason.no_scope, why)

    def turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self.say_off()

    def say_off(self) -> None:
        """One warning per scheduler, at the first forward or backward that finds them off."""
        if not self._said:
            self._said = True
            logger.warning(
                "fsdp_replay: no automatic scopes for this scheduler: %s; wrap each step "
                '(e.g. schedule.step(...)) in sched.iteration("train") to prefetch',
                self.off_reason,
            )
