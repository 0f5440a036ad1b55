"""Prefetch counters, cumulative over a scheduler's life, with a per-scope-key breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class KeyStats:
    """Counters of one scope key (or of all keys together)."""

    demands: int = 0
    """Units that needed their parameters (forward, backward and recompute uses)."""
    hits: int = 0
    """Demands whose all-gather had been issued before the demand."""
    misses: int = 0
    """Demands that had to issue their all-gather at the point of use."""
    resident: int = 0
    """Demands whose unit was already unsharded."""
    prefetches: int = 0
    """All-gathers the scheduler issued ahead of their use."""
    kept: int = 0
    """Units kept unsharded from one use to their next instead of resharded and gathered again."""
    wasted: int = 0
    """Prefetches and keeps the scheduler released without their demand coming."""
    dropped: int = 0
    """Prefetches and keeps another party undid or took over before their demand: a user's or a
    pipeline schedule's ``reshard()``/``unshard()``, ``reset_iter_state``, or FSDP2 dropping a
    pending gather when it finalizes a backward."""
    divergences: int = 0
    """Replayed scopes whose demands left their recorded order."""
    recordings: int = 0
    """Orders recorded and installed."""

    def add(self, counter: str, n: int = 1) -> None:
        setattr(self, counter, getattr(self, counter) + n)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(KeyStats)}

    @property
    def hit_rate(self) -> float:
        """Share of demands that did not wait for an all-gather issued at the demand."""
        return (self.hits + self.resident) / self.demands if self.demands else 0.0


@dataclass
class PrefetchStats(KeyStats):
    """All counters of a scheduler; ``demands == hits + misses + resident`` always holds."""

    per_key: dict[str, KeyStats] = field(default_factory=dict)
    """The same counters split by scope key (``"train"``, ``"auto:grad"``, ...)."""

    def count(self, key: str | None, counter: str, n: int = 1) -> None:
        """Bump a counter in the totals and, when inside a scope, in that key's breakdown."""
        self.add(counter, n)
        if key is not None:
            (self.per_key.get(key) or self.per_key.setdefault(key, KeyStats())).add(counter, n)
