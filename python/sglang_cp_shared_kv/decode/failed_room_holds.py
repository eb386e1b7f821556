"""Decode, the flag on, SGLang 0.5.12.post1: a failed room's pages and metadata slot stay held
until every prefill rank has stopped writing there.

SGLang 0.5.12.post1's decode frees a room's pages and metadata slot as soon as one prefill rank
reports it Failed, while the other CP ranks may still write chunks of it (each learns of the
failure only at its group's next poll); in xPyD, those late writes land in pages another
request now holds (design.md, "A failed room's pages on decode"). With the flag, every prefill
rank tells decode when its last write of a failed room is done (:mod:`..transfer.room_drain`).
Here decode keeps the room's pages and slot until every prefill sender SGLang counts for the
room has sent Success or that notice, or until :func:`..settings.config.failed_room_hold_s`
has passed (then a WARNING says who stayed silent). The request fails at once, as stock; only
its memory waits.

* :class:`FailedRoomHolds`, one per ``DecodeTransferQueue``: the releases SGLang asked for
  and the metadata slots it freed, deferred (:meth:`FailedRoomHolds.defer`,
  :class:`SlotsHeldBack`), and released once ready;
* the release is agreed: decode's attention-TP ranks allocate in lockstep, so every rank
  releases a hold in the same scheduler loop (a MIN all-reduce of the ready flags over
  SGLang's gloo group after each ``process_decode_queue`` while a hold is out: the holds are
  armed by SGLang's agreed Failed poll, so every rank holds the same rooms in the same order);
* while a hold is out the scheduler is not fully idle (SGLang's idle memory check would count
  the held pages as leaked, and a flush would reset the allocator under a late write).

What each failed room waits for is :class:`..transfer.decode.RoomDrains`' (the decode
manager's: its receiver thread keeps the notices).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, List, Optional

from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric
from sglang_cp_shared_kv.settings.config import FAILED_ROOM_HOLD_ENV, FLAG, failed_room_hold_s
from sglang_cp_shared_kv.transfer.decode import RoomDrains

logger = logging.getLogger(__name__)

HOLDS_METRIC = "sglang:cp_shared_kv_decode_failed_room_holds_total"


@dataclasses.dataclass(frozen=True)
class HoldRequest:
    """What the transfer queue tells the release of one request (set on the request for the
    duration of a ``pop_transferred``): whose holds, whose drains, which metadata slot."""

    holds: "FailedRoomHolds"
    drains: RoomDrains
    metadata_slot: int


@dataclasses.dataclass
class Hold:
    room: int
    rid: str
    release: Callable[[], None]  #: SGLang's own release of the request's pages, deferred
    drains: RoomDrains
    metadata_slot: int
    since: float
    deadline: float
    slot_freed: bool = False  #: SGLang freed the slot while held (released with the pages)

    def ready(self, now: float) -> bool:
        failure = self.drains.failure(self.room)
        expected = None if failure is None else failure.expected
        return now >= self.deadline or (expected is not None and len(self.drains.heard(self.room)) >= expected)


class FailedRoomHolds:
    """The held failed rooms of one decode ``DecodeTransferQueue`` (scheduler thread only)."""

    def __init__(self, free_slot: Callable[[int], None], *, hold_s: Optional[float] = None,
                 metrics: bool = False, clock: Callable[[], float] = time.monotonic):
        self._free_slot = free_slot
        self.hold_s = failed_room_hold_s() if hold_s is None else float(hold_s)
        self._clock = clock
        self._holds: List[Hold] = []
        self._counter = (prometheus_metric(
            "counter", HOLDS_METRIC,
            "Failed PD rooms whose pages a shared-KV decode held for the prefill ranks' last writes, by how "
            "the hold ended (drained: every prefill rank told it was done; timeout: one stayed silent).",
            ("how",)) if metrics else None)

    def __len__(self) -> int:
        return len(self._holds)

    def defer(self, req, release: Callable[[], None]) -> bool:
        """SGLang is about to release ``req``'s pages (``release`` does): hold them instead if
        its room failed here (True). Never decides to release at once: that decision is
        :meth:`release_ready`'s, agreed by every decode rank."""
        asked: Optional[HoldRequest] = getattr(req, HOLD_REQUEST_ATTR, None)
        if asked is None or asked.holds is not self:
            return False
        room = req.bootstrap_room
        if asked.drains.failure(room) is None:  # not a failed room (a corrupted transfer): stock
            return False
        now = self._clock()
        self._holds.append(Hold(room=room, rid=str(req.rid), release=release, drains=asked.drains,
                                metadata_slot=asked.metadata_slot, since=now, deadline=now + self.hold_s))
        return True

    def holds_slot(self, slot: int) -> bool:
        """Whether ``slot`` belongs to a held room (then SGLang's free of it is deferred)."""
        for hold in self._holds:
            if hold.metadata_slot == slot and not hold.slot_freed:
                hold.slot_freed = True
                return True
        return False

    def release_ready(self, group=None) -> int:
        """Release every hold that every rank of ``group`` (decode's gloo group; None or one
        rank: this process alone) finds ready; the count released."""
        if not self._holds:
            return 0
        now = self._clock()
        ready = [hold.ready(now) for hold in self._holds]
        ready = agreed(ready, group)
        kept: List[Hold] = []
        for hold, go in zip(self._holds, ready):
            if go:
                self._release(hold, now)
            else:
                kept.append(hold)
        released = len(self._holds) - len(kept)
        self._holds = kept
        return released

    def _release(self, hold: Hold, now: float) -> None:
        failure = hold.drains.failure(hold.room)
        heard = sorted(hold.drains.heard(hold.room))
        expected = None if failure is None else failure.expected
        drained = expected is not None and len(heard) >= expected
        hold.release()
        if hold.slot_freed:
            self._free_slot(hold.metadata_slot)
        hold.drains.forget(hold.room)
        if drained:
            logger.debug("%s (decode): room %s (request %s): every prefill rank is done; its pages released "
                         "after %.3f s", FLAG, hold.room, hold.rid, now - hold.since)
        else:
            logger.warning(
                "%s (decode): room %s (request %s) failed; its pages and metadata slot were held %.1f s for the "
                "prefill ranks' last writes and are released now, though only ranks %s of %s told they were done "
                "(a prefill rank may be dead or stalled; %s sets the hold).",
                FLAG, hold.room, hold.rid, now - hold.since, heard, "?" if expected is None else expected,
                FAILED_ROOM_HOLD_ENV)
        if self._counter is not None:
            self._counter.labels(how="drained" if drained else "timeout").inc()


def agreed(ready: List[bool], group) -> List[bool]:
    """``ready`` ANDed over every rank of ``group`` (one MIN all-reduce; no collective for one rank)."""
    if group is None:
        return ready
    import torch
    import torch.distributed as dist

    if dist.get_world_size(group=group) == 1:
        return ready
    flags = torch.tensor([int(r) for r in ready], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    return [bool(f) for f in flags.tolist()]


class SlotsHeldBack:
    """The transfer queue's metadata-slot allocator as SGLang's ``pop_transferred`` sees it: a
    slot of a held room is freed with the room's pages (:meth:`FailedRoomHolds.holds_slot`);
    everything else is the allocator's own."""

    def __init__(self, allocator, holds: FailedRoomHolds):
        self._allocator = allocator
        self._holds = holds

    def free(self, slot, *args, **kwargs):
        if self._holds.holds_slot(slot):
            return None
        return self._allocator.free(slot, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._allocator, name)


#: The attribute of a request carrying its :class:`HoldRequest` during ``pop_transferred``.
HOLD_REQUEST_ATTR = "_cp_shared_kv_hold_request"


__all__ = ["FailedRoomHolds", "Hold", "HoldRequest", "HOLD_REQUEST_ATTR", "HOLDS_METRIC", "SlotsHeldBack", "agreed"]
