"""Llama-style decoder LM for the recipes: RMSNorm, rotary attention, SwiGLU, tied output head.

The model is meant to be built on the meta device, sharded, then materialised with
``to_empty()`` + :meth:`Transformer.init_weights`, so no rank ever holds the full weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from train_lib.config import ModelConfig


def rotary_tables(
    *, head_dim: int, seq_len: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the rotary angles, each ``(seq_len, head_dim // 2)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of ``x`` (``batch, heads, seq, head_dim``) by position."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def init_full_(param: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    """Apply ``fill`` to the full parameter, then keep this rank's shard of it.

    DTensor's random ops are shard-aware only on CUDA-like devices: on CPU every rank would draw
    the same local values, repeating one shard across the tensor. Drawing the full tensor from the
    same seed on every rank gives the same model at any world size and on any device.
    """
    if not isinstance(param, DTensor):
        fill(param)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    fill(full)
    param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        init_full_(self.weight, nn.init.ones_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, *, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (w(x).view(batch, seq, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, *, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(dim=cfg.dim, n_heads=cfg.n_heads)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(dim=cfg.dim, hidden=cfg.ffn_dim)

    def init_weights(self, *, std: float, out_std: float) -> None:
        """Residual-branch outputs get ``out_std`` so the stream's variance does not grow with depth."""
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        attention, mlp = self.attention, self.feed_forward
        for linear in (attention.wq, attention.wk, attention.wv, mlp.w1, mlp.w3):
            init_full_(linear.weight, lambda t: nn.init.normal_(t, std=std))
        for linear in (attention.wo, mlp.w2):
            init_full_(linear.weight, lambda t: nn.init.normal_(t, std=out_std))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def _run_blocks(
    blocks: Sequence[TransformerBlock], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    for block in blocks:
        h = block(h, cos, sin)
    return h


class Transformer(nn.Module):
    """Decoder LM whose output head shares the embedding's weight (one Parameter, one FSDP unit)."""

    def __init__(self, cfg: ModelConfig, *, checkpoint_group: int = 0) -> None:
        """``checkpoint_group``: blocks per activation-checkpointed group (0: no recompute)."""
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.checkpoint_group = checkpoint_group
        head_dim = cfg.dim // cfg.n_heads
        # Derived from the config, never trained: non-persistent, so checkpoints hold weights only.
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, head_dim // 2), persistent=False)

    def tie_weights(self) -> None:
        """Make the head use the embedding's Parameter.

        ``to_empty()`` gives an unsharded module a new Parameter per name, which unties them;
        FSDP2 swaps its sharded parameters in place, which keeps them tied.
        """
        self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter and buffer after ``to_empty()``.

        Draws come from the global RNG in module order, so seeding it identically on every rank
        gives the same model on every run, whatever the prefetch mode or world size.
        """
        self.tie_weights()
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers * self.cfg.depth_repeats)
        init_full_(self.tok_embeddings.weight, lambda t: nn.init.normal_(t, std=std))
        for block in self.layers:
            block.init_weights(std=std, out_std=out_std)
        self.norm.reset_parameters()
        cos, sin = rotary_tables(
            head_dim=self.rope_cos.shape[1] * 2,
            seq_len=self.cfg.max_seq_len,
            theta=self.cfg.rope_theta,
            device=self.rope_cos.device,
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        group = self.checkpoint_group or len(self.layers)
        for _ in range(self.cfg.depth_repeats):
            for start in range(0, len(self.layers), group):
                blocks = self.layers[start : start + group]
                if self.checkpoint_group:
                    # Non-reentrant: works with FSDP2's hooks and with inputs that need no grad.
                    h = checkpoint(_run_blocks, blocks, h, cos, sin, use_reentrant=False)
                else:
                    h = _run_blocks(blocks, h, cos, sin)
        return self.output(self.norm(h))
