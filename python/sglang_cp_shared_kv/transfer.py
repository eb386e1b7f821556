"""PD transfer of each prefill CP rank's KV shard to a non-CP decode, over Mooncake.

With shared KV a prefill CP rank holds only the pages it owns (``owner(p) = (p - 1) mod N``),
at physical locations of its own pool. SGLang's Mooncake path, with
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1``, already makes every CP rank call
``MooncakeKVSender.send`` for every chunk of a request; stock, each rank then sends a
contiguous share of *logical* pages. Under the flag each rank instead sends:

* **MLA KV**: the pages of the chunk it owns; source = its physical page, destination =
  decode's preallocated page at the page's *position* in the request, counted from the
  decode prefix exactly as SGLang counts chunk positions (``MooncakeKVSender.curr_idx``).
  The positions travel as an integer array through ``TransferKVChunk.index_slice``; the
  transfer worker's ``req.dst_kv_indices[index_slice]`` then picks the destinations.
* **NSA index state** (last chunk): the index pages it owns, with positions over the
  *full* sequence from token 0 (SGLang's NSA state payload, on both sides, starts at 0
  even when decode has a prefix), as :class:`OwnedStatePages`.
* **aux** (last chunk), as stock: every rank, even one that owns nothing, completes the
  request so decode collects one response per prefill CP rank.

Decode stays stock. Pages 1.. of a request are owned by exactly one rank each, so the
ranks together write every position once and decode ends with the replicated layout.

What SGLang does not do and the hooks add (flag on; every hook passes straight through
otherwise, and the decode-side ones act only on a message a shared-KV prefill sent):

* rejection before enqueueing: positions outside decode's preallocated pages, physical
  pages outside this rank's registered buffers, the dummy page in a request, a HiSparse
  decode target. SGLang's worker would raise in its thread (killing the prefill
  instance) or silently drop pages;
* bounded Mooncake batches: SGLang writes all layers of a chunk in one
  ``batch_transfer_sync_write``; with interleaved ownership that is layers x owned pages
  descriptors (61 x 195 for a 100K-token prompt on CP8), beyond the 2,048 entries
  Mooncake's TCP lane admits by default. Writes are split into batches of at most
  ``SGLANG_CP_SHARED_KV_TRANSFER_BATCH_DESCRIPTORS`` (default 1,024, lowered to
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` when that is set lower);
* no swallowed failures: SGLang ignores ``maybe_send_extra``'s result, so a failed index
  write would still report success. A failed index write now fails the request (its aux
  write is withheld, which SGLang turns into ``KVPoll.Failed`` on both sides), and every
  failure names its cause in the prefill's failure record and, through one extra
  message, in decode's (see :func:`accept_failure_cause`).

Pages and descriptors per rank per chunk are logged at debug level and counted
(:func:`transfer_stats`; Prometheus counters with ``--enable-metrics``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from sglang_cp_shared_kv.config import DEFAULT_TRANSFER_BATCH_DESCRIPTORS as DEFAULT_MAX_DESCRIPTORS_PER_BATCH
from sglang_cp_shared_kv.config import FLAG, is_enabled
from sglang_cp_shared_kv.config import TRANSFER_BATCH_DESCRIPTORS_ENV as MAX_DESCRIPTORS_ENV
from sglang_cp_shared_kv.cp_shared_kv_layout import DUMMY_PAGE, CpSharedKVLayout

logger = logging.getLogger(__name__)

#: Mooncake's TCP transport admits this many queued entries per peer (default 2,048).
TCP_LANE_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"

_CONTEXT_ATTR = "_cp_shared_kv_shard_transfer"
_DECODE_CAUSES_ATTR = "_cp_shared_kv_failure_causes"
_CONTEXT_LOCK = threading.Lock()
_MAX_TRACKED_ROOMS = 4096

# The failure cause travels to decode as an AUX_DATA message whose length field can
# never match its payload: a decode without this plugin logs "AUX_DATA length
# mismatch" and drops it without touching a buffer; ours records the cause.
_CAUSE_LENGTH_FIELD = b"\xff\xff\xff\xff"
_CAUSE_PREFIX = b"sglang-cp-shared-kv failure cause:"
_MAX_CAUSE_BYTES = 4000


class CpSharedKVTransferError(RuntimeError):
    """The shared-KV PD transfer cannot run with this configuration."""


@dataclass(frozen=True, eq=False)
class OwnedStatePages:
    """The NSA index pages of one request that this rank owns.

    ``physical_pages[i]`` of this rank's index buffers holds the request's sequence page
    ``positions[i]`` (0-based from token 0); ``sequence_pages`` counts them all. It
    replaces the logical page list in SGLang's NSA state payload; ``len()`` is what this
    rank sends (SGLang's transfer metric counts it).
    """

    physical_pages: np.ndarray
    positions: np.ndarray
    sequence_pages: int

    def __len__(self) -> int:
        return int(self.physical_pages.size)


def contiguous_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> int:
    """Runs contiguous on both sides: Mooncake descriptors per layer for this page list."""
    if src_pages.size == 0:
        return 0
    breaks = (np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)
    return 1 + int(np.count_nonzero(breaks))


def resolve_max_descriptors_per_batch(environ=os.environ) -> int:
    """Descriptors per Mooncake batch: the explicit setting, else the default capped by
    the TCP lane's queue size when that is configured lower."""
    explicit = environ.get(MAX_DESCRIPTORS_ENV, "").strip()
    if explicit:
        try:
            value = int(explicit)
        except ValueError:
            value = 0
        if value < 1:
            raise CpSharedKVTransferError(f"{MAX_DESCRIPTORS_ENV}={explicit!r} must be a positive integer")
        return value
    limit = DEFAULT_MAX_DESCRIPTORS_PER_BATCH
    lane = environ.get(TCP_LANE_QUEUE_ENV, "").strip()
    if lane.isdigit() and int(lane) > 0:
        limit = min(limit, int(lane))
    return limit


# ------------------------------------------------------------------------ counters
class TransferStats:
    """What one prefill rank sent, cumulative; ``recent_chunks`` keeps the last chunks."""

    FIELDS = (
        "kv_chunks", "kv_chunk_pages", "kv_pages", "kv_descriptors",
        "state_pages", "state_descriptors",
        "write_batches", "write_descriptors", "write_bytes",
        "failed_writes", "failed_state_writes", "failed_aux_writes", "rejected_requests",
    )

    def __init__(self, recent: int = 256):
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = dict.fromkeys(self.FIELDS, 0)
        self._recent_chunks: collections.deque = collections.deque(maxlen=recent)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += int(delta)

    def record_chunk(self, record: Dict[str, Any]) -> None:
        with self._lock:
            self._recent_chunks.append(record)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
            out["recent_chunks"] = [dict(r) for r in self._recent_chunks]
        return out


_prometheus: Dict[str, Any] = {}


def _prometheus_counters():
    if not _prometheus:
        from prometheus_client import Counter

        _prometheus["pages"] = Counter(
            "sglang:cp_shared_kv_transfer_pages_total",
            "Pages a prefill CP rank sent to decode under shared KV (kind: kv | state).",
            labelnames=("cp_rank", "kind"))
        _prometheus["descriptors"] = Counter(
            "sglang:cp_shared_kv_transfer_descriptors_total",
            "Mooncake transfer descriptors (contiguous runs x layers) a prefill CP rank "
            "issued under shared KV (kind: kv | state).",
            labelnames=("cp_rank", "kind"))
        _prometheus["failures"] = Counter(
            "sglang:cp_shared_kv_transfer_failures_total",
            "Requests a prefill CP rank failed under shared KV (kind: kv | state | aux | rejected).",
            labelnames=("cp_rank", "kind"))
    return _prometheus


class _BoundedRooms:
    """room -> text, forgetting the oldest beyond a bound (rooms are random 64-bit ids)."""

    def __init__(self, bound: int = _MAX_TRACKED_ROOMS):
        self._bound = bound
        self._items: "collections.OrderedDict[int, str]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, room: int, text: str, *, append: bool = False) -> None:
        with self._lock:
            previous = self._items.get(room) if append else None
            self._items[room] = text if previous is None else f"{previous} | {text}"
            self._items.move_to_end(room)
            while len(self._items) > self._bound:
                self._items.popitem(last=False)

    def get(self, room: int) -> Optional[str]:
        with self._lock:
            return self._items.get(room)

    def pop(self, room: int) -> Optional[str]:
        with self._lock:
            return self._items.pop(room, None)


# ------------------------------------------------------------- per-manager state
@dataclass
class _FilteredChunk:
    logical_pages: int
    problem: Optional[str] = None


class PrefillShardTransfer:
    """The shared-KV transfer state of one prefill ``MooncakeKVManager`` (one CP rank)."""

    def __init__(self, kv_mgr):
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        from sglang_cp_shared_kv.capacity import current_split

        problems = []
        if not isinstance(kv_mgr, MooncakeKVManager):
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
        for i, state_type in enumerate(getattr(args, "state_types", []) or []):
            if state_type == StateType.NSA:
                self.state_buffer_pages[i] = min(
                    n // item for n, item in zip(args.state_data_lens[i], args.state_item_lens[i]))
                self.state_layers[i] = len(args.state_data_ptrs[i])
        split = current_split()
        if split is not None:
            expected = (split.cp_size, split.cp_rank, split.page_size, split.physical_tokens_per_rank // split.page_size + 1)
            actual = (self.layout.cp_size, self.layout.cp_rank, self.layout.page_size, self.kv_buffer_pages)
            if expected != actual:
                raise CpSharedKVTransferError(
                    f"{FLAG}: the Mooncake manager sees (cp_size, cp_rank, page_size, registered pages) = "
                    f"{actual} but this rank's pool was built for {expected}; the transfer would send "
                    "the wrong pages")
        self.max_descriptors_per_batch = resolve_max_descriptors_per_batch()
        self.stats = TransferStats()
        self._counters = _prometheus_counters() if getattr(kv_mgr.server_args, "enable_metrics", False) else None
        self._rank_label = str(self.layout.cp_rank)
        self._local = threading.local()
        self._rejected = _BoundedRooms()
        logger.info(
            "CP shared KV transfer: cp_rank=%d/%d sends only the pages it owns (MLA KV by request "
            "position, NSA index by sequence position); Mooncake batches of at most %d descriptors",
            self.layout.cp_rank, self.layout.cp_size, self.max_descriptors_per_batch)

    # ----------------------------------------------------------------- naming
    @property
    def who(self) -> str:
        return f"prefill CP rank {self.layout.cp_rank} of {self.layout.cp_size}"

    def _count(self, metric: str, kind: str, amount: int = 1) -> None:
        if self._counters is not None and amount:
            self._counters[metric].labels(cp_rank=self._rank_label, kind=kind).inc(amount)

    # --------------------------------------------------- thread-local hand-offs
    def _take_local(self, name: str):
        value = getattr(self._local, name, None)
        setattr(self._local, name, None)
        return value

    def take_write_failure(self) -> Optional[str]:
        """Cause of the last failed Mooncake write in this thread, if not yet reported."""
        return self._take_local("write_failure")

    # ------------------------------------------------------------ KV chunk pages
    def owned_pages(self, logical_pages, index_slice: slice) -> Tuple[np.ndarray, np.ndarray]:
        """This rank's physical pages of the chunk and their request positions."""
        logical_pages = np.asarray(logical_pages, dtype=np.int64)
        positions = np.arange(index_slice.start, index_slice.stop, dtype=np.int64)
        chunk = _FilteredChunk(logical_pages=int(logical_pages.size))
        self._local.filtered = chunk
        if positions.size != logical_pages.size:
            chunk.problem = (f"the chunk has {logical_pages.size} pages but its position range "
                             f"[{index_slice.start}, {index_slice.stop}) covers {positions.size}")
        elif logical_pages.size and int(logical_pages.min()) <= DUMMY_PAGE:
            chunk.problem = (f"the chunk's page table holds page {int(logical_pages.min())} (the dummy "
                             "page or below); no CP rank owns it, so decode would miss that page")
        if chunk.problem:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
        physical, owned_positions = self.layout.filter_owned_pages_np(logical_pages, positions)
        return physical.astype(np.int32), owned_positions

    def enqueue(self, original, kv_mgr, bootstrap_room, kv_indices, index_slice, is_last_chunk,
                aux_index=None, state_indices=None):
        """``add_transfer_request`` under the flag: ``kv_indices`` are this rank's physical
        pages and ``index_slice`` their request positions (from :meth:`owned_pages`)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        filtered: Optional[_FilteredChunk] = self._take_local("filtered")
        room = bootstrap_room
        if self._rejected.get(room) is not None:
            return None
        if (kv_mgr.request_status.get(room, KVPoll.Failed) == KVPoll.Failed
                or room not in kv_mgr.transfer_infos):
            # SGLang drops chunks of failed and unknown rooms itself.
            return original(kv_mgr, room, kv_indices, index_slice, is_last_chunk,
                            aux_index=aux_index, state_indices=state_indices)
        physical_pages, positions = kv_indices, index_slice
        problem = self._chunk_problem(kv_mgr, room, physical_pages, positions, filtered)
        if problem is None and is_last_chunk and state_indices:
            problem = self._own_state_pages(kv_mgr, state_indices)
        if problem is not None:
            return self._reject(original, kv_mgr, room, problem, aux_index)

        owned = len(physical_pages)
        descriptors = self._kv_descriptors(kv_mgr, room, physical_pages, positions)
        record = {
            "room": room,
            "positions": [int(positions.min()), int(positions.max())] if positions.size else [],
            "chunk_pages": filtered.logical_pages if filtered else owned,
            "owned_pages": owned,
            "descriptors": descriptors,
            "last": bool(is_last_chunk),
        }
        self.stats.record_chunk(record)
        self.stats.add(kv_chunks=1, kv_chunk_pages=record["chunk_pages"], kv_pages=owned,
                       kv_descriptors=descriptors)
        self._count("pages", "kv", owned)
        self._count("descriptors", "kv", descriptors)
        logger.debug("CP shared KV transfer: room=%s cp_rank=%d/%d chunk_pages=%d owned_pages=%d "
                     "descriptors=%d last=%s", room, self.layout.cp_rank, self.layout.cp_size,
                     record["chunk_pages"], owned, descriptors, is_last_chunk)
        if owned == 0 and not is_last_chunk:
            return None  # nothing of this chunk is ours; the last chunk always goes (aux, state)
        return original(kv_mgr, room, physical_pages, positions, is_last_chunk,
                        aux_index=aux_index, state_indices=state_indices)

    def _chunk_problem(self, kv_mgr, room, physical_pages, positions, filtered) -> Optional[str]:
        if not isinstance(positions, np.ndarray):
            return (f"the chunk arrived with a page range ({positions!r}) instead of page positions: the "
                    f"shared-KV page filter did not run (is SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1?)")
        if filtered is not None and filtered.problem:
            return filtered.problem
        physical_pages = np.asarray(physical_pages)
        if physical_pages.shape != positions.shape:
            return f"{physical_pages.size} pages but {positions.size} positions"
        if physical_pages.size:
            low, high = int(physical_pages.min()), int(physical_pages.max())
            if low < 1 or high >= self.kv_buffer_pages:
                return (f"physical KV page {low if low < 1 else high} is outside this rank's registered "
                        f"pages [1, {self.kv_buffer_pages})")
            if int(positions.min()) < 0:
                return f"negative page position {int(positions.min())}"
        for info in kv_mgr.transfer_infos.get(room, {}).values():
            if info.is_dummy:
                continue
            registration = kv_mgr.decode_kv_args_table.get(info.mooncake_session_id)
            if registration is not None and registration.enable_hisparse:
                return (f"decode {info.endpoint}:{info.dst_port} runs HiSparse, whose page-range "
                        "transfer cannot take page positions; not supported with shared KV")
            if positions.size and int(positions.max()) >= len(info.dst_kv_indices):
                return (f"page position {int(positions.max())} is outside the {len(info.dst_kv_indices)} "
                        f"pages decode {info.endpoint}:{info.dst_port} preallocated (positions count from "
                        "the decode prefix)")
        return None

    def _own_state_pages(self, kv_mgr, state_indices: List) -> Optional[str]:
        # SGLang's sender counts these entries for its transfer metric after enqueueing;
        # replacing them in place makes it count the pages this rank really sends.
        for i, pages_per_layer in self.state_buffer_pages.items():
            if i >= len(state_indices) or state_indices[i] is None or isinstance(state_indices[i], OwnedStatePages):
                continue
            logical = np.asarray(state_indices[i], dtype=np.int64).reshape(-1)
            if logical.size and int(logical.min()) <= DUMMY_PAGE:
                return (f"the request's NSA index page list holds page {int(logical.min())} (the dummy "
                        "page or below); no CP rank owns it, so decode would miss it")
            physical, positions = self.layout.filter_owned_pages_np(logical, np.arange(logical.size))
            if physical.size and int(physical.max()) >= pages_per_layer:
                return (f"physical index page {int(physical.max())} is outside this rank's registered "
                        f"index pages [1, {pages_per_layer})")
            state_indices[i] = OwnedStatePages(physical.astype(np.int32), positions, int(logical.size))
        return None

    def _kv_descriptors(self, kv_mgr, room, physical_pages, positions) -> int:
        for info in kv_mgr.transfer_infos.get(room, {}).values():
            if not info.is_dummy:
                dst = np.asarray(info.dst_kv_indices)[positions]
                return contiguous_runs(np.asarray(physical_pages, dtype=np.int64), dst.astype(np.int64)) * self.kv_layers
        return 0

    def _reject(self, original, kv_mgr, room, problem: str, aux_index):
        message = f"{self.who} rejected room {room} before enqueueing its transfer: {problem}"
        logger.error("CP shared KV transfer: %s", message)
        self.stats.add(rejected_requests=1)
        self._count("failures", "rejected")
        self._rejected.put(room, message)
        kv_mgr.record_failure(room, message)
        # SGLang's transfer worker is what tells decode: hand it one empty last chunk,
        # whose aux write send_aux_unless_failed withholds -> Failed on both sides.
        return original(kv_mgr, room, np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64), True,
                        aux_index=0 if aux_index is None else aux_index, state_indices=None)

    # ----------------------------------------------------------- Mooncake writes
    def write(self, original, kv_mgr, mooncake_session_id, transfer_blocks):
        blocks = transfer_blocks if isinstance(transfer_blocks, list) else list(transfer_blocks)
        limit = self.max_descriptors_per_batch
        if len(blocks) <= limit:
            batches = [blocks]
        else:
            batches = [blocks[i:i + limit] for i in range(0, len(blocks), limit)]
        for number, batch in enumerate(batches, 1):
            ret = original(kv_mgr, mooncake_session_id, batch)
            nbytes = sum(length for _, _, length in batch)
            if ret != 0:
                cause = (f"Mooncake batch_transfer_sync_write returned {ret} for batch {number} of "
                         f"{len(batches)} ({len(batch)} descriptors, {nbytes} bytes) to {mooncake_session_id}; "
                         "on Mooncake's TCP transport a rejected batch means the per-peer lane queue "
                         f"({TCP_LANE_QUEUE_ENV}, default 2048) was full: keep {MAX_DESCRIPTORS_ENV} "
                         f"(now {limit}) below it")
                self._local.write_failure = cause
                self.stats.add(failed_writes=1)
                logger.error("CP shared KV transfer (%s): %s", self.who, cause)
                return ret
            if batch:
                self.stats.add(write_batches=1, write_descriptors=len(batch), write_bytes=nbytes)
        return 0

    # -------------------------------------------------------- NSA index state
    def send_state(self, original, kv_mgr, req, prefill_state_indices, executor,
                   target_rank_registration_info=None):
        src_lists = list(prefill_state_indices)
        dst_lists = list(req.dst_state_indices)
        owned_pages = descriptors = 0
        for i, entry in enumerate(src_lists):
            if not isinstance(entry, OwnedStatePages):
                continue
            dst_all = np.asarray(dst_lists[i] if i < len(dst_lists) else [], dtype=np.int64).reshape(-1)
            keep = entry.positions < dst_all.size
            if not keep.all():
                # SGLang truncates a longer prefill list to decode's the same way.
                logger.warning("CP shared KV transfer: room %s: decode sent %d NSA index pages for a "
                               "%d-page sequence; positions beyond it are not sent",
                               req.room, dst_all.size, entry.sequence_pages)
            src = entry.physical_pages[keep]
            dst = dst_all[entry.positions[keep]].astype(np.int32)
            while len(dst_lists) <= i:
                dst_lists.append([])
            src_lists[i], dst_lists[i] = src, dst
            owned_pages += src.size
            descriptors += contiguous_runs(src.astype(np.int64), dst.astype(np.int64)) * self.state_layers.get(i, 0)
        self.stats.add(state_pages=owned_pages, state_descriptors=descriptors)
        self._count("pages", "state", owned_pages)
        self._count("descriptors", "state", descriptors)
        logger.debug("CP shared KV transfer: room=%s cp_rank=%d/%d state_pages=%d descriptors=%d",
                     req.room, self.layout.cp_rank, self.layout.cp_size, owned_pages, descriptors)
        rc = original(kv_mgr, dataclasses.replace(req, dst_state_indices=dst_lists), src_lists, executor,
                      target_rank_registration_info)
        if rc != 0:
            self._record_write_failure(
                kv_mgr, req.room, "state", rc,
                f"the NSA index state of room {req.room} ({owned_pages} pages, {descriptors} descriptors) "
                f"to decode {req.endpoint}:{req.dst_port}")
            self._local.failed_state = (req.room, req.mooncake_session_id)
        return rc

    def send_aux(self, original, kv_mgr, req, prefill_aux_index, dst_aux_ptrs):
        failed_state = self._take_local("failed_state")
        if self._rejected.get(req.room) is not None or failed_state == (req.room, req.mooncake_session_id):
            return -1  # the request already failed; SGLang makes a failed aux write Failed on both sides
        ret = original(kv_mgr, req, prefill_aux_index, dst_aux_ptrs)
        if ret != 0:
            self._record_write_failure(
                kv_mgr, req.room, "aux", ret,
                f"the request metadata (aux) of room {req.room} to decode {req.endpoint}:{req.dst_port}")
        return ret

    def _record_write_failure(self, kv_mgr, room, kind: str, rc, what: str) -> None:
        """Log, count and record (for both sides' failure messages) a failed ``kind`` write."""
        cause = self.take_write_failure() or f"return code {rc}"
        message = f"{self.who}: writing {what} failed: {cause}"
        logger.error("CP shared KV transfer: %s", message)
        self.stats.add(**{f"failed_{kind}_writes": 1})
        self._count("failures", kind)
        kv_mgr.record_failure(room, message)

    # ---------------------------------------------------- failure reporting
    def report_failure(self, kv_mgr, remote, dst_port, room) -> None:
        cause = self.take_write_failure()  # set when SGLang's own KV-chunk path failed
        with kv_mgr.failure_lock:
            reason = kv_mgr.failure_records.get(room)
            # Once the scheduler cleared the room it has read the record; do not recreate it.
            if cause and reason is not None and room in kv_mgr.request_status:
                reason = f"{reason}: {cause}"
                kv_mgr.failure_records[room] = reason
        if cause:
            self._count("failures", "kv")
        text = reason or self._rejected.get(room) or cause or "the transfer failed (no cause recorded)"
        if not text.startswith(self.who):
            text = f"{self.who}: {text}"
        send_failure_cause(kv_mgr, remote, dst_port, room, text)


# ------------------------------------------------------------------- lookup
def prefill_transfer(kv_mgr) -> Optional[PrefillShardTransfer]:
    """The shared-KV transfer state of a prefill manager; None when the flag is off."""
    context = kv_mgr.__dict__.get(_CONTEXT_ATTR)
    if context is not None:
        return context
    if not is_enabled(getattr(kv_mgr, "server_args", None)):
        return None
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if kv_mgr.disaggregation_mode != DisaggregationMode.PREFILL:
        return None
    with _CONTEXT_LOCK:
        context = kv_mgr.__dict__.get(_CONTEXT_ATTR)
        if context is None:
            context = PrefillShardTransfer(kv_mgr)
            setattr(kv_mgr, _CONTEXT_ATTR, context)
    return context


def transfer_stats(kv_mgr) -> Optional[Dict[str, Any]]:
    """Counters of what this prefill rank sent under shared KV (None when the flag is off)."""
    context = kv_mgr.__dict__.get(_CONTEXT_ATTR)
    return None if context is None else context.stats.snapshot()


# ------------------------------------------------------------ prefill hooks
def prepare_prefill_transfer(result, kv_mgr, *args, **kwargs):
    """AFTER ``MooncakeKVManager.__init__``: validate and announce at startup, not at the
    first request."""
    prefill_transfer(kv_mgr)
    return result


def filter_owned_pages(original, kv_mgr, kv_indices, index_slice):
    """AROUND ``disaggregation.utils.filter_kv_indices_for_cp_rank`` (imported by name by
    every backend; the hook registry rebinds those names too)."""
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(kv_mgr, kv_indices, index_slice)
    return context.owned_pages(kv_indices, index_slice)


def _delegate_to_shard_transfer(method: str, doc: str):
    """An AROUND hook on a ``MooncakeKVManager`` method: stock unless this manager moves a
    shared-KV shard, else ``PrefillShardTransfer.<method>(original, kv_mgr, ...)``."""
    def hook(original, kv_mgr, *args, **kwargs):
        context = prefill_transfer(kv_mgr)
        if context is None:
            return original(kv_mgr, *args, **kwargs)
        return getattr(context, method)(original, kv_mgr, *args, **kwargs)

    hook.__doc__ = doc
    return hook


enqueue_owned_chunk = _delegate_to_shard_transfer(
    "enqueue", "AROUND ``MooncakeKVManager.add_transfer_request``: validate before enqueueing.")
write_in_bounded_batches = _delegate_to_shard_transfer(
    "write", "AROUND ``MooncakeKVManager._transfer_data`` (every KV, state and aux write).")
send_owned_state_pages = _delegate_to_shard_transfer(
    "send_state", "AROUND ``MooncakeKVManager.maybe_send_extra``.")
send_aux_unless_failed = _delegate_to_shard_transfer(
    "send_aux", "AROUND ``MooncakeKVManager.send_aux``.")


def report_failure_cause_to_decode(original, kv_mgr, remote, dst_port, room, status, prefill_rank):
    """AROUND ``MooncakeKVManager.sync_status_to_decode_endpoint``: ahead of a Failed
    status, tell decode why (same socket, so decode reads the cause first)."""
    context = prefill_transfer(kv_mgr)
    if context is not None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        if status == KVPoll.Failed:
            context.report_failure(kv_mgr, remote, dst_port, room)
    return original(kv_mgr, remote, dst_port, room, status, prefill_rank)


def send_failure_cause(kv_mgr, remote, dst_port, room, text: str) -> None:
    from sglang.srt.utils.network import NetworkAddress

    payload = _CAUSE_PREFIX + text.encode("utf-8", "replace")[:_MAX_CAUSE_BYTES]
    address = NetworkAddress(remote, dst_port)
    try:
        # The same cached socket as SGLang's status message (same call form).
        kv_mgr._connect(address.to_tcp(), is_ipv6=address.is_ipv6).send_multipart(
            [kv_mgr.AUX_DATA_HEADER, str(room).encode("ascii"), b"0", b"0", _CAUSE_LENGTH_FIELD, payload])
    except Exception as exc:  # the Failed status still goes out; only the detail is lost
        logger.warning("CP shared KV transfer: could not send the failure cause of room %s to %s:%s: %s",
                       room, remote, dst_port, exc)


# ------------------------------------------------------------- decode hooks
def parse_failure_cause(msg) -> Optional[Tuple[int, str]]:
    if len(msg) != 6 or msg[4] != _CAUSE_LENGTH_FIELD or not msg[5].startswith(_CAUSE_PREFIX):
        return None
    try:
        room = int(msg[1].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return room, msg[5][len(_CAUSE_PREFIX):].decode("utf-8", "replace")


def accept_failure_cause(original, kv_mgr, msg, *args, **kwargs):
    """AROUND ``MooncakeKVManager._handle_aux_data`` (decode): keep a shared-KV prefill's
    failure cause for the room; every other message is SGLang's."""
    parsed = parse_failure_cause(msg)
    if parsed is None:
        return original(kv_mgr, msg, *args, **kwargs)
    room, text = parsed
    if room not in kv_mgr.request_status:
        return None  # the room is already concluded and cleared; nobody will read it
    causes = kv_mgr.__dict__.get(_DECODE_CAUSES_ATTR)
    if causes is None:
        with _CONTEXT_LOCK:
            causes = kv_mgr.__dict__.setdefault(_DECODE_CAUSES_ATTR, _BoundedRooms())
    causes.put(room, text, append=True)  # one cause per failing prefill rank
    logger.debug("CP shared KV transfer: failure cause for room %s: %s", room, text)
    return None


def failure_exception_with_cause(original, receiver, *args, **kwargs):
    """AROUND ``MooncakeKVReceiver.failure_exception`` (decode): name the prefill's cause."""
    from sglang.srt.disaggregation.mooncake.conn import KVTransferError

    try:
        return original(receiver, *args, **kwargs)
    except KVTransferError as exc:
        causes = receiver.kv_mgr.__dict__.get(_DECODE_CAUSES_ATTR)
        cause = causes.pop(exc.bootstrap_room) if causes is not None else None
        if not cause:
            raise
        raise KVTransferError(exc.bootstrap_room, f"{exc.failure_reason}; cause: {cause}") from exc


__all__ = [
    "CpSharedKVTransferError", "OwnedStatePages", "PrefillShardTransfer", "TransferStats",
    "MAX_DESCRIPTORS_ENV", "DEFAULT_MAX_DESCRIPTORS_PER_BATCH", "contiguous_runs",
    "resolve_max_descriptors_per_batch", "prefill_transfer", "transfer_stats",
    "prepare_prefill_transfer", "filter_owned_pages", "enqueue_owned_chunk", "write_in_bounded_batches",
    "send_owned_state_pages", "send_aux_unless_failed", "report_failure_cause_to_decode",
    "send_failure_cause", "parse_failure_cause", "accept_failure_cause", "failure_exception_with_cause",
]
