"""torch.compile of each block (torchtitan's default) with a scheduler attached: no graph break
that plain FSDP2 does not have, and the same numerics (see [Note: hooks are opaque to torch.compile]
in ``fsdp_replay/_hooks.py``). CI runs this file on every torch leg (2.11 to 2.15)."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.compare import assert_trains_like_plain, train
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.workloads import workload

MODES = ("plain", "demand", "static", "record_and_replay")
WORKLOADS = ("sequential", "checkpointed")
STEPS = 3


def _train_compiled(mesh, name: str, mode: str) -> dict:
    """``mode`` on a model whose blocks are compiled one by one (``aot_eager``: the CPU backend that
    runs the autograd graph Dynamo captured), counting Dynamo's graph breaks from a fresh cache."""
    torch._dynamo.reset()
    counters.clear()
    w = workload(name)
    model = w.make_model()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    model.shard(mesh)
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    run = train(model, w, sched, STEPS)
    return run | {
        "graph_breaks": dict(counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],
        "hits": sched.stats.as_dict()["hits"] if sched is not None else None,
    }


def _all_modes(mesh) -> dict:
    return {(name, mode): _train_compiled(mesh, name, mode) for name in WORKLOADS for mode in MODES}


@pytest.fixture(scope="module")
def compiled_runs():
    return spawn(_all_modes, timeout_s=600)


@pytest.mark.parametrize("name", WORKLOADS)
def test_compiled_blocks_add_no_graph_break_to_plain_fsdp2s(compiled_runs, name):
    for rank_result in compiled_runs:
        plain = rank_result[(name, "plain")]
        assert plain["graphs"] > 0  # the blocks were compiled at all
        for mode in MODES[1:]:
            run = rank_result[(name, mode)]
            assert run["graph_breaks"] == plain["graph_breaks"], (name, mode)
            assert run["graphs"] == plain["graphs"], (name, mode)


@pytest.mark.parametrize("name", WORKLOADS)
def test_compiled_blocks_train_bitwise_like_plain_fsdp2_compiled_alike(compiled_runs, name):
    for rank_result in compiled_runs:
        assert_trains_like_plain(rank_result, name, MODES[1:])


def test_compiled_blocks_are_still_prefetched_by_replay(compiled_runs):
    for rank_result in compiled_runs:
        assert rank_result[("sequential", "record_and_replay")]["hits"] > 0
