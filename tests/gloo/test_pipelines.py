"""Pipeline schedules (torch.distributed.pipelining) on 4 gloo ranks, pp=2 x dp=2, one scheduler per rank
over all its model chunks, each mode against plain FSDP2 on the same schedule.

Plain FSDP2 is right under every schedule with ``reshard_after_forward=False``, and under the
schedules without split backward with the default ``True``; there every mode must match it bitwise,
issue no more all-gathers, and leave the same units unsharded. Under zero-bubble schedules with
``reshard_after_forward=True`` plain FSDP2 itself trains wrongly (README, "Known upstream issues"):
there the modes must only run without error.
"""

import logging

import pytest
import torch

from fsdp_replay._compat import TORCH_RELEASE
from fsdp_replay.stats import Demand
from fsdp_replay.testing.contenders import REUSE
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.pipelines import (
    SINGLE_STAGE_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    PipelineSetup,
    available_schedules,
    pipeline_mesh,
    run_pipeline,
)

MODES = ("demand", "static", "record_and_replay")
SCHEDULES = available_schedules()
SHAPES_INFERRED = (True, False) if TORCH_RELEASE >= (2, 13) else (True,)
"""Before torch 2.13 ``PipelineStage`` takes given shapes differently (2.11 no gradient shapes; on 2.12 the
first step failed its metadata check with them, "has gradients None and is expecting to send gradients"):
there the stages infer them."""
FIRST_STEP_WITHOUT_MISSES = 1 if TORCH_RELEASE >= (2, 12) else 2
"""Replay misses nothing from the first replay on; on torch 2.11 from the second. There the stages
infer shapes with a forward of every chunk and no backward, which nothing reshards after, so the
recording's likely start is its first demand: the first replay follows the inference pass until its
third demand leaves it, realigns (the prefix rule) and gathers that demand at its use."""
CORRECT_SETUPS = [PipelineSetup(schedule=name, reshard_after_forward=False) for name in SCHEDULES] + [
    PipelineSetup(schedule=name, reshard_after_forward=True, infer_shapes=infer)
    for name in SCHEDULES
    if name not in ZERO_BUBBLE_SCHEDULES
    for infer in SHAPES_INFERRED
] + [
    # Chunk roots with parameters of their own (a LayerNorm each): prefetched at the scope's start, then
    # unshard()-ed by the schedule, they must still be kept later (issue 25).
    PipelineSetup(schedule="ScheduleInterleaved1F1B", root_params=True, infer_shapes=infer)
    for infer in SHAPES_INFERRED
    if "ScheduleInterleaved1F1B" in SCHEDULES
]
REUSE_SETUPS = [
    s for s in CORRECT_SETUPS
    if s.schedule in ("Schedule1F1B", "ScheduleInterleaved1F1B") and s.reshard_after_forward and not s.infer_shapes
]
UPSTREAM_WRONG_SETUPS = [PipelineSetup(schedule=name) for name in SCHEDULES if name in ZERO_BUBBLE_SCHEDULES]
AUTOMATIC_SETUPS = [PipelineSetup(schedule="Schedule1F1B"), PipelineSetup(schedule="ScheduleInterleaved1F1B")]
DIVERGENT = (PipelineSetup(schedule="ScheduleInterleaved1F1B"), (2, "ScheduleLoopedBFS"))
"""Step 2 of 4 runs another schedule over the same chunks: its iteration leaves the recorded order."""


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _everything(mesh) -> dict:
    mesh = pipeline_mesh(mesh.size())
    results = {}
    for setup in CORRECT_SETUPS + UPSTREAM_WRONG_SETUPS:
        for mode in ("plain",) + MODES + ((REUSE,) if setup in REUSE_SETUPS else ()):
            results[setup, mode] = run_pipeline(setup, mesh, mode)
    setup, switch = DIVERGENT
    for mode in ("plain", "record_and_replay"):
        results[setup, "divergent", mode] = run_pipeline(setup, mesh, mode, steps=4, switch=switch)
    for setup in AUTOMATIC_SETUPS:
        messages = _Messages()
        logging.getLogger("fsdp_replay").addHandler(messages)
        try:
            results[setup, "auto"] = run_pipeline(setup, mesh, "record_and_replay", explicit=False)
        finally:
            logging.getLogger("fsdp_replay").removeHandler(messages)
        results[setup, "auto"]["messages"] = messages.lines
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_everything, world_size=4, timeout_s=900)


def _same_numerics(got: dict, plain: dict) -> None:
    for step, (a, b) in enumerate(zip(got["steps"], plain["steps"])):
        assert a["losses"] == b["losses"], f"losses differ at step {step}"
        assert len(a["params"]) == len(b["params"])
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), f"parameters differ at step {step}"


def _setup_id(s: PipelineSetup) -> str:
    roots = "-root-params" if s.root_params else ""
    return f"{s.schedule}-raf{int(s.reshard_after_forward)}-{'inferred' if s.infer_shapes else 'given'}{roots}"


def _equals_plain(ranks: list[dict], setup: PipelineSetup, mode: str) -> None:
    for rank, results in enumerate(ranks):
        got, plain = results[setup, mode], results[setup, "plain"]
        _same_numerics(got, plain)
        for step, (a, b) in enumerate(zip(got["steps"], plain["steps"])):
            assert a["all_gathers"] <= b["all_gathers"], f"rank {rank} step {step}: more all-gathers than plain"
            assert a["held"] == b["held"], f"rank {rank} step {step}: other units left unsharded than plain"
        if mode in ("record_and_replay", REUSE):
            assert got["stats"]["divergences"] == 0, f"rank {rank}: {got['stats']}"
            for step, record in enumerate(got["steps"][FIRST_STEP_WITHOUT_MISSES:], start=FIRST_STEP_WITHOUT_MISSES):
                misses = [entry for entry in record["observed"] if entry[2] is Demand.miss]
                assert not misses, f"rank {rank} step {step}: misses after recording {misses}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", CORRECT_SETUPS, ids=_setup_id)
def test_each_mode_equals_plain_fsdp2(ranks, setup, mode) -> None:
    _equals_plain(ranks, setup, mode)


@pytest.mark.parametrize("setup", REUSE_SETUPS, ids=_setup_id)
def test_replay_keeping_units_for_later_uses_equals_plain_fsdp2(ranks, setup) -> None:
    """Each stage's toggles and finalization come between a microbatch's uses: only keeps that do
    not cross a backward's end are made, and the stage's own settings still win."""
    _equals_plain(ranks, setup, REUSE)
    for results in ranks:
        assert results[setup, REUSE]["stats"]["kept"] > 0


@pytest.mark.parametrize("setup", CORRECT_SETUPS[: len(SCHEDULES)], ids=lambda s: s.schedule)
def test_one_flat_order_names_units_by_chunk(ranks, setup) -> None:
    order = ranks[0][setup, "record_and_replay"]["order"]
    chunks = {fqn.split("/")[0] for fqn, _ in order} if setup.schedule not in SINGLE_STAGE_SCHEDULES else None
    if chunks is None:
        assert all("/" not in fqn for fqn, _ in order)  # one root: FQNs as they are
    else:
        assert chunks == {"chunk0", "chunk1"}
    assert {phase for _, phase in order} == {"forward", "backward"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", UPSTREAM_WRONG_SETUPS, ids=lambda s: s.schedule)
def test_zero_bubble_with_reshard_after_forward_runs(ranks, setup, mode) -> None:
    """Plain FSDP2 is wrong here (README, "Known upstream issues"): no error, and no more gathers."""
    for results in ranks:
        got, plain = results[setup, mode], results[setup, "plain"]
        assert len(got["steps"]) == len(plain["steps"])
        assert sum(s["all_gathers"] for s in got["steps"]) <= sum(s["all_gathers"] for s in plain["steps"]) + 1


@pytest.mark.parametrize("setup", AUTOMATIC_SETUPS, ids=lambda s: s.schedule)
def test_automatic_scopes_stop_with_one_message(ranks, setup) -> None:
    for results in ranks:
        got = results[setup, "auto"]
        _same_numerics(got, results[setup, "plain"])
        said = [line for line in got["messages"] if "no automatic scopes" in line]
        assert len(said) == 1 and "sched.iteration" in said[0], got["messages"]
        assert got["order"] is None


def test_a_step_that_leaves_the_order_falls_back_and_records_again(ranks) -> None:
    setup, _ = DIVERGENT
    for rank, results in enumerate(ranks):
        got, plain = results[setup, "divergent", "record_and_replay"], results[setup, "divergent", "plain"]
        _same_numerics(got, plain)
        assert got["stats"]["divergences"] == 1 and got["stats"]["recordings"] == 2, (rank, got["stats"])
        assert all(a["all_gathers"] <= b["all_gathers"] for a, b in zip(got["steps"], plain["steps"]))
        assert [a["held"] for a in got["steps"]] == [b["held"] for b in plain["steps"]]
