"""The decode side: keep a shared-KV prefill's failure cause and name it in the failure; keep
its drained notices and what each failed room waits for.

Decode runs stock SGLang; this only acts on the messages of :mod:`.failure_cause` (which only
a shared-KV prefill sends). The causes of one decode manager live on it, per room, bounded,
until ``MooncakeKVReceiver.failure_exception`` of that room reads them. With the flag on
decode (SGLang 0.5.12.post1), :class:`RoomDrains` keeps, also per room and bounded, which
prefill ranks have stopped writing a failed room, for :mod:`..decode.failed_room_holds`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import FrozenSet, Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.settings.config import guards_decode
from sglang_cp_shared_kv.transfer.failure_cause import BoundedRooms, parse_drained_notice, parse_failure_cause

logger = logging.getLogger(__name__)

_DECODE_CAUSES_ATTR = "_cp_shared_kv_failure_causes"
_CAUSES_LOCK = threading.Lock()
_ROOM_DRAINS_ATTR = "_cp_shared_kv_room_drains"


@dataclasses.dataclass(frozen=True)
class FailedRoom:
    """What decode knew of a room when it failed, read before SGLang's ``clear`` drops it."""

    expected: Optional[int]  #: prefill senders SGLang counts for the room (None: not known)
    succeeded: FrozenSet[int]  #: the senders whose Success had arrived (each wrote its last chunk)


class RoomDrains:
    """One decode manager's record of failed rooms: :class:`FailedRoom` per room, the prefill
    ranks whose drained notice arrived (receiver thread; a notice may come before the room fails
    here), and the ranks whose Success the receiver thread saw for a room still tracked (see
    :func:`note_late_success`). Bounded like the causes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._drained = BoundedRooms()  # room -> frozenset of prefill ranks
        self._seen_success = BoundedRooms()  # room -> frozenset of prefill ranks (every room)
        self._failed = BoundedRooms()  # room -> FailedRoom

    def drained(self, room: int, prefill_rank: int) -> None:
        self._add(self._drained, room, prefill_rank)

    def success_seen(self, room: int, prefill_rank: int) -> None:
        """A Success for a room SGLang still tracks: SGLang's own, unless the room fails here
        before SGLang's thread reads it (then SGLang, finding the room cleared, drops it)."""
        self._add(self._seen_success, room, prefill_rank)

    def _add(self, ranks_by_room: BoundedRooms, room: int, prefill_rank: int) -> None:
        with self._lock:
            ranks_by_room.put(room, (ranks_by_room.get(room) or frozenset()) | {prefill_rank})

    def failed(self, room: int, failure: FailedRoom) -> None:
        self._failed.put(room, failure)

    def failure(self, room: int) -> Optional[FailedRoom]:
        return self._failed.get(room)

    def heard(self, room: int) -> FrozenSet[int]:
        """The prefill ranks done with ``room``: Success before it failed, or drained since."""
        failure = self._failed.get(room)
        with self._lock:
            drained = self._drained.get(room) or frozenset()
            seen = self._seen_success.pop(room) if failure is not None else None
            if seen:  # NOTE: kept with the drains from now on: the busier map could drop it mid-hold
                drained |= seen
                self._drained.put(room, drained)
        return drained | (failure.succeeded if failure is not None else frozenset())

    def forget(self, room: int) -> None:
        with self._lock:
            self._drained.pop(room)
            self._seen_success.pop(room)
        self._failed.pop(room)


def room_drains(kv_mgr) -> Optional[RoomDrains]:
    """The decode manager's :class:`RoomDrains` (made on first use) where the plugin holds a
    failed room's pages (the flag on decode, a release whose decode frees them at once);
    None elsewhere."""
    drains = kv_mgr.__dict__.get(_ROOM_DRAINS_ATTR)
    if drains is not None:
        return drains
    if installed.INSTALLED.deferred_decode_release or not guards_decode(getattr(kv_mgr, "server_args", None)):
        return None
    with _CAUSES_LOCK:
        return kv_mgr.__dict__.setdefault(_ROOM_DRAINS_ATTR, RoomDrains())


def note_late_success(kv_mgr, msg) -> None:
    """Every message decode's receiver thread takes (before SGLang reads it): a prefill rank's
    Success status for a room decode already gave up counts as that rank being done with it.

    NOTE: SGLang ignores a status for a room it cleared, and a rank that sent all of a room
    before its group agreed on Failed (or whose decode failed the room alone: an abort on
    decode, its waiting timeout) sends no drained notice, only that Success. For a room SGLang
    no longer tracks, or that failed here, it counts as that rank's drain. For a room still
    tracked it is SGLang's own, and the failed room's snapshot reads it there, unless the room
    fails between this check and SGLang's reading it (SGLang then drops it as a status for a
    cleared room): so it is also kept aside (``success_seen``, bounded) and counted once the
    room has failed, instead of that hold running to its bound."""
    # (SGLang's status message: room, the KVPoll value and the sender id, each in ascii)
    if len(msg) != 3 or msg[1] != str(int(sg.KVPoll.Success)).encode("ascii"):
        return
    drains = kv_mgr.__dict__.get(_ROOM_DRAINS_ATTR)
    if drains is None:
        return
    try:
        room, prefill_rank = int(msg[0].decode("ascii")), int(msg[2].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return
    if room not in kv_mgr.request_status or drains.failure(room) is not None:
        drains.drained(room, prefill_rank)
    else:
        drains.success_seen(room, prefill_rank)


class StatusObserver:
    """Decode's receiving socket as its receiver thread sees it: each message goes to
    ``observe`` first (never raising into SGLang's thread); everything else is the socket's."""

    def __init__(self, sock, observe):
        self._sock = sock
        self._observe = observe

    def recv_multipart(self, *args, **kwargs):
        msg = self._sock.recv_multipart(*args, **kwargs)
        try:
            self._observe(msg)
        except Exception:  # NOTE: SGLang's receiver thread would die with it
            logger.exception("CP shared KV transfer: could not read a status message")
        return msg

    def __getattr__(self, name):
        return getattr(self._sock, name)


def keep_drained_notice(kv_mgr, msg) -> bool:
    """Whether ``msg`` (an ``AUX_DATA`` message) is a drained notice, which is then kept for
    its room where the plugin holds failed rooms (:func:`room_drains`). False: not one."""
    parsed = parse_drained_notice(msg)
    if parsed is None:
        return False
    drains = room_drains(kv_mgr)
    if drains is not None:
        room, prefill_rank = parsed
        drains.drained(room, prefill_rank)
        logger.debug("CP shared KV transfer: room %s: prefill rank %s drained", room, prefill_rank)
    return True


def note_failed_room(receiver) -> None:
    """Before SGLang's ``failure_exception`` clears ``receiver``'s room: what the room waits
    for (:class:`FailedRoom`), where the plugin holds failed rooms."""
    kv_mgr = receiver.kv_mgr
    drains = room_drains(kv_mgr)
    room = getattr(receiver, "bootstrap_room", None)
    if drains is None or room is None:
        return
    expected = kv_mgr.required_prefill_response_num_table.get(room)
    succeeded = frozenset(kv_mgr.prefill_response_tracker.get(room, ()))
    drains.failed(room, FailedRoom(expected=None if expected is None else int(expected), succeeded=succeeded))


def keep_failure_cause(kv_mgr, msg) -> bool:
    """Whether ``msg`` (an ``AUX_DATA`` message) is a failure cause, which is then kept for
    its room unless the room is already concluded and cleared (nobody would read it).
    False: the message is SGLang's."""
    parsed = parse_failure_cause(msg)
    if parsed is None:
        return False
    room, text = parsed
    if room not in kv_mgr.request_status:
        return True
    causes = kv_mgr.__dict__.get(_DECODE_CAUSES_ATTR)
    if causes is None:
        with _CAUSES_LOCK:
            causes = kv_mgr.__dict__.setdefault(_DECODE_CAUSES_ATTR, BoundedRooms())
    causes.put(room, text, append=True)  # one cause per failing prefill rank
    logger.debug("CP shared KV transfer: failure cause for room %s: %s", room, text)
    return True


def with_cause(kv_mgr, exc):
    """SGLang's ``KVTransferError`` ``exc`` with the prefill's cause for its room appended
    (the cause is consumed); None when there is none."""
    causes = kv_mgr.__dict__.get(_DECODE_CAUSES_ATTR)
    cause: Optional[str] = causes.pop(exc.bootstrap_room) if causes is not None else None
    if not cause:
        return None
    return sg.KVTransferError(exc.bootstrap_room, f"{exc.failure_reason}; cause: {cause}")


__all__ = ["FailedRoom", "RoomDrains", "StatusObserver", "keep_drained_notice", "keep_failure_cause", "note_failed_room",
           "note_late_success", "room_drains", "with_cause"]
