"""Shared machinery of the reliability suite: profiles, a per-example-timeout gloo launcher, FSDP2 leak checks.

The launcher runs on :func:`fsdp_replay.testing.distributed.spawn`: ranks run a *list* of examples
in one process group (spawning costs ~5 s per call), each example under its own watchdog, and a
hang or crash names the example that was running on every rank together with the stacks of the
hung ranks.
"""

from __future__ import annotations

import faulthandler
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.internals import gather_pending, param_groups
from fsdp_replay.testing.observer import fsdp_units
from fsdp_replay.testing.workloads import Schedule

LONG = os.environ.get("FSDP_REPLAY_LONG", "") not in ("", "0")
"""The long profile (``FSDP_REPLAY_LONG=1``): more examples, more faults, 2,000-iteration soak."""


@dataclass(frozen=True)
class Profile:
    """Sizes of one run of the suite."""

    schedule_examples: int
    """Random models x schedules drawn by hypothesis; each runs plain FSDP2 and all three modes."""
    steps: int
    """Iterations per run: one recording, then replays across optimizer steps."""
    soak_iterations: int
    """Replayed iterations of the soak test."""
    example_timeout_s: float
    """One example running longer than this on any rank counts as a hang."""


PROFILE = (
    Profile(schedule_examples=400, steps=4, soak_iterations=2000, example_timeout_s=60.0)
    if LONG
    else Profile(schedule_examples=32, steps=3, soak_iterations=60, example_timeout_s=60.0)
)
if os.environ.get("FSDP_REPLAY_EXAMPLES"):
    PROFILE = Profile(**{**PROFILE.__dict__, "schedule_examples": int(os.environ["FSDP_REPLAY_EXAMPLES"])})


def record_figures(section: str, figures: dict[str, Any]) -> None:
    """Append one JSON line to ``$FSDP_REPLAY_FIGURES`` (if set): the numbers RELIABILITY.md quotes."""
    path = os.environ.get("FSDP_REPLAY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"section": section, "long": LONG, **figures}) + "\n")


# --- launcher -------------------------------------------------------------------------------------


def _run_examples_on_rank(
    mesh: Any, fn: Callable[[Any, Any], Any], examples: list[Any], workdir: str, example_timeout_s: float
) -> list[Any]:
    """Runs inside one ``spawn`` rank; leaves progress and, on a timeout, stacks in ``workdir``."""
    rank = dist.get_rank()
    progress = Path(workdir, f"progress.{rank}")
    out = []
    with open(Path(workdir, f"stacks.{rank}"), "w") as stacks:
        for index, example in enumerate(examples):
            progress.write_text(f"{index}\n")
            # Dumps every thread's stack and exits the rank: the parent sees it die and reports it.
            faulthandler.dump_traceback_later(example_timeout_s, exit=True, file=stacks)
            try:
                out.append(fn(mesh, example))
            except BaseException as err:
                raise RuntimeError(f"example #{index}: {example!r}") from err
            finally:
                faulthandler.cancel_dump_traceback_later()
    progress.write_text("done\n")
    return out


def _running(workdir: str, world_size: int, examples: Sequence[Any]) -> str:
    lines = []
    for rank in range(world_size):
        try:
            at = Path(workdir, f"progress.{rank}").read_text().strip()
        except FileNotFoundError:
            at = "not started (process group setup)"
        if at.isdigit():
            at = f"example #{at}: {examples[int(at)]!r}"
        lines.append(f"  rank {rank}: {at}")
        stack = Path(workdir, f"stacks.{rank}")
        if stack.exists() and stack.stat().st_size:
            lines.append("    stacks at the timeout:\n" + _indent(stack.read_text()[-4000:], 6))
    return "\n".join(lines)


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def run_examples(
    fn: Callable[[Any, Any], Any],
    examples: Sequence[Any],
    *,
    world_size: int = 2,
    example_timeout_s: float | None = None,
    startup_s: float = 60.0,
) -> list[list[Any]]:
    """``[fn(mesh, e) for e in examples]`` on every gloo rank; returns one result list per rank.

    Every rank gets the same examples in the same order, so their collectives match. An example
    exceeding ``example_timeout_s`` on any rank fails the call naming it and each rank's stacks.
    """
    example_timeout_s = example_timeout_s or PROFILE.example_timeout_s
    examples = list(examples)
    workdir = tempfile.mkdtemp(prefix="fsdp_replay_reliability_")
    return spawn(
        _run_examples_on_rank,
        fn,
        examples,
        workdir,
        example_timeout_s,
        world_size=world_size,
        timeout_s=startup_s + example_timeout_s * max(len(examples), 1),
        diagnose=lambda: "running:\n" + _running(workdir, world_size, examples),
    )


# --- FSDP2 state checks -----------------------------------------------------------------------------


def fsdp_states(root: nn.Module) -> dict[str, Any]:
    """Every FSDP2 state with parameters under ``root``, by its module names (``fsdp_units``)."""
    return fsdp_units(root)


def gather_leaks(root: nn.Module) -> list[str]:
    """Units with an all-gather still pending or parameters still unsharded (empty = clean)."""
    problems = []
    for name, state in fsdp_states(root).items():
        for group in param_groups(state):
            if gather_pending(group):
                problems.append(f"{name}: all-gather pending")
            if not group.is_sharded:
                problems.append(f"{name}: parameters not resharded")
    return problems


def hook_count(root: nn.Module) -> int:
    """Module hooks of every kind on every module under ``root``."""
    total = 0
    for m in root.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            total += len(getattr(m, attr))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard; a parameter left unsharded across a step is a plain tensor, kept as is."""
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def local_grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else _local(p.grad) for p in model.parameters()]


def local_params(model: nn.Module) -> list[torch.Tensor]:
    return [_local(p.detach()) for p in model.parameters()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaNs compare equal to identical NaNs (a diverged run must still match bitwise)."""
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def same_tensors(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(_bits(x), _bits(y)))
        for x, y in zip(a, b)
    )


def same_floats(a: Sequence[float], b: Sequence[float]) -> bool:
    """Bitwise equality of Python floats (NaN == NaN when the bits agree)."""
    return same_tensors([torch.tensor(a, dtype=torch.float32)], [torch.tensor(b, dtype=torch.float32)])


# --- models and schedules -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A :class:`CallSequenceModel` and how it is sharded; blocks not in ``calls`` never run."""

    n_blocks: int
    calls: tuple[int, ...]
    spans: tuple[tuple[int, int], ...] = ()
    """Checkpointed slices of ``calls`` (non-reentrant activation checkpointing)."""
    keep_unsharded: tuple[int, ...] = ()
    """Blocks sharded with ``reshard_after_forward=False``."""
    reentrant: bool = False
    """Checkpoint ``spans`` with reentrant activation checkpointing (a nested backward per region)."""
    skips: tuple[tuple[int, ...], ...] = ()
    """Blocks the data skips at each step (``skips[step]``), alike on every rank: units that run only
    sometimes, as idle MoE experts or LayerDrop's blocks (tolerant replay, docs/TOLERANT_REPLAY.md)."""
    dim: int = 8
    hidden: int = 16
    rows: int = 4

    @property
    def units(self) -> int:
        return self.n_blocks + 1


def build_model(mesh: Any, spec: ModelSpec) -> nn.Module:
    """Seeded identically on every rank and in every run, sharded one unit per block plus the root."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_replay.testing.workloads import CallSequenceModel

    torch.manual_seed(0)
    model = CallSequenceModel(
        dim=spec.dim,
        hidden=spec.hidden,
        n_blocks=spec.n_blocks,
        calls=spec.calls,
        checkpoint_spans=spec.spans,
        reentrant=spec.reentrant,
    )
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i not in spec.keep_unsharded)
    return fully_shard(model, mesh=mesh)


def make_batch(spec: ModelSpec, step: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + mb)
    return torch.randn(spec.rows, spec.dim, generator=g)


def run_schedule(
    model: nn.Module,
    spec: ModelSpec,
    schedule: Schedule,
    step: int,
    *,
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    before_op: Callable[[int], None] | None = None,
) -> list[float]:
    """Microbatch forwards and backwards in ``schedule`` order; returns the losses by microbatch.

    ``before_op(i)`` runs before op ``i`` and once more with ``len(schedule)`` after the last one
    (where a test's interference goes).
    """
    losses: dict[int, torch.Tensor] = {}
    model.skip = set(spec.skips[step % len(spec.skips)]) if spec.skips else set()
    for i, (op, mb) in enumerate(schedule):
        if before_op is not None:
            before_op(i)
        if op == "F":
            out = model(make_batch(spec, step, mb))
            losses[mb] = loss_fn(out, mb) if loss_fn is not None else out
        else:
            losses[mb].backward()
    if before_op is not None:
        before_op(len(schedule))
    return [losses[mb].item() for mb in sorted(losses)]


def stats_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def stats_consistent(sched: Any) -> list[str]:
    """``demands == hits + misses + resident`` in the totals and in every key's breakdown."""
    problems = []
    for label, s in [("total", sched.stats), *sched.stats.per_key.items()]:
        if s.demands != s.hits + s.misses + s.resident:
            problems.append(f"{label}: demands {s.demands} != hits {s.hits} + misses {s.misses} + resident {s.resident}")
    return problems
