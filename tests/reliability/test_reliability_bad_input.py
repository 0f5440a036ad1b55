"""Bad input from every entry point: the Python API, Hydra overrides, and the recipe's command line.

Each must fail with an error naming what was wrong, and leave nothing half-made: no hook, no
scheduler, no sharded module, no process group, no run directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.nn as nn

import fsdp_replay
from fsdp_replay import PrefetchConfig, attach, scheduler_of
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.workloads import SEQUENTIAL
from reliability_harness import ModelSpec, build_model, fsdp_states, hook_count, record_figures, run_schedule

REPO = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(n_blocks=2, calls=(0, 1, 0))
BAD_CONFIGS = [
    ({"mode": "fast"}, "PrefetchConfig.mode"),
    ({"mode": None}, "PrefetchConfig.mode"),
    ({"mode": 1}, "PrefetchConfig.mode"),
    ({"forward_prefetch": -1}, "PrefetchConfig.forward_prefetch"),
    ({"forward_prefetch": 1.5}, "PrefetchConfig.forward_prefetch"),
    ({"forward_prefetch": True}, "PrefetchConfig.forward_prefetch"),
    ({"forward_prefetch": "2"}, "PrefetchConfig.forward_prefetch"),
    ({"backward_prefetch": -3}, "PrefetchConfig.backward_prefetch"),
    ({"backward_prefetch": None}, "PrefetchConfig.backward_prefetch"),
    ({"max_prefetch_bytes": 0}, "PrefetchConfig.max_prefetch_bytes"),
    ({"max_prefetch_bytes": -1}, "PrefetchConfig.max_prefetch_bytes"),
    ({"max_prefetch_bytes": 1.0e6}, "PrefetchConfig.max_prefetch_bytes"),
    ({"max_prefetch_bytes": True}, "PrefetchConfig.max_prefetch_bytes"),
    ({"check_ranks": "yes"}, "PrefetchConfig.check_ranks"),
    ({"check_ranks": 1}, "PrefetchConfig.check_ranks"),
    ({"on_divergence": "ignore"}, "PrefetchConfig.on_divergence"),
    ({"on_divergence": None}, "PrefetchConfig.on_divergence"),
]
TRIED: dict[str, int] = {}
"""Bad inputs tried per entry point (for RELIABILITY.md)."""


def _tried(entry: str) -> None:
    TRIED[entry] = TRIED.get(entry, 0) + 1


@pytest.fixture
def mesh():
    with fake_world(2) as mesh:
        yield mesh


def _untouched(model: nn.Module, hooks: int) -> None:
    """What a failed call must leave: no hook, no scheduler, FSDP2's own prefetch settings as they were."""
    assert hook_count(model) == hooks
    assert scheduler_of(model) is None
    for state in fsdp_states(model).values():
        assert state._states_to_forward_prefetch == [] and state._states_to_backward_prefetch == []


def _trains(model: nn.Module, mode: str = "record_and_replay") -> None:
    """A valid attach after the failure works: two scopes record, then replay."""
    sched = attach(model, PrefetchConfig(mode=mode))
    for step in range(2):
        with sched.iteration("train"):
            run_schedule(model, SPEC, SEQUENTIAL, step)
    assert sched.stats.divergences == 0
    sched.detach()


# --- Python API -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), BAD_CONFIGS, ids=lambda x: str(x))
def test_bad_config_values_raise_naming_the_field(kwargs, field):
    _tried("python: PrefetchConfig")
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        PrefetchConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), BAD_CONFIGS[:6], ids=lambda x: str(x))
def test_bad_config_mapping_to_attach_leaves_the_model_untouched(mesh, kwargs, field):
    _tried("python: attach")
    model = build_model(mesh, SPEC)
    hooks = hook_count(model)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        attach(model, kwargs)
    _untouched(model, hooks)
    _trains(model)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda mesh: nn.Linear(2, 2), TypeError, "needs the root module returned by fully_shard"),
        (lambda mesh: "model", TypeError, "needs the root module"),
        (lambda mesh: None, TypeError, "needs the root module"),
    ],
    ids=["plain_module", "string", "none"],
)
def test_attach_to_something_that_is_not_an_fsdp2_root_raises(mesh, make, error, message):
    _tried("python: attach")
    with pytest.raises(error, match=message):
        attach(make(mesh))


def test_attach_with_unknown_key_or_wrong_type_leaves_the_model_untouched(mesh):
    model = build_model(mesh, SPEC)
    hooks = hook_count(model)
    for config, error, message in [
        ({"mode": "static", "depth": 2}, TypeError, "depth"),
        (42, TypeError, "takes a PrefetchConfig, a mapping or None"),
        ("static", TypeError, "takes a PrefetchConfig, a mapping or None"),
    ]:
        _tried("python: attach")
        with pytest.raises(error, match=message):
            attach(model, config)
        _untouched(model, hooks)
    _trains(model)


def test_attach_twice_or_to_a_child_unit_raises_and_keeps_the_first_scheduler(mesh):
    model = build_model(mesh, SPEC)
    first = attach(model, PrefetchConfig(mode="static"))
    hooks = hook_count(model)
    for target, error, message in [
        (model, RuntimeError, "already attached"),
        (model.blocks[0], RuntimeError, "already attached"),
    ]:
        _tried("python: attach")
        with pytest.raises(error, match=message):
            attach(target)
        assert hook_count(model) == hooks and scheduler_of(model) is first
    first.detach()
    _trains(model)


def test_a_config_mutated_into_an_invalid_state_is_rejected_by_attach(mesh):
    """Regression: attach() trusts a PrefetchConfig instance; mutated after construction, a bad value
    (``cfg.mode = "demand"`` as a string, ``cfg.forward_prefetch = -1``) was used as-is: the string
    mode matched neither ``demand`` nor ``record_and_replay`` and silently ran as ``static``. Now a
    valid name is honoured and an invalid value is rejected."""
    model = build_model(mesh, SPEC)
    hooks = hook_count(model)
    honoured = PrefetchConfig()
    honoured.mode = "demand"  # a valid member name: attach re-validates, so it really runs demand
    sched = attach(model, honoured)
    with sched.iteration("train"):
        run_schedule(model, SPEC, SEQUENTIAL, 0)
    assert sched.mode.name == "demand" and sched.stats.prefetches == 0 and sched.stats.recordings == 0
    sched.detach()
    for field, value in [("mode", "fast"), ("forward_prefetch", -1), ("max_prefetch_bytes", 0)]:
        _tried("python: attach")
        config = PrefetchConfig()
        setattr(config, field, value)
        try:
            sched = attach(model, config)
        except ValueError as err:
            assert f"PrefetchConfig.{field}" in str(err)
            _untouched(model, hooks)
            continue
        with sched.iteration("train"):
            run_schedule(model, SPEC, SEQUENTIAL, 0)
        stats = sched.stats.as_dict()
        sched.detach()
        pytest.fail(f"attach() accepted PrefetchConfig.{field}={value!r}; one scope then gave {stats}")


def test_fully_shard_with_a_bad_prefetch_config_leaves_the_module_unsharded(mesh):
    """Regression: ``fsdp_replay.fully_shard(root, prefetch=<bad>)`` shards the root before
    validating ``prefetch``, so the error leaves a half-made FSDP2 root without a scheduler."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_replay.testing.workloads import CallSequenceModel

    for prefetch, error in [({"mode": "fast"}, ValueError), ("static", TypeError)]:
        _tried("python: fully_shard")
        model = CallSequenceModel(dim=4, hidden=8, n_blocks=1, calls=[0])
        fsdp_replay.fully_shard(model.blocks[0], mesh=mesh)
        with pytest.raises(error):
            fsdp_replay.fully_shard(model, mesh=mesh, prefetch=prefetch)
        assert not isinstance(model, FSDPModule), f"prefetch={prefetch!r}: the root was sharded before the error"


def test_bad_scope_keys_and_nested_scopes_raise_and_leave_the_scheduler_usable(mesh):
    model = build_model(mesh, SPEC)
    sched = attach(model)
    for key in ["", None, 3, "auto:grad", "auto:mine"]:
        _tried("python: iteration")
        with pytest.raises(ValueError, match="iteration\\(key=...\\)"):
            with sched.iteration(key):
                pass
    with sched.iteration("train"):
        run_schedule(model, SPEC, SEQUENTIAL, 0)
    assert sched.recorded_order("train") is not None
    _tried("python: iteration")
    with pytest.raises(RuntimeError, match="iterations do not nest"):
        with sched.iteration("train"):
            run_schedule(model, SPEC, SEQUENTIAL, 1)
            with sched.iteration("other"):
                pass
    # The outer scope failed with the nesting error: its order is invalidated, nothing is pending.
    assert sched.recorded_order("train") is None and sched.recorded_order("other") is None
    for step in range(2, 4):
        with sched.iteration("train"):
            run_schedule(model, SPEC, SEQUENTIAL, step)
    assert sched.recorded_order("train") is not None and sched.stats.divergences == 0


def test_detach_inside_a_scope_and_use_after_detach_raise(mesh):
    model = build_model(mesh, SPEC)
    sched = attach(model)
    with sched.iteration("train"):
        _tried("python: detach")
        with pytest.raises(RuntimeError, match="leave the iteration\\(\\) block first"):
            sched.detach()
        run_schedule(model, SPEC, SEQUENTIAL, 0)
    assert sched.recorded_order("train") is not None
    sched.detach()
    _tried("python: iteration")
    with pytest.raises(RuntimeError, match="detached"):
        with sched.iteration("train"):
            pass
    assert scheduler_of(model) is None
    _trains(model)


def test_bad_state_dicts_raise_and_keep_the_installed_orders(mesh):
    model = build_model(mesh, SPEC)
    sched = attach(model)
    with sched.iteration("train"):
        run_schedule(model, SPEC, SEQUENTIAL, 0)
    good = sched.state_dict()
    order = sched.recorded_order("train")
    for state, message in [
        ({"version": 99, "orders": {}}, "version 99 is not supported"),
        ({}, "version None is not supported"),
        ({"version": 1, "orders": {"train": [("blocks.0", "sideways", True, 0)]}}, "sideways"),
        ({"version": 2, "orders": {"train": [("blocks.0", "forward")]}}, "expected \\(fqn, phase"),
    ]:
        _tried("python: load_state_dict")
        with pytest.raises(ValueError, match=message):
            sched.load_state_dict(state)
        assert sched.recorded_order("train") == order
    # A stale order (a unit this model lacks) is not bad input: it is dropped with a warning, and re-recorded.
    sched.load_state_dict({"version": 1, "orders": {"train": [("blocks.9", "forward", True, 0)]}})
    assert sched.recorded_order("train") is None
    sched.load_state_dict(good)
    with sched.iteration("train"):
        run_schedule(model, SPEC, SEQUENTIAL, 1)
    assert sched.stats.divergences == 0


# --- Hydra overrides ------------------------------------------------------------------------------

HYDRA_BAD = [
    ("prefetch.mode=fast", "prefetch.mode"),
    ("prefetch=fast", "prefetch"),
    ("prefetch.forward_prefetch=-1", "PrefetchConfig.forward_prefetch"),
    ("prefetch.forward_prefetch=1.5", "prefetch.forward_prefetch"),
    ("prefetch.forward_prefetch=two", "PrefetchConfig.forward_prefetch"),  # a string, as "auto" is: the config says
    ("prefetch.backward_prefetch=-1", "PrefetchConfig.backward_prefetch"),
    ("prefetch.max_prefetch_bytes=0", "PrefetchConfig.max_prefetch_bytes"),
    ("prefetch.max_prefetch_bytes=-4096", "PrefetchConfig.max_prefetch_bytes"),
    ("prefetch.check_ranks=maybe", "prefetch.check_ranks"),
    ("prefetch.on_divergence=ignore", "PrefetchConfig.on_divergence"),
    ("prefetch.depth=2", "depth"),
    # Regression: appended keys are accepted by composition and silently dropped by to_job_config.
    ("+prefetch.forward_prefetc=2", "forward_prefetc"),
]


def _hydra_available() -> bool:
    return (REPO / "recipes" / "train_lib" / "config.py").exists() and (REPO / "configs" / "train.yaml").exists()


@pytest.mark.skipif(
    not _hydra_available(), reason="recipes/train_lib/config.py and configs/train.yaml are not in this checkout"
)
@pytest.mark.parametrize(("override", "field"), HYDRA_BAD, ids=[o for o, _ in HYDRA_BAD])
def test_bad_hydra_override_fails_naming_the_field_before_any_process_group(override, field):
    from hydra import compose, initialize_config_dir

    if str(REPO / "recipes") not in sys.path:
        sys.path.insert(0, str(REPO / "recipes"))  # as when the recipe runs: its train_lib package
    from train_lib.config import register_configs, to_job_config

    _tried("hydra: override")
    register_configs()
    with pytest.raises(Exception) as err:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            to_job_config(compose("train", overrides=[override]))
    text = "".join(str(e) for e in _chain(err.value))
    assert field in text, f"{override}: error does not name {field!r}: {text}"
    assert not dist.is_initialized()


def _chain(err: BaseException):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


# --- recipe command line --------------------------------------------------------------------------

RECIPE_BAD = [
    ("prefetch.mode=fast", "prefetch.mode", None),
    ("prefetch.forward_prefetch=-1", "PrefetchConfig.forward_prefetch", None),
    ("prefetch.on_divergence=ignore", "PrefetchConfig.on_divergence", 2),
]


def _recipe_available() -> bool:
    return (REPO / "recipes" / "train.py").exists() and _hydra_available()


@pytest.mark.skipif(not _recipe_available(), reason="recipes/train.py is not in this checkout")
@pytest.mark.parametrize(("override", "field", "nproc"), RECIPE_BAD, ids=[o for o, *_ in RECIPE_BAD])
def test_bad_recipe_flag_fails_fast_naming_the_field_and_leaves_no_run_directory(override, field, nproc, tmp_path):
    _tried("recipe: command line")
    run_dir = tmp_path / "run"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *launcher, "recipes/train.py", override, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert field in output, output
    assert "rank(s) on" not in output, "a process group was started before the config error"
    assert "Traceback" not in output or nproc, f"a bare traceback instead of a clear error:\n{output}"
    assert elapsed < 60, f"took {elapsed:.0f}s to reject a bad flag"
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) if run_dir.exists() else []
    assert not run_dir.exists(), f"the failed launch left a half-made run directory {run_dir}: {left}"


def test_zz_record_bad_input_figures():
    """Runs last in this module: how many bad inputs each entry point was given."""
    record_figures("bad_input", {"tried": dict(TRIED), "total": sum(TRIED.values())})
