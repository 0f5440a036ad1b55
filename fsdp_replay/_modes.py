"""Which strategy a new scope runs: the configured mode and, for record-and-replay, whether its
key has an order to replay (compared across ranks before its first replay), at the key's depth."""

from __future__ import annotations

from fsdp_replay._adaptive import AdaptiveDepth
from fsdp_replay._order import Cursor, RecordedOrders
from fsdp_replay._ranks import check_across_ranks
from fsdp_replay._strategies import DEMAND_ONLY, Record, Replay, Static, Strategy, static_successors
from fsdp_replay._units import Unit
from fsdp_replay._window import PrefetchWindow
from fsdp_replay.config import PrefetchConfig, PrefetchMode


class ScopeModes:
    """Makes each new scope's strategy, sharing the scheduler's orders, depths and window."""

    def __init__(
        self,
        config: PrefetchConfig,
        units: list[Unit],
        orders: RecordedOrders,
        depths: AdaptiveDepth,
        window: PrefetchWindow,
    ) -> None:
        self._config = config
        self._units = units
        self._static_successors = static_successors(units)
        self._orders = orders
        self._depths = depths
        self._window = window

    def strategy_for(self, key: str, *, rerecord: bool) -> Strategy:
        """The strategy of a new scope of ``key`` (``rerecord``: drop the key's order first).

        Raises:
            RankMismatchError: with ``check_ranks``, ranks recorded different orders for ``key``.
        """
        mode = self._config.mode
        if mode is PrefetchMode.demand:
            return DEMAND_ONLY
        if mode is PrefetchMode.static:
            return Static(self._static_successors, self._depths.of(key), self._window)
        self._orders.began(key)
        if rerecord:
            self._orders.drop(key, reason="rerecord=True")
        order = self._orders.get(key)
        if order is None:
            return Record(len(self._units))
        if self._config.check_ranks and self._orders.needs_check(key):
            check_across_ranks(key, self._orders, [unit.state for unit in self._units])
        may_skip_prefix = self._orders.first_replay(key)
        cursor = Cursor(order, depth=self._depths.of(key), reuse_distance=self._config.max_reuse_distance)
        return Replay(cursor, self._window, may_skip_prefix=may_skip_prefix)
