"""Train a Llama-style LM with FSDP2, its unshards scheduled by fsdp_replay.

    torchrun --standalone --nproc-per-node 2 recipes/train.py
    torchrun --standalone --nproc-per-node 2 recipes/train.py prefetch=demand model=small train.steps=50
    torchrun --standalone --nproc-per-node 4 recipes/train.py pipeline.stages=2 train.microbatches=4

CUDA + NCCL when a GPU is present, else CPU + gloo; ``python recipes/train.py`` runs a world of one.
With ``pipeline.stages > 1`` the ranks form a pipeline x FSDP mesh (``train_lib/pipeline.py``).
Each run gets its own folder, ``outputs/<train.run_name>/<date>_<time>/`` (``outputs/latest`` points
at the last one): ``metrics.jsonl`` (one line per step), ``summary.json``, ``metrics.png``, Hydra's
``train.log`` and ``.hydra/``, ``checkpoints/step_N`` when saving, and rank 0's
``sched.explain("train")`` of the last step: ``explain.txt`` (its table: how each demand was served,
why each miss missed, how long each waited) and ``order.png`` (its timeline); neither with
``train.prefetch_scheduler=false``, and no ``order.png`` without matplotlib.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_replay import PrefetchMode, PrefetchScheduler, PrefetchStats, WaitMeter, fully_shard, scheduler_of
from fsdp_replay.testing.workloads import Pass, Schedule, interleaved, sequential
from train_lib.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from train_lib.config import MicrobatchSchedule, TrainJobConfig, quiet_nonzero_ranks, register_configs, to_job_config
from train_lib.llama import Transformer
from train_lib.pipeline import build_pipeline, pipeline_step, recipe_mesh
from train_lib.report import PLAIN, RunReport, stats_delta
from train_lib.tokens import Split, TokenData, load_tokens

log = logging.getLogger("train")

TRAIN_KEY = "train"
"""The scope key of every optimizer step; the run folder's ``explain.txt`` explains its last one."""

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_NAME = "train"
VALIDATE_ONLY = "--validate-only"


def microbatch_schedule(n: int, schedule: MicrobatchSchedule) -> Schedule:
    """The passes of one optimizer step, e.g. interleaved with n=3: F0 F1 B0 F2 B1 B2."""
    return sequential(n) if schedule is MicrobatchSchedule.sequential else interleaved(n)


def launch_world() -> int:
    """The number of ranks :func:`distributed` will start: torchrun's, else a world of one."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else 1


@contextlib.contextmanager
def distributed() -> Iterator[torch.device]:
    """CUDA + NCCL when a GPU is present, else CPU + gloo; torn down on exit.

    .. note::
        The group is destroyed only after a barrier, so no rank closes its connections while a
        peer's side of the last collective is still completing. The barrier is skipped when the
        run raised, so a failed rank never waits for peers that are not coming; torchrun stops
        them. What a gloo worker thread still does after the barrier: :func:`exit_without_finalizing`.
    """
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        # Plain `python recipes/train.py`: a world of one needs no rendezvous.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield device
        dist.barrier()
    finally:
        dist.destroy_process_group()


CONFIG_ERROR_MEETING = timedelta(seconds=30)
"""How long a rank with a config error waits for its peers before exiting alone (they find the same error)."""


def exit_on_config_error(message: str) -> NoReturn:
    """End this rank with exit code 1 and ``message`` printed once, by rank 0; every rank finds the same error.

    .. note::
        torchrun stops every other rank with SIGTERM as soon as one rank has exited non-zero, and
        then reports that rank as killed by a signal; rank 0 could even be killed before it
        printed the message. So under torchrun the ranks first meet at the launcher's rendezvous
        store (no process group is needed, and none may exist yet) and then all exit at once,
        without unwinding through Hydra, ignoring the SIGTERM that the first exit may still bring
        a peer in the same instant (torchrun then logs that it sent one; the rank exits 1 all the
        same). torchrun still prints its own ``ChildFailedError`` report after the message, listing
        every rank with exit code 1; ``scripts/dev.sh train`` validates in one process first, so
        there the message is all there is.
    """
    if os.environ.get("RANK", "0") == "0":
        print(f"recipes/train.py: invalid config: {message}", file=sys.stderr, flush=True)
    if launch_world() > 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # A peer that never comes (or a store that is gone) must not keep this rank: it exits all the same.
        with contextlib.suppress(Exception):
            store, _, world = next(dist.rendezvous("env://", timeout=CONFIG_ERROR_MEETING))
            store = dist.PrefixStore("recipes/train.py config error", store)
            if store.add("arrived", 1) == world:
                store.set("all arrived", "1")
            store.wait(["all arrived"])
    sys.stdout.flush()
    os._exit(1)


def exit_without_finalizing() -> None:
    """Exit 0 after a finished run without Python's interpreter finalization.

    .. note::
        After the last collective returns, a gloo worker thread still drops its reference to that
        work and to the work before it, whose tensors have Python objects: the drop takes the
        GIL. If the main thread is already finalizing the interpreter, that thread is made to exit
        inside a destructor and the rank aborts (``terminate called without an active
        exception``, SIGABRT after the summary; about 1 run in 20 with 3 ranks on 2 cores, plain
        FSDP2 too). The barrier in :func:`distributed` cannot close that window (its own work is
        the one dropped late). Everything this run writes is closed by now, so log handlers and
        streams are flushed and the process ends without finalizing; hydra.main exits non-zero by
        itself on a failed run, which never reaches here.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_model(job: TrainJobConfig, *, mesh: DeviceMesh, device: torch.device) -> Transformer:
    """Build on the meta device, shard, then allocate and initialise only this rank's shards.

    This is what torchdistx's deferred init did; that package is unmaintained and does not
    install on current torch, while meta device + ``to_empty()`` is built into torch. The
    scheduler is attached unless ``train.prefetch_scheduler`` is false (plain FSDP2).
    """
    with torch.device("meta"):
        model = Transformer(job.model, checkpoint_group=job.train.activation_checkpointing)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    # The head's weight is the embedding's Parameter, so both modules must form one unit.
    fully_shard([model.tok_embeddings, model.output], mesh=mesh)
    fully_shard(model, mesh=mesh, prefetch=job.prefetch if job.train.prefetch_scheduler else None)
    model.to_empty(device=device)
    torch.manual_seed(job.train.seed)
    model.init_weights()
    return model


def lm_loss(model: Transformer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def global_mean(value: torch.Tensor, *, replicas: int | None = None) -> float:
    """Mean over ranks; also the step's synchronisation point, so step times are honest.

    ``replicas``: how many ranks hold a value, the others holding 0 (under pipelines, only the
    last stage's ranks have a loss: one per FSDP rank); default every rank.
    """
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / (replicas or dist.get_world_size())


def stats_of(sched: PrefetchScheduler | None) -> dict[str, int]:
    """The scheduler's cumulative counters; all 0 for plain FSDP2, which counts nothing."""
    return (sched.stats if sched is not None else PrefetchStats()).as_dict()


def wait_meters(modules: list[torch.nn.Module]) -> list[WaitMeter] | None:
    """Time every mode's all-gather waits alike, plain FSDP2 included; None without FSDP2's internals."""
    try:
        return [WaitMeter(module) for module in modules]
    except RuntimeError:  # the public-API fallback: waits are not measured there
        return None


def exposed_wait(meters: list[WaitMeter] | None) -> float | None:
    """Seconds this rank's uses blocked on their parameters since the last call."""
    return None if meters is None else sum(seconds for meter in meters for _, seconds in meter.take())


@contextlib.contextmanager
def scope(sched: PrefetchScheduler | None, key: str) -> Iterator[None]:
    """``sched.iteration(key)``; nothing for plain FSDP2 (no scheduler)."""
    if sched is None:
        yield
    else:
        with sched.iteration(key=key):
            yield


def train_step(
    model: Transformer, data: TokenData, job: TrainJobConfig, *, step: int, device: torch.device
) -> torch.Tensor:
    """All forwards and backwards of one optimizer step; returns the step's loss (detached)."""
    n = job.train.microbatches
    # Each microbatch's loss (and so its autograd graph) lives from its forward to its backward.
    pending: dict[int, torch.Tensor] = {}
    total = torch.zeros((), device=device)
    for kind, micro in microbatch_schedule(n, job.train.schedule):
        if kind is Pass.forward:
            inputs, targets = data.batch(Split.train, step=step, micro=micro, rank=dist.get_rank(), device=device)
            pending[micro] = lm_loss(model, inputs, targets) / n
        else:
            loss = pending.pop(micro)
            loss.backward()
            total += loss.detach()
    return total


@torch.no_grad()
def evaluate(
    model: Transformer, sched: PrefetchScheduler | None, data: TokenData, *,
    batches: int, step: int, device: torch.device,
) -> float:
    """Held-out loss, under its own scope key so eval's order never disturbs train's."""
    total = torch.zeros((), device=device)
    with scope(sched, "eval"):
        for micro in range(batches):
            inputs, targets = data.batch(Split.eval, step=step, micro=micro, rank=dist.get_rank(), device=device)
            total += lm_loss(model, inputs, targets)
    return global_mean(total / batches)


def load_job(cfg: DictConfig, *, world: int | None) -> tuple[TrainJobConfig, TokenData]:
    """The validated config and its token data; raises ``ValueError`` naming the field at fault.

    ``world``: the number of ranks, checked against ``pipeline.stages``; None when not known yet.
    """
    job = to_job_config(cfg)
    if world is not None:
        job.pipeline.check_world(world)
    data = load_tokens(
        job.data, vocab_size=job.model.vocab_size, seq_len=job.train.seq_len,
        batch_size=job.train.batch_size, seed=job.train.seed,
    )
    return job, data


def config_error(overrides: list[str], *, world: int | None) -> str | None:
    """Why the command line's config would be rejected, or None; composes in this process only.

    Runs before ``@hydra.main``, which makes the run directory before ``main()`` can validate, and
    before any process group, so a rejected run leaves nothing behind. Hydra's own flags
    (``--cfg``, ``-m``, ...) are left to Hydra, and ``main()`` validates again.
    """
    if any(arg.startswith("-") for arg in overrides):
        return None
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            load_job(compose(CONFIG_NAME, overrides=overrides), world=world)
    except MissingConfigException as err:
        return unknown_option(err)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        # Hydra says which override failed; its cause (OmegaConf's) says why, naming the field.
        return "\n".join(str(e) for e in (err, err.__cause__) if e is not None)
    return None


def unknown_option(err: MissingConfigException) -> str:
    """``prefetch=typo``: name the group's options, leaving out the schemas the YAML files extend.

    ``register_configs()`` stores each group's schema (``base_prefetch``) in that group, so Hydra
    lists it among the choices although selecting it gives a config with no mode of its own.
    """
    if not err.options or not err.missing_cfg_file:
        return str(err)
    group, _, name = err.missing_cfg_file.rpartition("/")
    schemas = {stored.removesuffix(".yaml") for stored in ConfigStore.instance().list(group)}
    options = [option for option in err.options if option not in schemas]
    return f"{group}={name}: no such option; {group} takes one of {', '.join(options)} (configs/{group}/)"


def remove_if_only_hydra_files(run_dir: Path) -> None:
    """Hydra creates the run directory before ``main()`` validates; a rejected run leaves none.

    Only reached when :func:`config_error` could not check first (Hydra flags on the command
    line). Only a directory holding nothing but Hydra's own files (``.hydra/``, an empty
    ``train.log``) is removed, so an earlier run's metrics or checkpoints are never touched.
    """
    entries = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    log_file = run_dir / "train.log"
    if entries <= {".hydra", "train.log"} and (not log_file.exists() or log_file.stat().st_size == 0):
        shutil.rmtree(run_dir, ignore_errors=True)
        # outputs/<run_name>/ and outputs/ too, if this run made them and nothing else is there
        for parent in run_dir.parents:
            if parent == Path.cwd() or not parent.is_relative_to(Path.cwd()):
                break
            with contextlib.suppress(OSError):
                parent.rmdir()


def shared_run_dir(run_dir: Path) -> Path:
    """Rank 0's run folder, on every rank.

    The default folder is time-stamped, and each rank's Hydra would read its own clock, so only
    rank 0's Hydra makes one (the other ranks run Hydra in ``.``, see ``__main__``); the others
    need it for their checkpoint shards.
    """
    picked = [str(run_dir)]
    dist.broadcast_object_list(picked, src=0)
    return Path(picked[0])


def link_latest(run_dir: Path) -> None:
    """Point ``outputs/latest`` at this run when its folder is under ``outputs/`` (the default)."""
    outputs = Path("outputs").resolve()
    if not run_dir.resolve().is_relative_to(outputs):
        return  # an explicit hydra.run.dir elsewhere: the run is not one of outputs/
    staged = outputs / f".latest.{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(run_dir.resolve().relative_to(outputs))
    try:
        staged.replace(outputs / "latest")  # a rename: a reader never finds the link missing
    except OSError as err:  # e.g. train.run_name=latest made outputs/latest a folder
        staged.unlink()
        log.warning("outputs/latest not updated: %s", err)


@hydra.main(config_path="../configs", config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig) -> None:
    # --- setup: config and data errors surface here, before any process group exists ---------
    try:
        job, data = load_job(cfg, world=launch_world())
    except ValueError as err:
        remove_if_only_hydra_files(Path(HydraConfig.get().runtime.output_dir))
        exit_on_config_error(str(err))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with distributed() as device:
        rank, world = dist.get_rank(), dist.get_world_size()
        run_dir = shared_run_dir(run_dir)
        if rank == 0:
            link_latest(run_dir)
        if job.pipeline.enabled:
            try:
                pipe = build_pipeline(job, mesh=recipe_mesh(job, device), device=device)
            except ValueError as err:  # the schedule's own check of train.microbatches; every rank finds it
                exit_on_config_error(
                    f"pipeline.schedule={job.pipeline.schedule} with train.microbatches={job.train.microbatches}: {err}"
                )
            # No `model` here: evaluation and checkpoints are off under pipelines (see below and
            # TrainJobConfig, which rejects train.save_every / resume_from with pipeline.stages > 1).
            modules, sched, replicas = pipe.chunks, pipe.sched, pipe.dp_size
            run_step = functools.partial(pipeline_step, pipe, data, job, device=device)
            n_params, layout = pipe.model_params(device), f", {pipe.describe()}"
        else:
            model = build_model(job, mesh=init_device_mesh(device.type, (world,)), device=device)
            modules, sched, replicas = [model], scheduler_of(model), world
            run_step = functools.partial(train_step, model, data, job, device=device)
            n_params, layout = sum(p.numel() for p in model.parameters()), ""
        mode = job.prefetch.mode.name if sched is not None else PLAIN
        optimizer = torch.optim.AdamW([p for module in modules for p in module.parameters()], lr=job.train.lr)
        start_step = 0
        resumed_from = Path(job.train.resume_from) if job.train.resume_from is not None else None
        if resumed_from is not None:
            start_step = load_checkpoint(resumed_from, model=model, optimizer=optimizer, sched=sched)
        log.info(
            "%s model, %.2fM params, %d rank(s) on %s (%s)%s, prefetch %s, data: %s, run dir %s%s",
            job.model.name, n_params / 1e6, world, device.type, dist.get_backend(), layout, mode,
            data.source, run_dir, f", resumed at step {start_step}" if start_step else "",
        )
        eval_every = job.train.eval_every
        if job.pipeline.enabled and eval_every:
            # Not implemented under pipelines: the eval forwards would need a schedule of their own.
            log.info("evaluation is off with pipeline.stages > 1 (train.eval_every=%d not used)", eval_every)
            eval_every = 0
        report = RunReport(
            run_dir=run_dir, enabled=rank == 0, mode=mode, start_step=start_step, steps=job.train.steps,
            tokens_per_step=job.train.batch_size * job.train.microbatches * job.train.seq_len * replicas,
            resumed_from=resumed_from, tensorboard=job.train.tensorboard,
        )
        meters = wait_meters(modules)

        # --- train: one sched.iteration() per optimizer step, optimizer.step() after it ------
        for step in range(start_step + 1, job.train.steps + 1):
            recording = sched is not None and sched.mode is PrefetchMode.record_and_replay
            if recording and sched.recorded_order(TRAIN_KEY) is None:
                report.recording()
            before = stats_of(sched)
            exposed_wait(meters)  # the last evaluation's waits are not this step's
            start = time.perf_counter()
            with scope(sched, TRAIN_KEY):
                loss = run_step(step=step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = global_mean(loss, replicas=replicas)
            seconds = time.perf_counter() - start
            step_stats = stats_delta(stats_of(sched), before)
            waited = exposed_wait(meters)
            eval_loss = None
            if eval_every and step % eval_every == 0:
                eval_loss = evaluate(model, sched, data, batches=job.train.eval_batches, step=step, device=device)
            if job.train.save_every and step % job.train.save_every == 0:
                save_checkpoint(checkpoint_dir(run_dir, step), model=model, optimizer=optimizer, sched=sched, step=step)
            report.step(
                step, loss=loss_value, seconds=seconds, stats=step_stats, eval_loss=eval_loss, exposed_wait_s=waited
            )

        # --- cleanup: the summary; leaving `distributed()` tears the process group down ------
        summary = report.finish(sched, device=device, explain_key=TRAIN_KEY)
        if rank == 0:
            log.info("summary\n%s", summary)


if __name__ == "__main__":
    register_configs()
    # `python recipes/train.py --validate-only [overrides]`: check in one process, start nothing
    # (scripts/dev.sh does this before torchrun, so a bad override is not reported once per rank).
    validate_only = sys.argv[1:2] == [VALIDATE_ONLY]
    if validate_only:
        del sys.argv[1]
    # dev.sh validates before torchrun picks the number of ranks: pipeline.stages is checked against it later.
    if (error := config_error(sys.argv[1:], world=None if validate_only else launch_world())) is not None:
        exit_on_config_error(error)
    if validate_only:
        raise SystemExit(0)
    quiet_nonzero_ranks()
    if os.environ.get("RANK", "0") != "0":
        sys.argv.append("hydra.run.dir=.")  # rank 0 picks the run folder: see shared_run_dir()
    main()
    exit_without_finalizing()
