"""Canonical workloads whose call order defeats FSDP2's prefetch guess.

Each workload builds a seeded model, shards it (one unit per block, root last), and runs one
iteration: a schedule of microbatch forwards ``("F", i)`` and backwards ``("B", i)``. Two of them
run units only when the data says so (``moe_dynamic``, ``layer_drop``): their decisions come from
the batch and the parameters, which every rank holds identically, so all ranks run the same units
(FSDP2 needs that: a unit run on one rank only would hang its all-gather).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import enum
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.utils.checkpoint import checkpoint

class Pass(str, enum.Enum):
    """One pass of a microbatch. It equals its letter, so ``("F", 0)`` and ``(Pass.forward, 0)``
    are the same step of a :data:`Schedule`."""

    forward = "F"
    backward = "B"


Schedule = Sequence[tuple[str, int]]
"""One optimizer step's passes in order, as ``(pass, microbatch)``: the one representation of a
microbatch schedule (tests, reliability harness, training recipe)."""


def sequential(n: int) -> Schedule:
    """F0 B0 F1 B1 ...: gradient accumulation, each microbatch's backward right after its forward."""
    return tuple((p, i) for i in range(n) for p in (Pass.forward, Pass.backward))


def interleaved(n: int) -> Schedule:
    """F0 F1 B0 F2 B1 ... B(n-1): 1F1B-style, each loss alive until its backward."""
    passes = [(Pass.forward, 0)]
    for i in range(1, n):
        passes += [(Pass.forward, i), (Pass.backward, i - 1)]
    return tuple(passes + [(Pass.backward, n - 1)])


SEQUENTIAL: Schedule = sequential(1)
ONE_F_ONE_B: Schedule = interleaved(3)


class Block(nn.Module):
    """A residual MLP block: enough compute to matter, nothing that hides numerics."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


BlockFactory = Callable[[int, int], nn.Module]
"""``(dim, hidden) -> block``: what a workload's blocks are (default :class:`Block`; the GPU
benchmark passes transformer blocks)."""


class CallSequenceModel(nn.Module):
    """Input projection, then blocks called in ``calls`` order (repeats = shared blocks), then a head.

    ``checkpoint_spans`` are ``(start, stop)`` slices of ``calls`` run under activation
    checkpointing (non-reentrant unless ``reentrant``), so their units are recomputed inside backward.
    Each block is ``block(dim, hidden)``; a block maps ``(rows, dim)`` to ``(rows, dim)``.
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden: int,
        n_blocks: int,
        calls: Sequence[int],
        checkpoint_spans: Sequence[tuple[int, int]] = (),
        reentrant: bool = False,
        block: BlockFactory = Block,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(block(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)
        self.calls = list(calls)
        self.checkpoint_spans = sorted(checkpoint_spans)
        self.reentrant = reentrant
        self.skip: set[int] = set()
        """Blocks that do not run in the next forwards (a test sets it per step, alike on every rank:
        the data skipping a block, as LayerDrop does)."""

    def _run(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for i in self.calls[start:stop]:
            if i not in self.skip:
                x = self.blocks[i](x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        position = 0
        for start, stop in self.checkpoint_spans:
            x = self._run(x, position, start)
            x = checkpoint(self._run, x, start, stop, use_reentrant=self.reentrant)
            position = stop
        x = self._run(x, position, len(self.calls))
        return self.head(x).square().mean()

    def shard(self, mesh, **kwargs) -> nn.Module:
        for block in self.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        return fully_shard(self, mesh=mesh, **kwargs)


class NestedBlock(nn.Module):
    """A pre-norm residual MLP block whose two linears :class:`NestedUnitsModel` shards as units of
    their own, inside the block's unit (which keeps the norm's parameters)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class NestedUnitsModel(CallSequenceModel):
    """Units inside units: each block's ``up`` and ``down`` are units, and so is the block around
    them, which is in use (and holds its own parameters) while they run."""

    def shard(self, mesh, **kwargs) -> nn.Module:
        for block in self.blocks:
            fully_shard(block.up, mesh=mesh, **kwargs)
            fully_shard(block.down, mesh=mesh, **kwargs)
        return super().shard(mesh, **kwargs)


class TiedLM(nn.Module):
    """Token embedding and output head sharing one weight, sharded as one grouped unit."""

    def __init__(self, *, vocab: int, dim: int, hidden: int, n_blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def shard(self, mesh, **kwargs) -> nn.Module:
        fully_shard([self.embed, self.head], mesh=mesh, **kwargs)
        for block in self.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        return fully_shard(self, mesh=mesh, **kwargs)


class MoELayer(nn.Module):
    """A residual mixture of experts; an expert no token is routed to is not called (as HF Mixtral
    and Qwen-MoE skip idle experts), so which expert units run depends on the data."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim)) for _ in range(n_experts)
        )

    def forward(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        out = x
        for e, expert in enumerate(self.experts):
            tokens = (chosen == e).nonzero().flatten()
            if tokens.numel() == 0:
                continue
            out = out.index_add(0, tokens, expert(x[tokens]))
        return out


class MoEModel(nn.Module):
    """Input projection, MoE layers whose experts are separate units, and a head.

    Tokens are routed by a fixed random projection of the model's input (hash routing, as in Hash
    Layers): a decision from data every rank holds identically, so every rank calls the same
    experts, and one that does not rest on gathered values (a fake backend gathers none).
    """

    def __init__(self, *, dim: int, hidden: int, n_layers: int, n_experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(MoELayer(dim, hidden, n_experts) for _ in range(n_layers))
        self.head = nn.Linear(dim, 1)
        self.register_buffer("routing", torch.randn(n_layers, dim, n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.einsum("td,lde->lte", x, self.routing).argmax(dim=-1)
        x = self.inp(x)
        for layer, tokens_to in zip(self.layers, chosen):
            x = layer(x, tokens_to)
        return self.head(x).square().mean()

    def shard(self, mesh, **kwargs) -> nn.Module:
        for layer in self.layers:
            for expert in layer.experts:
                fully_shard(expert, mesh=mesh, **kwargs)
        return fully_shard(self, mesh=mesh, **kwargs)


class LayerDropModel(CallSequenceModel):
    """Blocks each skipped with probability ``p_drop`` per forward (LayerDrop / stochastic depth).

    The draw is seeded from the batch, which every rank holds identically (``Workload.make_batch``
    is seeded from the step), so all ranks skip the same blocks, as a seed shared across ranks does.
    """

    def __init__(self, *, dim: int, hidden: int, n_blocks: int, p_drop: float) -> None:
        super().__init__(dim=dim, hidden=hidden, n_blocks=n_blocks, calls=range(n_blocks))
        self.p_drop = p_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = torch.rand(len(self.blocks), generator=_seeded_by(x)) < self.p_drop
        self.skip = {i for i, drop in enumerate(dropped.tolist()) if drop}
        return super().forward(x)


class LoopedModel(CallSequenceModel):
    """The middle block called 1 to ``max_loops`` times in a row per forward (a recurrent depth, as
    adaptive-computation and looped transformers run), the count drawn from the batch like
    :class:`LayerDropModel`'s, so every rank loops alike."""

    def __init__(self, *, dim: int, hidden: int, n_blocks: int, max_loops: int) -> None:
        super().__init__(dim=dim, hidden=hidden, n_blocks=n_blocks, calls=range(n_blocks))
        self.max_loops = max_loops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loops = int(torch.randint(1, self.max_loops + 1, (), generator=_seeded_by(x)))
        middle = len(self.blocks) // 2
        self.calls = [*range(middle), *[middle] * loops, *range(middle + 1, len(self.blocks))]
        return super().forward(x)


class MultiHeadModel(nn.Module):
    """Input projection, blocks, and one head unit per task; each forward runs one head, chosen by its
    batch (multi-task training: each microbatch of a step may be another task's), alike on every rank."""

    def __init__(self, *, dim: int, hidden: int, n_blocks: int, n_heads: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, 1)) for _ in range(n_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = int(torch.randint(len(self.heads), (1,), generator=_seeded_by(x)))
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.heads[head](x).square().mean()

    def shard(self, mesh, **kwargs) -> nn.Module:
        for module in (*self.blocks, *self.heads):
            fully_shard(module, mesh=mesh, **kwargs)
        return fully_shard(self, mesh=mesh, **kwargs)


class HalvingBlock(Block):
    """A :class:`Block` with a second forward method, whose residual branch is halved."""

    def halved(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * self.down(torch.nn.functional.silu(self.up(x)))


class MethodCallModel(CallSequenceModel):
    """Blocks in order, reached through methods registered with ``register_fsdp_forward_method`` (RL
    libraries register ``generate``): the root's :meth:`loss` and each even block's ``halved``.
    FSDP2 gathers for such a call as for a forward; the modules' forward hooks never run. Train it
    through :meth:`loss`."""

    def __init__(self, *, dim: int, hidden: int, n_blocks: int) -> None:
        super().__init__(dim=dim, hidden=hidden, n_blocks=n_blocks, calls=range(n_blocks), block=HalvingBlock)

    def _run(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for i in self.calls[start:stop]:
            x = self.blocks[i].halved(x) if i % 2 == 0 else self.blocks[i](x)
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)  # a method call: FSDP2's hooks run around it once registered, the module's do not

    def shard(self, mesh, **kwargs) -> nn.Module:
        root = super().shard(mesh, **kwargs)
        for block in self.blocks[::2]:
            register_fsdp_forward_method(block, "halved")
        register_fsdp_forward_method(self, "loss")
        return root


def _seeded_by(x: torch.Tensor) -> torch.Generator:
    """A generator seeded from the batch, which every rank holds identically."""
    return torch.Generator().manual_seed(hash(tuple(x.flatten()[:4].tolist())) & 0x7FFF_FFFF)


@dataclass(frozen=True)
class Workload:
    """A model factory, the inputs of one iteration, and the microbatch schedule."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, int], torch.Tensor]
    """(step, microbatch) -> input tensor, identical on every rank."""
    schedule: Schedule = SEQUENTIAL
    notes: str = field(default="", compare=False)
    record_steps: int = 1
    """The ``PrefetchConfig.record_steps`` that suits it: above 1 where data decides which units run."""

    @property
    def microbatches(self) -> int:
        return 1 + max(mb for _, mb in self.schedule)

    def on(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Workload:
        """This workload with its batches on ``device`` (floating ones cast to ``dtype`` if given).

        Batches are drawn on the CPU from a seeded generator, so every device sees the same
        inputs; the model goes where ``fully_shard``'s mesh puts it.
        """
        make = self.make_batch

        def moved(step: int, mb: int) -> torch.Tensor:
            batch = make(step, mb)
            return batch.to(device, dtype=dtype if dtype is not None and batch.is_floating_point() else None)

        return dataclasses.replace(self, make_batch=moved)


def linear_stack(mesh, *, layers: int = 4, dim: int = 8) -> nn.Module:
    """``nn.Sequential`` of seeded ``Linear(dim, dim)`` layers, one unit each, under a parameter-free root."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run_iteration(model: nn.Module, workload: Workload, step: int) -> list[float]:
    """Forwards and backwards in schedule order; returns each microbatch's loss."""
    losses: dict[int, torch.Tensor] = {}
    for op, mb in workload.schedule:
        if op == "F":
            losses[mb] = model(workload.make_batch(step, mb))
        else:
            losses[mb].backward()
    return [losses[mb].item() for mb in sorted(losses)]


def _dense_batch(dim: int, rows: int) -> Callable[[int, int], torch.Tensor]:
    def make(step: int, mb: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + mb)
        return torch.randn(rows, dim, generator=g)

    return make


def _token_batch(vocab: int, rows: int, seq: int) -> Callable[[int, int], torch.Tensor]:
    def make(step: int, mb: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + mb)
        return torch.randint(0, vocab, (rows, seq), generator=g)

    return make


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return factory()

    return make


def canonical_workloads(
    *, dim: int = 32, hidden: int = 64, n_blocks: int = 4, rows: int = 8, block: BlockFactory = Block
) -> list[Workload]:
    """The six workload shapes of the acceptance suite and the benchmark, in one place (the
    ``tied_embedding`` one always has :class:`Block` blocks)."""

    def seq_model(calls: Sequence[int], spans: Sequence[tuple[int, int]] = ()) -> Callable[[], nn.Module]:
        return _seeded(
            lambda: CallSequenceModel(
                dim=dim, hidden=hidden, n_blocks=n_blocks, calls=calls, checkpoint_spans=spans, block=block
            )
        )

    dense = _dense_batch(dim, rows)
    in_order = list(range(n_blocks))
    out_of_order = [*range(1, n_blocks, 2), *range(0, n_blocks, 2)][::-1]  # 4 blocks: [2, 0, 3, 1]
    shared = [0, 1, 1, 1, *range(2, n_blocks)]
    vocab = 64
    return [
        Workload("sequential", seq_model(in_order), dense),
        Workload("out_of_order", seq_model(out_of_order), dense, notes=f"calls {out_of_order}"),
        Workload("shared_block", seq_model(shared), dense, notes="block 1 called 3 times"),
        Workload(
            "checkpointed",
            seq_model(in_order, [(0, n_blocks // 2), (n_blocks // 2, n_blocks)]),
            dense,
            notes="two checkpoint regions of several units",
        ),
        Workload("interleaved_1f1b", seq_model(in_order), dense, schedule=ONE_F_ONE_B),
        Workload(
            "tied_embedding",
            _seeded(lambda: TiedLM(vocab=vocab, dim=dim, hidden=hidden, n_blocks=n_blocks)),
            _token_batch(vocab, rows, 9),
        ),
    ]


def conditional_workloads(*, dim: int = 32, hidden: int = 64, n_blocks: int = 4, rows: int = 8) -> list[Workload]:
    """Workloads whose data decides which units run (docs/TOLERANT_REPLAY.md): each step's order is
    its recorded order with some entries left out, so replay must tolerate skips."""
    dense = _dense_batch(dim, rows)
    return [
        Workload(
            "moe_dynamic",
            _seeded(lambda: MoEModel(dim=dim, hidden=hidden, n_layers=n_blocks, n_experts=4)),
            dense,
            notes="4 experts per layer as units, each token to one; an expert without tokens is not called",
            record_steps=4,
        ),
        Workload(
            "layer_drop",
            _seeded(lambda: LayerDropModel(dim=dim, hidden=hidden, n_blocks=2 * n_blocks, p_drop=0.05)),
            dense,
            notes="each block skipped with probability 0.05 per forward, the same on every rank",
            record_steps=4,
        ),
        Workload(
            "looped_block",
            _seeded(lambda: LoopedModel(dim=dim, hidden=hidden, n_blocks=n_blocks, max_loops=3)),
            dense,
            notes="the middle block called 1 to 3 times in a row per forward, the same on every rank",
            record_steps=4,
        ),
    ]


def nested_workloads(*, dim: int = 32, hidden: int = 64, n_blocks: int = 4, rows: int = 8) -> list[Workload]:
    """Workloads whose units nest (:class:`NestedUnitsModel`): the tests run them beside the
    canonical ones; the benchmark does not."""

    def nested(spans: Sequence[tuple[int, int]] = ()) -> Callable[[], nn.Module]:
        return _seeded(
            lambda: NestedUnitsModel(
                dim=dim, hidden=hidden, n_blocks=n_blocks, calls=range(n_blocks), checkpoint_spans=spans, block=NestedBlock
            )
        )

    dense = _dense_batch(dim, rows)
    return [
        Workload("nested_units", nested(), dense, notes="up and down units inside each block unit"),
        Workload("nested_checkpointed", nested([(0, n_blocks)]), dense, notes="nested units, every block recomputed in backward"),
    ]


def method_call_workload(*, dim: int = 32, hidden: int = 64, n_blocks: int = 4, rows: int = 8) -> Workload:
    """:class:`MethodCallModel`: run it with :func:`run_through_loss`, not :func:`run_iteration`."""
    return Workload(
        "method_calls",
        _seeded(lambda: MethodCallModel(dim=dim, hidden=hidden, n_blocks=n_blocks)),
        _dense_batch(dim, rows),
        notes="the root and the even blocks run through methods registered with register_fsdp_forward_method",
    )


def multi_head_workload(*, dim: int = 32, hidden: int = 64, n_blocks: int = 4, rows: int = 8) -> Workload:
    """:class:`MultiHeadModel` with 3 heads, 3 microbatches a step (gradient accumulation)."""
    return Workload(
        "multi_head",
        _seeded(lambda: MultiHeadModel(dim=dim, hidden=hidden, n_blocks=n_blocks, n_heads=3)),
        _dense_batch(dim, rows),
        schedule=sequential(3),
        notes="3 heads as units; each microbatch runs the one its batch picks (multi-task training)",
    )


def run_through_loss(model: nn.Module, workload: Workload, step: int) -> list[float]:
    """One step of :func:`method_call_workload`: ``model.loss`` of one batch, then its backward."""
    loss = model.loss(workload.make_batch(step, 0))
    loss.backward()
    return [loss.item()]


def workload(name: str, **sizes: Any) -> Workload:
    """A canonical, conditional or nested workload by name; ``sizes`` as :func:`canonical_workloads`
    takes them (a ``block`` factory only for the canonical ones)."""
    others = {k: v for k, v in sizes.items() if k != "block"}
    by_name = {w.name: w for w in canonical_workloads(**sizes) + conditional_workloads(**others) + nested_workloads(**others)}
    if name not in by_name:
        raise ValueError(f"unknown workload {name!r}; workloads are {', '.join(by_name)}")
    return by_name[name]
