"""The public-API fallback (torch releases outside the tested ones), forced on the tested release with
``FSDP_REPLAY_PUBLIC_API=1``: units found as FSDP2 defines them, no private FSDP2 attribute read,
prefetch through ``unshard(async_op=True)``, every workload bitwise equal to plain FSDP2."""

import os
import subprocess
import sys

import pytest
import torch

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay._compat import PUBLIC_API_ENV
from fsdp_replay.testing.compare import assert_trains_like_plain, train
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.observer import DemandObserver
from fsdp_replay.testing.workloads import canonical_workloads, method_call_workload, run_iteration, run_through_loss, workload

MODES = ("plain", "demand", "static", "record_and_replay")
WORKLOADS = [w.name for w in canonical_workloads()]
STEPS = 3


def _train(mesh, name: str, mode: str) -> dict:
    from fsdp_replay import _compat

    assert not _compat.INTERNALS_OK, "the fallback was not forced in this rank"
    w = workload(name)
    model = w.make_model().shard(mesh)
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    run = train(model, w, sched, STEPS, observer=DemandObserver(model))
    units = [u.fqn for u in sched.units] if sched is not None else None
    if sched is not None:
        sched.detach()
    return run | {
        "observed": [demand for step in run["observed"] for demand in step],
        "stats": sched.stats.as_dict() if sched else None,
        "units": units,
    }


def _train_method_calls(mesh, mode: str) -> dict:
    """The root and the even blocks through registered forward methods, which the fallback does not see."""
    w = method_call_workload()
    model = w.make_model().shard(mesh)
    sched = None if mode == "plain" else attach(model, PrefetchConfig(mode=mode))
    return train(model, w, sched, STEPS, iterate=run_through_loss)


def _all(mesh) -> dict:
    runs = {(n, m): _train(mesh, n, m) for n in WORKLOADS for m in MODES}
    return runs | {("method_calls", m): _train_method_calls(mesh, m) for m in MODES}


@pytest.fixture(scope="module")
def fallback_runs():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PUBLIC_API_ENV, "1")  # read at import by the spawned ranks
        return spawn(_all, timeout_s=600)


@pytest.mark.parametrize("name", WORKLOADS + ["method_calls"])
def test_every_mode_is_bitwise_equal_to_plain_fsdp2_on_the_public_api(fallback_runs, name):
    for rank_result in fallback_runs:
        assert_trains_like_plain(rank_result, name, MODES[1:])


def test_units_are_every_fully_shard_module_with_parameters_in_its_subtree(fallback_runs):
    units = fallback_runs[0][("sequential", "record_and_replay")]["units"]
    assert units == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]  # block params live in children
    # A grouped fully_shard([embed, head]) is one FSDP2 state; publicly each module is scheduled.
    assert fallback_runs[0][("tied_embedding", "record_and_replay")]["units"][:3] == ["<root>", "embed", "blocks.0"]


def test_replay_prefetches_through_the_public_api_and_counts_like_the_observer(fallback_runs):
    for rank_result in fallback_runs:
        run = rank_result[("sequential", "record_and_replay")]
        stats, seen = run["stats"], DemandObserver.counts(run["observed"])
        assert stats["recordings"] == 1 and stats["divergences"] == 0 and stats["prefetches"] > 0
        assert stats["hits"] == seen.get("hit", 0) > 0 and stats["kept"] == 0
        assert stats["demands"] == stats["hits"] + stats["misses"] + stats["resident"]


def test_the_fallback_warns_once_saying_what_is_lost():
    code = "import warnings; warnings.simplefilter('always'); import fsdp_replay, fsdp_replay._compat"
    env = {**os.environ, PUBLIC_API_ENV: "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("PublicAPIFallbackWarning") == 1, result.stderr
    assert "Lost: keeps" in result.stderr and f"{PUBLIC_API_ENV} is set" in result.stderr


def _alive_after_detach(mesh) -> dict:
    """Per mode, whether the model or the scheduler outlives ``detach()``, ``del`` and ``gc.collect()``."""
    import gc
    import weakref

    alive = {}
    w = workload("sequential")
    for mode in MODES[1:]:
        model = w.make_model().shard(mesh)
        sched = attach(model, PrefetchConfig(mode=mode))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(STEPS):
            with sched.iteration("train"):
                run_iteration(model, w, step)
            opt.step()
            opt.zero_grad()
        sched.detach()
        refs = (weakref.ref(model), weakref.ref(sched))
        del model, sched, opt
        gc.collect()
        alive[mode] = [ref() is not None for ref in refs]
    return alive


def test_no_module_or_scheduler_outlives_detach_in_any_mode_on_the_public_api():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PUBLIC_API_ENV, "1")
        ranks = spawn(_alive_after_detach, timeout_s=300)
    for alive in ranks:
        assert alive == {mode: [False, False] for mode in MODES[1:]}, alive


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_fallback_counts_hits_as_the_observer_sees_them(fallback_runs, name):
    for rank_result in fallback_runs:
        for mode in MODES[1:]:
            stats, seen = rank_result[(name, mode)]["stats"], DemandObserver.counts(rank_result[(name, mode)]["observed"])
            assert stats["hits"] == seen.get("hit", 0), (name, mode, stats, seen)
            assert stats["hits"] <= stats["prefetches"], (name, mode, stats)
