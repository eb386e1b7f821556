"""When a prefill CP rank has stopped writing a failed room: a drain marker behind its chunks.

A decode server frees a failed room's pages and metadata slot for the next request, so every
prefill rank must have stopped writing there first; a rank's own status says nothing about the
chunks the other ranks still hold (design.md, "A failed room's pages on decode"). So a rank
that gives a room up as failed (SGLang's ``failure_exception`` once the group agreed on Failed,
which then clears it; an abort)
puts one :class:`DrainMarker` on every transfer queue of its manager. SGLang's transfer worker
takes one item at a time and writes (or skips) a chunk before it takes the next, and a cleared
or failed room gets no new chunk, so a marker taken from a queue means no chunk of the room is
left on that queue; once it was taken from every queue, the rank sends each decode target of
the room a drained notice (:func:`.failure_cause.encode_drained_notice`), from the worker
thread that took it last. A worker meets the markers through :class:`DrainingQueue`, which
wraps its queue for the worker's lifetime and hands SGLang's loop only chunks.

SGLang 0.5.12.post1 only (0.5.23 drains a failed room itself: decode's ABORT, each prefill
rank's acknowledgement once its outstanding chunks are done).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)


class DrainMarker:
    """One failed ``room`` of one prefill rank, put on each of ``queues`` transfer queues:
    ``on_drained()`` runs once, on the thread that takes it from the last queue."""

    def __init__(self, room: int, queues: int, on_drained: Callable[[], None]):
        self.room = room
        self._left = queues
        self._lock = threading.Lock()
        self._on_drained = on_drained

    def taken(self) -> None:
        """A worker took this marker from its queue: every chunk put there before it is done."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._on_drained()


class DrainingQueue:
    """A transfer worker's queue as the worker sees it: ``get`` runs each :class:`DrainMarker`
    it meets (:meth:`DrainMarker.taken`) and returns the next chunk; everything else is the
    queue's own."""

    def __init__(self, queue):
        self._queue = queue

    def get(self, *args, **kwargs):
        while True:
            item = self._queue.get(*args, **kwargs)
            if not isinstance(item, DrainMarker):
                return item
            try:
                item.taken()
            except Exception:  # NOTE: never the worker's death: SGLang's loop would end with it
                logger.exception("CP shared KV transfer: the drained notice of room %s failed", item.room)

    def __getattr__(self, name):
        return getattr(self._queue, name)


def put_drain_markers(queues: Sequence, room: int, on_drained: Callable[[], None]) -> Optional[DrainMarker]:
    """One marker for ``room`` behind whatever each of ``queues`` holds now (no queue: nothing
    can be pending, ``on_drained`` runs now)."""
    if not queues:
        on_drained()
        return None
    marker = DrainMarker(room, len(queues), on_drained)
    for queue in queues:
        queue.put(marker)
    return marker


def decode_endpoints(targets) -> Tuple[Tuple[str, int], ...]:
    """The ``(host, status port)`` of each real (not dummy) decode target, once each."""
    return tuple(dict.fromkeys((info.endpoint, info.dst_port) for info in targets if not info.is_dummy))


__all__ = ["DrainMarker", "DrainingQueue", "decode_endpoints", "put_drain_markers"]
