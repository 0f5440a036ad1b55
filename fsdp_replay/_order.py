"""What comes next: a recorded iteration, the cursor that replays it, and how far ahead it looks.

Everything about the order lives here: the demands of a scope as they are recorded
(:class:`Recording`), the immutable sequence they become (:class:`ExecutionOrder`), the prefetch
depth of each phase (:class:`Depth`), the lookahead of each position (what a refill may provide
for), and the segment rule (a segment is the part of a scope between two ends of backward). An
order may merge several recorded scopes (``record_steps``): each entry then says in what share of
them it ran, and one that ran in fewer than half is not prefetched speculatively.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from fsdp_replay._units import Unit

logger = logging.getLogger("fsdp_replay")


class Phase(enum.Enum):
    """Why a unit needed its parameters."""

    forward = "forward"
    backward = "backward"
    recompute = "recompute"
    """A forward re-run during backward by activation checkpointing."""

    def __init__(self, value: str) -> None:
        self.in_forward = value == "forward"
        """Recompute happens inside backward, so it prefetches with the backward depth. (A plain
        attribute, read per demand: see [Note: Enum members on the per-demand path] in ``scheduler.py``.)"""


class Depth(NamedTuple):
    """All-gathers that may be in flight ahead of use, per phase (``PrefetchConfig``'s two depths)."""

    forward: int = 1
    backward: int = 1
    """Also the depth of recompute, which runs inside a backward."""

    def of(self, phase: Phase) -> int:
        return self.forward if phase.in_forward else self.backward


@dataclass(frozen=True, eq=False, slots=True)
class Entry:
    """One demand of a recorded iteration."""

    unit: Unit
    phase: Phase
    needs_gather: bool
    """The unit was sharded when this demand came while recording, so replay must gather for it.

    Units that stay unsharded (the root, ``reshard_after_forward=False``) never take a slot.
    """
    segment: int = 0
    """Backward passes finished before this demand in its scope (see :meth:`Cursor.lookahead`)."""
    share: float = 1.0
    """In what share of the recorded scopes this demand came (below 1: the data decided whether its
    unit ran; see :class:`MergedRecordings`)."""

    @property
    def speculative(self) -> bool:
        """Ran in fewer than half the recorded scopes: not prefetched ahead (it would be wasted more
        often than used), its demand gathers at the point of use."""
        return self.share < RARE_SHARE

    def matches(self, unit: Unit, phase: Phase) -> bool:
        return self.unit is unit and self.phase is phase

    def describe(self) -> str:
        return f"({self.unit.fqn!r}, {self.phase.value!r})"


class Recording:
    """The demands of a scope being recorded, each with the segment it falls in."""

    def __init__(self, units: int) -> None:
        self.entries: list[Entry] = []
        self.segment = 0
        """Backward passes finished so far in the scope."""
        self.likely_start = 0
        """Where later scopes probably start: after the first point at which someone else resharded
        every unit between two demands (a pipeline's cleanup after its shape-inference pass)."""
        self._units = units
        self._resharded_by_others: set[Unit] = set()

    def append(self, unit: Unit, phase: Phase, *, needs_gather: bool) -> None:
        self.entries.append(Entry(unit, phase, needs_gather, self.segment))
        self._resharded_by_others.clear()

    def resharded_by_other(self, unit: Unit) -> None:
        if self.likely_start or not self.entries:
            return
        self._resharded_by_others.add(unit)
        if len(self._resharded_by_others) == self._units:
            self.likely_start = len(self.entries)

    def end_backward(self) -> None:
        self.segment += 1


RARE_SHARE = 0.5
"""Entries that ran in fewer than this share of the recorded scopes are not prefetched
(:attr:`Entry.speculative`): a prefetch of one would be released unused more often than used."""


class MergedRecordings:
    """The recordings of a key's first ``record_steps`` scopes merged into one order, with how often
    each entry ran.

    Each recording is aligned to the merge so far by their longest matching blocks (``difflib``),
    stretch by stretch (:func:`_stretches`): a matched entry ran once more, an entry only one side
    has is kept where it came. A unit that data skips (an idle expert, a dropped layer) is one
    entry that ran in some of the scopes. The merge depends only on the demands, which every rank
    runs alike, so ranks merge the same order (and ``check_ranks`` compares it before its first
    replay, as any recording).
    """

    def __init__(self) -> None:
        self._entries: list[Entry] = []
        self._runs: list[int] = []
        self.scopes = 0

    def add(self, recording: Recording) -> None:
        """Align ``recording`` to the merge so far, stretch by stretch (see :func:`_stretches`)."""
        new = recording.entries
        mine, theirs = _stretches(self._entries), _stretches(new)
        entries: list[Entry] = []
        runs: list[int] = []
        matcher = difflib.SequenceMatcher(None, [k for k, _, _ in mine], [k for k, _, _ in theirs], autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                for (_, at, n), (_, their_at, m) in zip(mine[i1:i2], theirs[j1:j2]):
                    # The new scope ran the stretch's first m entries (one more run each); any more are new.
                    entries += self._entries[at : at + n] + new[their_at + n : their_at + m]
                    runs += [r + (i < m) for i, r in enumerate(self._runs[at : at + n])] + [1] * (m - n)
                continue
            for _, at, n in mine[i1:i2]:
                entries += self._entries[at : at + n]
                runs += self._runs[at : at + n]
            for _, at, m in theirs[j1:j2]:
                entries += new[at : at + m]
                runs += [1] * m
        self._entries, self._runs = entries, runs
        self.scopes += 1

    def order(self) -> ExecutionOrder:
        scopes = self.scopes
        return ExecutionOrder([dataclasses.replace(e, share=r / scopes) for e, r in zip(self._entries, self._runs)])


def _stretches(entries: Sequence[Entry]) -> list[tuple[tuple[Unit, Phase, int], int, int]]:
    """``(key, start, length)`` of each stretch of consecutive demands of one unit, phase and segment.

    Recordings are aligned stretch by stretch: a scope that demands a unit m times in a row (a
    block looped a data-dependent number of times) ran the merged stretch's first m entries, as
    those demands are interchangeable, and the ones other scopes lacked are its last. Aligned
    demand by demand, ``difflib`` may match them to any of the stretch's entries (often its last
    ones, as part of a longer block going on past it), so the stretch's first entries would look
    rarely run and its last ones certain, and the refill would stop short of the entry after it.
    """
    stretches = []
    start = 0
    for key, stretch in itertools.groupby(entries, key=lambda e: (e.unit, e.phase, e.segment)):
        length = sum(1 for _ in stretch)
        stretches.append((key, start, length))
        start += length
    return stretches


class Lookahead(NamedTuple):
    """What a refill at one position may provide for."""

    entries: tuple[Entry, ...]
    """Upcoming entries that need a gather, nearest first: ``gathers`` of them, plus one for a unit
    still in use, which is kept unsharded instead of gathered and so takes no gather slot."""
    gathers: int
    """All-gathers that may be in flight ahead: the prefetch depth of the phase being entered."""
    segment: int = 0
    """The segment all of ``entries`` are in."""
    reuse: Entry | None = None
    """The next entry of the unit demanded just before this position, where the reuse distance
    reaches it: the unit is kept unsharded until then rather than resharded and gathered again."""
    unread: Entry | None = None
    """The last of ``entries`` where a refill reaching it with every gather slot taken may stop
    there without reading its unit's FSDP2 state: it ran in every recorded scope and its unit
    encloses no other, so it is in use only if it is the unit just demanded (see [Note: the last
    entry unread] in ``_strategies.py``)."""


_NOTHING_AHEAD = Lookahead((), 0)


class ExecutionOrder:
    """An immutable recorded demand sequence; repeats and mixed phases included."""

    def __init__(self, entries: Sequence[Entry], *, likely_start: int = 0) -> None:
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.likely_start = likely_start
        """Where a first replay starts (``Recording.likely_start``); not kept in checkpoints."""
        self._lookaheads: dict[tuple[Depth, int], tuple[Lookahead, ...]] = {}
        self.conditional = any(e.share < 1.0 for e in self.entries)
        """Some entries ran in only some of the recorded scopes: data decides which units run, so
        with ``check_ranks`` each replayed scope's demands are compared across ranks at its end."""
        last = self.entries[-1].segment if self.entries else 0
        self.last_segment_start = next((i for i, e in enumerate(self.entries) if e.segment == last), 0)
        """Where the last segment begins: what a scope running more microbatches than recorded
        repeats (see [Note: more microbatches than recorded])."""

    def lookahead(self, depth: Depth, reuse_distance: int = 0) -> tuple[Lookahead, ...]:
        """Per position, what a refill there may provide for; computed once per depth and distance.

        The depth is that of the phase the position heads into (0: nothing is held ahead).
        Entries that were resident while recording take no slot; the entries end at a segment
        boundary (see :meth:`Cursor.lookahead`) and at a unit's second entry (one use at a time
        is provided for: the unit is kept unsharded from one use to the next, or gathered for
        the next). ``reuse_distance``: see :attr:`Lookahead.reuse` and ``_reuse_from``.
        """
        key = (depth, reuse_distance)
        if key not in self._lookaheads:
            entries = self.entries
            self._lookaheads[key] = tuple(
                _lookahead_from(entries, position, depth.of(entry.phase), reuse_distance)
                for position, entry in enumerate(entries)
            ) + (_NOTHING_AHEAD,)
        return self._lookaheads[key]

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, position: int) -> Entry:
        return self.entries[position]

    def suffix(self, start: int) -> ExecutionOrder:
        """The order from ``start`` on, its segments numbered from 0 again (``Replay``'s prefix rule)."""
        first = self.entries[start].segment
        return ExecutionOrder([dataclasses.replace(e, segment=e.segment - first) for e in self.entries[start:]])

    def needing_gathers(self, needed: Sequence[bool]) -> ExecutionOrder:
        """This order with each entry whose ``needed`` is True marked as needing a gather (one flag
        per entry); itself where that changes nothing."""
        if len(needed) != len(self.entries):
            raise ValueError(f"needing_gathers(): {len(needed)} flags for an order of {len(self.entries)} entries")
        if not any(n and not e.needs_gather for e, n in zip(self.entries, needed)):
            return self
        return ExecutionOrder(
            [e if e.needs_gather or not n else dataclasses.replace(e, needs_gather=True) for e, n in zip(self.entries, needed)]
        )

    def as_list(self) -> list[tuple[str, str]]:
        return [(e.unit.fqn, e.phase.value) for e in self.entries]

    def to_state(self) -> list[tuple]:
        """A picklable form keyed by FQN, for checkpoints and cross-rank comparison; an entry that did
        not run in every recorded scope carries its share as a fifth field."""
        return [
            (e.unit.fqn, e.phase.value, e.needs_gather, e.segment) + ((e.share,) if e.share != 1.0 else ())
            for e in self.entries
        ]

    @classmethod
    def from_state(cls, items: Sequence[Sequence], units: dict[str, Unit]) -> ExecutionOrder | str:
        """The order of :meth:`to_state`'s items, or why it is stale: it names a unit this model lacks.

        Raises:
            ValueError: an entry is malformed (not four fields, or an unknown phase).
        """
        entries = []
        for position, item in enumerate(items):
            if len(item) not in (4, 5):
                raise ValueError(
                    f"recorded order entry {position} is {item!r}; expected (fqn, phase, needs_gather, segment[, share])"
                )
            fqn, phase, needs_gather, segment, *share = item
            if phase not in Phase._value2member_map_:
                raise ValueError(
                    f"recorded order entry {position} has phase {phase!r}; valid phases are "
                    f"{', '.join(p.value for p in Phase)}"
                )
            if fqn not in units:
                return f"entry {position} names unit {fqn!r}, which this model does not have"
            entries.append(Entry(units[fqn], Phase(phase), bool(needs_gather), int(segment), *map(float, share)))
        return cls(entries)

    def digest(self) -> int:
        """A 62-bit fingerprint that ranks compare instead of whole orders."""
        return fingerprint(self.to_state())


WARN_EVERY = 50
"""A key's order dropped again within this many of its scopes after a warning is logged at INFO, not
WARNING: a model whose order keeps changing warns once per this many steps, not every step."""


class RecordedOrders:
    """The installed order of each scope key, and which of them the ranks have compared."""

    def __init__(self, *, record_steps: int = 1) -> None:
        self._orders: dict[str, ExecutionOrder] = {}
        self._checked: set[str] = set()
        self._unreplayed: set[str] = set()
        """Recorded in this process and not replayed yet (see :meth:`first_replay`)."""
        self._record_steps = record_steps
        self._merging: dict[str, MergedRecordings] = {}
        """Keys with fewer than ``record_steps`` recordings so far, merged as they come."""
        self._scopes: dict[str, int] = {}
        """Scopes begun per key (see :meth:`began`)."""
        self._warned_at: dict[str, int] = {}
        """The key's scope count when a drop of its order was last logged as a warning."""
        self._ran_less: set[str] = set()
        """Keys whose latest replayed scope ran less than the order (see :meth:`replay_ended`)."""

    def began(self, key: str) -> None:
        """A scope of ``key`` begins (what the divergence warning's rate counts)."""
        self._scopes[key] = self._scopes.get(key, 0) + 1

    def get(self, key: str) -> ExecutionOrder | None:
        return self._orders.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._orders

    def keys(self) -> list[str]:
        return list(self._orders)

    def install(self, key: str, recording: Recording) -> bool:
        """Make ``recording`` the order of ``key``; with ``record_steps`` above 1, merge it with the
        key's earlier recordings instead, installing the merge at the last. Returns whether an
        order was installed.

        A merged order has no likely start: a one-off prefix of the first recording ran in one
        scope of several, so it is rare and never prefetched.
        """
        if self._record_steps == 1:
            start = recording.likely_start if recording.likely_start < len(recording.entries) else 0
            order = ExecutionOrder(recording.entries, likely_start=start)
        else:
            merged = self._merging.setdefault(key, MergedRecordings())
            merged.add(recording)
            if merged.scopes < self._record_steps:
                return False
            order = self._merging.pop(key).order()
        self._orders[key] = order
        self._checked.discard(key)
        if self._record_steps == 1:
            self._unreplayed.add(key)  # a merged order has no one-off prefix to skip (above)
        self._ran_less.discard(key)
        return True

    def first_replay(self, key: str) -> bool:
        """Whether this replay of ``key`` is the first since it was recorded here; it no longer is after.

        Only a first replay may skip a one-off prefix of its recording (``Replay``'s prefix rule):
        an order loaded from a checkpoint, or replayed before, has none.
        """
        first = key in self._unreplayed
        self._unreplayed.discard(key)
        return first

    def ran_less(self, key: str) -> bool:
        """Whether the latest replayed scope of ``key`` ran less than its order: it stopped short of
        it, or skipped too much of it (see [Note: a scope that stops short])."""
        return key in self._ran_less

    def replay_ended(self, key: str, *, ran_less: bool) -> None:
        """A replayed scope of ``key`` ended, having run less than its order or not."""
        if ran_less:
            self._ran_less.add(key)
        else:
            self._ran_less.discard(key)

    def trim(self, key: str, order: ExecutionOrder) -> None:
        """Replace ``key``'s order by its suffix that a first replay followed; the ranks' check of it
        stands (every rank of the group trims the same order at the same demand, or diverges)."""
        if key in self._orders:
            self._orders[key] = order
            logger.info("fsdp_replay: the first replay of %r skipped a one-off prefix of its recording", key)

    def drop(self, key: str, *, reason: str) -> None:
        """Forget ``key``'s order and any recordings being merged (its next scope records again),
        saying why in the log: a warning at most once per :data:`WARN_EVERY` scopes of the key."""
        self._unreplayed.discard(key)
        self._merging.pop(key, None)
        self._ran_less.discard(key)
        if self._orders.pop(key, None) is not None:
            self._checked.discard(key)
            scopes, warned = self._scopes.get(key, 0), self._warned_at.get(key)
            if warned is None or scopes - warned >= WARN_EVERY:
                self._warned_at[key] = scopes
                logger.warning("fsdp_replay: invalidated the recorded order of %r: %s", key, reason)
            else:
                logger.info("fsdp_replay: invalidated the recorded order of %r again: %s", key, reason)

    def discard_unchecked(self, key: str) -> None:
        """Forget ``key``'s order without a log line (the ranks disagree on it and an error says so, or
        automatic scopes stopped and a warning says so)."""
        self._orders.pop(key, None)
        self._merging.pop(key, None)
        self._unreplayed.discard(key)
        self._ran_less.discard(key)

    def needs_check(self, key: str) -> bool:
        return key not in self._checked

    def checked(self, key: str) -> None:
        self._checked.add(key)

    def to_state(self) -> dict[str, list[tuple[str, str, bool, int]]]:
        return {key: order.to_state() for key, order in self._orders.items()}

    def load_state(self, state: dict[str, Any], units: dict[str, Unit]) -> dict[str, str]:
        """Replace every order with the valid ones of ``state``; returns why each stale one was left out.

        Raises:
            ValueError: an entry is malformed; the installed orders are then left as they were.
        """
        loaded = {key: ExecutionOrder.from_state(items, units) for key, items in state.items()}
        self._orders = {key: order for key, order in loaded.items() if isinstance(order, ExecutionOrder)}
        self._checked.clear()  # loaded orders are compared across ranks before first use
        self._unreplayed.clear()
        self._merging.clear()
        self._ran_less.clear()
        return {key: why for key, why in loaded.items() if isinstance(why, str)}


def fingerprint(items: Sequence[Sequence[Any]]) -> int:
    """A 62-bit fingerprint of a sequence of tuples, that ranks compare instead of the whole sequence."""
    h = hashlib.sha256()
    for item in items:
        h.update(("\0".join(map(str, item)) + "\n").encode())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def first_difference(a: Sequence, b: Sequence) -> int:
    """Position of the first differing item (the shorter length if one is a prefix of the other)."""
    for position, (x, y) in enumerate(zip(a, b)):
        if tuple(x) != tuple(y):
            return position
    return min(len(a), len(b))


class Cursor:
    """A monotonic position in an order: each demand is checked against ``expected`` then ``advance``d."""

    def __init__(self, order: ExecutionOrder, *, depth: Depth = Depth(), reuse_distance: int = 0) -> None:
        self.order = order
        self.position = 0
        self.segment = 0
        """Backward passes finished so far in the replayed scope."""
        self.depth = depth
        self.reuse_distance = reuse_distance
        self._entries = order.entries
        self._lookahead = order.lookahead(depth, reuse_distance)

    @property
    def expected(self) -> Entry | None:
        return self._entries[self.position] if self.position < len(self._entries) else None

    @property
    def done(self) -> bool:
        return self.position >= len(self._entries)

    def advance(self) -> None:
        self.position += 1

    def take(self, unit: Unit, phase: Phase) -> bool:
        """Advance past the expected entry if it is ``(unit, phase)``; False (and no move) otherwise.

        :attr:`expected`, :meth:`Entry.matches` and :meth:`advance` in one call: this runs per demand.
        """
        position = self.position
        if position < len(self._entries):
            entry = self._entries[position]
            if entry.unit is unit and entry.phase is phase:
                self.position = position + 1
                return True
        return False

    def find(self, unit: Unit, phase: Phase) -> int | None:
        """The position of the next entry of ``(unit, phase)`` in the current segment, if any (where a
        demand that skipped entries rejoins the order: ``Replay``'s tolerance)."""
        entries, segment = self._entries, self.segment
        for position in range(self.position, len(entries)):
            entry = entries[position]
            if entry.segment > segment:
                return None
            if entry.unit is unit and entry.phase is phase:
                return position
        return None

    @property
    def between_segments(self) -> bool:
        """A backward ended since the last entry walked, which ended its segment: the scope stands
        between two microbatches of gradient accumulation, say (not past the order's end)."""
        position = self.position
        return 0 < position < len(self._entries) and self.segment > self._entries[position - 1].segment

    def repeat(self, unit: Unit, phase: Phase) -> int | None:
        """Past the order's end after its last backward ended, the position of ``(unit, phase)`` in
        another pass of the last segment, which the cursor then walks; None (and no move) where it
        is not past the end or the segment lacks it. See [Note: more microbatches than recorded]."""
        entries = self._entries
        if self.position < len(entries) or not entries or self.segment <= (last := entries[-1].segment):
            return None
        past_the_end = self.position, self.segment
        self.position, self.segment = self.order.last_segment_start, last
        if (at := self.find(unit, phase)) is None:
            self.position, self.segment = past_the_end
        return at

    def end_backward(self) -> None:
        self.segment += 1

    def waits_for_backward_end(self) -> bool:
        """The position heads into the next segment, whose lookahead waits for :meth:`end_backward`."""
        return self._lookahead[self.position].segment > self.segment

    def lookahead(self) -> Lookahead:
        """What a refill may provide for now, not yet demanded (see :meth:`ExecutionOrder.lookahead`).

        The segment rule: FSDP2 drops the gathers still pending when a backward finalizes, so
        nothing is provided for across the end of a backward. It has two halves: a lookahead
        never crosses into the next segment (``_lookahead_from``), and one that starts in the
        next segment (the last demand of a backward was replayed, the backward has not ended
        yet) waits for :meth:`end_backward`. The position never passes the end (a demand there
        diverges), where the lookahead is empty.
        """
        ahead = self._lookahead[self.position]
        return ahead if ahead.segment <= self.segment else _NOTHING_AHEAD


# [Note: sometimes-run entries ahead]
# An entry that ran in only some recorded scopes takes no depth slot, so that where the data skips
# it the next unit's gather is in flight too. Unbounded, a run of such entries was all gathered
# at once: a MoE layer of 16 experts each run in ~70% of the steps (``record_steps=4``, depth 1,
# no byte cap) held 10-11 units unsharded or gathering at a time where plain FSDP2 held 1 and
# static 2. So a lookahead picks at most ``depth`` of them (the nearest), besides the ``depth``
# that ran in every scope: at most twice the depth's gathers are in flight.


def _lookahead_from(entries: tuple[Entry, ...], position: int, depth: int, reuse_distance: int) -> Lookahead:
    if depth == 0:
        return _NOTHING_AHEAD
    segment = entries[position].segment
    picked: list[Entry] = []
    units: set[Unit] = set()
    certain = sometimes = 0
    """Entries picked that ran in every recorded scope, and in only some: the second take no depth
    slot (see ``Replay.provide``), so a skip of one costs its released gather, not also a miss of
    the next; at most ``depth`` of them are picked ([Note: sometimes-run entries ahead])."""
    for i in range(position, len(entries)):
        entry = entries[i]
        # depth + 1 entries: the nearest may be a unit in use, kept rather than gathered.
        if certain > depth or entry.segment != segment:
            break  # the first half of the segment rule (see Cursor.lookahead)
        if not entry.needs_gather or entry.share < RARE_SHARE:
            continue
        if entry.unit in units:
            break
        if entry.share < 1.0:
            if sometimes == depth:
                continue  # [Note: sometimes-run entries ahead]
            sometimes += 1
        picked.append(entry)
        units.add(entry.unit)
        certain += entry.share == 1.0
    reuse = _reuse_from(entries, position, reuse_distance) if reuse_distance and position else None
    last = picked[-1] if picked else None
    unread = last if last is not None and last.share == 1.0 and not last.unit.encloses else None
    return Lookahead(tuple(picked), depth, segment, reuse, unread)


def _reuse_from(entries: tuple[Entry, ...], position: int, distance: int) -> Entry | None:
    """The next entry of the unit demanded at ``position - 1`` if at most ``distance`` all-gathers
    come before it, in the same segment (a backward's end drops what is held), and it needs a gather."""
    demanded = entries[position - 1]
    between = 0
    for i in range(position, len(entries)):
        entry = entries[i]
        if entry.segment != demanded.segment:
            return None
        if entry.unit is demanded.unit:
            return entry if entry.needs_gather else None
        between += entry.needs_gather
        if between > distance:
            return None
    return None
