"""An emulated interconnect on one GPU: FSDP2's collectives on the fake backend take a link's time.

NCCL refuses two ranks on one GPU, and FSDP2 skips the all-gather on a world of one, so one GPU
shows no overlap by itself. On the fake backend (``fake_world(n, "cuda")``) the one process is
rank 0 of ``n``: FSDP2 issues every collective of that rank, on its own streams, and nothing
moves. :class:`EmulatedLink` wraps the collective functions FSDP2 calls so that each also
occupies ONE link stream, shared by all-gathers and reduce-scatters, for
``bytes * (n - 1) / n / bandwidth`` (a ring collective's time on one rank): a spin kernel
(``torch.cuda._sleep``, cycles per second calibrated once with CUDA events) that starts after the
issuing stream's work so far, and that the issuing stream then waits for. Compute, streams and
events are real; communication sits where NCCL would put it, in host issue order.

What it leaves out: the gathered parameters hold rank 0's shard and whatever memory held before
(time, not numerics); no per-collective latency; NCCL's kernels take SMs and memory bandwidth
from compute, a spin kernel takes one SM. Without CUDA it only logs the collectives (no link).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

COLLECTIVES = {
    "all_gather_into_tensor": "AG",  # FSDP2 on torch 2.11-2.12
    "all_gather_single": "AG",  # torch 2.13+
    "reduce_scatter_tensor": "RS",
    "reduce_scatter_single": "RS",
}
"""The ``torch.distributed`` functions FSDP2's ``DefaultAllGather``/``DefaultReduceScatter`` call
(looked up on the module at each call), by the kind of collective."""


def calibrate_sleep(device: torch.device, *, cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on ``device``, timed with CUDA events (median)."""
    rates = []
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # the first launch loads the kernel
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / (start.elapsed_time(end) / 1e3))
    return statistics.median(rates)


class EmulatedLink:
    """One shared link of ``bandwidth_gbps`` (GB/s, 1e9 bytes) for an emulated world of ``world_size``.

    ``bandwidth_gbps`` may be changed between steps. :attr:`log`, when a list, receives every
    collective as ``(kind, unsharded bytes)`` (the link-only bound replays it, :meth:`time_alone`).
    """

    def __init__(self, device: torch.device, *, world_size: int, bandwidth_gbps: float) -> None:
        if world_size < 2:
            raise ValueError(f"EmulatedLink: world_size must be >= 2 (a world of one has no link), got {world_size}")
        self.device = device
        self.world_size = world_size
        self.bandwidth_gbps = bandwidth_gbps
        self.log: list[tuple[str, int]] | None = None
        self.on_gpu = device.type == "cuda"
        self.cycles_per_s = calibrate_sleep(device) if self.on_gpu else None
        self.stream = torch.cuda.Stream(device) if self.on_gpu else None
        self._inside = False

    def seconds(self, nbytes: int) -> float:
        """How long one rank's share of a ring collective over ``nbytes`` (unsharded) takes on the link."""
        return nbytes * (self.world_size - 1) / self.world_size / (self.bandwidth_gbps * 1e9)

    def occupy(self, nbytes: int) -> None:
        """Hold the link for ``nbytes``' time after the current stream's work; the current stream waits for it."""
        if self.stream is None:
            return
        issuing = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(issuing)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(max(1, round(self.seconds(nbytes) * self.cycles_per_s)))
        issuing.wait_stream(self.stream)

    def time_alone(self, log: list[tuple[str, int]]) -> float:
        """Seconds the link takes for ``log``'s collectives back to back, nothing else running
        (CUDA events around them); 0 without a GPU."""
        if self.stream is None or not log:
            return 0.0
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for _, nbytes in log:
                torch.cuda._sleep(max(1, round(self.seconds(nbytes) * self.cycles_per_s)))
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _wrap(self, kind: str, collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def on_link(*args: Any, **kwargs: Any) -> Any:
            if self._inside:  # one torch collective implemented by another: counted once
                return collective(*args, **kwargs)
            self._inside = True
            try:
                out = collective(*args, **kwargs)
            finally:
                self._inside = False
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            nbytes = max(t.numel() * t.element_size() for t in tensors)  # the unsharded side
            if self.log is not None:
                self.log.append((kind, nbytes))
            self.occupy(nbytes)
            return out

        return on_link

    @contextlib.contextmanager
    def installed(self) -> Iterator[EmulatedLink]:
        """Route every collective FSDP2 issues over the link while the block runs."""
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, collective in originals.items():
            setattr(dist, name, self._wrap(COLLECTIVES[name], collective))
        try:
            yield self
        finally:
            for name, collective in originals.items():
                setattr(dist, name, collective)
