"""Parameters changed in place at the start of each step, inside ``iteration()`` where scoped (a
checkpoint loaded with ``load_state_dict`` or DCP's ``set_model_state_dict``, an update under
``torch.no_grad()``): every mode trains bitwise like plain FSDP2 making the same changes, although
replay's first gathers were issued before them ([Note: parameters changed before a demand]); on
FSDP2's internals and on the public-API fallback."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from fsdp_replay import attach
from fsdp_replay._compat import PUBLIC_API_ENV
from fsdp_replay.testing.compare import assert_trains_like_plain, train
from fsdp_replay.testing.contenders import REUSE, contender_config
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.workloads import run_iteration, workload

MODES = ("plain", "demand", "static", "record_and_replay", REUSE)
WORKLOADS = ("sequential", "interleaved_1f1b")
CHANGES = ("no_grad", "load_state_dict", "set_model_state_dict")


def _changing(change: str, snapshot: dict):
    """A step that first changes the parameters (from the second step on), then runs the workload."""

    def iterate(model, w, step):
        if step:
            if change == "no_grad":
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
            elif change == "load_state_dict":
                model.load_state_dict(snapshot)
            else:
                set_model_state_dict(model, snapshot)
        return run_iteration(model, w, step)

    return iterate


def _all_runs(mesh, workloads: tuple[str, ...], scopes: tuple[bool, ...]) -> tuple[dict, dict]:
    runs, wasted = {}, {}
    for name in workloads:
        w = workload(name)
        for change in CHANGES:
            for scoped in scopes:
                case = f"{name}/{change}/{'explicit' if scoped else 'automatic'}"
                for mode in MODES:
                    model = w.make_model().shard(mesh)
                    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    sched = None if mode == "plain" else attach(model, contender_config(mode))
                    runs[(case, mode)] = train(model, w, sched, 4, scoped=scoped, iterate=_changing(change, snapshot))
                    if sched is not None:
                        wasted[(case, mode)] = sched.stats.wasted
    return runs, wasted


@pytest.fixture(scope="module")
def results():
    return spawn(_all_runs, WORKLOADS, (True, False), timeout_s=600)


@pytest.fixture(scope="module")
def fallback_results():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PUBLIC_API_ENV, "1")  # read at import by the spawned ranks
        return spawn(_all_runs, ("sequential",), (True,), timeout_s=600)


def _given_up_and_rolled_back(snapshot: dict):
    """The third step is given up after its forward (its loss was not finite, say), the model rolled
    back to its first state with ``load_state_dict``, and the step run again: no optimizer step in
    between, so the automatic scope of the given-up forward still holds what it provided."""

    def iterate(model, w, step):
        if step == 2:
            model(w.make_batch(step, 0))
            model.load_state_dict(snapshot)
        return run_iteration(model, w, step)

    return iterate


def _rollback_runs(mesh) -> dict:
    runs = {}
    for name in ("sequential", "checkpointed"):
        w = workload(name)
        for mode in MODES:
            model = w.make_model().shard(mesh)
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
            sched = None if mode == "plain" else attach(model, contender_config(mode))
            runs[(name, mode)] = train(model, w, sched, 5, scoped=False, iterate=_given_up_and_rolled_back(snapshot))
    return runs


@pytest.mark.parametrize("case", [f"{n}/{c}/{s}" for n in WORKLOADS for c in CHANGES for s in ("explicit", "automatic")])
def test_every_mode_trains_bitwise_like_plain_fsdp2_making_the_same_changes(results, case):
    for runs, _ in results:
        assert_trains_like_plain(runs, case, MODES[1:])


@pytest.mark.parametrize("change", CHANGES)
def test_the_public_api_fallback_trains_bitwise_like_plain_fsdp2_too(fallback_results, change):
    for runs, _ in fallback_results:
        assert_trains_like_plain(runs, f"sequential/{change}/explicit", MODES[1:])


def test_replay_released_its_first_gathers_where_the_change_followed_them(results, fallback_results):
    for _, wasted in results + fallback_results:
        for (case, mode), n in wasted.items():
            if mode.startswith("record_and_replay") and case.endswith("explicit"):
                assert n >= 3, (case, mode, n)  # each replayed step's first gather, issued at the scope's start


def test_a_rollback_after_a_step_given_up_trains_bitwise_like_plain_fsdp2():
    for runs in spawn(_rollback_runs, timeout_s=600):
        for name in ("sequential", "checkpointed"):
            assert_trains_like_plain(runs, name, MODES[1:])
