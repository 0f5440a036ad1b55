"""What [Note: the last entry unread] saves, timed on one model: its lookaheads leave the last entry
unread (as the code does) or not (the refill reads it, as before) in alternate rounds.

    bash scripts/dev.sh python docs/repro/last_entry_unread_cost.py 256 15   # units, rounds per variant

Two record_and_replay models in one process, one of each, would not do: a model's own memory
placement moves its figure by a point or more for the whole process (docs/HOST_COST.md, "Placement
bias"). So one model runs both, in the pattern r u u r r u u r ... (as many rounds of each, each
variant first of a pair in turn), beside plain FSDP2 and static, in ``measure_cpu_cost``'s protocol otherwise
(fake backend, world 8, one thread, thread CPU time, rotating start); each variant's overhead is
the median over its rounds of (its step / plain's step of the same round) - 1.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

sys.path.insert(0, "bench")

import torch  # noqa: E402

from bench_config import BenchConfig  # noqa: E402
from bench_measure import SCOPE_KEY, build_contender, release, timed_step  # noqa: E402
from fsdp_replay.testing.distributed import fake_world  # noqa: E402
from fsdp_replay.testing.workloads import workload  # noqa: E402


def main(units: int, rounds: int) -> None:
    cc = BenchConfig().cpu_cost
    torch.set_num_threads(1)
    ratios: dict[str, list[float]] = {"unread": [], "read": [], "static": []}
    with fake_world(cc.world_size) as mesh:
        w = workload("sequential", dim=cc.dim, hidden=cc.hidden, n_blocks=units, rows=cc.rows)
        run = dataclasses.replace(BenchConfig().bench, quick=False)
        contenders = [build_contender(m, w, mesh, run, metered=False) for m in ("plain", "record_and_replay", "static")]
        replay = contenders[1]
        variants = None
        for step in range(cc.warmup_steps + 2 * rounds):
            order = replay.sched._orders.get(SCOPE_KEY)
            if variants is None and order is not None and order._lookaheads:
                ((key, aheads),) = order._lookaheads.items()  # one depth, one distance
                variants = {"unread": aheads, "read": tuple(a._replace(unread=None) for a in aheads)}
            k = step - cc.warmup_steps  # r u u r r u u r ...: as many rounds of each, each first of a pair in turn
            variant = "unread" if (k // 2 + k) % 2 else "read"
            if variants is not None:
                order._lookaheads[key] = variants[variant]
            first = step % len(contenders)
            in_turn = contenders[first:] + contenders[:first]
            cpu = {c.mode: timed_step(c, step, None, torch.device("cpu"))["cpu_s"] for c in in_turn}
            if step >= cc.warmup_steps and variants is not None:
                ratios[variant].append(cpu["record_and_replay"] / cpu["plain"])
                ratios["static"].append(cpu["static"] / cpu["plain"])
        release(contenders)
    over = {k: 100 * (statistics.median(v) - 1) for k, v in ratios.items()}
    print(
        f"{units} units: record_and_replay unread {over['unread']:+.2f}%, read {over['read']:+.2f}%, "
        f"difference {over['unread'] - over['read']:+.2f} points (static {over['static']:+.2f}%; "
        f"rounds {len(ratios['unread'])} and {len(ratios['read'])})"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
