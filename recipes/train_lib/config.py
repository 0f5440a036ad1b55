"""The training recipe's config: its Hydra schemas, their registration and validation.

``configs/train.yaml`` extends :class:`TrainJobConfig`; the ``model`` group extends
:class:`ModelConfig`, and the ``prefetch`` group the library's own
:class:`~fsdp_replay.PrefetchConfig` (registered by :func:`fsdp_replay.hydra.register_prefetch_config`),
so a Hydra override such as ``prefetch.mode=static`` sets exactly the field a Python user passes
to ``fully_shard``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from fsdp_replay import PrefetchConfig
from fsdp_replay.config import require_at_least
from fsdp_replay.hydra import register_prefetch_config
from fsdp_replay.testing.pipelines import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, available_schedules, held_back
from train_lib.checkpoint import find_checkpoint

__all__ = [
    "DataConfig",
    "MicrobatchSchedule",
    "ModelConfig",
    "PipelineConfig",
    "TrainConfig",
    "TrainJobConfig",
    "quiet_nonzero_ranks",
    "register_configs",
    "to_job_config",
]


class MicrobatchSchedule(enum.Enum):
    """Order of the microbatches' forwards and backwards inside one optimizer step."""

    sequential = "sequential"
    """F0 B0 F1 B1 ...: plain gradient accumulation."""
    interleaved = "interleaved"
    """F0 F1 B0 F2 B1 ... B(n-1): 1F1B-style, one forward ahead of the backwards."""


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder of ``recipes/train_lib/llama.py`` (the ``model`` group's schema)."""

    name: str = "tiny"
    """Label shown in logs and the summary."""
    vocab_size: int = 256
    """Token ids are bytes, so 256 covers both the synthetic stream and ``data.path`` files."""
    dim: int = 64
    """Width of the residual stream."""
    n_layers: int = 4
    """Decoder blocks; each block is one FSDP unit."""
    n_heads: int = 4
    """Attention heads; ``dim / n_heads`` must be even for rotary embeddings."""
    ffn_dim: int = 192
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 128
    """Longest sequence the rotary tables cover."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    depth_repeats: int = 1
    """Passes through the block stack per forward; > 1 reuses every block (weight sharing across depth)."""

    def __post_init__(self) -> None:
        require_at_least(1, self, "vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len", "depth_repeats")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"ModelConfig.dim must be a multiple of 2 * n_heads (even rotary head dim), "
                f"got dim={self.dim}, n_heads={self.n_heads}"
            )


@dataclass
class DataConfig:
    """Where training tokens come from."""

    path: str | None = None
    """A text file read as bytes (vocab 256); ``None`` uses the seeded synthetic stream (no download)."""
    synthetic_tokens: int = 1 << 16
    """Length of the synthetic stream."""
    eval_fraction: float = 0.1
    """Tail of the token stream held out for evaluation."""

    def __post_init__(self) -> None:
        if self.path is not None and not Path(self.path).is_file():
            raise ValueError(f"DataConfig.path: no such file {self.path!r} (relative to {os.getcwd()})")
        require_at_least(1, self, "synthetic_tokens")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"DataConfig.eval_fraction must be in (0, 1), got {self.eval_fraction!r}")


@dataclass
class TrainConfig:
    """Optimisation loop of ``recipes/train.py``."""

    run_name: str = "train"
    """Runs go to ``outputs/<run_name>/<date>_<time>/``: rank 0 picks the folder and the other
    ranks receive it; ``outputs/latest`` points at the last one."""
    steps: int = 100
    """Optimizer steps to run (a resumed run continues up to this step)."""
    batch_size: int = 8
    """Sequences per microbatch on each rank."""
    seq_len: int = 64
    """Tokens per sequence."""
    microbatches: int = 1
    """Microbatches accumulated into each optimizer step, all inside one ``sched.iteration()``."""
    schedule: MicrobatchSchedule = MicrobatchSchedule.sequential
    """Order of the microbatches' forwards and backwards."""
    activation_checkpointing: int = 0
    """Blocks per non-reentrant ``torch.utils.checkpoint`` group; 0 disables recompute."""
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    seed: int = 0
    """Seeds weight init (identical on every rank) and data order."""
    eval_every: int = 25
    """Evaluate every N steps under the ``"eval"`` scope key; 0 disables evaluation."""
    eval_batches: int = 2
    """Held-out batches per evaluation."""
    save_every: int = 0
    """Save a checkpoint to ``<run dir>/checkpoints/step_N`` every N steps; 0 disables saving."""
    resume_from: str | None = None
    """Resume from a checkpoint folder (``<run>/checkpoints/step_N``) or a run folder (its latest
    checkpoint): weights, optimizer, step and the recorded prefetch orders. Validation replaces it
    with the absolute path of the checkpoint folder."""
    tensorboard: bool = True
    """Also log loss, eval loss, step time, hit rate and exposed wait per step under ``<run dir>/tensorboard/``
    (rank 0); where the ``tensorboard`` package is missing the summary says so and nothing else changes."""
    prefetch_scheduler: bool = True
    """False: plain FSDP2, torch's ``fully_shard`` with no scheduler attached (FSDP2's own prefetch)
    and ``prefetch.*`` unused: the baseline every prefetch mode must match bitwise."""

    def __post_init__(self) -> None:
        require_at_least(1, self, "steps", "batch_size", "seq_len", "microbatches", "eval_batches")
        require_at_least(0, self, "activation_checkpointing", "eval_every", "save_every")
        if not self.lr >= 0:  # also rejects nan; AdamW would raise on each rank, past the config check
            raise ValueError(f"TrainConfig.lr must be a number >= 0, got {self.lr!r}")
        if self.resume_from is not None:
            try:
                self.resume_from = str(find_checkpoint(Path(self.resume_from)))
            except ValueError as err:
                raise ValueError(f"TrainConfig.resume_from: {err}") from None


SCHEDULE_PREFIX = "Schedule"


@dataclass
class PipelineConfig:
    """Pipeline parallelism (``torch.distributed.pipelining``) over FSDP2: ``stages`` x (ranks / ``stages``)
    ranks, each pipeline stage sharded over the ranks of its FSDP dimension.

    One scheduler per rank covers all the stages (model chunks) that rank holds; each optimizer
    step is one ``schedule.step()`` inside ``sched.iteration("train")``. ``train.microbatches`` is
    the schedule's number of microbatches (each ``train.batch_size`` sequences), which orders them
    itself, so ``train.schedule`` does not apply. Not supported with ``stages > 1``: evaluation
    (skipped, with a log line), checkpoints (``train.save_every``, ``train.resume_from``: rejected),
    ``model.depth_repeats > 1`` (rejected).
    """

    stages: int = 1
    """Pipeline ranks (the ``pp`` mesh dimension); must divide the number of ranks. 1: no pipeline."""
    virtual_stages: int = 1
    """Stages per pipeline rank: 1 for the single-stage schedules (1F1B, GPipe), 2 for the V ones
    (ZBVZeroBubble, DualPipeV), any for the looped ones (rank r holds stages r, r + stages, ...).
    The model's blocks are cut into ``stages * virtual_stages`` stages."""
    schedule: str = "1F1B"
    """``torch.distributed.pipelining.schedules.Schedule<name>``, e.g. 1F1B, Interleaved1F1B."""

    def __post_init__(self) -> None:
        require_at_least(1, self, "stages", "virtual_stages")
        valid = [name.removeprefix(SCHEDULE_PREFIX) for name in available_schedules()]
        if self.schedule not in valid:
            reason = held_back(self.schedule_class)
            why = f"{self.schedule!r} {reason}" if reason else f"unknown pipeline schedule {self.schedule!r}"
            raise ValueError(f"PipelineConfig.schedule: {why}; valid schedules are {', '.join(valid)}")
        fixed = {**dict.fromkeys(SINGLE_STAGE_SCHEDULES, 1), **dict.fromkeys(V_SCHEDULES, 2)}
        if (needed := fixed.get(self.schedule_class)) is not None and self.virtual_stages != needed:
            raise ValueError(
                f"PipelineConfig.virtual_stages must be {needed} with schedule {self.schedule} "
                f"(stages per pipeline rank), got {self.virtual_stages}"
            )

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    @property
    def schedule_class(self) -> str:
        """The schedule's class name in ``torch.distributed.pipelining.schedules``."""
        return SCHEDULE_PREFIX + self.schedule

    @property
    def n_stages(self) -> int:
        """Stages the model is cut into."""
        return self.stages * self.virtual_stages

    def check_world(self, world: int) -> None:
        """Reject a number of ranks that the pipeline ranks do not divide."""
        if world % self.stages:
            raise ValueError(
                f"PipelineConfig.stages ({self.stages}) must divide the number of ranks ({world}): "
                "the ranks form a (stages, ranks / stages) mesh of pipeline x FSDP ranks"
            )


@dataclass
class TrainJobConfig:
    """Top-level config of ``recipes/train.py`` (``configs/train.yaml`` extends it)."""

    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """Prefetch scheduler settings, passed to the root ``fully_shard`` call."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """Token source."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline parallelism; ``stages: 1`` (the default) trains without it."""

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"TrainConfig.seq_len ({self.train.seq_len}) exceeds ModelConfig.max_seq_len "
                f"({self.model.max_seq_len})"
            )
        if self.model.vocab_size < 256:
            raise ValueError(f"ModelConfig.vocab_size must be >= 256 for byte tokens, got {self.model.vocab_size}")
        if self.pipeline.enabled:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        """What ``pipeline.stages > 1`` does not support, named with the setting to change."""
        pipeline, train = self.pipeline, self.train
        if pipeline.n_stages > self.model.n_layers:
            raise ValueError(
                f"PipelineConfig: stages * virtual_stages ({pipeline.n_stages}) exceeds ModelConfig.n_layers "
                f"({self.model.n_layers}); every stage needs at least one block"
            )
        if self.model.depth_repeats != 1:
            raise ValueError(
                f"ModelConfig.depth_repeats must be 1 with pipeline.stages > 1 (a stage cannot reuse the "
                f"blocks of other stages), got {self.model.depth_repeats}"
            )
        if train.schedule is not MicrobatchSchedule.sequential:
            raise ValueError(
                "TrainConfig.schedule does not apply with pipeline.stages > 1: pipeline.schedule orders the "
                f"microbatches; leave train.schedule at sequential (got {train.schedule.name})"
            )
        # Checkpoints would need each pipeline rank's recorded orders saved apart: not implemented.
        if train.save_every or train.resume_from is not None:
            raise ValueError(
                "TrainConfig.save_every / resume_from: checkpoints are not supported with pipeline.stages > 1; "
                "set train.save_every=0 and train.resume_from=null"
            )


def register_configs() -> None:
    """Store the schemas that the YAML files under ``configs/`` extend through their defaults lists."""
    register_prefetch_config()  # the library's: the ``prefetch`` group's schema is PrefetchConfig
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainJobConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)


def _reject_unknown_keys(node: DictConfig, schema: type, path: str = "") -> None:
    """``+group.typo=1`` composes (``+`` may add keys) but would be dropped silently: name it."""
    names = [f.name for f in dataclasses.fields(schema)]
    hints = typing.get_type_hints(schema)
    for key in node.keys():
        if key not in names:
            raise ValueError(f"unknown config field '{path}{key}'; {schema.__name__} has {', '.join(names)}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(node[key], DictConfig):
            _reject_unknown_keys(node[key], hints[key], f"{path}{key}.")


def to_job_config(cfg: DictConfig) -> TrainJobConfig:
    """Build the dataclasses, which runs their ``__post_init__`` validation.

    OmegaConf checks types and enum names while composing, but not ranges such as
    ``prefetch.forward_prefetch=-1``; converting to objects does, so call this before any
    process group starts. Raises ``ValueError`` naming the field and its valid values.
    """
    _reject_unknown_keys(cfg, TrainJobConfig)
    job = OmegaConf.to_object(cfg)
    if not isinstance(job, TrainJobConfig):
        raise ValueError(f"expected a config built on 'train_schema', got {type(job).__name__}")
    return job


def quiet_nonzero_ranks(argv: list[str] | None = None) -> None:
    """Let only rank 0 write Hydra's log file and ``.hydra/`` config snapshot.

    Under torchrun every rank runs Hydra in the same pinned run directory; without this the
    ranks would write the same files concurrently. Call before the ``@hydra.main`` function;
    ``argv`` defaults to ``sys.argv``, which Hydra parses.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        argv = sys.argv if argv is None else argv
        argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
