"""Cross-rank checks: of a recorded order (replaying different orders would mismatch collectives),
and of a replayed scope's demands where the data decides which units run (ranks that skip different
units would pair different collectives)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from fsdp_replay import _compat
from fsdp_replay._order import RecordedOrders, fingerprint, first_difference


class RankMismatchError(RuntimeError):
    """Ranks recorded different orders; replaying them would issue mismatched collectives."""


def check_across_ranks(key: str, orders: RecordedOrders, states: Sequence[Any]) -> None:
    """Compare ``key``'s order (length + digest) over each distinct process group of the units' ``states``.

    Several groups arise with several roots (model chunks) sharded over different groups; each
    is compared in the order the states come, which is the same on every rank of it. Marks the
    order checked if all ranks agree; otherwise forgets it and raises on every rank.

    Raises:
        RankMismatchError: naming, for each rank that differs from rank 0, the first differing demand.
    """
    order = orders.get(key)
    all_orders = _every_ranks_items_if_they_differ(key, order.to_state(), order.digest(), states)
    if all_orders is not None:
        orders.discard_unchecked(key)
        headline = f"ranks recorded different demand orders for iteration {key!r}"
        raise RankMismatchError(_describe_rank_mismatch(headline, all_orders))
    orders.checked(key)


def check_demands_across_ranks(key: str, demands: list[tuple[str, str]], states: Sequence[Any]) -> None:
    """Compare a replayed scope's ``(unit FQN, phase)`` demands (length + digest) across the ranks of
    each process group of the units' ``states``: one small all-gather per group, at the scope's end.

    Raises:
        RankMismatchError: on every rank, naming for each rank that differs from rank 0 the first
            differing demand: the data skipped different units on different ranks.
    """
    all_demands = _every_ranks_items_if_they_differ(key, demands, fingerprint(demands), states)
    if all_demands is not None:
        raise RankMismatchError(
            _describe_rank_mismatch(
                f"ranks ran different units in iteration {key!r} (the data skipped different units on different ranks)",
                all_demands,
            )
        )


def _every_ranks_items_if_they_differ(key: str, items: list[Any], digest: int, states: Sequence[Any]) -> list[Any] | None:
    """Every rank's ``items`` where some rank of a process group of ``states`` has others (compared
    by length and ``digest``, each group in the order the states come, the same on all its ranks)."""
    compared: set[int] = set()
    for state in states:
        if (group := id(_compat.process_group(state))) in compared:
            continue
        compared.add(group)
        if (every := _every_ranks_if_they_differ(key, items, digest, state)) is not None:
            return every
    return None


def _every_ranks_if_they_differ(key: str, items: list[Any], digest: int, state: Any) -> list[Any] | None:
    group = _compat.process_group(state)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    with _compat.trace("fsdp_replay::check_ranks", key):
        mine = torch.tensor([len(items), digest], dtype=torch.int64, device=_compat.device(state))
        # Pre-filled with our own value: a no-op (fake) backend then compares equal.
        gathered = [mine.clone() for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        if all(torch.equal(g, mine) for g in gathered):
            return None
        every: list[Any] = [items for _ in gathered]
        dist.all_gather_object(every, items, group=group)
    return every


def _describe_rank_mismatch(headline: str, orders: list[list[tuple]]) -> str:
    reference = orders[0]
    lines = [f"fsdp_replay: {headline} (check_ranks=True):"]
    for rank, order in enumerate(orders[1:], start=1):
        if order == reference:
            continue
        pos = first_difference(reference, order)
        ref = reference[pos][:2] if pos < len(reference) else "end of order"
        got = order[pos][:2] if pos < len(order) else "end of order"
        lines.append(
            f"  first difference at demand {pos}: rank 0 has {ref}, rank {rank} has {got} "
            f"(lengths {len(reference)} vs {len(order)})"
        )
    lines.append("Every rank must run the same units in the same order; replay would mismatch collectives.")
    return "\n".join(lines)


def agree_on_max(values: list[int], states: Sequence[Any]) -> list[int]:
    """The element-wise largest of ``values`` over the ranks of each distinct process group of the
    units' ``states`` (one small all-reduce per group; the adaptive depth's agreement)."""
    agreed = torch.tensor(values, dtype=torch.int64)
    compared: set[int] = set()
    for state in states:
        group = _compat.process_group(state)
        if id(group) in compared or group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            continue
        compared.add(id(group))
        on_device = agreed.to(_compat.device(state))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
        agreed = on_device.cpu()
    return agreed.tolist()
