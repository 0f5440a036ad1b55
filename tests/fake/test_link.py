"""The emulated link (``fsdp_replay.testing.link``) sees each collective FSDP2 issues once, with its
unsharded bytes, and puts torch.distributed back as it was. (Its GPU timing: tests/gpu/test_cuda_waits.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.link import COLLECTIVES, EmulatedLink
from fsdp_replay.testing.workloads import run_iteration, workload

WORLD = 4


def test_every_gather_and_reduce_scatter_is_logged_once_with_its_unsharded_bytes():
    with fake_world(WORLD) as mesh:
        w = workload("sequential")
        model = w.make_model().shard(mesh)
        block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())  # DTensor: the full size
        link = EmulatedLink(torch.device("cpu"), world_size=WORLD, bandwidth_gbps=1.0)
        with link.installed():
            link.log = []
            run_iteration(model, w, 0)
    blocks = [kind for kind, nbytes in link.log if nbytes == block_bytes]
    # 4 blocks: gathered in forward, again in backward (resharded after forward), reduce-scattered once.
    assert blocks.count("AG") == 8 and blocks.count("RS") == 4, link.log
    assert link.seconds(block_bytes) == pytest.approx(block_bytes * (WORLD - 1) / WORLD / 1e9)


def test_installing_the_link_restores_torch_distributed_afterwards():
    before = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    link = EmulatedLink(torch.device("cpu"), world_size=WORLD, bandwidth_gbps=1.0)
    with link.installed():
        assert all(getattr(dist, name) is not f for name, f in before.items())
    assert {name: getattr(dist, name) for name in before} == before


def test_a_world_of_one_has_no_link():
    with pytest.raises(ValueError, match="world_size must be >= 2.*got 1"):
        EmulatedLink(torch.device("cpu"), world_size=1, bandwidth_gbps=50.0)
