"""Start the measuring ranks of a run: the standard workloads (``bench_measure``), the pipeline
(``bench_pipeline``) or the explained workloads (``bench_explain``).

Also runnable as a script, which is how ``bench/bench.py`` starts the ranks inside the
rate-limited network namespace::

    python bench/bench_ranks.py CONFIG.json RESULTS.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import bench_explain
import bench_measure
import bench_pipeline
from bench_config import BenchConfig
from fsdp_replay.testing.distributed import spawn


def run_ranks(cfg: BenchConfig, out_dir: Path) -> list[dict[str, Any]]:
    """All ranks of the measured run: NCCL on GPUs when present, else gloo on CPU (the pipeline and
    explain suites: gloo always)."""
    run = cfg.bench
    if cfg.suite == "pipeline":
        return spawn(
            bench_pipeline.measure_rank, cfg.to_dict(), world_size=cfg.pipeline.world_size, timeout_s=run.timeout_s
        )
    if cfg.suite == "explain":
        return spawn(bench_explain.measure_rank, cfg.to_dict(), str(out_dir), world_size=run.world_size, timeout_s=run.timeout_s)
    if torch.cuda.is_available():
        world = min(run.world_size, torch.cuda.device_count())
        if world < 2:
            raise SystemExit("bench/bench.py: the CUDA run needs at least 2 GPUs (communication is the point)")
        return spawn(
            bench_measure.measure_rank, cfg.to_dict(), str(out_dir), world_size=world, timeout_s=run.timeout_s, backend="nccl"
        )
    return spawn(bench_measure.measure_rank, cfg.to_dict(), str(out_dir), world_size=run.world_size, timeout_s=run.timeout_s)


if __name__ == "__main__":
    config_path, results_path, out_dir = sys.argv[1:4]
    cfg = BenchConfig.from_dict(json.loads(Path(config_path).read_text()))
    Path(results_path).write_text(json.dumps(run_ranks(cfg, Path(out_dir))))
