"""Prefetch counters, cumulative over a scheduler's life, with a per-scope-key breakdown.

Also the vocabulary that stats, the scheduler, the observer (``fsdp_replay.testing``), reports
and messages share: :class:`Demand` names how a demand finds its unit, :class:`Count` names a
counter, :class:`MissReason` names why a demand found its unit neither gathered nor gathering.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Sequence


class Count(str, enum.Enum):
    """A counter of :class:`KeyStats`; its value is the field's name (and the key of ``as_dict()``)."""

    demands = "demands"
    hits = "hits"
    misses = "misses"
    resident = "resident"
    prefetches = "prefetches"
    kept = "kept"
    wasted = "wasted"
    wasted_bytes = "wasted_bytes"
    dropped = "dropped"
    divergences = "divergences"
    recordings = "recordings"


class Demand(str, enum.Enum):
    """How a demand finds its unit, read from FSDP2's own state at the moment of use."""

    counter: Count
    """The counter of :class:`KeyStats` that demands of this class add to."""

    def __new__(cls, value: str, counter: Count) -> Demand:
        member = str.__new__(cls, value)
        member._value_ = value
        member.counter = counter  # a plain attribute: read once per demand
        return member

    hit = "hit", Count.hits
    """Its all-gather was issued ahead of the demand and is pending."""
    miss = "miss", Count.misses
    """Sharded with no gather pending: the all-gather is issued at the point of use."""
    resident = "resident", Count.resident
    """Already unsharded, or a backward use FSDP2 needs no parameters for
    (``set_unshard_in_backward(False)``): no all-gather is needed."""


_DEMANDS_SERVED = tuple(Demand)


class MissReason(str, enum.Enum):
    """Why a demand had to gather at its point of use (or a gather was wasted), in the user's terms.

    A member compares equal to its value, the text reports print; ``explain()`` rows add the
    particulars (which divergence, whose call) as ``detail``.
    """

    recording = "recording scope"
    """The key has no order yet: this scope records it, prefetching nothing."""
    automatic_scope_start = "first demand of an automatic scope"
    """An automatic scope opens inside the root's forward (or, ``auto:backward``, at a backward's
    first demand with no scope open), at this very demand."""
    after_divergence = "after a divergence"
    """The scope left its recorded order (the detail says where) and finishes demand-only."""
    realigned = "first replay realigned to its recording"
    """A first replay found its demands elsewhere in the recording (the prefix rule of pipelines) and
    follows from there on."""
    skipped_ahead = "came after skipped entries"
    """Recorded entries before this demand did not run this time (a unit the data skipped): replay
    moved on to it, released what it had provided for them, and prefetches on from here."""
    more_microbatches = "more microbatches than recorded"
    """The scope went on past its recorded order after its last backward (more microbatches than its
    key recorded: a batch-size ramp-up, dynamic batching): this demand started another pass of the
    order's last segment, which replay follows from here, providing for the rest."""
    not_in_order = "not in the recorded order"
    """The order has no entry for this demand here (a unit its recorded scopes did not run): it is
    gathered at its use, and replay continues where it was."""
    speculative = "rarely run: not prefetched"
    """Its entry ran in fewer than half the recorded scopes (``record_steps``), so it is not
    prefetched speculatively."""
    invalidated = "order invalidated mid-scope"
    """``invalidate()`` dropped the order this scope replayed; it finishes demand-only."""
    depth = "prefetch depth reached"
    """The phase's prefetch depth (``forward_prefetch``/``backward_prefetch``) kept it out of the lookahead."""
    byte_cap = "byte cap reached"
    """Providing for it would have exceeded ``max_prefetch_bytes``."""
    backward_end = "no prefetch across the end of a backward"
    """It came in the next segment before FSDP2 finalized the backward (FSDP2 drops gathers pending there)."""
    resident_when_recorded = "resident when recorded"
    """The order was recorded with the unit already unsharded, so replay provides nothing for it."""
    dropped = "FSDP2 dropped or resharded a prefetched unit"
    """What the window provided was undone before the demand; the detail says by whom."""
    changed_in_place = "parameters changed after the gather"
    """Its parameters were changed in place (a checkpoint loaded, an update under ``torch.no_grad()``)
    after its gather was issued ahead, inside the scope: the gather held their old values, so it was
    released and FSDP2 gathered again at the use."""
    cannot_keep = "unit in use could not be kept"
    """It was in use when the order needed it next, and its unsharded values predate an optimizer step."""
    public_fallback = "public-API fallback"
    """FSDP2's internals are not used here, so a unit in use cannot be kept unsharded for its next use."""
    declined = "FSDP2 declined the gather"
    """FSDP2 would not gather it then (a gradient reduction pending, or no unshard in backward)."""
    static_guess = "static order guessed other units"
    """``static`` mode: not among the module-tree successors prefetched after the previous demand."""
    demand_mode = "demand mode"
    """``demand`` mode prefetches nothing."""
    no_scope = "outside any scope"
    """No ``iteration()`` was open and no automatic scope could open."""


class Why(NamedTuple):
    """A :class:`MissReason` and its particulars (which divergence, whose call), if any."""

    reason: MissReason
    detail: str | None = None

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


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
    wasted_bytes: int = 0
    """Unsharded bytes of the ``wasted`` prefetches and keeps."""
    dropped: int = 0
    """Prefetches and keeps another party undid or took over before their demand: a user's or a
    pipeline schedule's ``reshard()``/``unshard()``, ``reset_iter_state``, or FSDP2 dropping a
    pending gather when it finalizes a backward."""
    divergences: int = 0
    """Replayed scopes whose demands left their recorded order."""
    recordings: int = 0
    """Orders recorded and installed."""

    def add(self, counter: Count, n: int = 1) -> None:
        # A Count is its field's name (a str). Through __dict__, as getattr/setattr with a str
        # subclass skip the type's lookup cache, and this runs a few times per demand.
        self.__dict__[counter] += n

    def as_dict(self) -> dict[str, int]:
        """Every counter by its field's name."""
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
    miss_reasons: collections.Counter[MissReason] = field(default_factory=collections.Counter)
    """Misses by :class:`MissReason`, every key together (``explain()`` shows them per demand)."""

    def count_served(self, key: str | None, served: Sequence[Demand]) -> None:
        """Demands and how each was served, counted in one go: a scope lists them as they come and
        the scheduler counts them when the stats are read and when the scope ends, so no demand
        pays for a counter call (see [Note: counting a scope's demands] in ``scheduler.py``)."""
        if served:
            self.count(key, Count.demands, len(served))
            for demand in _DEMANDS_SERVED:
                if n := served.count(demand):  # a C loop over the list
                    self.count(key, demand.counter, n)

    def count(self, key: str | None, counter: Count, n: int = 1) -> None:
        """Bump a counter in the totals and, when inside a scope, in that key's breakdown."""
        self.__dict__[counter] += n
        if key is not None:
            (self.per_key.get(key) or self.per_key.setdefault(key, KeyStats())).__dict__[counter] += n
