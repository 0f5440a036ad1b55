"""Run a function on N gloo ranks (with a hang timeout), or in one process on the fake backend."""

from __future__ import annotations

import contextlib
import io
import multiprocessing.forkserver
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


START_METHOD_ENV = "FSDP_REPLAY_TEST_START_METHOD"
START_METHODS = ("spawn", "forkserver")
# What every rank imports before its work; the forkserver imports it once for all of them.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.device_mesh", "fsdp_replay"]
# Set by pytest before each test; nothing a rank imports reads it.
_ENV_NOT_COMPARED = frozenset({"PYTEST_CURRENT_TEST"})
_forkserver_env: dict[str, str] | None = None  # the environment the forkserver (and its imports) started in


def _rank_context(backend: str) -> Any:
    """The multiprocessing context that starts the ranks, chosen by ``FSDP_REPLAY_TEST_START_METHOD``.

    ``spawn`` (the default) starts each rank in a fresh interpreter, as torchrun does: its own hash
    seed and address layout, and ~3 s of imports a spawn. ``forkserver`` forks each rank from one
    server that imported torch and fsdp_replay once (~0.7 s a spawn, CI's torch-matrix legs), so
    ranks share the server's hash seed and layout. The package reads ``FSDP_REPLAY_PUBLIC_API`` at
    import, so a rank is forked only while the environment is the one the server imported under;
    otherwise (a test that set a variable) it is spawned. NCCL ranks are always spawned.
    """
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r}: expected one of {', '.join(START_METHODS)}")
    if method == "spawn" or backend == "nccl":
        return mp.get_context("spawn")
    global _forkserver_env
    if _forkserver_env is None:
        multiprocessing.forkserver.set_forkserver_preload(_FORKSERVER_PRELOAD)
        multiprocessing.forkserver.ensure_running()
        _forkserver_env = _compared_env()
    return mp.get_context("forkserver" if _compared_env() == _forkserver_env else "spawn")


def _compared_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _ENV_NOT_COMPARED}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, results: Any, args: tuple
) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    device = "cuda" if backend == "nccl" else "cpu"
    succeeded = False
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        mesh = init_device_mesh(device, (world_size,))
        # Serialized here: tensors sent as-is would be shared-memory handles that die with this process.
        buffer = io.BytesIO()
        torch.save(fn(mesh, *args), buffer)
        results.put((rank, True, buffer.getvalue()))
        succeeded = True
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            # The barrier keeps a rank from closing its connections while a peer's side of the
            # last collective is still completing. A failed rank skips it: its peers may never
            # arrive, and spawn() reports its error and stops them. A gloo abort at interpreter
            # exit (recipes/train.py, exit_without_finalizing) comes after the result is sent, so
            # it cannot fail a test here.
            if succeeded:
                dist.barrier()
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 240.0,
    backend: str = "gloo",
    diagnose: Callable[[], str] | None = None,
) -> list[Any]:
    """``fn(mesh, *args)`` on every rank (gloo on CPU, or nccl with one GPU per rank); per-rank results.

    A rank that raises fails the call with its traceback; ranks still running after
    ``timeout_s`` are killed and reported as hung, so a deadlock fails fast instead of stalling CI.
    Ranks are spawned, or forked from a preloaded server with ``FSDP_REPLAY_TEST_START_METHOD=forkserver``
    (:func:`_rank_context`).
    ``diagnose()``, if given, is appended to a hang or lost-rank error (e.g. what each rank ran).
    """
    ctx = _rank_context(backend)
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, results, args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: float | None = None  # a rank's result may still be in the pipe just after it exits
    try:
        while len(got) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(got))
                dead = [(r, procs[r].exitcode) for r in missing if procs[r].exitcode is not None]
                if dead:
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 5:
                        raise RuntimeError(
                            f"{fn.__qualname__}: ranks exited without a result (rank, exit code): {dead}"
                            + _diagnosis(diagnose)
                        )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{fn.__qualname__} did not finish within {timeout_s:.0f}s on ranks {missing} (a hang?)"
                        + _diagnosis(diagnose)
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"{fn.__qualname__} failed on rank {rank}:\n{payload}")
            got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world_size)]


def _diagnosis(diagnose: Callable[[], str] | None) -> str:
    return f"\n{diagnose()}" if diagnose is not None else ""


@contextlib.contextmanager
def fake_world(world_size: int, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """A single-process FSDP2 world on the fake backend: collectives are no-ops, ordering is real.

    With ``device_type="cuda"`` the one process plays rank 0 of ``world_size`` on one GPU: real
    compute, streams and events, no data moved (``bench/bench_link.py`` gives it a link's time).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh(device_type, (world_size,))
    finally:
        dist.destroy_process_group()
