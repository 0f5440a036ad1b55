"""``suite=gpu_link``: plain FSDP2 and the modes on ONE GPU, with an emulated link between emulated ranks.

The one process is rank 0 of ``gpu_link.world_size`` on the fake backend (``fake_world(n, "cuda")``):
FSDP2 computes for real on its own streams and issues every collective of that rank, and
``fsdp_replay.testing.link.EmulatedLink`` makes each hold one shared link stream for its ring time
at ``gpu_link.bandwidth_gbps``. Per workload every contender (``LINK_CONTENDERS``) gets its own
model, stepped in alternation; at each bandwidth the bound is max(compute-only, link-only), both
measured in the same run: the unsharded model with no FSDP2, and demand's collectives back to back
on the link. Without CUDA (``bench.quick=true``, CI) the same plumbing runs on CPU with no link.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench_config import LINK_CONTENDERS, BenchConfig, GpuLinkConfig
from bench_measure import build_contender, compute_only, release, timed_step
from fsdp_replay.testing.distributed import fake_world
from fsdp_replay.testing.link import EmulatedLink
from fsdp_replay.testing.workloads import Workload, canonical_workloads, interleaved

SCOPE_KEY = "bench"  # bench_measure.timed_step's scope


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MLP, over ``(rows, dim)`` = sequences of ``seq_len``.

    ``host_sync``: after the block, read how many rows a router would send one way to the host
    (``.item()``), as an MoE layer's token counts are: the host cannot run ahead of this block.
    """

    def __init__(self, dim: int, hidden: int, *, heads: int, seq_len: int, host_sync: bool = False) -> None:
        super().__init__()
        self.heads, self.seq_len, self.host_sync = heads, seq_len, host_sync
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.routed: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, dim = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(rows // self.seq_len, self.seq_len, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(rows, dim))
        x = x + self.down(F.gelu(self.up(self.mlp_norm(x))))
        if self.host_sync:
            self.routed = int((x[:, 0] > 0).sum().item())
        return x


def _on_device(make: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> Callable[[], nn.Module]:
    """Build the model on ``device`` (a CPU init of GPU-sized blocks takes minutes), then cast it."""

    def made() -> nn.Module:
        with torch.device(device):
            return make().to(dtype)

    return made


def _batches(cfg: GpuLinkConfig, device: torch.device, dtype: torch.dtype) -> Callable[[int, int], torch.Tensor]:
    """Seeded inputs drawn on the device itself (drawing 8192 x 4096 on the host would cost a step's time)."""

    def make(step: int, mb: int) -> torch.Tensor:
        g = torch.Generator(device).manual_seed(1000 * step + mb)
        return torch.randn(cfg.rows, cfg.dim, generator=g, device=device, dtype=dtype)

    return make


def link_workloads(cfg: GpuLinkConfig, device: torch.device) -> list[Workload]:
    """``cfg.workloads`` with transformer blocks, on ``device`` in ``cfg.dtype``."""
    dtype = getattr(torch, cfg.dtype)

    def shapes(host_sync: bool) -> dict[str, Workload]:
        block = functools.partial(TransformerBlock, heads=cfg.heads, seq_len=cfg.seq_len, host_sync=host_sync)
        made = canonical_workloads(dim=cfg.dim, hidden=cfg.hidden, n_blocks=cfg.n_blocks, rows=cfg.rows, block=block)
        return {w.name: w for w in made}

    plain, syncing = shapes(False), shapes(True)
    every = plain | {
        "host_sync": dataclasses.replace(syncing["sequential"], name="host_sync", notes="each block reads a count to the host"),
        "interleaved_2mb": dataclasses.replace(plain["sequential"], name="interleaved_2mb", schedule=interleaved(2)),
    }
    batches = _batches(cfg, device, dtype)
    return [
        dataclasses.replace(every[name], make_model=_on_device(every[name].make_model, device, dtype), make_batch=batches)
        for name in cfg.workloads
    ]


def _step(contender: Any, step: int, device: torch.device) -> dict[str, Any]:
    """``timed_step``, with the step's peak memory above what was allocated when it started."""
    resting = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resting = torch.cuda.memory_allocated(device)
    record = timed_step(contender, step, None, device)
    record["peak_bytes"] = torch.cuda.max_memory_allocated(device) - resting if device.type == "cuda" else None
    return record


def _alternate(
    contenders: list[Any], link: EmulatedLink, g: GpuLinkConfig, device: torch.device, collectives: list[tuple[str, int]]
) -> dict[str, list[dict[str, Any]]]:
    """Warmup, then timed steps, one contender after another; fills an empty ``collectives`` with
    demand's in its first replayed step (one gather per use: what the link must carry)."""
    records: dict[str, list[dict[str, Any]]] = {c.mode: [] for c in contenders}
    for step in range(g.warmup_steps + g.steps):
        for c in contenders:
            link.log = collectives if c.mode == "demand" and step == 1 and not collectives else None
            record = _step(c, step, device)
            if step >= g.warmup_steps:
                records[c.mode].append(record)
    link.log = None
    return records


def measure_workload(w: Workload, mesh: Any, link: EmulatedLink, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """Every contender of ``w`` in alternation at each bandwidth, then the bound at each."""
    g = cfg.gpu_link
    contenders = [
        build_contender(mode, w, mesh, cfg.bench, name=name, depth=depth, metered=False)
        for name, (mode, depth) in LINK_CONTENDERS.items()
    ]
    per_bandwidth: dict[str, Any] = {}
    collectives: list[tuple[str, int]] = []
    for bandwidth in g.bandwidth_gbps:
        link.bandwidth_gbps = bandwidth
        per_bandwidth[str(bandwidth)] = {"records": _alternate(contenders, link, g, device, collectives)}
    release(contenders)
    del contenders  # the models' memory goes before the unsharded compute-only model is built
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    compute_s = statistics.median(compute_only(w, dataclasses.replace(cfg.bench, bound_steps=g.bound_steps), device))
    for bandwidth in g.bandwidth_gbps:
        link.bandwidth_gbps = bandwidth
        link_s = statistics.median(link.time_alone(collectives) for _ in range(g.bound_steps))
        per_bandwidth[str(bandwidth)]["bound"] = {"compute_s": compute_s, "link_s": link_s, "bound_s": max(compute_s, link_s)}
    return {"notes": w.notes, "collectives": len(collectives), "bandwidths": per_bandwidth}


def measure(cfg: BenchConfig) -> dict[str, Any]:
    """The whole suite in this process; what the report needs besides the machine."""
    g = cfg.gpu_link
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(cfg.bench.threads)  # the plumbing run shares CI's cores
    results: dict[str, Any] = {}
    with fake_world(g.world_size, device.type) as mesh:
        link = EmulatedLink(device, world_size=g.world_size, bandwidth_gbps=g.bandwidth_gbps[0])
        with link.installed():
            for w in link_workloads(g, device):
                start = time.perf_counter()
                results[w.name] = measure_workload(w, mesh, link, cfg, device)
                # Figures as they come: a run stopped by a time limit still leaves them in its log.
                print(f"bench: {w.name} measured in {time.perf_counter() - start:.1f} s; {_brief(results[w.name])}", flush=True)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "link": (
            f"emulated: {g.world_size} ranks on one GPU (fake backend), one link stream shared by all-gathers and "
            f"reduce-scatters, torch.cuda._sleep at {link.cycles_per_s / 1e9:.3f} G cycles/s (calibrated)"
            if link.on_gpu else "none: no CUDA device, so no link (plumbing run; every figure is compute)"
        ),
        "workloads": summarize(results),
    }


def _brief(measured: dict[str, Any]) -> str:
    """One line per workload: each contender's median step ms and the bound, at each bandwidth."""
    parts = []
    for bandwidth, b in measured["bandwidths"].items():
        steps = ", ".join(f"{c} {statistics.median(r['step_s'] for r in rs) * 1e3:.1f}" for c, rs in b["records"].items())
        parts.append(f"{float(bandwidth):g} GB/s: {steps} ms (bound {b['bound']['bound_s'] * 1e3:.1f})")
    return "; ".join(parts)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per workload and bandwidth, per contender: median step, ratios, share of the bound, depth, peak."""
    out: dict[str, Any] = {}
    for name, w in results.items():
        out[name] = {"notes": w["notes"], "bandwidths": {}}
        for bandwidth, b in w["bandwidths"].items():
            medians = {c: statistics.median(r["step_s"] for r in rs) for c, rs in b["records"].items()}
            rows = {}
            for c, rs in b["records"].items():
                peaks = [r["peak_bytes"] for r in rs if r["peak_bytes"] is not None]
                rows[c] = {
                    "median_step_s": medians[c],
                    "x_plain": medians["plain"] / medians[c],
                    "x_demand": medians["demand"] / medians[c],
                    "of_bound": b["bound"]["bound_s"] / medians[c],
                    "depth": rs[-1].get("depth") if LINK_CONTENDERS[c][0] not in ("plain", "demand") else None,
                    "peak_bytes": max(peaks) if peaks else None,
                    "misses": statistics.median(r["observed"].get("miss", 0) for r in rs),
                    "step_s": [r["step_s"] for r in rs],
                }
            out[name]["bandwidths"][bandwidth] = {"bound": b["bound"], "contenders": rows}
    return out


def render(report: dict[str, Any]) -> str:
    """The generated section: one table per bandwidth."""
    g, m = report["config"]["gpu_link"], report["machine"]
    parts = [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['device']}, {m['cpu']}, torch {m['torch']}. Link: {report['link']}.",
        "",
        f"Model: {g['n_blocks']} transformer blocks (dim {g['dim']}, MLP {g['hidden']}, {g['heads']} heads), "
        f"{g['dtype']}, {g['rows']} rows a microbatch (sequences of {g['seq_len']}); emulated world {g['world_size']}; "
        f"{g['warmup_steps']} warmup + {g['steps']} timed steps per contender and bandwidth, alternating "
        f"{', '.join(LINK_CONTENDERS)}. Run took {report['wall_s']:.0f} s.",
        "",
    ]
    for bandwidth in map(str, g["bandwidth_gbps"]):
        parts += [
            f"### {float(bandwidth):g} GB/s",
            "",
            "| workload | contender | median step ms | x plain | x demand | % of bound | bound ms (compute / link) "
            "| depth (fwd, bwd) | step peak MiB | misses |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, w in report["workloads"].items():
            b = w["bandwidths"][bandwidth]
            bound = b["bound"]
            for c, f in b["contenders"].items():
                depth = "-" if f["depth"] is None else f"{f['depth'][0]}, {f['depth'][1]}"
                peak = "n/a" if f["peak_bytes"] is None else f"{f['peak_bytes'] / 2**20:.0f}"
                parts.append(
                    f"| {name} | {c} | {f['median_step_s'] * 1e3:.1f} | {f['x_plain']:.2f} | {f['x_demand']:.2f} | "
                    f"{100 * f['of_bound']:.0f}% | {bound['bound_s'] * 1e3:.1f} ({bound['compute_s'] * 1e3:.1f} / "
                    f"{bound['link_s'] * 1e3:.1f}) | {depth} | {peak} | {f['misses']:g} |"
                )
        parts.append("")
    return "\n".join(parts)
