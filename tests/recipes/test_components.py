"""The recipe's model, data, init and microbatch schedule, checked in one process (no torchrun)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from train import Pass, build_model, lm_loss, microbatch_schedule
from train_lib.config import DataConfig, MicrobatchSchedule, ModelConfig, TrainJobConfig
from train_lib.llama import PipelineChunk, Transformer, apply_rotary, rotary_tables, stage_layers
from train_lib.tokens import SUCCESSORS, Split, TokenData, file_tokens, load_tokens, synthetic_tokens


CPU = torch.device("cpu")


def names(passes: list[tuple[Pass, int]]) -> str:
    return " ".join(f"{kind.value}{micro}" for kind, micro in passes)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [(MicrobatchSchedule.sequential, "F0 B0 F1 B1 F2 B2"), (MicrobatchSchedule.interleaved, "F0 F1 B0 F2 B1 B2")],
)
def test_microbatch_schedules_of_three(schedule: MicrobatchSchedule, expected: str) -> None:
    assert names(microbatch_schedule(3, schedule)) == expected


@given(n=st.integers(1, 32), schedule=st.sampled_from(MicrobatchSchedule))
def test_every_microbatch_runs_forward_then_backward_once(n: int, schedule: MicrobatchSchedule) -> None:
    passes = microbatch_schedule(n, schedule)
    assert len(passes) == 2 * n and set(passes) == {(kind, i) for i in range(n) for kind in Pass}
    live, peak = set(), 0
    for kind, micro in passes:
        assert (kind is Pass.forward) == (micro not in live)
        live ^= {micro}
        peak = max(peak, len(live))
    # Interleaving keeps one extra microbatch's activations alive, never more.
    assert peak == (1 if schedule is MicrobatchSchedule.sequential or n == 1 else 2)


def tiny(**overrides: object) -> ModelConfig:
    return ModelConfig(**{"dim": 32, "n_layers": 4, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 16, **overrides})


def built(cfg: ModelConfig, *, checkpoint_group: int = 0, seed: int = 0) -> Transformer:
    model = Transformer(cfg, checkpoint_group=checkpoint_group)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def block_calls(model: Transformer) -> list[int]:
    calls = [0] * len(model.layers)
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_output_head_is_tied_to_the_embedding() -> None:
    with torch.device("meta"):
        model = Transformer(tiny())
    assert model.output.weight is model.tok_embeddings.weight
    model.to_empty(device=CPU)
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight


def test_init_is_seeded_and_fills_every_tensor() -> None:
    with torch.device("meta"):
        model = Transformer(tiny())
    model.to_empty(device=CPU)
    torch.manual_seed(0)
    model.init_weights()
    again = built(tiny())
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(model.rope_cos, again.rope_cos)
    assert not torch.equal(built(tiny(), seed=1).layers[0].attention.wq.weight, again.layers[0].attention.wq.weight)
    assert math.isclose(lm_loss(model, *batch()).item(), math.log(256), rel_tol=0.05)


def test_activation_checkpointing_recomputes_groups_without_changing_gradients() -> None:
    plain, checkpointed = built(tiny()), built(tiny(), checkpoint_group=2)
    plain_calls, checkpointed_calls = block_calls(plain), block_calls(checkpointed)
    lm_loss(plain, *batch()).backward()
    lm_loss(checkpointed, *batch()).backward()
    assert plain_calls == [1, 1, 1, 1]
    assert checkpointed_calls == [2, 2, 2, 2]
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_depth_repeats_call_each_block_several_times() -> None:
    model = built(tiny(depth_repeats=3))
    calls = block_calls(model)
    with torch.no_grad():
        model(batch()[0])
    assert calls == [3, 3, 3, 3]


def test_rotary_rotates_pairs_without_changing_their_length() -> None:
    cos, sin = rotary_tables(head_dim=8, seq_len=5, theta=10000.0, device=CPU)
    x = torch.randn(1, 2, 5, 8)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    pair_norm = lambda t: t.unflatten(-1, (4, 2)).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))


def test_synthetic_stream_is_seeded_and_learnable() -> None:
    tokens = synthetic_tokens(length=5000, vocab_size=256, seed=3)
    assert np.array_equal(tokens, synthetic_tokens(length=5000, vocab_size=256, seed=3))
    assert not np.array_equal(tokens, synthetic_tokens(length=5000, vocab_size=256, seed=4))
    assert tokens.min() >= 0 and tokens.max() < 256
    followers: dict[int, set[int]] = {}
    for a, b in zip(tokens[:-1].tolist(), tokens[1:].tolist()):
        followers.setdefault(a, set()).add(b)
    assert max(len(f) for f in followers.values()) <= SUCCESSORS


def test_batches_are_a_pure_function_of_step_microbatch_and_rank() -> None:
    data = load_tokens(DataConfig(synthetic_tokens=4000), vocab_size=256, seq_len=16, batch_size=3, seed=0)

    def get(split: Split = Split.train, **change: int) -> tuple[torch.Tensor, torch.Tensor]:
        return data.batch(split, **{"step": 1, "micro": 0, "rank": 0, **change}, device=CPU)

    inputs, targets = get()
    assert inputs.shape == targets.shape == (3, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(get()[0], inputs)
    for change in ({"step": 2}, {"micro": 1}, {"rank": 1}):
        assert not torch.equal(get(**change)[0], inputs), change
    assert not torch.equal(get(Split.eval)[0], inputs)


def test_text_file_tokens_are_its_bytes(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes("héllo wörld\n".encode() * 50)
    assert file_tokens(path).tolist() == list(path.read_bytes())
    data = load_tokens(DataConfig(path=str(path)), vocab_size=256, seq_len=8, batch_size=2, seed=0)
    assert data.source == f"data.path={path}"
    assert bytes(data.splits[Split.train].tolist()) + bytes(data.splits[Split.eval].tolist()) == path.read_bytes()


def test_too_short_a_stream_names_source_and_sizes(tmp_path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("x" * 100)
    with pytest.raises(ValueError, match=r"data.path=.*short.txt: the eval split has 10 tokens, needs more than 17"):
        TokenData(file_tokens(path), seq_len=16, batch_size=2, eval_fraction=0.1, seed=0, source=f"data.path={path}")


def test_sharded_init_matches_the_unsharded_model_on_every_rank() -> None:
    """Rank 1 of 2 holds exactly its rows of the full model: init does not depend on world size."""
    job = TrainJobConfig()
    full = built(job.model, seed=job.train.seed)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        sharded = build_model(job, mesh=init_device_mesh("cpu", (2,)), device=CPU)
        for (name, param), expected in zip(sharded.named_parameters(), full.parameters(), strict=True):
            assert torch.equal(param.to_local(), expected.chunk(2, dim=0)[1]), name
    finally:
        dist.destroy_process_group()


def test_pipeline_stages_start_as_the_whole_model_and_chain_into_its_forward() -> None:
    """Three stages over four blocks: the same initial weights (the untied head starts as a copy of
    the embedding) and, chained, bitwise the whole model's logits."""
    cfg = tiny()
    full = built(cfg)
    stages = []
    for stage in range(3):
        with torch.device("meta"):
            chunk = PipelineChunk(cfg, stage=stage, n_stages=3)
        chunk.to_empty(device=CPU)
        torch.manual_seed(0)
        chunk.init_weights()
        stages.append(chunk)
    assert [list(chunk.layers) for chunk in stages] == [["0"], ["1"], ["2", "3"]]
    assert [stage_layers(cfg, stage=s, n_stages=3) for s in range(3)] == [range(0, 1), range(1, 2), range(2, 4)]
    whole = dict(full.named_parameters())
    names = [name for chunk in stages for name, _ in chunk.named_parameters()]
    assert sorted(names) == sorted([*whole, "output.weight"])  # named_parameters() lists the tied weight once
    for chunk in stages:
        for name, param in chunk.named_parameters():
            assert torch.equal(param, whole["tok_embeddings.weight" if name == "output.weight" else name]), name
    assert stages[2].output.weight is not stages[0].tok_embeddings.weight
    tokens = batch()[0]
    h = tokens
    with torch.no_grad():
        for chunk in stages:
            h = chunk(h)
        assert torch.equal(h, full(tokens))
