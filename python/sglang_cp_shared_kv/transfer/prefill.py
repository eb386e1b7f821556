"""The prefill side of the shard transfer: one :class:`PrefillShardTransfer` per prefill
``MooncakeKVManager`` (one CP rank), built and validated when the manager starts, and how
the hooks find it (:func:`prefill_transfer`, :func:`built_prefill_transfer`;
:func:`transfer_stats` reads its counters).

:class:`PrefillShardTransfer` is the state of one rank's transfer and the concerns that share
it, each a base class of its own module:

* :class:`.chunk_admission.ChunkAdmission` -- which pages of a chunk this rank sends, checked
  before SGLang enqueues them;
* :class:`.shard_writes.ShardWrites` -- the Mooncake writes: bounded batches, the NSA index
  state, aux unless the room failed;
* :class:`.room_failures.RoomFailureNotices` -- telling decode that a room failed.

What it checks and reads at startup is :mod:`.startup`'s; it raises the problems found, at
construction (the manager's) and in :meth:`PrefillShardTransfer.check_pool` (the prefill
bootstrap queue's), so a rank that cannot serve this way never starts.

Hand-offs between hooks travel on the objects SGLang passes: the chunk's page count and
problem on the positions array (:class:`.pages.ChunkPositions`, filter ->
``add_transfer_request``); a failed index write on the request's ``TransferInfo``
(``maybe_send_extra`` -> ``send_aux``). The one exception, the cause of a failed Mooncake
write, is :class:`.rooms.WriteFailureHandOff`, which says why.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG, shares_kv
from sglang_cp_shared_kv.transfer.chunk_admission import ChunkAdmission
from sglang_cp_shared_kv.transfer.failure_cause import BoundedRooms
from sglang_cp_shared_kv.transfer.pages import CpSharedKVTransferError, resolve_max_descriptors_per_batch
from sglang_cp_shared_kv.transfer.room_failures import RoomFailureNotices
from sglang_cp_shared_kv.transfer.rooms import AbortNotices, WriteFailureHandOff
from sglang_cp_shared_kv.transfer.shard_writes import ShardWrites
from sglang_cp_shared_kv.transfer.startup import RegisteredBuffers, manager_problems, pool_mismatch, rank_layout
from sglang_cp_shared_kv.transfer.stats import RankCounters, TransferStats

logger = logging.getLogger(__name__)

_CONTEXT_ATTR = "_cp_shared_kv_shard_transfer"
_CONTEXT_LOCK = threading.Lock()


class PrefillShardTransfer(ChunkAdmission, ShardWrites, RoomFailureNotices):
    """The shared-KV transfer state of one prefill ``MooncakeKVManager`` (one CP rank).

    NOTE: the concerns are base classes over this one state, not parts it holds, because they
    share it (a room admission rejects is what the aux write withholds and the failure
    notices name), and because the hooks and the e2e switches (``scripts/e2e/
    sitecustomize.py`` wraps ``PrefillShardTransfer.owned_pages`` and ``.write``) reach them
    as methods of this class."""

    def __init__(self, kv_mgr):
        problems = manager_problems(kv_mgr)
        if problems:
            raise CpSharedKVTransferError(f"{FLAG}: the PD transfer of KV shards cannot run: " + "; ".join(problems))

        self.layout = rank_layout(kv_mgr)
        self.buffers = RegisteredBuffers.of_manager(kv_mgr)
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
        # room -> (cause, session ids told): refused at intake (0.5.23) before all of decode
        # registered; the rest are told on registration, under the same lock
        self._refused_unregistered = BoundedRooms()
        self._drained_rooms = BoundedRooms()  # room -> True: its drain markers are out
        self._room_endpoints = BoundedRooms()  # room -> its decode endpoints, for its drain
        self._registration_lock = threading.Lock()
        logger.info(
            "CP shared KV transfer: cp_rank=%d/%d sends only the pages it owns (MLA KV by request "
            "position, NSA index by sequence position); Mooncake batches of at most %d descriptors",
            self.layout.cp_rank, self.layout.cp_size, self.max_descriptors_per_batch)

    def check_pool(self, pool) -> None:
        """Refuse to start when this manager's view differs from the pool the rank built."""
        mismatch = pool_mismatch(self.layout, self.buffers, pool)
        if mismatch is not None:
            raise CpSharedKVTransferError(mismatch)

    @property
    def who(self) -> str:
        return f"prefill CP rank {self.layout.cp_rank} of {self.layout.cp_size}"


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
