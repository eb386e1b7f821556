"""The prefill side of the shard transfer: one :class:`PrefillShardTransfer` per prefill
``MooncakeKVManager`` (one CP rank), built and validated when the manager starts.

It takes what SGLang's Mooncake path hands the hooks (the chunk's pages, the NSA state
payload, the write blocks, the ``TransferInfo`` of each decode target) and decides with
:mod:`.pages` what this rank sends, counts it (:mod:`.stats`) and, when a request fails,
records the cause and sends it to decode (:mod:`.rooms`, :mod:`.failure_cause`).

Hand-offs between hooks travel on the objects SGLang passes: the chunk's page count and
problem on the positions array (:class:`.pages.ChunkPositions`, filter ->
``add_transfer_request``); a failed index write on the request's ``TransferInfo``
(``maybe_send_extra`` -> ``send_aux``). The one exception, the cause of a failed Mooncake
write, is :class:`.rooms.WriteFailureHandOff`, which says why.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Dict, List, Optional

import numpy as np

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.settings.config import FLAG, shares_kv
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.observability.nvtx import marked
from sglang_cp_shared_kv.transfer.failure_cause import BoundedRooms
from sglang_cp_shared_kv.transfer.pages import (
    ChunkPositions,
    CpSharedKVTransferError,
    Destination,
    OwnedStatePages,
    bounded_batches,
    chunk_problem,
    contiguous_runs,
    filter_chunk,
    kv_descriptors,
    own_state_pages,
    rejected_batch_cause,
    resolve_max_descriptors_per_batch,
    state_pages_to_send,
)
from sglang_cp_shared_kv.transfer.room_failures import RoomFailureNotices
from sglang_cp_shared_kv.transfer.rooms import FAILED_ATTR, AbortNotices, WriteFailureHandOff, mark_failed, room_targets
from sglang_cp_shared_kv.transfer.stats import RankCounters, TransferStats

logger = logging.getLogger(__name__)

_CONTEXT_ATTR = "_cp_shared_kv_shard_transfer"
_CONTEXT_LOCK = threading.Lock()

class PrefillShardTransfer(RoomFailureNotices):
    """The shared-KV transfer state of one prefill ``MooncakeKVManager`` (one CP rank); how
    it tells decode that a room failed is :class:`.room_failures.RoomFailureNotices`'."""

    def __init__(self, kv_mgr):
        problems = []
        if not isinstance(kv_mgr, sg.MooncakeKVManager):
            problems.append(f"the transfer backend is {type(kv_mgr).__name__}; only Mooncake is supported")
        if not kv_mgr.is_mla_backend:
            problems.append("the KV pool is not an MLA pool")
        if not kv_mgr.enable_all_cp_ranks_for_transfer:
            problems.append("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not 1, so non-zero CP ranks "
                            "would not send their pages")
        if kv_mgr.attn_cp_size <= 1:
            problems.append(f"the attention CP size is {kv_mgr.attn_cp_size}")
        args = kv_mgr.kv_args
        if not args.kv_data_ptrs:
            problems.append("no KV buffers are registered")
        if problems:
            raise CpSharedKVTransferError(f"{FLAG}: the PD transfer of KV shards cannot run: " + "; ".join(problems))

        self.layout = CpSharedKVLayout(page_size=int(args.page_size), cp_size=int(kv_mgr.attn_cp_size),
                                       cp_rank=int(kv_mgr.attn_cp_rank))
        self.kv_layers = len(args.kv_data_ptrs)
        # Registered KV buffers hold (physical pages + page 0) pages each.
        self.kv_buffer_pages = min(n // item for n, item in zip(args.kv_data_lens, args.kv_item_lens))
        self.state_buffer_pages: Dict[int, int] = {}
        self.state_layers: Dict[int, int] = {}
        index_state = sg.INDEX_STATE_TYPE  # StateType.NSA on 0.5.12.post1, .DSA on 0.5.23
        for i, state_type in enumerate(getattr(args, "state_types", []) or []):
            if state_type == index_state:
                self.state_buffer_pages[i] = min(
                    n // item for n, item in zip(args.state_data_lens[i], args.state_item_lens[i]))
                self.state_layers[i] = len(args.state_data_ptrs[i])
        self.max_descriptors_per_batch = resolve_max_descriptors_per_batch()
        self.stats = TransferStats()
        self.counters = RankCounters(self.layout.cp_rank, getattr(kv_mgr.server_args, "enable_metrics", False))
        self.write_failures = WriteFailureHandOff()
        self._rejected = BoundedRooms()
        self._abort_notices = AbortNotices()
        # room -> (cause, session ids told): aborted before all of decode registered; the
        # rest are told on registration. The lock makes "read the targets, keep the room"
        # one step against the bootstrap thread's "registered: pop the room".
        self._aborted_unregistered = BoundedRooms()
        self._registration_lock = threading.Lock()
        logger.info(
            "CP shared KV transfer: cp_rank=%d/%d sends only the pages it owns (MLA KV by request "
            "position, NSA index by sequence position); Mooncake batches of at most %d descriptors",
            self.layout.cp_rank, self.layout.cp_size, self.max_descriptors_per_batch)

    def check_pool(self, pool) -> None:
        """Refuse to start when this manager's view differs from the pool the rank built."""
        layout = pool.cp_layout
        expected = (layout.cp_size, layout.cp_rank, layout.page_size, pool.physical_size // layout.page_size + 1)
        actual = (self.layout.cp_size, self.layout.cp_rank, self.layout.page_size, self.kv_buffer_pages)
        if expected != actual:
            raise CpSharedKVTransferError(
                f"{FLAG}: the Mooncake manager sees (cp_size, cp_rank, page_size, registered pages) = "
                f"{actual} but this rank's pool was built for {expected}; the transfer would send "
                "the wrong pages")

    @property
    def who(self) -> str:
        return f"prefill CP rank {self.layout.cp_rank} of {self.layout.cp_size}"

    # ------------------------------------------------------------ KV chunk pages
    def owned_pages(self, logical_pages, index_slice: slice):
        """This rank's physical pages of the chunk and their request positions."""
        return filter_chunk(self.layout, logical_pages, index_slice)

    def enqueue(self, original, kv_mgr, bootstrap_room, kv_indices, index_slice, is_last_chunk,
                aux_index=None, state_indices=None, **chunk_extras):
        """``add_transfer_request`` under the flag: ``kv_indices`` are this rank's physical
        pages and ``index_slice`` their request positions (from :meth:`owned_pages`).
        ``chunk_extras``: the keywords a release adds to the chunk (0.5.23: its token count
        and events), handed on with the chunk's pages."""
        room = bootstrap_room
        if self._rejected.get(room) is not None:
            return None
        if (kv_mgr.request_status.get(room, sg.KVPoll.Failed) == sg.KVPoll.Failed
                or room not in kv_mgr.transfer_infos):
            # SGLang drops chunks of failed and unknown rooms itself.
            return original(kv_mgr, room, kv_indices, index_slice, is_last_chunk,
                            aux_index=aux_index, state_indices=state_indices, **chunk_extras)
        physical_pages, positions = kv_indices, index_slice
        problem = chunk_problem(physical_pages, positions, self.kv_buffer_pages, self._destinations(kv_mgr, room),
                                is_last_chunk=bool(is_last_chunk))
        if problem is None and is_last_chunk and state_indices:
            problem = self.own_state_pages_in_place(state_indices)
        if problem is not None:
            return self._reject(original, kv_mgr, room, problem, aux_index)

        owned = len(physical_pages)
        descriptors = self._kv_descriptors(kv_mgr, room, physical_pages, positions)
        record = {
            "room": room,
            "positions": [int(positions.min()), int(positions.max())] if positions.size else [],
            "chunk_pages": positions.chunk_pages if isinstance(positions, ChunkPositions) else owned,
            "owned_pages": owned,
            "descriptors": descriptors,
            "last": bool(is_last_chunk),
        }
        self.stats.record_chunk(record)
        self.stats.add(kv_chunks=1, kv_chunk_pages=record["chunk_pages"], kv_pages=owned,
                       kv_descriptors=descriptors)
        self.counters.count("pages", "kv", owned)
        self.counters.count("descriptors", "kv", descriptors)
        logger.debug("CP shared KV transfer: room=%s cp_rank=%d/%d chunk_pages=%d owned_pages=%d "
                     "descriptors=%d last=%s", room, self.layout.cp_rank, self.layout.cp_size,
                     record["chunk_pages"], owned, descriptors, is_last_chunk)
        if owned == 0 and not is_last_chunk:
            return None  # nothing of this chunk is ours; the last chunk always goes (aux, state)
        return original(kv_mgr, room, physical_pages, positions, is_last_chunk,
                        aux_index=aux_index, state_indices=state_indices, **chunk_extras)

    @staticmethod
    def _destinations(kv_mgr, room) -> List[Destination]:
        out = []
        for info in room_targets(kv_mgr, room):
            if info.is_dummy:
                continue
            registration = kv_mgr.decode_kv_args_table.get(info.mooncake_session_id)
            # HiSparse decode: a flag of its registration, or device pages of each room
            hisparse = (getattr(info, "dst_device_kv_indices", None) is not None if installed.INSTALLED.hisparse_signal == "room"
                        else bool(getattr(registration, "enable_hisparse", False)))
            out.append(Destination(name=f"{info.endpoint}:{info.dst_port}", pages=len(info.dst_kv_indices),
                                   hisparse=hisparse,
                                   relayout=bool(getattr(registration, "requires_dcp_relayout", False))))
        return out

    def own_state_pages_in_place(self, state_indices: List) -> Optional[str]:
        """Replace each NSA entry of SGLang's state payload by this rank's
        :class:`.pages.OwnedStatePages`; the problem when it cannot send them."""
        # SGLang's sender counts these entries for its transfer metric after enqueueing;
        # replacing them in place makes it count the pages this rank really sends.
        for i, pages_per_layer in self.state_buffer_pages.items():
            if i >= len(state_indices) or state_indices[i] is None or isinstance(state_indices[i], OwnedStatePages):
                continue
            entry, problem = own_state_pages(self.layout, state_indices[i], pages_per_layer)
            if problem is not None:
                return problem
            state_indices[i] = entry
        return None

    def _kv_descriptors(self, kv_mgr, room, physical_pages, positions) -> int:
        for info in room_targets(kv_mgr, room):
            if not info.is_dummy:
                return kv_descriptors(physical_pages, positions, info.dst_kv_indices, self.kv_layers)
        return 0

    def _reject(self, original, kv_mgr, room, problem: str, aux_index):
        message = f"{self.who} rejected room {room} before enqueueing its transfer: {problem}"
        logger.error("CP shared KV transfer: %s", message)
        self.stats.add(rejected_requests=1)
        self.counters.count("failures", "rejected")
        self._rejected.put(room, message)
        mark_failed(room_targets(kv_mgr, room), message)
        kv_mgr.record_failure(room, message)
        # SGLang's transfer worker is what tells decode: hand it one empty last chunk,
        # whose aux write send_aux withholds -> Failed on both sides.
        return original(kv_mgr, room, np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64), True,
                        aux_index=0 if aux_index is None else aux_index, state_indices=None)

    # ----------------------------------------------------------- Mooncake writes
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

    # -------------------------------------------------------- NSA index state
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
            descriptors += contiguous_runs(src.astype(np.int64), dst.astype(np.int64)) * self.state_layers.get(i, 0)
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

def built_prefill_transfer(kv_mgr) -> Optional[PrefillShardTransfer]:
    """The manager's shared-KV transfer state if it was built (at startup, flag on), else None."""
    return kv_mgr.__dict__.get(_CONTEXT_ATTR)


def prefill_transfer(kv_mgr) -> Optional[PrefillShardTransfer]:
    """The shared-KV transfer state of a prefill manager (built on first use); None when
    the flag is off."""
    context = built_prefill_transfer(kv_mgr)
    if context is not None:
        return context
    if not shares_kv(getattr(kv_mgr, "server_args", None)):
        return None
    if kv_mgr.disaggregation_mode != sg.DisaggregationMode.PREFILL:
        return None
    with _CONTEXT_LOCK:
        context = built_prefill_transfer(kv_mgr)
        if context is None:
            context = PrefillShardTransfer(kv_mgr)
            setattr(kv_mgr, _CONTEXT_ATTR, context)
    return context


def transfer_stats(kv_mgr) -> Optional[Dict[str, Any]]:
    """Counters of what this prefill rank sent under shared KV (None when the flag is off)."""
    context = built_prefill_transfer(kv_mgr)
    return None if context is None else context.stats.snapshot()


__all__ = ["PrefillShardTransfer", "prefill_transfer", "built_prefill_transfer", "transfer_stats"]
