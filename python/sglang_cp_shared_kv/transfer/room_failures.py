"""How one prefill CP rank tells decode that a room failed: the abort path (a room the
prefill ends before its last chunk went out) and the cause ahead of SGLang's own Failed
status. :class:`RoomFailureNotices` is a base of :class:`.prefill.PrefillShardTransfer`
(beside :class:`.chunk_admission.ChunkAdmission` and :class:`.shard_writes.ShardWrites`)
and uses its state; the messages themselves are :mod:`.rooms`' and :mod:`.failure_cause`'s.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, Optional, Tuple

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.transfer.failure_cause import (
    BoundedRooms,
    encode_drained_notice,
    encode_failed_status,
    encode_failure_cause,
)
from sglang_cp_shared_kv.transfer.room_drain import decode_endpoints, put_drain_markers
from sglang_cp_shared_kv.transfer.rooms import (
    AbortNotices,
    WriteFailureHandOff,
    mark_failed,
    prefill_unique_rank,
    registration_complete,
    room_targets,
    send_failure_cause,
    send_status_frames,
)
from sglang_cp_shared_kv.transfer.stats import RankCounters, TransferStats

logger = logging.getLogger(__name__)


class RoomFailureNotices:
    """The failure notices of one prefill manager's shard transfer: a base of
    :class:`.prefill.PrefillShardTransfer`, whose state below it reads."""

    who: str
    stats: TransferStats
    counters: RankCounters
    write_failures: WriteFailureHandOff
    _rejected: BoundedRooms  # room -> why this rank failed it
    _abort_notices: AbortNotices
    _aborted_unregistered: BoundedRooms  # room -> (cause, session ids told)
    _refused_unregistered: BoundedRooms  # room -> (cause, session ids told) (:meth:`fail_refused_room`)
    _drained_rooms: BoundedRooms  # room -> True: drain markers out (:meth:`drain_failed_room`)
    _room_endpoints: BoundedRooms  # room -> its decode endpoints (:meth:`remember_decode_endpoints`)
    _registration_lock: threading.Lock

    def fail_unsent_room(self, kv_mgr, room, why: str, *, record: bool = True) -> bool:
        """The prefill ends ``room`` before its last chunk went out (an abort): tell decode now
        instead of after its waiting timeout -- the cause, then SGLang's Failed status, to
        every decode target of the room. Any chunk of the room still to come is dropped and
        its aux write withheld. Targets that have not registered the room with this rank
        yet are told when they have (:meth:`tell_late_registration`). ``record``: keep the
        cause for the prefill's own ``failure_exception`` (False where SGLang never reads
        it, which would leave it in ``failure_records`` for good). False when the room has
        concluded or was already failed (nothing to tell).

        NOTE: sent from the caller's thread (SGLang's scheduler, which aborts), on sockets
        only this path uses: SGLang clears the room's ``transfer_infos`` right after an
        abort (``failure_exception`` -> ``clear``), so a chunk handed to its transfer
        worker could find no target left; and its cached status sockets belong to the
        worker threads."""
        status = kv_mgr.request_status.get(room)
        if status in (None, sg.KVPoll.Success, sg.KVPoll.Failed) or self._rejected.get(room):
            return False
        message = f"{self.who}: room {room} ends unsent: {why}"
        self._rejected.put(room, message)
        if record:
            kv_mgr.record_failure(room, message)
        self.stats.add(aborted_requests=1)
        self.counters.count("failures", "aborted")
        with self._registration_lock:
            targets = room_targets(kv_mgr, room)
            mark_failed(targets, message)
            told = self._tell_decode(kv_mgr, room, message, targets)
            complete = registration_complete(targets)
            if not complete:
                self._aborted_unregistered.put(room, (message, told))
        self.drain_failed_room(kv_mgr, room, targets)
        if not complete:
            logger.info("CP shared KV transfer: %s; %d decode target(s) told, the rest when they register",
                        message, len(told))
        return True

    def fail_refused_room(self, kv_mgr, room, why: str) -> None:
        """The prefill refused ``room``'s request at intake and made no sender for it (SGLang
        0.5.23's ``PrefillBootstrapQueue.add``: ``is_unadmitted_reject`` or the capacity check),
        so nothing of SGLang's will ever tell decode, which fails the room only at its waiting
        timeout: tell every decode target now, the cause (``why``: SGLang's own refusal message)
        and SGLang's Failed status; targets that have not registered the room with this rank yet
        are told when they have (:meth:`tell_late_registration`, the last 4,096 refused rooms
        remembered). Once every target was told, this rank forgets SGLang's entries for the
        room (its status, decode targets and prefix length), which no sender will ever clear.

        Every CP rank makes the same refusal (the scheduler's intake runs on each rank over the
        same broadcast request list and the same capacity): each tells decode for itself, no
        collective, no raise. NOTE: called on the scheduler thread; SGLang's bootstrap thread
        registers decode targets meanwhile, hence the registration lock (as for an abort)."""
        message = f"{self.who}: room {room} ends unsent: the prefill refused the request at intake: {why}"
        self.stats.add(refused_requests=1)
        self.counters.count("failures", "refused")
        with self._registration_lock:
            targets = room_targets(kv_mgr, room)
            told = self._tell_decode(kv_mgr, room, message, targets)
            # WaitingForInput: SGLang's bootstrap thread is done registering the room's targets
            # (or Failed: decode gave the room up since, its ABORT handled)
            done = (registration_complete(targets)
                    and kv_mgr.request_status.get(room) in (sg.KVPoll.WaitingForInput, sg.KVPoll.Failed))
            if not done:
                self._refused_unregistered.put(room, (message, told))
        if done:
            forget_unsent_room(kv_mgr, room)
        else:
            logger.info("CP shared KV transfer: %s; %d decode target(s) told, the rest when they register",
                        message, len(told))

    def drain_failed_room(self, kv_mgr, room, targets) -> None:
        """This rank gave ``room`` up as failed (an abort, or SGLang's ``failure_exception`` once
        the group agreed on Failed), and ``targets`` (its ``TransferInfo``) are the decode ranks it may
        have written to: tell each once every chunk of the room this rank enqueued was written
        or skipped (:mod:`.room_drain`), so decode can free the room's pages. Once per room.
        Not on a release whose decode drains the room itself (0.5.23: ABORT and its
        acknowledgement), where no worker would know the marker."""
        if installed.INSTALLED.deferred_decode_release or self._drained_rooms.get(room):
            return
        endpoints = decode_endpoints(targets) or self._room_endpoints.pop(room) or ()
        if not endpoints:
            return
        self._drained_rooms.put(room, True)
        frames = encode_drained_notice(kv_mgr.AUX_DATA_HEADER, room, prefill_unique_rank(kv_mgr))

        def tell_decode_drained() -> None:  # (on the transfer worker that took the last marker)
            for remote, dst_port in endpoints:
                send_status_frames(kv_mgr, remote, dst_port, frames, f"the drained notice of room {room}")
            logger.debug("CP shared KV transfer: %s: room %s drained; %d decode target(s) told",
                         self.who, room, len(endpoints))

        put_drain_markers(kv_mgr.transfer_queues, room, tell_decode_drained)

    def remember_decode_endpoints(self, kv_mgr, room) -> None:
        """Keep ``room``'s decode endpoints for its drain (bounded; the first chunk's): SGLang's
        transfer worker drops a room's targets once this rank has sent all of it, and the
        group may agree on Failed after that (another rank failed), when this rank's Success
        may have reached a decode that had already given the room up, and been ignored."""
        if not installed.INSTALLED.deferred_decode_release and self._room_endpoints.get(room) is None:
            self._room_endpoints.put(room, decode_endpoints(room_targets(kv_mgr, room)))

    def tell_late_registration(self, kv_mgr, room, status) -> None:
        """After SGLang's bootstrap thread set ``room`` WaitingForInput (every decode target
        registered it with this rank): the targets of a room aborted or refused before that,
        not told yet, are failed now instead of waiting for their timeout.

        NOTE: the lock is taken for every room that completes its registration, never skipped
        on an empty map read outside it: the scheduler thread may hold the lock mid-way through
        an abort or a refusal, its snapshot of the targets taken before this thread added the
        last one, and its entry put only just before it lets go; this thread then waits for
        that entry instead of missing it (that target would learn of the room only at its
        waiting timeout). Once per room, uncontended but for that case."""
        if status != sg.KVPoll.WaitingForInput:
            return
        with self._registration_lock:
            pending = self._aborted_unregistered.pop(room)
            refused = self._refused_unregistered.pop(room)
        if refused is not None:
            message, told = refused
            self._tell_decode(kv_mgr, room, message, _untold(room_targets(kv_mgr, room), told))
            # (on SGLang's bootstrap thread, which has just registered the room's last target)
            forget_unsent_room(kv_mgr, room)
        if pending is not None:
            message, told = pending
            targets = room_targets(kv_mgr, room)
            mark_failed(targets, message)
            # (registered after the abort, so never written to: drained already)
            self._tell_decode(kv_mgr, room, message, _untold(targets, told),
                              drained=not installed.INSTALLED.deferred_decode_release)

    def _tell_decode(self, kv_mgr, room, message: str, targets, *, drained: bool = False) -> frozenset:
        """The cause and SGLang's Failed status to each of ``targets`` (dummies skipped), and
        with ``drained`` the drained notice; the session ids told."""
        targets = [info for info in targets if not info.is_dummy]
        if not targets:
            return frozenset()
        rank = prefill_unique_rank(kv_mgr)
        messages = [encode_failure_cause(kv_mgr.AUX_DATA_HEADER, room, message), encode_failed_status(room, rank)]
        if drained:
            messages.append(encode_drained_notice(kv_mgr.AUX_DATA_HEADER, room, rank))
        for info in targets:
            self._abort_notices.send(info.endpoint, info.dst_port, messages)
        logger.info("CP shared KV transfer: %s; decode told it failed (%d target(s))", message, len(targets))
        return frozenset(info.mooncake_session_id for info in targets)

    def report_failure(self, kv_mgr, room, targets: Iterable[Tuple[str, int]],
                       reason: Optional[str] = None) -> Optional[str]:
        """Just before SGLang sends ``targets`` (decode ``(host, port)`` pairs) its Failed status
        for ``room``: send each the cause first (same socket, so decode reads it first).

        ``reason``: the failure reason SGLang is about to record itself (0.5.23's
        ``conclude_transfer``); None where it recorded it before (0.5.12.post1). Returns
        ``reason`` with the cause of a failed Mooncake write on this thread appended, for
        SGLang to record."""
        cause = self.write_failures.take()  # set when SGLang's own KV-chunk path failed
        with kv_mgr.failure_lock:
            recorded = kv_mgr.failure_records.get(room)
            # Once the scheduler cleared the room it has read the record; do not recreate it.
            if cause and recorded is not None and room in kv_mgr.request_status:
                recorded = f"{recorded}: {cause}"
                kv_mgr.failure_records[room] = recorded
        if cause:
            self.counters.count("failures", "kv")
            if reason is not None:
                reason = f"{reason}: {cause}"
        text = recorded or reason or self._rejected.get(room) or cause or "the transfer failed (no cause recorded)"
        if not text.startswith(self.who):
            text = f"{self.who}: {text}"
        for remote, dst_port in targets:
            send_failure_cause(kv_mgr, remote, dst_port, room, text)
        return reason


def _untold(targets, told) -> tuple:
    """The ``TransferInfo`` of ``targets`` whose session is not among ``told``."""
    return tuple(info for info in targets if info.mooncake_session_id not in told)


def forget_unsent_room(kv_mgr, room) -> None:
    """Drop SGLang's prefill entries for ``room``, which has no sender to clear them (a room
    refused at intake, every decode target told): what ``CommonKVSender.clear`` drops of a
    room. A later ABORT from decode finds the room unknown and is acknowledged as SGLang
    acknowledges any room it has no write in flight for."""
    kv_mgr.request_status.pop(room, None)
    kv_mgr.transfer_infos.pop(room, None)
    getattr(kv_mgr, "req_to_decode_prefix_len", {}).pop(room, None)


__all__ = ["RoomFailureNotices", "forget_unsent_room"]
