"""The Mooncake writes of one prefill CP rank: what SGLang's transfer worker writes for an
admitted chunk (:mod:`.chunk_admission`), done the shard transfer's way.

* every write (KV, NSA index state, aux: ``_transfer_data``) in batches of at most
  ``max_descriptors_per_batch`` descriptors: all layers of a chunk in one batch can exceed
  what Mooncake's TCP lane admits (:func:`.pages.bounded_batches`);
* the NSA index state (``maybe_send_extra``, last chunk): the entries admission made this
  rank's :class:`.pages.OwnedStatePages`, to decode's pages by sequence position;
* aux (``send_aux``): withheld for a room that already failed on this rank (rejected, or its
  index write failed), which SGLang turns into Failed on both sides.

A failed write is logged, counted and recorded for both sides' failure messages. The
cause of a failed batch waits in :class:`.rooms.WriteFailureHandOff` (``_transfer_data``
does not know its room) for the hook that does: the index and aux writes here, the KV
chunk's status report in :mod:`.room_failures`.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.observability.nvtx import marked
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.transfer.failure_cause import BoundedRooms
from sglang_cp_shared_kv.transfer.pages import (
    OwnedStatePages,
    bounded_batches,
    contiguous_runs,
    rejected_batch_cause,
    state_pages_to_send,
)
from sglang_cp_shared_kv.transfer.rooms import FAILED_ATTR, WriteFailureHandOff, failure_recorded, mark_failed
from sglang_cp_shared_kv.transfer.startup import RegisteredBuffers
from sglang_cp_shared_kv.transfer.stats import RankCounters, TransferStats

logger = logging.getLogger(__name__)


class ShardWrites:
    """The Mooncake writes of one prefill manager's shard transfer: a base of
    :class:`.prefill.PrefillShardTransfer`, whose state below it reads."""

    layout: CpSharedKVLayout
    buffers: RegisteredBuffers
    max_descriptors_per_batch: int
    stats: TransferStats
    counters: RankCounters
    write_failures: WriteFailureHandOff
    who: str
    _rejected: BoundedRooms  # room -> why this rank failed it (no aux write for it)

    def write(self, original, kv_mgr, mooncake_session_id, transfer_blocks):
        """``_transfer_data`` in batches of at most ``max_descriptors_per_batch``."""
        limit = self.max_descriptors_per_batch
        batches = bounded_batches(transfer_blocks, limit)
        for number, batch in enumerate(batches, 1):
            with marked("pd:batch"):
                ret = original(kv_mgr, mooncake_session_id, batch)
            if ret != 0:
                cause = rejected_batch_cause(ret, number, len(batches), batch, mooncake_session_id, limit)
                self.write_failures.put(cause)
                self.stats.add(failed_writes=1)
                logger.error("CP shared KV transfer (%s): %s", self.who, cause)
                return ret
            if batch:
                self.stats.add(write_batches=1, write_descriptors=len(batch),
                               write_bytes=sum(length for _, _, length in batch))
        return 0

    def send_state(self, original, kv_mgr, req, prefill_state_indices, executor,
                   target_rank_registration_info=None):
        """``maybe_send_extra`` with each NSA entry as this rank's pages and their
        destinations by sequence position; a failure is recorded and fails the request."""
        src_lists = list(prefill_state_indices)
        dst_lists = list(req.dst_state_indices)
        owned_pages = descriptors = 0
        for i, entry in enumerate(src_lists):
            if not isinstance(entry, OwnedStatePages):
                continue
            src, dst, decode_pages = state_pages_to_send(entry, dst_lists[i] if i < len(dst_lists) else None)
            if src.size < len(entry):
                # SGLang truncates a longer prefill list to decode's the same way.
                logger.warning("CP shared KV transfer: room %s: decode sent %d NSA index pages for a "
                               "%d-page sequence; positions beyond it are not sent",
                               req.room, decode_pages, entry.sequence_pages)
            while len(dst_lists) <= i:
                dst_lists.append([])
            src_lists[i], dst_lists[i] = src, dst
            owned_pages += src.size
            descriptors += (contiguous_runs(src.astype(np.int64), dst.astype(np.int64))
                            * self.buffers.state_layers.get(i, 0))
        self.stats.add(state_pages=owned_pages, state_descriptors=descriptors)
        self.counters.count("pages", "state", owned_pages)
        self.counters.count("descriptors", "state", descriptors)
        logger.debug("CP shared KV transfer: room=%s cp_rank=%d/%d state_pages=%d descriptors=%d",
                     req.room, self.layout.cp_rank, self.layout.cp_size, owned_pages, descriptors)
        rc = original(kv_mgr, dataclasses.replace(req, dst_state_indices=dst_lists), src_lists, executor,
                      target_rank_registration_info)
        if rc != 0:
            self._record_write_failure(
                kv_mgr, req.room, "state", rc,
                f"the NSA index state of room {req.room} ({owned_pages} pages, {descriptors} descriptors) "
                f"to decode {req.endpoint}:{req.dst_port}")
            mark_failed((req,), "its NSA index write failed")
        return rc

    def send_aux(self, original, kv_mgr, req, prefill_aux_index, dst_aux_ptrs):
        """``send_aux`` unless the request already failed (rejected, or its index write)."""
        if getattr(req, FAILED_ATTR, None) is not None or self._rejected.get(req.room) is not None:
            if installed.INSTALLED.deferred_decode_release and failure_recorded(kv_mgr, req.room):
                # NOTE: nothing of this write was submitted: a -1 would withhold this rank's
                # drain acknowledgement and keep decode's pages for its release timeout (30 s);
                # SGLang concludes the room Failed from its failure record instead
                return 0
            return -1  # the request already failed; SGLang makes a failed aux write Failed on both sides
        ret = original(kv_mgr, req, prefill_aux_index, dst_aux_ptrs)
        if ret != 0:
            self._record_write_failure(
                kv_mgr, req.room, "aux", ret,
                f"the request metadata (aux) of room {req.room} to decode {req.endpoint}:{req.dst_port}")
        return ret

    def _record_write_failure(self, kv_mgr, room, kind: str, rc, what: str) -> None:
        """Log, count and record (for both sides' failure messages) a failed ``kind`` write."""
        cause = self.write_failures.take() or f"return code {rc}"
        message = f"{self.who}: writing {what} failed: {cause}"
        logger.error("CP shared KV transfer: %s", message)
        self.stats.add(**{f"failed_{kind}_writes": 1})
        self.counters.count("failures", kind)
        kv_mgr.record_failure(room, message)


__all__ = ["ShardWrites"]
