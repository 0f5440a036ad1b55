"""A unit FSDP2 does not unshard in backward (``set_unshard_in_backward(False)``: an embedding, as
OLMo-core shards it) needs no gather there: its backward use is no miss, and nothing is provided
for it (no prefetch FSDP2 would decline, no keep across the step for a use without parameters)."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_replay import PrefetchConfig, attach


class EmbeddingLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim)) for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x), tokens)


@pytest.mark.parametrize("config", [PrefetchConfig(), PrefetchConfig(max_reuse_distance=100), PrefetchConfig(mode="static")])
def test_a_backward_use_fsdp2_needs_no_parameters_for_is_neither_missed_nor_provided_for(mesh8, config):
    torch.manual_seed(0)
    model = EmbeddingLM()
    for module in (model.embed, *model.blocks):
        fully_shard(module, mesh=mesh8)
    fully_shard(model, mesh=mesh8)
    model.embed.set_unshard_in_backward(False)
    sched = attach(model, config)
    for step in range(3):
        tokens = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(step))  # 2-D activations: no views
        with sched.iteration("train"):
            model(tokens).backward()
    report = sched.explain("train")
    served = {(row.unit, row.phase): row.served for row in report.rows}
    # Neither missed nor kept from its forward (a reuse distance kept it across the whole step).
    assert served[("embed", "backward")] == "resident", str(report)
    if config.mode.name == "record_and_replay":
        assert ("embed", "backward") in sched.recorded_order("train")
        assert "miss" not in served.values(), str(report)
