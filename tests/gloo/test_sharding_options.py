"""What users pass to ``fully_shard`` besides a mesh, and the meshes they build: mixed precision, CPU
offload, a custom shard placement, no reshard after forward, HSDP (a replicate x shard mesh) and
tensor parallelism inside each block. Every mode trains bitwise like plain FSDP2 given the same, and
replay makes every demand after the recording a hit or resident."""

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdp_replay import attach
from fsdp_replay.testing.compare import assert_trains_like_plain, train
from fsdp_replay.testing.contenders import REUSE, contender_config
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import workload

MODES = ("plain", "demand", "static", "record_and_replay", REUSE)
WORKLOADS = ("sequential", "checkpointed", "shared_block", "interleaved_1f1b")
STEPS = 3


def _dim1_where_even(param: nn.Parameter) -> Shard | None:
    """Shard matrices on their second dimension (FSDP2's default is the first)."""
    return Shard(1) if param.ndim > 1 and param.shape[1] % 2 == 0 else None


def _by_kwargs(**kwargs: Any) -> Callable[[nn.Module, Any], nn.Module]:
    return lambda model, mesh: model.shard(mesh, **kwargs)


def _hsdp(model: nn.Module, mesh: Any) -> nn.Module:
    return model.shard(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))


def _tensor_parallel(model: nn.Module, mesh: Any) -> nn.Module:
    """Each block's MLP split column- then row-wise over a tp dimension, FSDP2 over the dp one."""
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh_2d["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model.shard(mesh_2d["dp"])


OPTIONS: dict[str, tuple[int, Callable[[nn.Module, Any], nn.Module]]] = {
    "mixed_precision": (2, _by_kwargs(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
    "cpu_offload": (2, _by_kwargs(offload_policy=CPUOffloadPolicy(pin_memory=False))),
    "shard_placement": (2, _by_kwargs(shard_placement_fn=_dim1_where_even)),
    "no_reshard_after_forward": (2, _by_kwargs(reshard_after_forward=False)),
    "hsdp": (4, _hsdp),
    "tensor_parallel": (4, _tensor_parallel),
}
"""Option -> (world size, how the model is sharded)."""


def _train(mesh, option: str, name: str, mode: str) -> dict:
    w = workload(name)
    model = OPTIONS[option][1](w.make_model(), mesh)
    sched = None if mode == "plain" else attach(model, contender_config(mode))
    run = train(model, w, sched, STEPS, observer=DemandObserver(model))
    return run | {"stats": sched.stats.as_dict() if sched else None}


def _all(mesh, option: str) -> dict:
    return {(name, mode): _train(mesh, option, name, mode) for name in WORKLOADS for mode in MODES}


@pytest.fixture(scope="module", params=list(OPTIONS))
def runs(request):
    option = request.param
    return option, spawn(_all, option, world_size=OPTIONS[option][0], timeout_s=600)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_mode_is_bitwise_equal_to_plain_fsdp2_with_the_same_option(runs, name):
    _, results = runs
    for rank_result in results:
        assert_trains_like_plain(rank_result, name, MODES[1:])


def test_replay_makes_every_demand_after_the_recording_a_hit_or_resident(runs):
    option, results = runs
    for rank_result in results:
        for name in WORKLOADS:
            for mode in ("record_and_replay", REUSE):
                run = rank_result[(name, mode)]
                assert run["stats"]["recordings"] == 1 and run["stats"]["divergences"] == 0, (option, name, mode)
                for step, observed in enumerate(run["observed"][1:], start=1):
                    assert {kind for _, _, kind in observed} <= {"hit", "resident"}, (option, name, mode, step)
                assert any(kind == "hit" for observed in run["observed"][1:] for _, _, kind in observed), (option, name, mode)
