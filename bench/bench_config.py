"""Schema of ``configs/bench.yaml`` (the benchmark's Hydra config), shared by the launcher and the ranks.

Kept apart from ``bench/bench.py`` so the spawned ranks can unpickle it without importing Hydra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fsdp_replay.config import require_at_least

MODES = ("plain", "demand", "static", "record_and_replay")
"""``plain`` is torch's ``fully_shard`` with no scheduler attached (FSDP2's own default prefetch)."""
WORKLOADS = ("sequential", "out_of_order", "shared_block", "checkpointed", "interleaved_1f1b")
CONDITIONAL_WORKLOADS = ("moe_dynamic", "layer_drop")
"""Data decides which of their units run (``bench.workloads=[moe_dynamic,layer_drop]``): ``record_and_replay``
merges ``Workload.record_steps`` recordings, and warms up at least that many steps plus one."""
SUITES = ("standard", "pipeline", "explain", "depths", "gpu_link", "host_cost")
"""``standard``: ``bench.workloads`` on ``bench.world_size`` ranks; ``pipeline``: the ``pipeline`` node;
``explain``: ``sched.explain()`` of a replayed ``record_and_replay`` step of each of ``bench.workloads``;
``depths``: plain, demand and ``record_and_replay`` at each of ``bench.depths``, on ``bench.workloads``;
``gpu_link``: the ``gpu_link`` node, one GPU with an emulated link (``bench_gpu_link``);
``host_cost``: the scheduler's CPU cost (the ``cpu_cost`` node's protocol) at each of ``cpu_cost.unit_counts``."""
LINK_WORKLOADS = ("sequential", "out_of_order", "shared_block", "checkpointed", "host_sync", "interleaved_2mb")
"""``suite=gpu_link``'s workloads: canonical ones, ``host_sync`` (each block reads a value to the host)
and ``interleaved_2mb`` (F0 F1 B0 B1); ``interleaved_1f1b`` (3 microbatches) may be added."""
LINK_CONTENDERS = {
    "plain": ("plain", None),
    "demand": ("demand", None),
    "static": ("static", None),
    "record_and_replay": ("record_and_replay", None),
    "record_and_replay depth 2": ("record_and_replay", 2),
}
"""What ``suite=gpu_link`` steps in alternation: name -> (mode, depth of both phases; None: the package default)."""
AUTO = "auto"
DEPTH_SETTLE_STEPS = 6
"""``suite=depths`` steps every contender this many more warmup steps than ``bench.warmup_steps``: an
``auto`` depth starts at 1 and tries one step deeper per scope (keeping or undoing it the next)."""


def depth_contender(depth: str) -> str:
    """The name ``suite=depths`` gives ``record_and_replay`` at prefetch ``depth`` in both phases."""
    return f"record_and_replay depth {depth}"


@dataclass
class RunConfig:
    """The measured run: workloads, model size, steps (the ``bench`` node)."""

    quick: bool = False
    """CI smoke run: tiny models and two measured steps (replaces the sizes and step counts below)."""
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    """Workloads of ``fsdp_replay.testing.workloads`` to measure (``tied_embedding`` and
    :data:`CONDITIONAL_WORKLOADS` also work)."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    """Stepped in this order, one step each in turn: A B C D A B C D ..."""
    dim: int = 512
    """Block width; a block is two ``dim x hidden`` linears, one FSDP unit."""
    hidden: int = 1024
    n_blocks: int = 6
    rows: int = 256
    """Rows per microbatch: sets compute per unit against its all-gather time."""
    warmup_steps: int = 3
    """Per mode, before timing; the first ``record_and_replay`` scope records."""
    steps: int = 10
    """Timed steps per mode (the median is reported)."""
    world_size: int = 2
    threads: int = 1
    """``torch.set_num_threads`` per rank; gloo needs a core of its own to overlap (2 cores: 1)."""
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    max_reuse_distance: int = 0
    """``record_and_replay``'s ``PrefetchConfig.max_reuse_distance`` (every suite): a unit is kept
    unsharded for a next use at most this many all-gathers away."""
    depths: list[str] = field(default_factory=lambda: ["1", "2", "3", AUTO])
    """``suite=depths``: the prefetch depths (both phases) ``record_and_replay`` runs at side by side;
    whole numbers >= 0 and ``auto``. The other suites use ``forward_prefetch``/``backward_prefetch``."""
    bound_steps: int = 5
    """Repetitions of the compute-only and communication-only runs (median)."""
    profile: bool = False
    """Also export one ``torch.profiler`` trace per workload and mode (rank 0) under ``traces/``."""
    plot: bool = True
    """Write ``bench.png`` (needs matplotlib; skipped with a note when it is missing)."""
    update_benchmarks_md: str | None = None
    """Path of BENCHMARKS.md whose generated section this run replaces (None: leave it alone)."""
    timeout_s: float = 1800.0
    """Ranks still running after this are killed (a hang fails instead of stalling)."""

    def __post_init__(self) -> None:
        if self.quick:
            self.dim, self.hidden, self.n_blocks, self.rows = 64, 128, 4, 16
            self.warmup_steps, self.steps, self.bound_steps = 2, 2, 1
        require_at_least(1, self, "dim", "hidden", "n_blocks", "rows", "steps", "threads", "bound_steps")
        require_at_least(2, self, "warmup_steps", "world_size")  # record, then one replayed warmup
        require_at_least(0, self, "forward_prefetch", "backward_prefetch", "max_reuse_distance")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"RunConfig.modes: got {self.modes}; pick distinct modes from {', '.join(MODES)}")
        if "plain" not in self.modes or "demand" not in self.modes:
            raise ValueError("RunConfig.modes must include plain and demand (the ratios are relative to them)")
        if not self.workloads:
            raise ValueError("RunConfig.workloads must name at least one workload")
        self.depths = [str(d) for d in self.depths]
        bad = [d for d in self.depths if d != AUTO and not (d.isdigit() and d.isascii())]
        if bad or not self.depths or len(set(self.depths)) != len(self.depths):
            raise ValueError(
                f"RunConfig.depths: got {self.depths} (bad: {', '.join(map(repr, bad)) or 'empty or repeated'}); "
                f"give distinct prefetch depths, each a whole number >= 0 or {AUTO!r}"
            )

    def contenders(self, suite: str) -> dict[str, tuple[str, int | str | None]]:
        """What ``suite`` steps in alternation: name -> (mode, depth of both phases; None: the
        configured ``forward_prefetch``/``backward_prefetch``)."""
        if suite != "depths":
            return {mode: (mode, None) for mode in self.modes}
        fixed = {"plain": ("plain", None), "demand": ("demand", None)}
        return fixed | {depth_contender(d): ("record_and_replay", d if d == AUTO else int(d)) for d in self.depths}


@dataclass
class NetnsConfig:
    """Rate-limited interconnect for CPU runs: both ranks in a network namespace with a tbf on loopback."""

    enabled: str = "auto"
    """``auto``: when root on a CPU run; ``true``: required (fails without root); ``false``: plain loopback."""
    rate: str = "2gbit"
    """tbf rate of the namespace's loopback (tc syntax)."""
    burst: str = "256kb"
    latency: str = "100ms"

    def __post_init__(self) -> None:
        self.enabled = str(self.enabled).lower()
        if self.enabled not in ("auto", "true", "false"):
            raise ValueError(f"NetnsConfig.enabled must be auto, true or false, got {self.enabled!r}")


@dataclass
class CpuCostConfig:
    """Scheduler CPU cost: fake backend (no communication), many tiny units, a process per contender."""

    world_size: int = 8
    units: int = 64
    dim: int = 16
    hidden: int = 32
    rows: int = 4
    warmup_steps: int = 3
    steps: int = 100
    """Rounds (one step of each mode); per-step CPU time on a shared machine varies by +-10%."""
    unit_counts: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])
    """``suite=host_cost``: the unit counts scanned (``units`` is the standard suite's one count)."""
    scan_steps: int = 20
    """``suite=host_cost``: rounds per unit count (a 1024-unit step takes about a second of CPU)."""
    placements: int = 4
    """Fresh processes per contender, one set after another, the rounds shared among them: a
    process's memory placement moves its steps by a point or more for its whole life, so each
    figure is the mean over placements (``bench_cpu_cost``, [Note: a process per contender])."""

    def __post_init__(self) -> None:
        require_at_least(2, self, "world_size", "units", "warmup_steps")
        require_at_least(1, self, "dim", "hidden", "rows", "steps", "scan_steps", "placements")
        if self.placements > min(self.steps, self.scan_steps):
            raise ValueError(
                f"CpuCostConfig.placements must be at most steps and scan_steps (each placement runs at least one round), "
                f"got placements={self.placements}, steps={self.steps}, scan_steps={self.scan_steps}"
            )
        if not self.unit_counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in self.unit_counts):
            raise ValueError(f"CpuCostConfig.unit_counts must be one or more integers >= 2, got {self.unit_counts!r}")


@dataclass
class PipelineConfig:
    """The pipeline workload (``suite=pipeline``): torch.distributed.pipelining over FSDP2 chunks, pp x dp gloo ranks.

    Stages come from ``fsdp_replay.testing.pipelines`` (a block is one ``dim x dim`` linear, one
    FSDP unit, resharded after forward). Modes, warmup and timed steps, threads and prefetch depths
    are those of the ``bench`` node.
    """

    schedules: list[str] = field(default_factory=lambda: ["Schedule1F1B", "ScheduleInterleaved1F1B"])
    world_size: int = 4
    pp: int = 2
    """Pipeline ranks; ``world_size / pp`` data-parallel (FSDP) ranks per stage."""
    chunks: int = 2
    """Stages per rank for the looped schedules (ScheduleInterleaved1F1B); single-stage schedules hold one."""
    blocks_per_stage: int = 2
    dim: int = 1024
    """One block is ``dim x dim`` fp32: 4 MiB at 1024."""
    rows: int = 1024
    """Rows per step, split into ``microbatches``."""
    microbatches: int = 4

    def __post_init__(self) -> None:
        from fsdp_replay.testing.pipelines import ZERO_BUBBLE_SCHEDULES, available_schedules

        require_at_least(1, self, "chunks", "blocks_per_stage", "dim", "rows", "microbatches")
        require_at_least(2, self, "world_size", "pp")
        if self.world_size % self.pp:
            raise ValueError(f"PipelineConfig: world_size {self.world_size} is not a multiple of pp {self.pp}")
        if self.rows % self.microbatches:
            raise ValueError(f"PipelineConfig: rows {self.rows} is not a multiple of microbatches {self.microbatches}")
        # The stages are resharded after forward, which zero-bubble schedules train wrongly with in
        # plain FSDP2 (README: Known upstream issues): there is no correct baseline to compare with.
        known = [s for s in available_schedules() if s not in ZERO_BUBBLE_SCHEDULES]
        if not self.schedules or any(s not in known for s in self.schedules):
            raise ValueError(f"PipelineConfig.schedules: got {self.schedules}; pick from {', '.join(known)}")


@dataclass
class GpuLinkConfig:
    """``suite=gpu_link``: one GPU plays rank 0 of ``world_size`` on the fake backend, with every
    all-gather and reduce-scatter holding one emulated link (``fsdp_replay.testing.link``).

    Blocks are transformer blocks (pre-norm causal attention, then an MLP), built on the GPU in
    ``dtype``; a microbatch is ``rows`` rows, ``rows / seq_len`` sequences. ``bench.quick=true``
    shrinks everything (how CI runs the suite's plumbing on CPU, with no link).
    """

    bandwidth_gbps: Any = 50.0
    """Link bandwidth in GB/s (1e9 bytes), or a list: every workload is measured at each in turn."""
    world_size: int = 8
    """Emulated ranks: a collective over B unsharded bytes holds the link B * (N-1)/N / bandwidth."""
    workloads: list[str] = field(default_factory=lambda: list(LINK_WORKLOADS))
    dim: int = 4096
    hidden: int = 14336
    """MLP width: a block is 4 dim^2 (attention) + 2 dim x hidden parameters (184M at the defaults)."""
    heads: int = 32
    seq_len: int = 2048
    rows: int = 8192
    n_blocks: int = 6
    dtype: str = "bfloat16"
    warmup_steps: int = 3
    """Per bandwidth, per contender, before timing; the first record_and_replay scope records."""
    steps: int = 8
    """Timed steps per contender and bandwidth (the median is reported)."""
    bound_steps: int = 3

    def __post_init__(self) -> None:
        raw = self.bandwidth_gbps
        values = list(raw) if isinstance(raw, (list, tuple)) or type(raw).__name__ == "ListConfig" else [raw]
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 for v in values):
            raise ValueError(f"GpuLinkConfig.bandwidth_gbps must be a positive number of GB/s or a list of them, got {raw!r}")
        self.bandwidth_gbps = [float(v) for v in values]
        require_at_least(2, self, "world_size", "warmup_steps")
        require_at_least(1, self, "dim", "hidden", "heads", "seq_len", "rows", "n_blocks", "steps", "bound_steps")
        if self.dim % self.heads or self.rows % self.seq_len:
            raise ValueError(
                f"GpuLinkConfig: dim {self.dim} must be a multiple of heads {self.heads}, "
                f"and rows {self.rows} a multiple of seq_len {self.seq_len}"
            )
        known = (*LINK_WORKLOADS, "interleaved_1f1b")
        if not self.workloads or any(w not in known for w in self.workloads):
            raise ValueError(f"GpuLinkConfig.workloads: got {self.workloads}; pick from {', '.join(known)}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"GpuLinkConfig.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    def shrink(self) -> None:
        """``bench.quick``: tiny blocks and two timed steps (the CPU plumbing run)."""
        self.dim, self.hidden, self.heads, self.seq_len, self.rows, self.n_blocks = 64, 128, 4, 8, 16, 4
        self.warmup_steps, self.steps, self.bound_steps = 2, 2, 1


@dataclass
class BenchConfig:
    """Top-level config of ``bench/bench.py``."""

    suite: str = "standard"
    """What one run measures: one of ``SUITES``."""
    bench: RunConfig = field(default_factory=RunConfig)
    netns: NetnsConfig = field(default_factory=NetnsConfig)
    cpu_cost: CpuCostConfig = field(default_factory=CpuCostConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    gpu_link: GpuLinkConfig = field(default_factory=GpuLinkConfig)

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"BenchConfig.suite must be one of {', '.join(SUITES)}, got {self.suite!r}")
        if self.bench.quick:
            self.cpu_cost.units, self.cpu_cost.steps, self.cpu_cost.warmup_steps = 16, 3, 2
            self.cpu_cost.unit_counts, self.cpu_cost.scan_steps, self.cpu_cost.placements = [4, 16], 3, 2
            self.pipeline.dim, self.pipeline.blocks_per_stage, self.pipeline.rows = 32, 2, 16
            self.gpu_link.shrink()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchConfig:
        # quick already applied: do not apply it twice (it would be harmless, but keep it exact)
        bench = dict(d["bench"], quick=False)
        cfg = cls(
            suite=d["suite"],
            bench=RunConfig(**bench),
            netns=NetnsConfig(**d["netns"]),
            cpu_cost=CpuCostConfig(**d["cpu_cost"]),
            pipeline=PipelineConfig(**d["pipeline"]),
            gpu_link=GpuLinkConfig(**d["gpu_link"]),
        )
        cfg.bench.quick = d["bench"]["quick"]
        return cfg
