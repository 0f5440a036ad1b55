"""``explain()`` on 2 gloo ranks: rows agree with an independent observer, waits are measured
exactly where a use waited, and each miss reason is produced on purpose and reported at its demand."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from fsdp_replay import PrefetchConfig, WaitMeter, attach
from fsdp_replay.stats import Demand, MissReason
from fsdp_replay.testing.distributed import spawn
from fsdp_replay.testing.internals import HAS_RESET_ITER_STATE
from fsdp_replay.testing.observer import DemandObserver


class _Pause(torch.autograd.Function):
    """Sleeps in forward and in backward: compute long enough for a prefetch issued before it to land."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class Ordered(nn.Module):
    """Units ``layers.<i>`` called in ``order`` (repeats allowed) under a parameter-free root."""

    def __init__(self, mesh, order: list[int], *, n: int = 4, dim: int = 64, pause_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.order = list(order)
        self.pause_s = pause_s
        self.dim = dim
        for layer in self.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
            if self.pause_s:
                x = _Pause.apply(x, self.pause_s)
        return x.pow(2).mean()

    def batch(self, step: int) -> torch.Tensor:
        return torch.randn(4, self.dim, generator=torch.Generator().manual_seed(step))


def _step(model: Ordered, sched, step: int, *, explicit: bool = True, microbatches: int = 1) -> None:
    # A pausing rank starts late, so its peers' first gather waits for it, and its own, issued
    # at the scope's start, lands before its use.
    time.sleep(model.pause_s)
    with sched.iteration("train") if explicit else contextlib.nullcontext():
        time.sleep(model.pause_s)
        for mb in range(microbatches):
            model(model.batch(10 * step + mb)).backward()


def _rows(report) -> list[tuple]:
    return [(r.position, r.unit, r.phase, r.served.value, r.reason, r.detail, r.wait_s) for r in report.rows]


# --- rows and waits against the observer ---------------------------------------------------------


def _observed(mesh, mode: str, png_dir: str) -> list[dict]:
    """Rank 0 pauses in every use and rank 1 does not: rank 0's prefetches land before their use,
    rank 1's wait for rank 0 to join each collective, so which use waits is known in advance
    (20 ms either way)."""
    pause = 0.02 if dist.get_rank() == 0 else 0.0
    model = Ordered(mesh, [0, 1, 2, 3], pause_s=pause)
    # No reduce-scatter: it would make the ranks meet after each backward use, and whether a
    # gather issued just before it has finished would be a race between gloo's threads.
    model.set_requires_gradient_sync(False)
    # No rank check either: its collective at the first replay's start would line the ranks up just
    # before rank 1's first use, and whether that gather had finished would again be a race.
    sched = attach(model, PrefetchConfig(mode=mode, measure_waits=True, check_ranks=False))
    observer = DemandObserver(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []
    for step in range(3):
        _step(model, sched, step)
        report = sched.explain("train")
        steps.append({"rows": _rows(report), "observed": observer.take_with_waits(), "mode": report.mode})
        opt.step()
        opt.zero_grad()
    png = Path(png_dir) / f"order_{mode}_{dist.get_rank()}.png"
    sched.explain("train").plot(png)
    steps.append({"png": png.stat().st_size, "table": str(sched.explain("train"))})
    return steps


@pytest.mark.parametrize("mode", ["record_and_replay", "static", "demand"])
def test_rows_agree_with_the_observer_and_waits_are_positive_exactly_where_a_use_waited(mode: str, tmp_path: Path) -> None:
    for rank, steps in enumerate(spawn(_observed, mode, str(tmp_path))):
        *scopes, picture = steps
        assert picture["png"] > 10_000, "the timeline picture was not written"
        assert picture["table"].startswith("fsdp_replay explain 'train'")
        for step, scope in enumerate(scopes):
            rows, observed = scope["rows"], scope["observed"]
            assert [(r[1], r[2]) for r in rows] == [(o[0], o[1]) for o in observed]
            as_observed = [Demand.resident.value if r[3] == "kept" else r[3] for r in rows]
            assert as_observed == [o[2].value for o in observed], f"rank {rank} step {step}"
            waited = [r[6] > 0 for r in rows]
            must_wait = [o[3] for o in observed]
            if mode == "static" and rank == 1:
                # Where static misses on rank 0, rank 0 issues that gather and the next back to back,
                # so whether rank 1's next use still finds it running is a race: only a measured wait
                # where the observer saw one, and one at every miss, are certain.
                assert all(must for w, must in zip(waited, must_wait) if w), f"step {step}: {rows}"
                assert all(r[6] > 0 for r in rows if r[3] == "miss")
            else:
                assert waited == must_wait, f"rank {rank} step {step}: {rows}"
            assert all((r[4] is None) == (r[3] != "miss") for r in rows), "a reason exactly where a demand missed"
        if mode == "record_and_replay":
            assert [s["mode"] for s in scopes] == ["record", "replay", "replay"]
            assert any(r[6] > 0 and r[3] == "hit" for r in scopes[2]["rows"]) == (rank == 1)


def _meter_beside_the_scheduler(mesh) -> tuple[float, float]:
    """A WaitMeter made before attach() and measure_waits both see each wait (rank 1 waits for rank 0)."""
    model = Ordered(mesh, [0, 1, 2, 3], pause_s=0.02 if dist.get_rank() == 0 else 0.0)
    model.set_requires_gradient_sync(False)
    meter = WaitMeter(model)
    sched = attach(model, PrefetchConfig(measure_waits=True))
    for step in range(2):
        meter.take()
        _step(model, sched, step)
    metered = sum(seconds for _, seconds in meter.take())
    sched.detach()  # before the meter: either order works
    meter.remove()
    return metered, sched.explain("train").total_wait_s


def test_a_wait_meter_and_measure_waits_see_the_same_waits() -> None:
    for rank, (metered, explained) in enumerate(spawn(_meter_beside_the_scheduler)):
        # The meter sees FSDP2's own waits; explain() adds the issue of a missed gather (none here).
        assert metered == pytest.approx(explained, rel=1e-9, abs=1e-12), rank
        assert (explained > 0.01) == (rank == 1)


# --- each reason, on purpose -----------------------------------------------------------------------


def _reasons(mesh) -> dict[str, dict]:
    out: dict[str, dict] = {}

    def run(name: str, order: list[int], config: PrefetchConfig, steps: int, *, interfere=None, explicit=True, mb=1):
        model = Ordered(mesh, order)
        sched = attach(model, config)
        handles = []
        for step in range(steps):
            if interfere is not None and step == steps - 1:
                handles = interfere(model, sched)
            _step(model, sched, step, explicit=explicit, microbatches=mb)
        for handle in handles:
            handle.remove()
        key = "train" if explicit else "auto:grad"
        report = sched.explain(key)
        out[name] = {
            "rows": _row_tuples(report),
            "undone": [(u.unit, u.why, u.wasted) for u in report.undone],
            "miss_reasons": dict(sched.stats.miss_reasons),
            "mode": report.mode,
            "outcome": report.outcome,
        }
        sched.detach()

    rr = PrefetchConfig()
    run("recording", [0, 1, 2, 3], rr, 1)
    run("automatic", [0, 1, 2, 3], rr, 2, explicit=False)
    run("demand", [0, 1, 2, 3], PrefetchConfig(mode="demand"), 1)
    run("depth", [0, 1, 2, 3], PrefetchConfig(backward_prefetch=0), 2)
    run("static_guess", [0, 2, 1, 3], PrefetchConfig(mode="static"), 1)
    unit_bytes = 64 * 64 * 4 + 64 * 4
    run("byte_cap", [0, 2, 1, 3], PrefetchConfig(mode="static", forward_prefetch=2, max_prefetch_bytes=unit_bytes * 3 // 2), 1)
    # The last backward use (layers.1) guesses layers.0 next; FSDP2 drops that gather when it finalizes.
    run("finalized", [1, 0, 2, 3], PrefetchConfig(mode="static"), 1, mb=2)

    def diverge(model, sched):
        model.order = [0, 2, 1, 3]
        return []

    run("divergence", [0, 1, 2, 3], rr, 2, interfere=diverge)

    def user_reshard(model, sched):
        # Before layers.2 runs, the user reshards it: the gather issued for it ahead is undone.
        return [model.layers[1].register_forward_hook(lambda *_: model.layers[2].reshard())]

    run("user_reshard", [0, 1, 2, 3], rr, 2, interfere=user_reshard)

    def reset(model, sched):
        return [model.layers[1].register_forward_hook(lambda *_: model.reset_iter_state())]

    if HAS_RESET_ITER_STATE:
        run("reset", [0, 1, 2, 3], rr, 2, interfere=reset)

    def invalidate(model, sched):
        return [model.layers[3].register_forward_hook(lambda *_: sched.invalidate("train"))]

    run("invalidated", [0, 1, 2, 3], rr, 2, interfere=invalidate)

    def fail_backward_end(model, sched):
        # The first microbatch's backward raises after its last unit's use, before FSDP2 finalizes it;
        # the user catches it and goes on: the next microbatch comes with no end of backward seen.
        failed = [False]

        def forward(x: torch.Tensor) -> torch.Tensor:
            x = x.detach().requires_grad_(True)

            def hook(grad: torch.Tensor) -> None:
                if not failed[0]:
                    failed[0] = True
                    raise RuntimeError("a bad microbatch")

            x.register_hook(hook)
            return Ordered.forward(model, x)

        model.forward = forward
        return []

    def run_with_failed_backward() -> None:
        model = Ordered(mesh, [0, 1, 2, 3])
        sched = attach(model, rr)
        _step(model, sched, 0, microbatches=2)
        fail_backward_end(model, sched)
        with sched.iteration("train"):
            for mb in range(2):
                loss = model(model.batch(mb))
                with contextlib.suppress(RuntimeError):
                    loss.backward()
        out["backward_end"] = {"rows": _row_tuples(sched.explain("train"))}
        sched.detach()
        if HAS_RESET_ITER_STATE:
            model._get_fsdp_state()._reset_iter_state()

    run_with_failed_backward()

    def run_resident() -> None:
        model = Ordered(mesh, [0, 1, 2, 3])
        model.layers[1].set_reshard_after_forward(False)  # while recording: resident at its backward use
        sched = attach(model, rr)
        _step(model, sched, 0)
        model.layers[1].set_reshard_after_forward(True)
        _step(model, sched, 1)
        out["resident_when_recorded"] = {"rows": _row_tuples(sched.explain("train"))}
        sched.detach()

    run_resident()

    def stale(model, sched):
        # The user leaves layers.1 unsharded across an optimizer step: its values are stale, so the
        # scheduler may not keep it from its first call to its second.
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model.layers[1].unshard()
        opt.step()
        return []

    run("stale", [0, 1, 1, 2], rr, 2, interfere=stale)

    def run_realigned() -> None:
        # As a pipeline's shape inference: every unit resharded by someone else between the first
        # step's two microbatches makes the first replay start at the second; the first replay's
        # own second microbatch then realigns it.
        model = Ordered(mesh, [0, 1, 2, 3])
        sched = attach(model, rr)
        for step in range(2):
            with sched.iteration("train"):
                for mb in range(2):
                    model(model.batch(mb)).backward()
                    if mb == 0:
                        for layer in model.layers:
                            layer.reshard()
        out["realigned"] = {"rows": _row_tuples(sched.explain("train"))}
        sched.detach()

    run_realigned()

    def run_changed_in_place() -> None:
        # The user loads a checkpoint inside iteration(), before the forward: the gather issued as
        # the scope started (layers.0's) holds the values from before it.
        model = Ordered(mesh, [0, 1, 2, 3])
        sched = attach(model, rr)
        _step(model, sched, 0)
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with sched.iteration("train"):
            model.load_state_dict(snapshot)
            model(model.batch(10)).backward()
        report = sched.explain("train")
        out["changed_in_place"] = {"rows": _row_tuples(report), "undone": [(u.unit, u.why, u.wasted) for u in report.undone]}
        sched.detach()

    run_changed_in_place()

    def run_more_microbatches() -> None:
        # Recorded with 2 microbatches, then a step of 3 (a batch-size ramp-up): the third
        # microbatch's first demand starts another pass of the order's last segment.
        model = Ordered(mesh, [0, 1, 2, 3])
        sched = attach(model, rr)
        _step(model, sched, 0, microbatches=2)
        _step(model, sched, 1, microbatches=3)
        out["more_microbatches"] = {"rows": _row_tuples(sched.explain("train")), "stats": sched.stats.as_dict()}
        sched.detach()

    run_more_microbatches()

    def run_no_scope() -> None:
        chunks = [Ordered(mesh, [0, 1, 2, 3]), Ordered(mesh, [0, 1, 2, 3])]
        sched = attach(chunks, rr)
        loss = chunks[1](chunks[0](chunks[0].batch(0)).reshape(1, 1).expand(4, 64))
        loss.backward()
        out["no_scope"] = {"miss_reasons": dict(sched.stats.miss_reasons), "misses": sched.stats.misses}
        sched.detach()

    run_no_scope()
    return out


def _row_tuples(report) -> list[tuple]:
    return [(r.position, r.unit, r.phase, r.served.value, r.reason, r.detail) for r in report.rows]


@pytest.fixture(scope="module")
def reasons() -> dict[str, dict]:
    return spawn(_reasons)[0]


def _misses(rows) -> list[tuple]:
    return [(position, unit, phase, reason) for position, unit, phase, served, reason, _ in rows if served == "miss"]


def test_recording_scope_misses_everything_with_that_reason(reasons) -> None:
    rows = reasons["recording"]["rows"]
    assert reasons["recording"]["mode"] == "record"
    assert _misses(rows) == [(r[0], r[1], r[2], MissReason.recording) for r in rows if r[3] == "miss"]
    assert len(_misses(rows)) == 8  # every use: each unit is resharded after its forward and after its backward


def test_automatic_scope_misses_only_its_first_demand(reasons) -> None:
    assert _misses(reasons["automatic"]["rows"]) == [(0, "layers.0", "forward", MissReason.automatic_scope_start)]


def test_demand_mode(reasons) -> None:
    assert {r[3] for r in _misses(reasons["demand"]["rows"])} == {MissReason.demand_mode}


def test_depth_zero_in_backward(reasons) -> None:
    misses = _misses(reasons["depth"]["rows"])
    # layers.3 too: at depth 0 nothing is held ahead, not even a unit kept from its forward.
    assert [m[:3] for m in misses] == [(4 + i, f"layers.{3 - i}", "backward") for i in range(4)]
    assert {m[3] for m in misses} == {MissReason.depth}
    assert reasons["depth"]["rows"][5][5] == "backward_prefetch=0"


def test_static_guess_and_byte_cap(reasons) -> None:
    # Forward order 0, 2, 1, 3: after layers.0 static guesses layers.1.
    assert _misses(reasons["static_guess"]["rows"])[:2] == [
        (0, "layers.0", "forward", MissReason.static_guess),
        (1, "layers.2", "forward", MissReason.static_guess),
    ]
    # With depth 2 layers.2 is guessed too, but the cap holds one and a half units.
    assert _misses(reasons["byte_cap"]["rows"])[1] == (1, "layers.2", "forward", MissReason.byte_cap)


def test_fsdp2_finalizing_a_backward_drops_the_gather(reasons) -> None:
    rows = reasons["finalized"]["rows"]
    assert rows[9][:5] == (9, "layers.0", "forward", "miss", MissReason.dropped)
    assert "finalizes a backward" in rows[9][5]


def test_divergence_names_itself_and_the_rest_falls_back(reasons) -> None:
    entry = reasons["divergence"]
    misses = _misses(entry["rows"])
    assert misses[0] == (1, "layers.2", "forward", MissReason.after_divergence)
    assert "diverged at demand 1" in entry["rows"][1][5]
    assert {m[3] for m in misses} == {MissReason.after_divergence}
    assert entry["outcome"].startswith("diverged")
    assert ("layers.1", True) in [(u[0], u[2]) for u in entry["undone"]], "the gather issued for layers.1 was wasted"


@pytest.mark.parametrize(
    "case, who",
    [
        ("user_reshard", "a user's reshard()"),
        pytest.param("reset", "reset_iter_state()", marks=pytest.mark.skipif(not HAS_RESET_ITER_STATE, reason="torch 2.11/2.12")),
    ],
)
def test_another_partys_call_is_named(reasons, case: str, who: str) -> None:
    entry = reasons[case]
    assert entry["rows"][2][:6] == (2, "layers.2", "forward", "miss", MissReason.dropped, who)
    assert ("layers.2", who, False) in entry["undone"]


def test_invalidate_mid_scope(reasons) -> None:
    misses = _misses(reasons["invalidated"]["rows"])
    assert misses and {m[3] for m in misses} == {MissReason.invalidated}
    assert misses[0][0] == 4  # the first backward use after invalidate() in layers.3's forward


def test_a_demand_before_the_end_of_its_backward(reasons) -> None:
    rows = reasons["backward_end"]["rows"]
    assert rows[8][:5] == (8, "layers.0", "forward", "miss", MissReason.backward_end)


def test_recorded_resident_then_sharded(reasons) -> None:
    rows = reasons["resident_when_recorded"]["rows"]
    assert rows[6][:5] == (6, "layers.1", "backward", "miss", MissReason.resident_when_recorded)


def test_a_unit_left_unsharded_across_a_step_is_not_kept(reasons) -> None:
    rows = reasons["stale"]["rows"]
    assert rows[1][3] == "resident" and rows[2][:5] == (2, "layers.1", "forward", "miss", MissReason.cannot_keep)
    assert "predate the last optimizer step" in rows[2][5]


def test_the_first_replay_realigns_to_its_recording(reasons) -> None:
    rows = reasons["realigned"]["rows"]
    assert rows[8][:5] == (8, "layers.0", "forward", "miss", MissReason.realigned)
    assert not [r for r in rows[9:] if r[3] == "miss"]


def test_parameters_changed_after_the_gather(reasons) -> None:
    entry = reasons["changed_in_place"]
    assert _misses(entry["rows"]) == [(0, "layers.0", "forward", MissReason.changed_in_place)]
    assert entry["undone"] == [("layers.0", "its parameters changed in place before its demand", True)]


def test_more_microbatches_than_recorded(reasons) -> None:
    entry = reasons["more_microbatches"]
    assert len(entry["rows"]) == 3 * 8
    assert _misses(entry["rows"]) == [(16, "layers.0", "forward", MissReason.more_microbatches)]
    assert entry["stats"]["divergences"] == 0 and entry["stats"]["recordings"] == 1


def test_demands_outside_any_scope_are_counted(reasons) -> None:
    entry = reasons["no_scope"]
    assert entry["miss_reasons"] == {MissReason.no_scope: entry["misses"]} and entry["misses"] > 0


def test_cumulative_counter(reasons) -> None:
    assert reasons["recording"]["miss_reasons"] == {MissReason.recording: 8}
    assert reasons["divergence"]["miss_reasons"][MissReason.recording] == 8


def _public_fallback(mesh) -> list[tuple]:
    model = Ordered(mesh, [0, 1, 1, 2])
    sched = attach(model, PrefetchConfig())
    for step in range(2):
        _step(model, sched, step)
    return _misses(_row_tuples(sched.explain("train")))


def test_public_fallback_cannot_keep_a_unit_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_REPLAY_PUBLIC_API", "1")
    misses = spawn(_public_fallback)[0]
    assert (2, "layers.1", "forward", MissReason.public_fallback) in misses
