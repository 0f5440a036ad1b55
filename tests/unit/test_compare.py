import pytest
import torch

from fsdp_replay.testing.compare import assert_trains_like_plain


def _runs(grad: torch.Tensor | None, loss: float = 1.0) -> dict:
    plain = {"losses": [1.0], "grads": [[torch.ones(2), None]]}
    return {("w", "plain"): plain, ("w", "mode"): {"losses": [loss], "grads": [[grad, None]]}}


def test_equal_runs_pass_and_any_difference_fails():
    assert_trains_like_plain(_runs(torch.ones(2)), "w", ["mode"])
    for runs in (_runs(torch.ones(2), loss=1.5), _runs(torch.tensor([1.0, 1.0 + 1e-7])), _runs(None)):
        with pytest.raises(AssertionError):
            assert_trains_like_plain(runs, "w", ["mode"])
