"""What a scope does with each demand: one small strategy object per mode.

The scheduler classifies and counts a demand, then hands it to its scope's strategy, which
decides what to provide for next: :class:`Record` appends it to a recording, :class:`Replay`
checks it against the recorded order and refills from the order's lookahead, :class:`Static`
prefetches the unit's module-tree successors, and :class:`DemandOnly` does nothing. Replay
tolerates units the data skips (see [Note: skipped entries and a changed order]). What comes
next is the order's to say (``_order.py``); what is held is the window's (``_window.py``). A
strategy never changes its scope's mode: a replay that leaves its order returns why, and the
scheduler switches the scope to :data:`DEMAND_ONLY`.
"""

from __future__ import annotations

import enum
from typing import Protocol, Sequence

from fsdp_replay import _compat
from fsdp_replay._compat import Standing
from fsdp_replay._order import Cursor, Depth, Entry, ExecutionOrder, Phase, Recording
from fsdp_replay._timeline import Event
from fsdp_replay._units import Unit
from fsdp_replay._window import Held, PrefetchWindow
from fsdp_replay.stats import Demand, MissReason, Why


class ScopeMode(enum.Enum):
    """What a scope does with its demands; fixed when it opens, except that it may fall back to demand."""

    record = "record"
    """The key has no order yet: every demand is recorded and nothing is prefetched."""
    replay = "replay"
    """Each demand is checked against the key's order, and the next entries are provided for."""
    static = "static"
    """The attach-time guess: each demand prefetches the units after it in module-tree order."""
    demand = "demand"
    """Nothing is prefetched: ``demand`` mode, or the rest of a scope after a divergence."""


class Strategy(Protocol):
    mode: ScopeMode
    gathers_misses: bool
    """Whether the scheduler issues a missed unit's gather at its demand, before :meth:`on_demand`
    provides for what comes next, so that it is not queued behind those prefetches."""

    def on_demand(self, unit: Unit, phase: Phase, demand: Demand) -> str | None:
        """Act on a demand the scheduler has classified; returns why it left the order, if it did."""

    def end_backward(self) -> None:
        """A backward of the scope finished (FSDP2's root post-backward callback ran)."""

    def provide(self) -> None:
        """Provide for what comes next: at an explicit scope's start and after each of its backwards."""

    def why_missed(self, unit: Unit, phase: Phase) -> Why:
        """Why this demand, about to be handed to :meth:`on_demand`, found its unit not provided for."""


def gather_at_demand(unit: Unit, phase: Phase) -> None:
    """Issue a missed unit's gather now, before any prefetch (see ``Strategy.gathers_misses``)."""
    _compat.issue_unshard(unit.state, backward=not phase.in_forward, fqn=unit.fqn, use_now=True)


class DemandOnly:
    """No prefetch: every unit is gathered at its point of use, by FSDP2."""

    mode = ScopeMode.demand
    gathers_misses = False

    def on_demand(self, unit: Unit, phase: Phase, demand: Demand) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def provide(self) -> None:
        pass

    def why_missed(self, unit: Unit, phase: Phase) -> Why:
        return _DEMAND_MODE  # a scope that fell back to demand-only knows why itself


DEMAND_ONLY = DemandOnly()
"""Stateless, so one instance serves every scope."""

_DEMAND_MODE = Why(MissReason.demand_mode)
_RECORDING = Why(MissReason.recording)
OFF_ORDER = Why(MissReason.after_divergence, "this demand left the recorded order")
"""A replay's miss off its order: the scheduler learns from :meth:`Replay.on_demand` whether it
diverged there, realigned (the prefix rule) or was tolerated (:attr:`Replay.tolerated`)."""
_REALIGNED = Why(MissReason.realigned)
_MORE_MICROBATCHES = Why(MissReason.more_microbatches, "another pass of the recorded order's last segment")
_NOT_IN_ORDER = Why(MissReason.not_in_order)

# [Note: skipped entries and a changed order]
# Where data decides which units run (idle MoE experts, LayerDrop), a scope's demands are its
# order with some entries left out. Replay treats the order as what usually happens: a demand
# found further on in the current segment moves the cursor to it, and the entries passed by are
# *skipped* (what was provided for them and is not needed next is released at once, counted as
# wasted); a demand the segment does not have further on is gathered at its use and the cursor
# stays. Skips never reorder, so two things tell a changed order from skips: a demand of an entry
# skipped earlier in the same segment (it came after entries recorded after it: the order is
# reordered, e.g. two blocks swapped), which diverges at once and names the demand where the order
# was left; and, at the scope's end, no more than MIN_MATCHED of its demands and skipped entries
# matching the order. Another segment is another microbatch, which may run what this one skipped
# (multi-task training: each microbatch through the head its batch picks), so skips are forgotten
# at each end of backward.
# Every decision rests on the order and the scope's demands, which all ranks share, so ranks
# skip, release and prefetch alike.

# [Note: skips of entries that ran in some scopes]
# A merged order (``record_steps`` above 1) holds entries that ran in only some of its recorded
# scopes, and where two such entries never ran in one scope together, the merge could not see
# which comes first: LayerDrop recordings of blocks 0, 1, 3 and of blocks 0, 2 merge into 0, 1, 3,
# 2, and a step running all four then demanded block 3 after skipping it for block 2. That was
# taken for a changed order: the key diverged and recorded 4 scopes again, and again at the next
# such step (a top-2-of-4 MoE in 2 layers re-recorded every fifth scope, 62 hits in 720 demands
# over 40 steps). So a late demand of a skipped entry diverges only where the two entries ran in
# one recorded scope, in the recorded order: where either ran in every recorded scope. Otherwise
# it is served where it is used, a miss ("not in the recorded order"). Nor does the skip of an
# entry that ran in only some scopes count against the scope at its end (MIN_MATCHED): the data
# was expected to skip it sometimes (a top-1-of-8 MoE with ``record_steps=4`` skipped as many
# entries as it ran and diverged at 6 of 40 scopes, recording most of the others).

# [Note: more microbatches than recorded]
# A key's steps may run different numbers of microbatches: a batch-size ramp-up adds some every few
# thousand steps, dynamic batching packs a varying count, an epoch ends on a remainder. Fewer than
# recorded is a scope that stops short (below). More used to leave every demand past the order's
# end off it (all gathered at their use: 9 misses per extra microbatch of the 4-block workloads,
# against 0 in the recorded ones), and a scope running twice the recorded count matched too little
# of it and diverged, so the next scope re-recorded with no prefetch at all (a ramp from 2 to 4
# microbatches on the fake backend: 36 misses in the step after it). A segment is the part of a
# scope between two ends of backward, which in gradient accumulation is one microbatch; so after
# the order's last backward ended, a demand found in its last segment starts another pass of that
# segment (``Cursor.repeat``), replayed like the first: only the extra microbatch's first demand
# misses (nothing is provided at the last backward's end, where most scopes end). The recorded
# order is kept; a scope running fewer microbatches than that afterwards stops short of it.
# Such a scope ended between two segments (``Cursor.between_segments``), having run whole
# microbatches, and is always tolerated: the rule that a second short scope in a row matching too
# little of the order diverges (a loop that changed) would otherwise make a step of 2 after one
# of 3 re-record a 4-microbatch order (4 steps with no prefetch where ``record_steps=4``). A key
# whose steps now always run fewer keeps its order, and each step's last backward end gathers for
# a microbatch that does not come (counted wasted); ``iteration(key, rerecord=True)`` records the
# new count. A first replay running fewer is no exception: its demands match the order's last
# segments as well as its first, and the prefix rule's realignment at a scope's end used to take
# them for the order after a one-off prefix and trim it (a merged order of 2, 3, 2 and 4
# microbatches lost its first segment, and its third microbatch, now in 25% of the scopes, was no
# longer prefetched). That realignment is not tried between segments: a one-off prefix ending at
# a backward's end is a pipeline's shape inference, after which every unit is resharded, and the
# likely start skips it from the first demand on.

MIN_MATCHED = 0.5
"""A replayed scope whose matched demands are not more than this share of its demands plus the
entries it skipped that ran in every recorded scope ran another order (a forward-only scope of a
forward-and-backward order, for one): it diverges (see [Note: skipped entries and a changed
order]), unless every demand was in the order and the key's replayed scope before it did not run
less, or it stopped short between two segments (fewer microbatches: [Note: more microbatches than
recorded]).

[Note: a scope that stops short]
A training loop may give up a step after its forward (a loss that is not finite: no backward, no
optimizer step). That scope ran a prefix of its key's order, every demand in place, and ended
early. An early-exit model's step that stops after block 1 of 6 likewise runs every demand in
place, skipping the rest of the forward and their backwards. Dropping the order for such a step
would cost the next scope a recording (no prefetch at all, ``record_steps`` scopes of it) and a
warning, for a step that is the exception. So a replayed scope that ran less than its order, every
demand in it, is tolerated, like the early end of a scope that ran most of its order: the entries
it never reached are skipped, what was provided for them is released. Only a second scope of the
key in a row that runs less, matching too little of the order for MIN_MATCHED, diverges: the loop
changed (the key now runs forward only, say), and the next scope records the order it runs now.
One that stopped between two segments ran fewer microbatches, which is always tolerated ([Note:
more microbatches than recorded]).
"""
_BYTE_CAP = Why(MissReason.byte_cap, "max_prefetch_bytes would be exceeded")
_DEPTH_REACHED = Why(MissReason.depth, "the depth's gathers were already in flight")
_DECLINED = Why(MissReason.declined, "a gradient reduction was pending, or FSDP2 does not unshard in backward")

_PREFETCHED, _IN_USE, _PROVIDED, _SKIPPED = Held.prefetched, Standing.in_use, Standing.provided, Event.skipped
"""Read per refill entry: see [Note: Enum members on the per-demand path] in ``scheduler.py``."""

# [Note: the last entry unread]
# At depth d a refill's lookahead has d + 1 entries, one more than the slots, for a unit in use that
# is kept rather than gathered. In the steady state the first d fill the slots and the last only
# shows the depth reached: reading its unit's FSDP2 state (``standing``) then finds a unit sharded,
# and the refill stops. Only two standings would not stop it there: in use (kept instead) and
# unsharded by someone else (passed over, with nothing after it to provide for). The second changes
# nothing, being the last entry; the first needs the unit to be the one just demanded or one whose
# forward or backward runs around that one's, as a unit enclosing another does (``Unit.encloses``).
# So ``Lookahead.unread`` names that last entry where it ran in every recorded scope and encloses
# nothing, and the refill stops at it unread once the slots are taken, as it would after reading
# it: a far-ahead unit's FSDP2 objects are cold in the CPU's caches, which from 64 units on made the
# read cost more than its opcodes. (A unit whose forward calls a unit outside its own modules is in use then
# without enclosing it; as this last entry it is resharded after that use and gathered again, one
# gather more, where the read would have kept it.) 48 opcodes a replayed demand (537.2 -> 489.1,
# bench_calls.py --units 16 --steps 1 --opcodes); timed on one model whose refill reads the last
# entry or not in alternate rounds, beside plain FSDP2 (``measure_cpu_cost``'s protocol otherwise),
# -0.2, -0.9, -0.8 and -0.4, -1.0 points of overhead at 16, 64, 256 and 1024 units (20 to 100
# rounds each; a run of 8 rounds at 1024 units gave +0.7).


class Record:
    """Append each demand to a recording; the scheduler installs it as the key's order if the scope succeeds.

    Nothing is prefetched while recording: FSDP2 gathers every unit at its point of use.
    """

    mode = ScopeMode.record
    gathers_misses = False

    def __init__(self, units: int) -> None:
        self.recording = Recording(units)

    def on_demand(self, unit: Unit, phase: Phase, demand: Demand) -> None:
        with _compat.trace("fsdp_replay::record", unit.fqn, phase.value):
            self.recording.append(unit, phase, needs_gather=demand is not Demand.resident)

    def end_backward(self) -> None:
        self.recording.end_backward()

    def provide(self) -> None:
        pass

    def why_missed(self, unit: Unit, phase: Phase) -> Why:
        return _RECORDING


class Replay:
    """Walk the key's recorded order with a cursor, providing for its next entries after each demand.

    Replay counts only the prefetches among the entries it provides for against the depth: a
    kept unit is no all-gather in flight, so it takes no slot (its bytes still count in the window).

    The prefix rule: a first recording may begin with a one-off pass that later scopes do not run
    (a pipeline schedule's shape inference runs a forward and backward inside its first ``step()``,
    then reshards every unit). So the first replay of an order starts at its likely start
    (``Recording.likely_start``), remembers its demands, and where they leave the order (or end
    short of it) it looks for another position from which the order matches every one of them; it
    then follows that suffix, which the scheduler keeps as the order if the scope reaches its end.
    A wrong realignment is a divergence like any other.

    Skipped entries: see [Note: skipped entries and a changed order].
    """

    mode = ScopeMode.replay
    gathers_misses = True

    def __init__(self, cursor: Cursor, window: PrefetchWindow, *, may_skip_prefix: bool = False) -> None:
        self.cursor = cursor
        self._window = window
        self._recorded = cursor.order
        self._seen: list[tuple[Unit, Phase]] | None = [] if may_skip_prefix else None
        """The scope's demands so far, on a first replay only (the prefix rule)."""
        self._start = 0
        """Where in the recorded order the suffix being followed starts."""
        self._stop: tuple[object, Why] | None = None
        """Where the latest refill stopped short and why: ``(entry, why)``."""
        self.capped = [False, False]
        """Whether the byte cap stopped a refill heading into forward, and into backward (``"auto"`` depth)."""
        self.tolerated = _NOT_IN_ORDER
        """Why the latest demand off the order was tolerated (skipped entries, not in the order, realigned)."""
        self.left_at: int | None = None
        """On a divergence at a late demand of a skipped entry: the scope's demand at which it was skipped."""
        self._demands = 0
        self._matched = 0
        self._passed = 0
        """Entries skipped so far."""
        self._passed_always_run = 0
        """Of those, entries that ran in every recorded scope: only their skips count against the
        scope (see MIN_MATCHED)."""
        self.ran_less = False
        """The scope ended having run less than its order (too little matched, every demand in it):
        tolerated once, a second such scope of the key in a row diverges."""
        self._skipped: dict[tuple[Unit, Phase], tuple[int, str]] = {}
        """Entries skipped so far in the segment: the demand that skipped each, and where the order was left there."""
        self._ran: set[Unit] = set()
        """Units demanded in forward so far, where the order is conditional: a sometimes-run unit not
        among them has no backward to provide for."""
        self._conditional = cursor.order.conditional
        if may_skip_prefix and cursor.order.likely_start:
            self._follow(cursor.order.likely_start, position=0)

    @property
    def skipped_prefix(self) -> bool:
        return self._start > 0

    def on_demand(self, unit: Unit, phase: Phase, demand: Demand) -> str | None:
        index = self._demands
        self._demands = index + 1
        if self._conditional and phase.in_forward:
            self._ran.add(unit)
        if self._seen is not None:
            self._seen.append((unit, phase))
        if self.cursor.take(unit, phase):
            self._matched += 1
        elif self._realign(at_end=False):
            self.cursor.advance()
            self._matched += 1
            self.tolerated = _REALIGNED
        elif (divergence := self._tolerate(unit, phase, index)) is not None:
            return divergence
        self.provide(demanded=unit)
        return None

    def _tolerate(self, unit: Unit, phase: Phase, index: int) -> str | None:
        """A demand off the order: skip to it, or serve it on demand; returns why the order changed if it did."""
        cursor = self.cursor
        got = f"({unit.fqn!r}, {phase.value!r})"
        tolerated = None
        if (at := cursor.find(unit, phase)) is None and (at := cursor.repeat(unit, phase)) is not None:
            tolerated = _MORE_MICROBATCHES
        if at is not None:
            passed = cursor.order.entries[cursor.position : at]
            cursor.position = at + 1
            self._matched += 1
            if passed:
                left = f"diverged at demand {at - len(passed)}: expected {passed[0].describe()}, got {got}"
                demanded_always_ran = cursor.order.entries[at].share == 1.0
                for entry in passed:
                    if demanded_always_ran or entry.share == 1.0:  # [Note: skips of entries that ran in some scopes]
                        self._skipped.setdefault((entry.unit, entry.phase), (index, left))
                self._skip(passed, f"skipped by demand {index} {got}")
            skipped_ahead = Why(MissReason.skipped_ahead, f"{len(passed)} recorded entries before it did not run")
            self.tolerated = tolerated or skipped_ahead  # passed is empty only at a repeated segment's first entry
            return None
        if (skipped := self._skipped.get((unit, phase))) is not None:
            self.left_at, left = skipped
            return f"{left}; then {got} came at demand {index}, after entries recorded after it: the order changed"
        self.tolerated = _NOT_IN_ORDER
        return None

    def _skip(self, passed: Sequence[Entry], why: str) -> None:
        """Log the entries passed by, and release what was provided for them that the lookahead does not need now."""
        self._passed += len(passed)
        self._passed_always_run += sum(entry.share == 1.0 for entry in passed)
        window = self._window
        timeline = window.timeline
        needed = {entry.unit for entry in self.cursor.lookahead().entries}
        for entry in passed:
            timeline.append((_SKIPPED, entry.unit, entry.phase, why))
            if entry.unit not in needed and window.holds(entry.unit) is not None:
                window.release(entry.unit, f"its entry ({entry.unit.fqn!r}, {entry.phase.value!r}) was skipped: {why}")

    def _realign(self, *, at_end: bool) -> bool:
        """The prefix rule: follow the recording from the first other position that matches every
        demand of the scope (and, ``at_end``, has no more); False where none does."""
        seen = self._seen
        if seen is None:
            return False
        recorded = self._recorded
        last = len(recorded) - len(seen)
        for start in range(last if at_end else 0, last + 1):
            if start != self._start and all(recorded[start + i].matches(u, p) for i, (u, p) in enumerate(seen)):
                self._follow(start, position=len(seen) if at_end else len(seen) - 1)  # the demand being handled
                return True
        return False

    def _follow(self, start: int, *, position: int) -> None:
        cursor = Cursor(self._recorded.suffix(start), depth=self.cursor.depth, reuse_distance=self.cursor.reuse_distance)
        cursor.position = position
        cursor.segment = self.cursor.segment
        self.cursor = cursor
        self._start = start

    def end_backward(self) -> None:
        self.cursor.end_backward()
        self._skipped.clear()  # the next segment is another microbatch: what this one skipped may run there

    def followed_order(self, served: Sequence[Demand]) -> ExecutionOrder | None:
        """The suffix of the recording this first replay followed (the prefix rule), to keep as the
        key's order; None where the scope did not run it exactly (the order stays as recorded).

        A suffix run with skips or demands off it is no evidence of a one-off prefix: with gradient
        accumulation and LayerDrop, a first microbatch running a block that the recorded one had
        skipped was taken for the order after a one-off prefix, and the key kept the last of its
        two microbatches for good, each later step then missing one "more microbatches than
        recorded" (and, where that microbatch had skips of its own, those too: 41 misses in 7 steps
        against 34). ``served``: how each of the scope's demands found its unit. An entry whose
        demand found its unit sharded (a hit or a miss) needs a gather from now on, even if the
        recording found the unit unsharded there: the one-off prefix may have left it so (torch
        2.11's pipeline stages infer shapes with a forward and reshard nothing after it), which no
        later scope does. A unit that turns out unsharded after all takes no gather: a refill
        passes over units already provided.
        """
        order = self.cursor.order
        if self._passed or self._matched != self._demands or len(served) != len(order):
            return None
        return order.needing_gathers([demand is not Demand.resident for demand in served])

    def why_missed(self, unit: Unit, phase: Phase) -> Why:
        """The latest refill ran at this very position (after the previous demand, or at the end
        of a backward), so it either stopped short of this entry, or never looked at it."""
        cursor = self.cursor
        entry = cursor.expected
        if entry is None or not entry.matches(unit, phase):
            return OFF_ORDER
        if self._stop is not None and self._stop[0] is entry:
            return self._stop[1]
        if entry.speculative:
            return Why(MissReason.speculative, f"it ran in {entry.share:.0%} of the recorded scopes")
        if not entry.needs_gather:
            return Why(MissReason.resident_when_recorded, "its order was recorded while someone else held it unsharded")
        if cursor.waits_for_backward_end():
            return Why(MissReason.backward_end, "it came before FSDP2 finalized the backward before it")
        if cursor.depth.of(phase) == 0:
            return Why(MissReason.depth, f"{'forward' if phase.in_forward else 'backward'}_prefetch=0")
        return Why(MissReason.dropped, "provided for, then undone before its demand")

    @property
    def stopped_short(self) -> bool:
        """Every demand so far was found in the order (some entries skipped, maybe), and the order
        goes on: a scope ending now ran a prefix of it (a step given up after its forward), not
        another order."""
        return self._matched == self._demands and not self.cursor.done

    def unfinished(self, *, may_run_less: bool) -> str | None:
        """Why a scope ending now left its order: too few of its demands matched it (the entries
        it never reached are skipped); None if it kept to it, or it :attr:`stopped_short` between
        two segments, or every demand was in the order and ``may_run_less`` (the key's scope
        before it did not run less; see [Note: a scope that stops short])."""
        cursor = self.cursor  # the prefix rule may have followed another suffix
        if self._passed == 0 and self._matched == self._demands:
            # Between segments: fewer microbatches than recorded ([Note: more microbatches than recorded]).
            if cursor.done or (not cursor.between_segments and self._realign(at_end=True)):
                return None
        in_order = self._matched == self._demands  # every demand in the order: skips only
        rest = cursor.order.entries[cursor.position :]
        skipped = self._passed_always_run + sum(entry.share == 1.0 for entry in rest)
        if self._matched > MIN_MATCHED * (self._demands + skipped) or (self.stopped_short and cursor.between_segments):
            self._skip(rest, "the scope ended before it")
            return None
        if in_order and may_run_less:
            self.ran_less = True
            self._skip(rest, "the scope ended before it")
            return None
        return (
            f"ended after {cursor.position} of {len(cursor.order)} recorded demands, {self._matched} of its "
            f"{self._demands} demands in the order and {skipped} entries skipped"
            + (f"; next expected {rest[0].describe()}" if rest else "")
            + (", and so did its key's scope before it" if in_order else "")
        )

    def provide(self, demanded: Unit | None = None) -> None:
        """Provide for the cursor's lookahead, nearest first (after each demand, at an explicit
        scope's start and after each of its backwards).

        At most ``depth`` all-gathers are in flight ahead. A unit in use now (``demanded``, about
        to run, or an outer unit still running) that its entry needs again is not resharded and
        gathered again: it is kept unsharded, which costs its bytes but no gather slot. A unit
        already unsharded or gathering by someone else's doing needs nothing. Last, unless the byte
        cap or a unit that may not be kept stopped the refill (nearest first), ``demanded`` is kept
        for a next use further ahead, within ``max_reuse_distance`` (``Lookahead.reuse``).
        """
        ahead = self.cursor.lookahead()
        window = self._window
        holds, standing_of = window.holds, _compat.standing
        gathers = 0
        self._stop = None
        ran, unread = self._ran, ahead.unread
        for entry in ahead.entries:
            unit = entry.unit
            # A sometimes-run entry takes no depth slot: where the data skips it, the next unit's
            # gather is in flight too (at most ``depth`` of them: [Note: sometimes-run entries ahead]).
            sometimes = entry.share < 1.0
            if sometimes and not entry.phase.in_forward and unit not in ran:
                continue  # a sometimes-run unit that did not run forward has no backward this scope
            held = holds(unit)
            if held is not None:
                gathers += held is _PREFETCHED and not sometimes
                continue
            if entry is unread and gathers >= ahead.gathers and unit is not demanded:
                self._stop = (entry, _DEPTH_REACHED)  # [Note: the last entry unread]
                break
            state = unit.state
            standing = _IN_USE if unit is demanded else standing_of(state)
            if standing is _PROVIDED:
                continue  # resident or gathering already (accumulation settings, a user's unshard)
            in_use = standing is _IN_USE
            if not in_use and not sometimes and gathers >= ahead.gathers:
                self._stop = (entry, _DEPTH_REACHED)
                break  # the next demand frees a slot
            if not window.fits(unit):
                self._stop = (entry, _BYTE_CAP)
                self.capped[not entry.phase.in_forward] = True
                return  # the next demand frees room; nothing later may jump the queue
            if in_use:
                if (why_not := window.why_not_kept(unit)) is not None:
                    self._stop = (entry, why_not)
                    return  # nothing later may jump the queue
                window.keep(unit)
            elif window.prefetch(unit, state, backward=not entry.phase.in_forward):
                gathers += not sometimes
            else:
                self._stop = (entry, _DECLINED)
        reuse = ahead.reuse
        if reuse is not None and reuse.unit is demanded and holds(demanded) is None:
            if window.fits(demanded) and window.why_not_kept(demanded) is None:
                window.keep(demanded)


class Static:
    """Module-tree order in forward, its reverse in backward: the attach-time guess.

    Static counts every unit held against the depth, not only its prefetches as replay does. It
    never keeps, and a wrong guess stays held (its gather pending) until its unit is used, so
    memory stays within ``depth`` units ahead however often it guesses wrong. Where the data
    decides which units run (a multi-task model's heads, MoE experts), a backward guesses only
    units that ran forward since the last backward, and the first backward demand after forwards
    releases the forward guesses of units that did not run: either wrong guess would otherwise
    hold the depth slot until FSDP2 drops it at the backward's end, missing every demand of the
    backward.
    """

    mode = ScopeMode.static
    gathers_misses = True

    def __init__(self, successors: StaticSuccessors, depth: Depth, window: PrefetchWindow) -> None:
        self._successors = successors
        self._depth = depth
        self._window = window
        self._guessed: list[Unit] | None = None
        """The successors the previous demand guessed; None before the scope's first demand."""
        self._stop: tuple[list[Unit], Why] | None = None
        """The guesses it did not prefetch, and why."""
        self.capped = [False, False]
        """Whether the byte cap stopped a guess in forward, and in backward (``"auto"`` depth)."""
        self._ran: set[Unit] = set()
        """Units demanded in forward since the last backward demand: the backwards that follow are
        theirs (a microbatch's; with microbatches interleaved, 1F1B's, mostly of the same units)."""
        self._after_forward = False
        """The last demand was a forward one."""

    def on_demand(self, unit: Unit, phase: Phase, demand: Demand) -> None:
        forward = phase.in_forward
        depth = self._depth.of(phase)
        window = self._window
        if forward:
            if not self._after_forward:
                self._after_forward = True
                self._ran.clear()  # another microbatch's forwards begin
            self._ran.add(unit)
            guessed = self._successors[True][unit][:depth]
        else:
            if self._after_forward:
                self._after_forward = False
                self._release_unrun()
            successors = self._successors[False][unit]
            guessed = successors[:depth]
            # [Note: static's backward guesses] The slice, then one C-level test: guessing only
            # what ran cost static 30 Python opcodes a demand with the filter run on every backward
            # demand, 18 so (bench_calls.py --opcodes, 16 units: 488.5 before, 519.0, 506.5).
            ran = self._ran  # empty in a scope of a backward alone (through a retained graph): no filter
            if ran and not ran.issuperset(guessed):  # the data skipped a guessed unit
                guessed = self._ran_of(successors, depth)
        self._guessed = guessed
        self._stop = None
        for i, successor in enumerate(guessed):
            if window.count() >= depth:
                self._stop = (guessed[i:], Why(MissReason.depth, f"{len(window)} earlier guesses still held"))
                return
            state = successor.state
            if not _compat.is_sharded_idle(state):
                continue
            if not window.fits(successor):
                self._stop = (guessed[i:], _BYTE_CAP)
                self.capped[not forward] = True
                return
            window.prefetch(successor, state, backward=not forward)

    def _ran_of(self, successors: list[Unit], depth: int) -> list[Unit]:
        """The first ``depth`` of ``successors`` that ran forward since the last backward."""
        ran, picked = self._ran, []
        for successor in successors:
            if len(picked) >= depth:
                break
            if successor in ran:
                picked.append(successor)
        return picked

    def _release_unrun(self) -> None:
        """The forwards are over for now: a unit guessed for them that did not run has no demand
        in the backward (a later microbatch's forward may run it: it gathers at its use then)."""
        window, ran = self._window, self._ran
        for unit in [unit for unit in window.units(Held.prefetched) if unit not in ran]:
            window.release(unit, "static guessed it for a forward that did not run it")

    def end_backward(self) -> None:
        pass

    def provide(self) -> None:
        pass  # each demand guesses afresh: nothing is provided for ahead of the first

    def why_missed(self, unit: Unit, phase: Phase) -> Why:
        if self._guessed is None:
            return Why(MissReason.static_guess, "the scope's first demand: static guesses only from the demand before")
        if self._stop is not None and unit in self._stop[0]:
            return self._stop[1]
        if self._depth.of(phase) == 0:
            return Why(MissReason.depth, f"{'forward' if phase.in_forward else 'backward'}_prefetch=0")
        if unit in self._guessed:  # not prefetched: FSDP2 still held it unsharded then, and resharded it since
            return Why(MissReason.static_guess, "guessed while still unsharded from its previous use")
        if not phase.in_forward and self._ran and unit not in self._ran:
            return Why(MissReason.static_guess, "in backward static guesses only units that ran forward since the last backward")
        return Why(MissReason.static_guess, "not among the module-tree successors of the previous demand")


StaticSuccessors = dict[bool, dict[Unit, list[Unit]]]


def static_successors(units: list[Unit]) -> StaticSuccessors:
    """For each unit, the units after it in forward (True) and backward (False) static order.

    Only within its own root: with several (pipeline chunks), when another chunk runs next is the
    schedule's to say, which a module-tree guess cannot know (FSDP2's own guess is per root too).
    """
    forward = {u: [v for v in units[i + 1 :] if v.root == u.root] for i, u in enumerate(units)}
    backward = list(reversed(units))
    return {
        True: forward,
        False: {u: [v for v in backward[i + 1 :] if v.root == u.root] for i, u in enumerate(backward)},
    }
