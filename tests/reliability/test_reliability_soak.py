"""Soak: many replayed iterations of a small model, alternating a training key and a no_grad eval key.

Memory (process RSS, live tensor bytes), module hooks, global optimizer hooks and FSDP2's own
per-iteration lists must stay flat; the counters must stay consistent; every replayed iteration
must hit; losses and final weights must be bitwise those of plain FSDP2 run alongside.
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import torch
from torch.optim import optimizer as optim_module

from fsdp_replay import PrefetchConfig, attach
from fsdp_replay.testing.internals import iteration_bookkeeping
from reliability_harness import (
    PROFILE,
    ModelSpec,
    build_model,
    fsdp_states,
    gather_leaks,
    hook_count,
    record_figures,
    run_examples,
    run_schedule,
    stats_consistent,
)

SPEC = ModelSpec(n_blocks=3, calls=(0, 1, 2, 1), spans=((2, 4),))
"""blocks.1 runs twice, the last two calls are recomputed in backward."""
SCHEDULE = (("F", 0), ("F", 1), ("B", 0), ("B", 1))
EVAL_EVERY = 5
WARMUP = 20
CHECKPOINTS = 10
RSS_GROWTH_LIMIT = 16 << 20
"""Allowed RSS growth from the first sample to the last (allocator warm-up: ~6 MiB, all early)."""
RSS_TAIL_LIMIT = 1 << 20
"""Allowed RSS growth over the second half of the samples: 2,000 iterations x 1 KiB leaked exceeds it."""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensor_bytes() -> int:
    storages = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                s = obj.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        except Exception:  # some tensor subclasses have no storage of their own
            continue
    return sum(storages.values())


def _fsdp_lists(model) -> int:
    """Entries in FSDP2's per-iteration bookkeeping (post-forward order and indices)."""
    states = fsdp_states(model)
    return iteration_bookkeeping(states["<root>"], list(states.values()))


def _soak(mesh, iterations: int) -> dict:
    plain = build_model(mesh, SPEC)
    model = build_model(mesh, SPEC)
    sched = attach(model, PrefetchConfig())
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, model)]
    eval_input = torch.ones(SPEC.rows, SPEC.dim)
    samples, problems, mismatches = [], [], 0
    every = max((iterations - WARMUP) // CHECKPOINTS, 1)
    started = time.perf_counter()
    for it in range(iterations):
        if it == WARMUP:
            sched.reset_stats()
        plain_losses = run_schedule(plain, SPEC, SCHEDULE, it)
        with sched.iteration("train"):
            losses = run_schedule(model, SPEC, SCHEDULE, it)
        mismatches += losses != plain_losses
        if (leaks := gather_leaks(model)) and len(problems) < 5:
            problems.append(f"iteration {it}: after the scope: {leaks}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if it >= WARMUP and (it - WARMUP) % every == 0 or it == iterations - 1:
            gc.collect()
            samples.append(
                {
                    "iteration": it,
                    "rss": _rss(),
                    "tensor_bytes": _live_tensor_bytes(),
                    "module_hooks": hook_count(model),
                    "optimizer_hooks": len(optim_module._global_optimizer_pre_hooks),
                    "fsdp_lists": _fsdp_lists(model),
                }
            )
        # Sampled before the eval forward: after a no_grad forward FSDP2 keeps the root unsharded.
        if it % EVAL_EVERY == 0:
            with torch.no_grad():
                plain_eval = plain(eval_input).item()
                with sched.iteration("eval"):
                    mismatches += model(eval_input).item() != plain_eval
    seconds = time.perf_counter() - started
    same_weights = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(plain.parameters(), model.parameters()))
    stats = sched.stats
    problems += stats_consistent(sched)
    keys = {k: v.as_dict() for k, v in stats.per_key.items()}
    # Nothing may outlive the model: the scheduler and its global optimizer hook go with it.
    ref = weakref.ref(sched)
    hooks_before = len(optim_module._global_optimizer_pre_hooks)
    del sched, model, opts
    gc.collect()
    return {
        "samples": samples,
        "stats": stats.as_dict(),
        "per_key": keys,
        "problems": problems,
        "mismatches": mismatches,
        "same_weights": same_weights,
        "scheduler_freed": ref() is None,
        "optimizer_hooks_freed": hooks_before - len(optim_module._global_optimizer_pre_hooks),
        "seconds": seconds,
    }


def test_soak_memory_hooks_and_counters_stay_flat_and_training_stays_bitwise():
    iterations = PROFILE.soak_iterations
    per_rank = run_examples(_soak, [iterations], example_timeout_s=120 + iterations * 0.5)
    for rank, (r,) in enumerate(per_rank):
        assert r["mismatches"] == 0 and r["same_weights"], f"rank {rank}: drifted from plain FSDP2: {r['mismatches']}"
        assert not r["problems"], r["problems"]
        for field in ("tensor_bytes", "module_hooks", "optimizer_hooks", "fsdp_lists"):
            values = [s[field] for s in r["samples"]]
            assert len(set(values)) == 1, f"rank {rank}: {field} not flat: {values}"
        rss = [s["rss"] for s in r["samples"]]
        assert rss[-1] - rss[0] < RSS_GROWTH_LIMIT, f"rank {rank}: RSS grew {(rss[-1] - rss[0]) / 2**20:.1f} MiB: {rss}"
        tail = rss[-1] - rss[len(rss) // 2]
        assert tail < RSS_TAIL_LIMIT, f"rank {rank}: RSS still growing in the second half ({tail / 2**10:.0f} KiB): {rss}"
        s = r["stats"]
        # After warm-up every demand is replayed: no recording, divergence, miss or waste.
        assert (s["recordings"], s["divergences"], s["misses"], s["wasted"]) == (0, 0, 0, 0), s
        assert s["demands"] == s["hits"] + s["resident"] and s["prefetches"] == s["hits"], s
        assert set(r["per_key"]) == {"train", "eval"}, r["per_key"]
        assert r["scheduler_freed"] and r["optimizer_hooks_freed"] == 1, r
    r = per_rank[0][0]
    record_figures(
        "soak",
        {
            "iterations": iterations,
            "replayed_after_warmup": iterations - WARMUP,
            "eval_scopes": len(range(0, iterations, EVAL_EVERY)),
            "stats_after_warmup": r["stats"],
            "rss_mib": [round(s["rss"] / 2**20, 1) for s in r["samples"]],
            "rss_growth_kib": (r["samples"][-1]["rss"] - r["samples"][0]["rss"]) // 1024,
            "rss_tail_growth_kib": (r["samples"][-1]["rss"] - r["samples"][len(r["samples"]) // 2]["rss"]) // 1024,
            "tensor_bytes": r["samples"][0]["tensor_bytes"],
            "module_hooks": r["samples"][0]["module_hooks"],
            "seconds": round(r["seconds"], 1),
            "ms_per_iteration_both_models": round(1000 * r["seconds"] / iterations, 1),
        },
    )
