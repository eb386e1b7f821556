"""How a shared-KV prefill tells decode why a request failed (pure: no SGLang).

SGLang's status message to decode has exactly three frames and decode's failure text is
fixed, so the cause travels as one extra message on the same ZMQ socket, sent just before
the Failed status: an ``AUX_DATA`` message whose length field (``0xFFFFFFFF``) can never
match its payload. A decode with this plugin keeps the text for the room; a decode
without it logs SGLang's "AUX_DATA length mismatch" and drops the message without
touching a buffer.

Frames: ``[AUX_DATA header, room (ascii), b"0", b"0", 0xFFFFFFFF, prefix + UTF-8 text]``.

The drained notice (:mod:`.room_drain`: a prefill rank will write nothing more for a failed
room) travels the same way, with its own prefix and the sender id decode counts ranks by.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, List, Optional, Sequence, Tuple

CAUSE_LENGTH_FIELD = b"\xff\xff\xff\xff"
CAUSE_PREFIX = b"sglang-cp-shared-kv failure cause:"
DRAINED_PREFIX = b"sglang-cp-shared-kv drained:"
MAX_CAUSE_BYTES = 4000
MAX_TRACKED_ROOMS = 4096


def _encode(aux_data_header: bytes, room: int, payload: bytes) -> List[bytes]:
    """An ``AUX_DATA`` message of the plugin's for ``room`` (module docstring: its frames)."""
    return [aux_data_header, str(room).encode("ascii"), b"0", b"0", CAUSE_LENGTH_FIELD, payload]


def _parse(msg: Sequence[bytes], prefix: bytes) -> Optional[Tuple[int, bytes]]:
    """``(room, payload after prefix)`` of a plugin message starting with ``prefix``; None otherwise."""
    if len(msg) != 6 or msg[4] != CAUSE_LENGTH_FIELD or not msg[5].startswith(prefix):
        return None
    try:
        return int(msg[1].decode("ascii")), msg[5][len(prefix):]
    except (UnicodeDecodeError, ValueError):
        return None


def encode_failure_cause(aux_data_header: bytes, room: int, text: str) -> List[bytes]:
    """The frames of the cause message for ``room`` (text cut to ``MAX_CAUSE_BYTES``)."""
    return _encode(aux_data_header, room, CAUSE_PREFIX + text.encode("utf-8", "replace")[:MAX_CAUSE_BYTES])


def encode_failed_status(room: int, prefill_rank: int) -> List[bytes]:
    """SGLang's status message to decode saying ``room`` failed on ``prefill_rank`` (the
    three frames of ``MooncakeKVManager.sync_status_to_decode_endpoint``: room, KVPoll
    value, sender id; ``KVPoll.Failed`` is 0). Decode fails the room on the first one."""
    return [str(room).encode("ascii"), b"0", str(prefill_rank).encode("ascii")]


def parse_failure_cause(msg: Sequence[bytes]) -> Optional[Tuple[int, str]]:
    """``(room, text)`` of a cause message; None for any other ``AUX_DATA`` message."""
    parsed = _parse(msg, CAUSE_PREFIX)
    return None if parsed is None else (parsed[0], parsed[1].decode("utf-8", "replace"))


def encode_drained_notice(aux_data_header: bytes, room: int, prefill_rank: int) -> List[bytes]:
    """The frames telling decode that ``prefill_rank`` (SGLang's sender id, the one its
    status message carries) has written or skipped every chunk of the failed ``room``."""
    return _encode(aux_data_header, room, DRAINED_PREFIX + str(prefill_rank).encode("ascii"))


def parse_drained_notice(msg: Sequence[bytes]) -> Optional[Tuple[int, int]]:
    """``(room, prefill_rank)`` of a drained notice; None for any other message."""
    parsed = _parse(msg, DRAINED_PREFIX)
    if parsed is None:
        return None
    try:
        return parsed[0], int(parsed[1].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


class BoundedRooms:
    """room -> text (or whatever its user keeps per room), forgetting the oldest beyond a
    bound (rooms are random 64-bit ids)."""

    def __init__(self, bound: int = MAX_TRACKED_ROOMS):
        self._bound = bound
        self._items: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, room: int, text: Any, *, append: bool = False) -> None:
        """``append``: join ``text`` to the room's earlier text with " | " (texts only)."""
        with self._lock:
            previous = self._items.get(room) if append else None
            self._items[room] = text if previous is None else f"{previous} | {text}"
            self._items.move_to_end(room)
            while len(self._items) > self._bound:
                self._items.popitem(last=False)

    def get(self, room: int) -> Optional[Any]:
        with self._lock:
            return self._items.get(room)

    def pop(self, room: int) -> Optional[Any]:
        with self._lock:
            return self._items.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


__all__ = ["CAUSE_LENGTH_FIELD", "CAUSE_PREFIX", "DRAINED_PREFIX", "MAX_CAUSE_BYTES", "MAX_TRACKED_ROOMS",
           "encode_failure_cause", "encode_failed_status", "encode_drained_notice", "parse_failure_cause",
           "parse_drained_notice", "BoundedRooms"]
