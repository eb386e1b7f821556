"""Chunk admission on one prefill CP rank: which pages of a chunk it sends, and whether
SGLang's transfer worker may have the chunk at all.

SGLang's Mooncake sender hands each chunk of a request first to
``filter_kv_indices_for_cp_rank`` (:meth:`ChunkAdmission.owned_pages`: the pages this rank
owns and their positions in the request, :mod:`.pages`), then to ``add_transfer_request``
(:meth:`ChunkAdmission.enqueue`), which checks the chunk against decode's preallocated
pages and this rank's registered buffers (:class:`.startup.RegisteredBuffers`), makes the
NSA state entries of the last chunk the pages this rank owns, counts what it admits
(:mod:`.stats`) and only then enqueues. A chunk it cannot send fails its room here
(``_reject``): SGLang's worker would raise in its thread (killing the prefill instance) or
silently drop pages.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import numpy as np

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.transfer.failure_cause import BoundedRooms
from sglang_cp_shared_kv.transfer.pages import (
    ChunkPositions,
    Destination,
    OwnedStatePages,
    chunk_problem,
    filter_chunk,
    kv_descriptors,
    own_state_pages,
)
from sglang_cp_shared_kv.transfer.rooms import mark_failed, room_targets
from sglang_cp_shared_kv.transfer.startup import RegisteredBuffers
from sglang_cp_shared_kv.transfer.stats import RankCounters, TransferStats

logger = logging.getLogger(__name__)


class ChunkAdmission:
    """The chunk admission of one prefill manager's shard transfer: a base of
    :class:`.prefill.PrefillShardTransfer`, whose state below it reads."""

    layout: CpSharedKVLayout
    buffers: RegisteredBuffers
    stats: TransferStats
    counters: RankCounters
    who: str
    _rejected: BoundedRooms  # room -> why this rank failed it (it sends nothing more of it)

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
        self.remember_decode_endpoints(kv_mgr, room)
        physical_pages, positions = kv_indices, index_slice
        problem = chunk_problem(physical_pages, positions, self.buffers.kv_buffer_pages,
                                self._destinations(kv_mgr, room), is_last_chunk=bool(is_last_chunk))
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
        for i, pages_per_layer in self.buffers.state_buffer_pages.items():
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
                return kv_descriptors(physical_pages, positions, info.dst_kv_indices, self.buffers.kv_layers)
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


__all__ = ["ChunkAdmission"]
