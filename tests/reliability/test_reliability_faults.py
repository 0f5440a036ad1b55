"""Faults: an exception at each hook point in turn, in the recording and in a replayed iteration.

Points: the pre-forward of every unit (its first and its last call of the iteration, after FSDP2
has unsharded it, and before any hook ran), every activation-checkpoint recompute, the backward of
every unit (after FSDP2's pre-backward unshard), the loss, and KeyboardInterrupt inside a scope.
After each: no pending all-gather, no unsharded parameters, no recording kept from the failed
scope, no hook left behind, and the next iterations train bitwise like plain FSDP2 in which the
failed step never happened (a failed step applies no update), recording and replaying again.

Also two non-faults that stress the hooks: a unit whose outputs do not require grad, and a forward
under ``torch.no_grad`` in the middle of a training scope.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.internals import clear_unsharded_grad, fsdp_params, unsharded_grad
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import sequential
from reliability_harness import (
    LONG,
    ModelSpec,
    build_model,
    fsdp_states,
    gather_leaks,
    hook_count,
    local_grads,
    record_figures,
    run_examples,
    run_schedule,
    same_floats,
    same_tensors,
    stats_consistent,
    stats_delta,
)

SPEC = ModelSpec(n_blocks=3, calls=(0, 1, 2, 1), spans=((2, 4),))
"""blocks.1 runs twice; the last two calls are one checkpoint region, recomputed in backward."""
SCHEDULE = sequential(2)
"""Two accumulated microbatches: a fault in the second comes after the first's gradients."""
MICROBATCHES = 2
AFTER = 3
"""Iterations after the failed one: re-record, then replay twice."""


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    where: str
    """``"hook"`` (a unit's forward, recompute or backward), or ``"loss"``."""
    fqn: str = ""
    phase: str = ""
    occurrence: int = 1
    """Which use of ``(fqn, phase)`` in the iteration raises (1-based); for ``"loss"``, the microbatch + 1."""
    step: int = 2
    """0 fails the recording scope; 2 fails a replayed one."""
    interrupt: bool = False
    """Raise KeyboardInterrupt instead of an exception."""
    first_hook: bool = False
    """Pre-forward hook prepended last: runs before fsdp_replay's and FSDP2's (the unit is still sharded)."""
    explicit: bool = True

    def label(self) -> str:
        kind = "KeyboardInterrupt" if self.interrupt else "exception"
        at = f"{self.fqn} {self.phase} #{self.occurrence}" if self.where == "hook" else f"loss of microbatch {self.occurrence - 1}"
        scope = "recording" if self.step == 0 else "replayed"
        return f"{kind} at {at}{' (before all hooks)' if self.first_hook else ''} in a {scope} {'explicit' if self.explicit else 'automatic'} scope"


def _uses(spec: ModelSpec) -> dict[tuple[str, str], int]:
    """How often each (unit, phase) is demanded in one iteration of SCHEDULE."""
    uses = Counter({("<root>", "forward"): 1, ("<root>", "backward"): 1})
    checkpointed = {i for start, stop in spec.spans for i in range(start, stop)}
    for position, block in enumerate(spec.calls):
        uses[(f"blocks.{block}", "forward")] += 1
        uses[(f"blocks.{block}", "backward")] += 1
        if position in checkpointed:
            uses[(f"blocks.{block}", "recompute")] += 1
    return {k: v * MICROBATCHES for k, v in uses.items()}


def fault_cases() -> list[Fault]:
    cases = []
    for step in (0, 2):
        for (fqn, phase), n in sorted(_uses(SPEC).items()):
            # Short profile: the first use in the recording scope, the last in a replayed one.
            occurrences = range(1, n + 1) if LONG else [1 if step == 0 else n]
            cases += [Fault("hook", fqn, phase, occurrence, step) for occurrence in occurrences]
        cases += [Fault("loss", occurrence=mb + 1, step=step) for mb in range(MICROBATCHES)]
    cases += [Fault("hook", fqn, "forward", 1, first_hook=True) for fqn in ("<root>", "blocks.0", "blocks.1", "blocks.2")]
    cases += [
        Fault("hook", "blocks.1", "forward", 3, interrupt=True),
        Fault("hook", "blocks.2", "backward", 1, interrupt=True),
        Fault("loss", occurrence=2, interrupt=True),
        Fault("loss", occurrence=2, step=0, interrupt=True),
        Fault("hook", "blocks.1", "forward", 2, explicit=False),
        Fault("hook", "blocks.1", "recompute", 1, explicit=False),
        Fault("hook", "blocks.0", "backward", 2, explicit=False),
        Fault("loss", occurrence=2, explicit=False),
    ]
    return cases


class Injector:
    """Counts uses of each unit while armed and raises at the target one, from where a user hook would."""

    def __init__(self, model: torch.nn.Module, fault: Fault) -> None:
        self.fault, self.armed, self.counts = fault, False, Counter()
        self.handles = []
        for fqn, state in fsdp_states(model).items():
            module = state._modules[0]
            self.handles += [
                module.register_forward_pre_hook(functools.partial(self._pre, fqn), prepend=fault.first_hook),
                module.register_forward_hook(functools.partial(self._post, fqn)),
            ]

    def _hit(self, fqn: str, phase: str) -> None:
        if not self.armed or self.fault.where != "hook":
            return
        self.counts[(fqn, phase)] += 1
        if (fqn, phase) == (self.fault.fqn, self.fault.phase) and self.counts[(fqn, phase)] == self.fault.occurrence:
            self.armed = False
            raise (KeyboardInterrupt if self.fault.interrupt else InjectedFault)(self.fault.label())

    def _pre(self, fqn: str, module, args) -> None:
        self._hit(fqn, "recompute" if torch._C._current_graph_task_id() != -1 else "forward")

    def _post(self, fqn: str, module, args, output) -> None:
        if not self.armed or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        fired = [False]

        def on_grad(grad):
            if not fired[0]:
                fired[0] = True
                self._hit(fqn, "backward")

        output.register_hook(on_grad)

    def loss_fn(self, out: torch.Tensor, mb: int) -> torch.Tensor:
        if self.armed and self.fault.where == "loss" and mb == self.fault.occurrence - 1:
            self.armed = False
            raise (KeyboardInterrupt if self.fault.interrupt else InjectedFault)(self.fault.label())
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _segments(sched, key: str) -> list[int] | None:
    order = sched.state_dict()["orders"].get(key)
    return None if order is None else [segment for *_, segment in order]


def _clean_segments(segments: list[int] | None) -> list[int] | None:
    """One explicit scope of SCHEDULE: microbatch 0's demands precede the first backward's end."""
    if segments is None:
        return None
    half = len(segments) // 2
    return [0] * half + [1] * (len(segments) - half)


def stale_unsharded_grads(model: torch.nn.Module) -> list[str]:
    """Parameters whose *unsharded* tensor still holds a gradient (FSDP2 accumulates into it next time)."""
    return [
        f"{name}: {fp._param_fqn}"
        for name, state in fsdp_states(model).items()
        for fp in fsdp_params(state)
        if unsharded_grad(fp) is not None
    ]


def recover_plain_fsdp2(model: torch.nn.Module) -> None:
    """FSDP2's documented recovery, plus the step it misses in torch 2.13.

    ``reset_iter_state()`` reshards but keeps the ``.grad`` that autograd already wrote to
    unsharded parameters whose post-backward never ran (the root's, after a backward that raised);
    the next backward accumulates into it, so gradients drift. Tests of automatic scopes, where
    recovery is the user's job, do both; explicit scopes must do it themselves.
    """
    model.reset_iter_state()
    for state in fsdp_states(model).values():
        for fp in fsdp_params(state):
            clear_unsharded_grad(fp)


_REFERENCES: dict[tuple[int, int | None], list[dict]] = {}


def _reference(mesh, steps: int, skip: int | None) -> list[dict]:
    """Plain FSDP2 in which step ``skip`` never happened (cached: every rank runs the same cases in order)."""
    if (steps, skip) not in _REFERENCES:
        _REFERENCES[(steps, skip)] = _plain_run(mesh, steps, skip)
    return _REFERENCES[(steps, skip)]


def _plain_run(mesh, steps: int, skip: int | None) -> list[dict]:
    model = build_model(mesh, SPEC)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        if step == skip:
            out.append(None)
            continue
        losses = run_schedule(model, SPEC, SCHEDULE, step)
        out.append({"losses": losses, "grads": local_grads(model)})
        opt.step()
        opt.zero_grad()
    return out


def _run_fault(mesh, fault: Fault) -> dict:
    steps = fault.step + 1 + AFTER
    reference = _reference(mesh, steps, skip=fault.step)
    model = build_model(mesh, SPEC)
    sched = attach(model, PrefetchConfig())
    key = "train" if fault.explicit else "auto:grad"
    injector = Injector(model, fault)
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    hooks = hook_count(model)
    problems = []
    for step in range(steps):
        injector.armed = step == fault.step
        before = sched.stats.as_dict()
        raised = None
        try:
            if fault.explicit:
                with sched.iteration("train"):
                    losses = run_schedule(model, SPEC, SCHEDULE, step, loss_fn=injector.loss_fn)
            else:
                losses = run_schedule(model, SPEC, SCHEDULE, step, loss_fn=injector.loss_fn)
        except (InjectedFault, KeyboardInterrupt) as err:
            raised = err
            if not fault.explicit:
                recover_plain_fsdp2(model)  # what a user must do without a scope; explicit scopes recover themselves
        delta = stats_delta(sched.stats.as_dict(), before)
        observed = observer.take()
        where = f"step {step}"
        if step == fault.step:
            expected = KeyboardInterrupt if fault.interrupt else InjectedFault
            if not isinstance(raised, expected):
                problems.append(f"{where}: expected {expected.__name__} to propagate, got {raised!r}")
            problems += [f"{where}: after the failure: {leak}" for leak in gather_leaks(model)]
            problems += [f"{where}: after the failure: stale gradient on unsharded {p}" for p in stale_unsharded_grads(model)]
            # An automatic scope cannot see a failure outside the model's own forward/backward (a
            # loss or backward that raised): the next root forward closes it and drops its order.
            if sched.recorded_order(key) is not None and (fault.explicit or fault.phase == "forward"):
                problems.append(f"{where}: the failed scope left a recorded order of {key!r}")
            if hook_count(model) != hooks:
                problems.append(f"{where}: {hook_count(model) - hooks} module hooks left behind")
            opt.zero_grad(set_to_none=True)  # the failed step's partial gradients are discarded
            continue
        if raised is not None:
            problems.append(f"{where}: unexpected {raised!r}")
            continue
        ref = reference[step]
        if not same_floats(losses, ref["losses"]):
            problems.append(f"{where}: losses {losses} != plain FSDP2 {ref['losses']}")
        if not same_tensors(local_grads(model), ref["grads"]):
            problems.append(f"{where}: gradients differ from plain FSDP2")
        problems += [f"{where}: after the scope: {leak}" for leak in gather_leaks(model)]
        if step > fault.step:
            if step == fault.step + 1 and delta["recordings"] != 1:
                problems.append(f"{where}: the first iteration after the failure recorded {delta['recordings']} times")
            if step > fault.step + 1:
                if delta["divergences"]:
                    problems.append(f"{where}: {delta['divergences']} divergences after recovery")
                misses = [d for i, d in enumerate(observed) if d[2] == "miss" and (fault.explicit or i % (len(observed) // 2))]
                if misses:
                    problems.append(f"{where}: replay after recovery missed {misses}")
                segments = _segments(sched, key)
                if fault.explicit and segments != _clean_segments(segments):
                    problems.append(
                        f"{where}: the order re-recorded after the failure has backward segments "
                        f"{segments}, a clean recording has {_clean_segments(segments)}"
                    )
        opt.step()
        opt.zero_grad()
    problems += stats_consistent(sched)
    if hook_count(model) != hooks:
        problems.append(f"end: {hook_count(model) - hooks} module hooks left behind")
    injector.remove()
    observer.remove()
    return {"problems": problems}


@pytest.fixture(scope="module")
def fault_results():
    cases = fault_cases()
    per_rank = run_examples(_run_fault, cases)
    record_figures(
        "faults",
        {
            "faults": len(cases),
            "hook_points": len({(c.fqn, c.phase, c.occurrence) for c in cases if c.where == "hook"}),
            "interrupts": sum(c.interrupt for c in cases),
            "iterations_per_rank": sum(c.step + 1 + AFTER for c in cases) * 2,
        },
    )
    return cases, per_rank


def _failures(cases, per_rank, select) -> list[str]:
    return [
        f"rank {rank}: {case.label()}:\n    " + "\n    ".join(result["problems"][:5])
        for rank, results in enumerate(per_rank)
        for case, result in zip(cases, results)
        if select(case) and result["problems"]
    ]


@pytest.mark.parametrize(
    "select",
    [
        pytest.param(lambda c: c.where == "hook" and c.phase == "forward" and not c.interrupt, id="pre_forward"),
        pytest.param(lambda c: c.where == "hook" and c.phase == "recompute" and not c.interrupt, id="recompute"),
        pytest.param(lambda c: c.where == "hook" and c.phase == "backward" and not c.interrupt, id="backward"),
        pytest.param(lambda c: c.where == "loss" and not c.interrupt, id="loss"),
        pytest.param(lambda c: c.interrupt, id="keyboard_interrupt"),
    ],
)
def test_a_fault_leaves_no_gather_no_unsharded_params_no_recording_and_training_recovers(fault_results, select):
    cases, per_rank = fault_results
    failures = _failures(cases, per_rank, select)
    assert not failures, f"{len(failures)} case(s) failed:\n" + "\n".join(failures)


# --- non-faults that stress the hooks -------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    detach_block: int | None = None
    """A forward hook on this block returns its output detached: the unit's outputs need no grad."""
    no_grad_forward_after: int | None = None
    """Run a ``torch.no_grad`` forward after this schedule position, inside the training scope."""
    explicit: bool = True


def variants() -> list[Variant]:
    return [
        *(Variant(f"outputs of blocks.{b} need no grad", detach_block=b) for b in range(SPEC.n_blocks)),
        Variant("outputs of blocks.1 need no grad, automatic scopes", detach_block=1, explicit=False),
        *(Variant(f"no_grad forward after schedule position {i}", no_grad_forward_after=i) for i in range(len(SCHEDULE))),
        Variant("no_grad forward between microbatches, automatic scopes", no_grad_forward_after=1, explicit=False),
    ]


def _train_variant(mesh, variant: Variant, scheduled: bool) -> dict:
    model = build_model(mesh, SPEC)
    sched = attach(model, PrefetchConfig()) if scheduled else None
    if variant.detach_block is not None:
        model.blocks[variant.detach_block].register_forward_hook(lambda m, a, out: out.detach())
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step in range(4):
        before = sched.stats.as_dict() if sched else {}
        schedule = list(SCHEDULE)
        losses, eval_losses = {}, []

        def body():
            for position, (op, mb) in enumerate(schedule):
                if op == "F":
                    losses[mb] = model(torch.randn(SPEC.rows, SPEC.dim, generator=torch.Generator().manual_seed(1000 * step + mb)))
                else:
                    losses[mb].backward()
                if position == variant.no_grad_forward_after:
                    with torch.no_grad():
                        eval_losses.append(model(torch.ones(SPEC.rows, SPEC.dim)).item())

        if sched is not None and variant.explicit:
            with sched.iteration("train"):
                body()
        else:
            body()
        steps.append(
            {
                "losses": [losses[mb].item() for mb in sorted(losses)] + eval_losses,
                "grads": local_grads(model),
                "leaks": gather_leaks(model),
                "observed": observer.take(),
                "stats": stats_delta(sched.stats.as_dict(), before) if sched else None,
            }
        )
        opt.step()
        opt.zero_grad()
    return {"steps": steps, "consistency": stats_consistent(sched) if sched else []}


def _run_variant(mesh, variant: Variant) -> dict:
    plain = _train_variant(mesh, variant, scheduled=False)
    got = _train_variant(mesh, variant, scheduled=True)
    problems = list(got["consistency"])
    for step, (p, g) in enumerate(zip(plain["steps"], got["steps"])):
        if not same_floats(p["losses"], g["losses"]):
            problems.append(f"step {step}: losses {g['losses']} != plain {p['losses']}")
        if not same_tensors(p["grads"], g["grads"]):
            problems.append(f"step {step}: gradients differ from plain FSDP2")
        # The root is not resharded after a no_grad forward (reshard_after_forward=False); plain FSDP2 alike.
        problems += [f"step {step}: {leak}" for leak in g["leaks"] if leak not in p["leaks"]]
        if step >= 2:
            if g["stats"]["divergences"]:
                problems.append(f"step {step}: {g['stats']['divergences']} divergences")
            if variant.explicit and any(kind == "miss" for *_, kind in g["observed"]):
                problems.append(f"step {step}: replay missed: {g['observed']}")
    return {"problems": problems}


def test_units_without_grad_outputs_and_no_grad_forwards_in_a_scope_match_plain_fsdp2():
    cases = variants()
    per_rank = run_examples(_run_variant, cases)
    failures = [
        f"rank {rank}: {case.name}:\n    " + "\n    ".join(result["problems"][:5])
        for rank, results in enumerate(per_rank)
        for case, result in zip(cases, results)
        if result["problems"]
    ]
    record_figures("hook_stress", {"variants": len(cases), "iterations_per_rank": len(cases) * 8})
    assert not failures, f"{len(failures)} variant(s) failed:\n" + "\n".join(failures)


def _problems_matching(fault_results, *needles: str) -> list[str]:
    cases, per_rank = fault_results
    return [
        f"rank {rank}: {case.label()}: {problem}"
        for rank, results in enumerate(per_rank)
        for case, result in zip(cases, results)
        for problem in result["problems"]
        if any(n in problem for n in needles)
    ]


def test_a_failed_backward_leaves_no_stale_gradient_on_unsharded_params(fault_results):
    """Regression: FSDP2's reset_iter_state() keeps autograd's .grad on unsharded root params; the
    next backward accumulates into it and every later gradient drifts from plain FSDP2."""
    found = _problems_matching(fault_results, "stale gradient on unsharded")
    assert not found, "\n".join(found[:10])


def test_a_failed_backward_does_not_stop_later_backwards_from_ending_their_scope(fault_results):
    """Regression: the end-of-backward callback queued in the failed backward never runs, so the
    hooks never queue another; later orders lose their backward segments and replays miss."""
    found = _problems_matching(fault_results, "backward segments", "replay after recovery missed")
    assert not found, "\n".join(found[:10])
