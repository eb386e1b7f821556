"""The decode side: keep a shared-KV prefill's failure cause and name it in the failure.

Decode runs stock SGLang; this only acts on the cause message of :mod:`.failure_cause`
(which only a shared-KV prefill sends). The causes of one decode manager live on it, per
room, bounded, until ``MooncakeKVReceiver.failure_exception`` of that room reads them.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.transfer.failure_cause import BoundedRooms, parse_failure_cause

logger = logging.getLogger(__name__)

_DECODE_CAUSES_ATTR = "_cp_shared_kv_failure_causes"
_CAUSES_LOCK = threading.Lock()


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


__all__ = ["keep_failure_cause", "with_cause"]
