"""What a user sees of a run: a rank-0 progress bar, a JSONL line per step, TensorBoard scalars, a final
summary and plot, and the scheduler's explanation of the last training step (``explain.txt``, ``order.png``).

TensorBoard is optional (``tensorboard`` is in the ``recipes`` and ``test`` extras): without the
package the run logs the same figures to ``metrics.jsonl`` only and its summary says so in one line.
"""

from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fsdp_replay import KeyStats, PrefetchScheduler, PrefetchStats
from train_lib.checkpoint import CHECKPOINTS_DIR, saved_checkpoints
from train_lib.plot import NOT_DRAWN, PLOT_FILE, plot_metrics

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
EXPLAIN_FILE = "explain.txt"
ORDER_PLOT_FILE = "order.png"
TENSORBOARD_DIR = "tensorboard"
PLAIN = "plain"
"""The mode name of ``train.prefetch_scheduler=false``: plain FSDP2, no scheduler attached, nothing counted."""
NOT_COUNTED = "n/a (plain FSDP2: no scheduler counts demands)"
"""The summary's counter rows for ``train.prefetch_scheduler=false``: a 0 there would read as a failure."""


def stats_delta(after: dict[str, int], before: dict[str, int]) -> KeyStats:
    """Counters of one step, from two snapshots of the scheduler's cumulative counters."""
    return KeyStats(**{name: after[name] - before[name] for name in after})


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak bytes and what was measured: CUDA's allocator peak, else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocated"
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"


def write_explain(sched: PrefetchScheduler | None, run_dir: Path, *, key: str) -> str:
    """Write ``sched.explain(key)``'s table and timeline into ``run_dir``; the summary's line about them.

    The summary says how many demands missed; these files say which, why, and how long each
    waited, without rerunning anything. Only the last finished ``key`` scope is kept by the
    scheduler, so this is the run's last training step, as this rank (0) saw it.
    """
    if sched is None:
        return "not written: plain FSDP2 has no scheduler to explain (train.prefetch_scheduler=false)"
    try:
        report = sched.explain(key)
    except ValueError:  # e.g. resumed at the last step: no scope of `key` ran
        return f"not written: no {key!r} step ran"
    (run_dir / EXPLAIN_FILE).write_text(f"{report}\n")
    try:
        report.plot(run_dir / ORDER_PLOT_FILE)
    except ImportError:
        return f"{EXPLAIN_FILE}; {ORDER_PLOT_FILE} {NOT_DRAWN}"
    return f"{EXPLAIN_FILE}, {ORDER_PLOT_FILE}: rank 0's last {key!r} step"


def shown_path(path: Path) -> Path:
    """``outputs/train/...`` rather than an absolute path, when the run is under the working directory."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def tensorboard_writer(log_dir: Path) -> tuple[Any | None, str]:
    """A ``SummaryWriter`` on ``log_dir`` and the summary's line; None and why, without the package."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    except ImportError:
        return None, "not written: the tensorboard package is not installed (pip install tensorboard)"
    return SummaryWriter(log_dir=str(log_dir)), f"{shown_path(log_dir)}/"


class RunReport:
    """Writes only on rank 0 (``enabled``); the other ranks keep no files open."""

    def __init__(
        self, *, run_dir: Path, enabled: bool, mode: str, start_step: int, steps: int, tokens_per_step: int,
        resumed_from: Path | None = None, tensorboard: bool = False,
    ) -> None:
        """``resumed_from``: the checkpoint folder the run started from, named in the summary.
        ``tensorboard``: also log each step's figures under ``<run dir>/tensorboard/``, where the package is installed.
        """
        self.enabled = enabled
        self.run_dir = run_dir
        self.mode = mode
        self.counted = mode != PLAIN
        self.start_step = start_step
        self.resumed_from = resumed_from
        self.tokens_per_step = tokens_per_step
        self.step_times: list[float] = []
        self.last_eval_loss: float | None = None
        self._bar = tqdm(total=steps, initial=start_step, desc=mode, unit="step", disable=not enabled)
        # A resumed run continues the metrics of the run it resumes.
        self._metrics = open(run_dir / METRICS_FILE, "a" if start_step else "w") if enabled else None
        self._tensorboard, self._tensorboard_line = None, "off (train.tensorboard=false)"
        if enabled and tensorboard:
            self._tensorboard, self._tensorboard_line = tensorboard_writer(run_dir / TENSORBOARD_DIR)

    def recording(self) -> None:
        """Say on the progress line that the coming step records the prefetch order (it prefetches nothing)."""
        self._bar.set_postfix_str("recording the prefetch order: no prefetch this step")

    def step(
        self, step: int, *, loss: float, seconds: float, stats: KeyStats, eval_loss: float | None,
        exposed_wait_s: float | None = None,
    ) -> None:
        """``exposed_wait_s``: how long the step's uses blocked on all-gathers; None where not measured."""
        self.step_times.append(seconds)
        if not self.enabled:
            return
        line: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "step_time_s": seconds,
            "tokens_per_s": self.tokens_per_step / seconds,
            "exposed_wait_s": exposed_wait_s,
            "hit_rate": stats.hit_rate,
            **stats.as_dict(),
        }
        postfix = {"loss": f"{loss:.4f}", "step_s": f"{seconds:.3f}"}
        if self.counted:
            postfix["hit"] = f"{stats.hit_rate:.0%}"
        if stats.recordings:
            postfix["order"] = "recorded"
        if eval_loss is not None:
            line["eval_loss"] = self.last_eval_loss = eval_loss
        if self.last_eval_loss is not None:
            postfix["eval"] = f"{self.last_eval_loss:.4f}"
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            self._log_scalars(line)
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update()

    def _log_scalars(self, line: dict[str, Any]) -> None:
        """The step's line of ``metrics.jsonl`` as TensorBoard scalars (plain FSDP2 counts no hits: none drawn)."""
        scalars = {
            "loss/train": line["loss"],
            "loss/eval": line.get("eval_loss"),
            "step_time_ms": line["step_time_s"] * 1e3,
            "tokens_per_s": line["tokens_per_s"],
            "exposed_wait_ms": None if line["exposed_wait_s"] is None else line["exposed_wait_s"] * 1e3,
            "prefetch/hit_rate": line["hit_rate"] if self.counted else None,
        }
        for tag, value in scalars.items():
            if value is not None:
                self._tensorboard.add_scalar(tag, value, line["step"])

    def finish(self, sched: PrefetchScheduler | None, *, device: torch.device, explain_key: str) -> str:
        """Close the outputs, write ``summary.json`` and the explanation of ``explain_key``; return the summary table.

        ``sched`` is None for plain FSDP2: its counters read 0, there are no recorded orders and
        nothing to explain. Under pipelines they are this (rank 0's) scheduler's, over the stages
        this rank holds.
        """
        self._bar.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        # The first step records the order and warms up allocators; leave it out when there are more.
        steady = self.step_times[1:] or self.step_times
        mean_step = statistics.fmean(steady) if steady else float("nan")
        peak, memory_kind = peak_memory(device)
        stats = sched.stats if sched is not None else PrefetchStats()
        checkpoints = [str(path) for path in saved_checkpoints(self.run_dir)]
        summary = {
            "mode": self.mode,
            "resumed_from": None if self.resumed_from is None else str(self.resumed_from),
            "checkpoints": checkpoints,
            "steps": len(self.step_times),
            "mean_step_time_s": mean_step,
            "tokens_per_s": self.tokens_per_step / mean_step,
            "peak_memory_bytes": peak,
            "memory_kind": memory_kind,
            **stats.as_dict(),
            "hit_rate": stats.hit_rate,
            "per_key": {key: counters.as_dict() for key, counters in stats.per_key.items()},
            "recorded_orders": {
                key: order for key in stats.per_key
                if sched is not None and (order := sched.recorded_order(key)) is not None
            },
        }
        if self.enabled:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        plot = self._plot() if self.enabled else ""
        explained = write_explain(sched, self.run_dir, key=explain_key) if self.enabled else ""
        counted = self.counted
        rows = [
            ("mode", self.mode),
            ("mean step time", f"{mean_step * 1e3:.1f} ms"),
            ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
            (f"peak memory ({memory_kind})", f"{peak / 2**20:,.1f} MiB"),
            ("prefetch hits / misses / resident",
             f"{stats.hits} / {stats.misses} / {stats.resident}" if counted else NOT_COUNTED),
            ("hit rate: (hits + resident) / demands", f"{stats.hit_rate:.1%}" if counted else "n/a"),
            ("prefetches / kept / wasted", f"{stats.prefetches} / {stats.kept} / {stats.wasted}" if counted else "n/a"),
            ("divergences", str(stats.divergences) if counted else "n/a"),
            ("run folder", str(shown_path(self.run_dir))),
        ]
        if self.resumed_from is not None:
            rows.append(("resumed from", f"{shown_path(self.resumed_from)} (step {self.start_step})"))
        rows += [
            ("checkpoints", self._checkpoints_line(checkpoints)),
            ("tensorboard", self._tensorboard_line),
            ("plot", plot),
            ("explain", explained),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)

    def _checkpoints_line(self, checkpoints: list[str]) -> str:
        """Where this run's checkpoints are, with the one to resume from (or why there are none)."""
        if not checkpoints:
            return "none saved (train.save_every=N saves every N steps)"
        folder = shown_path(self.run_dir / CHECKPOINTS_DIR)
        return f"{folder}/: {', '.join(Path(c).name for c in checkpoints)} (train.resume_from=<run folder> takes the last)"

    def _plot(self) -> str:
        """Draw the run's metrics file (a resumed run in the same folder continues it); the summary's line."""
        lines = (self.run_dir / METRICS_FILE).read_text().splitlines()
        title = f"{self.mode}: {self.run_dir.name}"
        if plot_metrics([json.loads(line) for line in lines], self.run_dir / PLOT_FILE, title=title) is None:
            return NOT_DRAWN
        return PLOT_FILE
