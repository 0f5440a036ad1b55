"""Llama-style decoder LM for the recipes: RMSNorm, rotary attention, SwiGLU, tied output head.

The model is meant to be built on the meta device, sharded, then materialised with
``to_empty()`` + :meth:`Transformer.init_weights`, so no rank ever holds the full weights.
:class:`PipelineChunk` is one pipeline stage of the same model, built and initialised the same way.
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

INIT_STD = 0.02
"""Standard deviation of the embedding and of the blocks' input projections."""


def residual_std(cfg: ModelConfig) -> float:
    """Init std of the residual-branch outputs, so the stream's variance does not grow with depth."""
    return INIT_STD / math.sqrt(2 * cfg.n_layers * cfg.depth_repeats)


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


def run_stack(
    blocks: Sequence[TransformerBlock], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, checkpoint_group: int
) -> torch.Tensor:
    """One pass through ``blocks``; with ``checkpoint_group``, each group of that many blocks is
    recomputed in backward."""
    group = checkpoint_group or len(blocks)
    for start in range(0, len(blocks), group):
        chunk = blocks[start : start + group]
        if checkpoint_group:
            # Non-reentrant: works with FSDP2's hooks and with inputs that need no grad.
            h = checkpoint(_run_blocks, chunk, h, cos, sin, use_reentrant=False)
        else:
            h = _run_blocks(chunk, h, cos, sin)
    return h


def register_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """Rotary tables as buffers: derived from the config, never trained, so non-persistent
    (checkpoints hold weights only)."""
    head_dim = cfg.dim // cfg.n_heads
    module.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, head_dim // 2), persistent=False)
    module.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, head_dim // 2), persistent=False)


def fill_rope(module: nn.Module, cfg: ModelConfig) -> None:
    """Fill the buffers of :func:`register_rope` after ``to_empty()``."""
    cos, sin = rotary_tables(
        head_dim=module.rope_cos.shape[1] * 2, seq_len=cfg.max_seq_len, theta=cfg.rope_theta,
        device=module.rope_cos.device,
    )
    module.rope_cos.copy_(cos)
    module.rope_sin.copy_(sin)


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
        register_rope(self, cfg)

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
        init_full_(self.tok_embeddings.weight, lambda t: nn.init.normal_(t, std=INIT_STD))
        for block in self.layers:
            block.init_weights(std=INIT_STD, out_std=residual_std(self.cfg))
        self.norm.reset_parameters()
        fill_rope(self, self.cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for _ in range(self.cfg.depth_repeats):
            h = run_stack(self.layers, h, cos, sin, checkpoint_group=self.checkpoint_group)
        return self.output(self.norm(h))


def stage_layers(cfg: ModelConfig, *, stage: int, n_stages: int) -> range:
    """The blocks of pipeline stage ``stage`` of ``n_stages``: contiguous, as even as the count allows
    (later stages take the remainder)."""
    if not 1 <= n_stages <= cfg.n_layers:
        raise ValueError(f"{n_stages} pipeline stages need 1 to ModelConfig.n_layers ({cfg.n_layers}) stages")
    return range(stage * cfg.n_layers // n_stages, (stage + 1) * cfg.n_layers // n_stages)


def _scratch_block(cfg: ModelConfig, device: torch.device) -> TransformerBlock:
    """A block with uninitialised memory; building it on meta draws nothing from the RNG."""
    with torch.device("meta"):
        block = TransformerBlock(cfg)
    return block.to_empty(device=device)


class PipelineChunk(nn.Module):
    """Pipeline stage ``stage`` of ``n_stages`` of :class:`Transformer`: a slice of its blocks, with the
    token embedding on the first stage and the final norm and output head on the last.

    Modules keep the names they have in :class:`Transformer` (``layers.<i>`` with the global block
    index ``i``), so a stage's parameter names are the whole model's. The output head is not tied to
    the embedding: they live on different stages (tying them would need a gradient all-reduce
    between the first and the last stage). It starts as a copy of the embedding, so the initial
    model computes what :class:`Transformer` computes from the same seed.
    """

    def __init__(self, cfg: ModelConfig, *, stage: int, n_stages: int, checkpoint_group: int = 0) -> None:
        """``checkpoint_group``: blocks per activation-checkpointed group within this stage (0: no recompute)."""
        super().__init__()
        if cfg.depth_repeats != 1:
            raise ValueError(
                f"ModelConfig.depth_repeats={cfg.depth_repeats}: a pipeline stage cannot reuse blocks that "
                "other stages hold; use depth_repeats=1 with pipeline stages"
            )
        self.cfg = cfg
        self.stage, self.n_stages = stage, n_stages
        self.checkpoint_group = checkpoint_group
        first, last = stage == 0, stage == n_stages - 1
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if first else None
        held = stage_layers(cfg, stage=stage, n_stages=n_stages)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in held})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps) if last else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if last else None
        register_rope(self, cfg)

    @torch.no_grad()
    def init_weights(self) -> None:
        """The values :meth:`Transformer.init_weights` gives these modules, after seeding the same way.

        That init draws from the global RNG in module order; the draws of the modules other
        stages hold are made into scratch tensors and dropped, so the RNG reaches each of this
        stage's modules where it would in the whole model.
        """
        device = self.rope_cos.device
        embedding = torch.empty(self.cfg.vocab_size, self.cfg.dim, device=device)
        nn.init.normal_(embedding, std=INIT_STD)
        for module in (self.tok_embeddings, self.output):
            if module is not None:
                init_full_(module.weight, lambda t: t.copy_(embedding))
        held = [int(i) for i in self.layers]
        for i in range(max(held, default=-1) + 1):
            block = self.layers[str(i)] if str(i) in self.layers else _scratch_block(self.cfg, device)
            block.init_weights(std=INIT_STD, out_std=residual_std(self.cfg))
        if self.norm is not None:
            self.norm.reset_parameters()
        fill_rope(self, self.cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``(batch, seq)`` on the first stage, else the previous stage's hidden states
        ``(batch, seq, dim)``; returns logits on the last stage, else hidden states."""
        seq = x.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        h = run_stack(list(self.layers.values()), h, cos, sin, checkpoint_group=self.checkpoint_group)
        return self.output(self.norm(h)) if self.output is not None else h
