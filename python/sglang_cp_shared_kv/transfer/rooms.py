"""A room's decode targets, and how a prefill rank tells them the room failed: the parts
of the shard transfer that deal with failures rather than pages.

* :func:`room_targets`, :func:`registration_complete`, :func:`mark_failed` -- the
  ``TransferInfo`` of each decode target SGLang keeps per room, read safely against its
  bootstrap thread, and the mark that withholds a failed room's aux write;
* :class:`WriteFailureHandOff` -- the cause of a failed Mooncake write, from the hook that
  sees it to the one that reports it (one thread);
* :class:`AbortNotices` and :func:`send_failure_cause` -- the cause message
  (:mod:`.failure_cause`) on its way to decode's status endpoint;
* :func:`prefill_unique_rank` -- the sender id decode counts responses by.

:class:`.prefill.PrefillShardTransfer` holds one of each per CP rank; its chunk admission,
writes and failure notices decide when.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional

import zmq

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.transfer.failure_cause import encode_failure_cause

logger = logging.getLogger(__name__)

#: Set (to the reason) on SGLang's ``TransferInfo`` (one room, one decode session) once the
#: room failed on this rank: rejected before enqueueing, aborted, or its NSA index write
#: failed. ``transfer_worker`` passes that same object to ``maybe_send_extra`` and, right
#: after, to ``send_aux`` (SGLang 0.5.12.post1, mooncake/conn.py 1230, 1345, 1353), whose hook
#: withholds the aux write for it. NOTE: the mark, not the bounded room map, is what guards
#: the aux write: it lives exactly as long as SGLang holds the room's ``transfer_infos``, so
#: no burst of other failures can make it forgotten (and a rank report Success).
FAILED_ATTR = "_cp_shared_kv_failed"


def room_targets(kv_mgr, room) -> tuple:
    """The ``TransferInfo`` of each decode target ``room`` has registered with this rank.

    NOTE: SGLang's bootstrap thread adds to ``transfer_infos[room]`` while decode registers;
    ``tuple(dict.values())`` copies it in one C call under the GIL, where iterating it in
    Python on the scheduler thread could raise "dictionary changed size during iteration"."""
    return tuple(kv_mgr.transfer_infos.get(room, {}).values())


def registration_complete(targets: tuple) -> bool:
    """Whether every decode target of the room has registered (SGLang sets the room
    WaitingForInput at that moment, mooncake/conn.py 1445-1454)."""
    return bool(targets) and len(targets) >= targets[0].required_dst_info_num


def mark_failed(targets, reason: str) -> None:
    for info in targets:
        setattr(info, FAILED_ATTR, reason)


class WriteFailureHandOff(threading.local):
    """The cause of the last failed Mooncake write on this thread, until one reader takes it.

    The transfer's one thread-local hand-off, and why it is needed: SGLang calls
    ``_transfer_data(mooncake_session_id, transfer_blocks)`` (mooncake/conn.py 572) without
    the room, so the hook that sees a batch fail cannot file the cause under a room. Its
    reader knows the room and runs on the same thread right after, because SGLang's
    ``transfer_worker`` (conn.py 1197-1396; one thread per transfer queue, 230-245) takes
    one ``TransferKVChunk`` -- one room -- from its queue at a time (1207) and makes every
    write of it, and what follows a failed one, on that thread (loop over the room's
    ``TransferInfo``, 1230):

    * a KV chunk: ``send_kvcache`` (1282) -> ``_send_kvcache_generic`` ->
      ``process_layers`` -> ``_transfer_data`` (687, 661-665); on failure (1319)
      ``record_failure`` and ``sync_status_to_decode_endpoint(Failed)`` (1328-1340), whose
      hook takes the cause (:meth:`.room_failures.RoomFailureNotices.report_failure`);
    * the NSA index: ``maybe_send_extra`` (1345) -> ``_send_kvcache_generic`` ->
      ``_transfer_data``; the ``maybe_send_extra`` hook takes it as that returns;
    * aux: ``send_aux`` (1353) -> ``_transfer_data`` (896); its hook takes it as it returns.

    ``sync_status_to_decode_endpoint`` has no other caller (1240, 1334, 1368, all in
    ``transfer_worker``). Exception: with ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL`` SGLang writes
    the layers from executor threads (667-676); such a cause stays on that thread and is
    only logged (docs/transfer.md, "Known limits"). Line numbers are 0.5.12.post1's; on 0.5.23
    the reporter is ``conclude_transfer`` (via ``conclude_failure``), whose Mooncake callers
    all run in ``transfer_worker`` too (mooncake/conn.py 1078, 2597, 2750, 2786, 2812).
    """

    def __init__(self) -> None:
        self.cause: Optional[str] = None

    def put(self, cause: str) -> None:
        self.cause = cause

    def take(self) -> Optional[str]:
        """The cause, if a write on this thread failed since the last ``take``."""
        cause, self.cause = self.cause, None
        return cause


def concludes_failed(kv_mgr, room, status) -> bool:
    """Whether SGLang's ``conclude_transfer`` (0.5.23) sends decode Failed for ``room`` when asked
    to conclude it with ``status``: Failed, or Success over the room's failure record or a room
    already marked Failed (it turns those into Failed itself)."""
    if status == sg.KVPoll.Failed:
        return True
    return status == sg.KVPoll.Success and (
        failure_recorded(kv_mgr, room) or kv_mgr.request_status.get(room) == sg.KVPoll.Failed)


def failure_recorded(kv_mgr, room) -> bool:
    """Whether ``room`` has a failure record on this rank (``record_failure``)."""
    with kv_mgr.failure_lock:
        return room in kv_mgr.failure_records


def prefill_unique_rank(kv_mgr) -> int:
    """The sender id decode counts responses by (SGLang 0.5.12.post1, mooncake/conn.py
    ``transfer_worker``: one per attention-TP x PP x CP rank)."""
    return (kv_mgr.attn_tp_rank * (kv_mgr.pp_size * kv_mgr.attn_cp_size)
            + kv_mgr.pp_rank * kv_mgr.attn_cp_size + kv_mgr.attn_cp_rank)


class AbortNotices:
    """PUSH sockets to decode status endpoints, for the abort path only (see
    :meth:`.room_failures.RoomFailureNotices.fail_unsent_room`): one per endpoint, kept, behind one lock;
    a message to an unreachable decode waits in ZMQ's queue and never blocks the caller."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sockets: Dict[str, Any] = {}

    def send(self, remote: str, dst_port: int, messages: List[List[bytes]]) -> None:
        address = sg.NetworkAddress(remote, dst_port)
        endpoint = address.to_tcp()
        try:
            with self._lock:
                sock = self._sockets.get(endpoint)
                if sock is None:
                    sock = zmq.Context.instance().socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    if address.is_ipv6:
                        sock.setsockopt(zmq.IPV6, 1)
                    sock.connect(endpoint)
                    self._sockets[endpoint] = sock
                for frames in messages:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except Exception as exc:  # decode then fails the room at its waiting timeout, as without us
            logger.warning("CP shared KV transfer: could not tell decode %s that a room was aborted: %s",
                           endpoint, exc)


def send_failure_cause(kv_mgr, remote, dst_port, room, text: str) -> None:
    """The cause message (:mod:`.failure_cause`) to decode's status endpoint."""
    # the Failed status still goes out if this fails; only the detail is lost
    send_status_frames(kv_mgr, remote, dst_port, encode_failure_cause(kv_mgr.AUX_DATA_HEADER, room, text),
                       f"the failure cause of room {room}")


def send_status_frames(kv_mgr, remote, dst_port, frames: List[bytes], what: str) -> bool:
    """``frames`` to decode's status endpoint on the caller's thread, on the same cached socket
    as SGLang's status message and the way SGLang sends on it; False (and a WARNING naming
    ``what``) when the send raised."""
    address = sg.NetworkAddress(remote, dst_port)
    endpoint = address.to_tcp()
    try:
        if installed.INSTALLED.status_sends_locked:
            kv_mgr._send_multipart_locked(endpoint, frames, is_ipv6=address.is_ipv6)
        else:
            kv_mgr._connect(endpoint, is_ipv6=address.is_ipv6).send_multipart(frames)
    except Exception as exc:
        logger.warning("CP shared KV transfer: could not send %s to %s:%s: %s", what, remote, dst_port, exc)
        return False
    return True


__all__ = ["FAILED_ATTR", "room_targets", "registration_complete", "mark_failed", "WriteFailureHandOff",
           "prefill_unique_rank", "AbortNotices", "send_failure_cause", "send_status_frames", "concludes_failed", "failure_recorded"]
