"""Token streams for the recipes: a seeded synthetic stream (no download) or a text file's bytes.

Batches are a pure function of ``(seed, split, step, microbatch, rank)``: every prefetch mode sees
the same data, and a resumed run needs no data-loader state to continue where it stopped.
"""

from __future__ import annotations

import enum
from pathlib import Path

import numpy as np
import torch

from train_lib.config import DataConfig

SUCCESSORS = 4
"""Tokens that may follow each token in the synthetic stream: a floor of ln(4) nats to learn towards."""


class Split(enum.IntEnum):
    train = 0
    eval = 1


def synthetic_tokens(*, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """A random Markov chain over the vocabulary, so the loss has something to learn."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, SUCCESSORS)).tolist()
    picks = rng.integers(0, SUCCESSORS, size=length).tolist()
    tokens = [int(rng.integers(0, vocab_size))]
    for pick in picks[1:]:
        tokens.append(successors[tokens[-1]][pick])
    return np.asarray(tokens, dtype=np.int64)


def file_tokens(path: str | Path) -> np.ndarray:
    """The file's bytes as token ids (vocab 256), so any text file works without a tokenizer."""
    return np.frombuffer(Path(path).read_bytes(), dtype=np.uint8).astype(np.int64)


class TokenData:
    """Fixed-length windows drawn from a token stream, split into a train head and an eval tail."""

    def __init__(
        self, tokens: np.ndarray, *, seq_len: int, batch_size: int, eval_fraction: float, seed: int, source: str
    ) -> None:
        n_eval = int(len(tokens) * eval_fraction)
        self.splits = {Split.train: tokens[: len(tokens) - n_eval], Split.eval: tokens[len(tokens) - n_eval :]}
        for split, part in self.splits.items():
            # A window needs seq_len inputs plus one target beyond them.
            if len(part) <= seq_len + 1:
                raise ValueError(
                    f"{source}: the {split.name} split has {len(part)} tokens, needs more than {seq_len + 1} "
                    f"(train.seq_len={seq_len}, data.eval_fraction={eval_fraction})"
                )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.source = source

    def batch(
        self, split: Split, *, step: int, micro: int, rank: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each ``(batch_size, seq_len)``."""
        part = self.splits[split]
        rng = np.random.default_rng([self.seed, int(split), step, micro, rank])
        starts = rng.integers(0, len(part) - self.seq_len - 1, size=self.batch_size)
        windows = torch.from_numpy(np.stack([part[s : s + self.seq_len + 1] for s in starts]))
        windows = windows.to(device)
        return windows[:, :-1], windows[:, 1:]


def load_tokens(cfg: DataConfig, *, vocab_size: int, seq_len: int, batch_size: int, seed: int) -> TokenData:
    """Read or generate the stream; raises ``ValueError`` when it is too short for ``seq_len``."""
    if cfg.path is not None:
        tokens, source = file_tokens(cfg.path), f"data.path={cfg.path}"
    else:
        tokens = synthetic_tokens(length=cfg.synthetic_tokens, vocab_size=vocab_size, seed=seed)
        source = "synthetic stream"
    return TokenData(
        tokens, seq_len=seq_len, batch_size=batch_size, eval_fraction=cfg.eval_fraction, seed=seed, source=source
    )
