"""torch.compile of each block (torchtitan's default) or of the whole sharded model, with a scheduler
attached: no graph break that plain FSDP2 does not have, and the same numerics (see [Note: hooks are
opaque to torch.compile] in ``fsdp_replay/_hooks.py``), with FSDP2's internals and on the public-API
fallback. CI runs this file on every torch leg (2.11 to 2.15)."""

import gc

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay._compat import PUBLIC_API_ENV
from fsdp_replay.testing.compare import assert_trains_like_plain, train
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.workloads import method_call_workload, run_iteration, run_through_loss, workload

MODES = ("plain", "demand", "static", "record_and_replay")
COMPILED = ("blocks", "swapped", "whole")
"""How the model is compiled: each block in place before sharding (``block.compile()``); each block
swapped for ``torch.compile(block, fullgraph=True)`` before sharding, so FSDP2 shards the compiled
wrapper and any graph break raises (torchtitan's ``apply_compile``); or the sharded model as a whole,
the scheduler attached first (Dynamo then meets FSDP2's hooks and fsdp_replay's in one frame)."""
CASES = (
    "sequential/blocks",
    "checkpointed/blocks",
    "sequential/swapped",
    "checkpointed/swapped",
    "sequential/whole",
    "shared_block/whole",
    "method_calls/methods",
)
"""Workload/how compiled. Compiled whole, the checkpointed workload captures no graph at all, with
or without a scheduler, so it shows nothing there. ``method_calls/methods``: the even blocks'
methods registered with ``register_fsdp_forward_method`` compiled after sharding, so Dynamo traces
FSDP2's method wrapper and meets the ``_pre_forward`` the scheduler shadows."""
STEPS = 3


def _train_compiled(mesh, case: str, mode: str) -> dict:
    """``mode`` on a model compiled as ``case`` says (``aot_eager``: the CPU backend that runs the
    autograd graph Dynamo captured), counting Dynamo's graph breaks from a fresh cache."""
    torch._dynamo.reset()
    counters.clear()
    # The previous runs' models, in reference cycles (a block holds its compiled method), are
    # collected now: collected during a trace, each drops its entry from FSDP2's module-state
    # WeakKeyDictionary while Dynamo iterates it ("dictionary changed size during iteration", on
    # 2.14.1 with the public-API fallback, depending on when the collector happens to run).
    gc.collect()
    name, compiled = case.split("/")
    w = method_call_workload() if name == "method_calls" else workload(name)
    model = w.make_model()
    if compiled == "blocks":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    elif compiled == "swapped":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    model.shard(mesh)
    if compiled == "methods":
        for block in model.blocks[::2]:
            block.halved = torch.compile(block.halved, backend="aot_eager")
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    if compiled == "whole":
        model.compile(backend="aot_eager")
    run = train(model, w, sched, STEPS, iterate=run_through_loss if name == "method_calls" else run_iteration)
    return run | {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "hits": sched.stats.as_dict()["hits"] if sched is not None else None,
    }


def _all_modes(mesh) -> dict:
    return {(case, mode): _train_compiled(mesh, case, mode) for case in CASES for mode in MODES}


@pytest.fixture(scope="module", params=[False, True], ids=["internals", "public_api"])
def compiled_runs(request):
    """Every case with FSDP2's internals, and again with the public-API fallback forced."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param:
            patch.setenv(PUBLIC_API_ENV, "1")  # read at import by the spawned ranks
        return spawn(_all_modes, timeout_s=600)


@pytest.mark.parametrize("case", CASES)
def test_compiling_adds_no_graph_break_to_plain_fsdp2s(compiled_runs, case):
    for rank_result in compiled_runs:
        plain = rank_result[(case, "plain")]
        assert plain["graphs"] > 0  # something was compiled at all
        for mode in MODES[1:]:
            run = rank_result[(case, mode)]
            assert run["graph_breaks"] == plain["graph_breaks"], (case, mode)
            assert run["graphs"] == plain["graphs"], (case, mode)


@pytest.mark.parametrize("case", CASES)
def test_compiled_models_train_bitwise_like_plain_fsdp2_compiled_alike(compiled_runs, case):
    for rank_result in compiled_runs:
        assert_trains_like_plain(rank_result, case, MODES[1:])


@pytest.mark.parametrize("compiled", COMPILED)
def test_compiled_models_are_still_prefetched_by_replay(compiled_runs, compiled):
    for rank_result in compiled_runs:
        assert rank_result[(f"sequential/{compiled}", "record_and_replay")]["hits"] > 0
