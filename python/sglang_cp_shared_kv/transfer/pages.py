"""Page, run and descriptor arithmetic of the shard transfer (pure: numpy, the layout, config).

Everything here is a function of page lists and settings: which pages of a chunk this
rank sends and to which request positions, why a chunk cannot be sent, which NSA index
pages it owns and where they go on decode, how many Mooncake descriptors a page list
costs, how a write is cut into bounded batches and how large those may be. Nothing here
imports SGLang or torch, so it runs (and is unit-tested) where neither is installed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from sglang_cp_shared_kv.settings.config import DEFAULT_TRANSFER_BATCH_DESCRIPTORS as DEFAULT_MAX_DESCRIPTORS_PER_BATCH
from sglang_cp_shared_kv.settings.config import TRANSFER_BATCH_DESCRIPTORS_ENV as MAX_DESCRIPTORS_ENV
from sglang_cp_shared_kv.cp_shared_kv_layout import DUMMY_PAGE, CpSharedKVLayout

logger = logging.getLogger(__name__)

#: Mooncake's TCP transport (the fallback without RDMA) admits one batch to a peer up to
#: about these two together: entries queued on the peer's lanes plus entries waiting for
#: admission.
TCP_LANE_QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
TCP_LANE_PENDING_ENV = "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"
#: NOTE: Mooncake's default for each of the two, and the range it takes (outside it, it logs
#: "Invalid ... using default 1024"). Measured on mooncake-transfer-engine 0.3.13.post1 (TCP
#: loopback, docs/transfer.md): with the defaults a 2,048-entry batch passed and a
#: 2,100-entry one failed; with both at 512, 1,024 passed and 1,100 failed; 65,535 is taken,
#: 100,000 falls back to the default.
TCP_LANE_DEFAULT = 1024
TCP_LANE_RANGE = (1, 65535)


class CpSharedKVTransferError(RuntimeError):
    """The shared-KV PD transfer cannot run with this configuration."""


# ------------------------------------------------------------------ KV chunks
class ChunkPositions(np.ndarray):
    """The request positions (int64) of the pages of one chunk this rank sends, and what
    the filter saw of the chunk: ``chunk_pages`` (all its pages, owned or not),
    ``chunk_end`` (the request position just past its last page: where the request ends
    when this is its last chunk) and ``problem`` (why it cannot be sent; None when it can).

    The filter returns it as SGLang's ``index_slice``; ``MooncakeKVSender.send`` hands it
    unchanged to ``add_transfer_request`` (where the enqueue hook reads ``chunk_pages`` and
    ``problem``), which stores it in ``TransferKVChunk.index_slice``; the transfer worker's
    ``req.dst_kv_indices[index_slice]`` is then numpy fancy indexing, whose result is a
    plain array of the indexed array's type.
    """

    chunk_pages: int
    chunk_end: int
    problem: Optional[str]

    @classmethod
    def of(cls, positions, chunk_pages: int, chunk_end: int, problem: Optional[str] = None) -> "ChunkPositions":
        out = np.asarray(positions, dtype=np.int64).view(cls)
        out.chunk_pages, out.chunk_end, out.problem = int(chunk_pages), int(chunk_end), problem
        return out

    def __array_finalize__(self, obj) -> None:
        self.chunk_pages = getattr(obj, "chunk_pages", 0)
        self.chunk_end = getattr(obj, "chunk_end", 0)
        self.problem = getattr(obj, "problem", None)


def filter_chunk(layout: CpSharedKVLayout, logical_pages, index_slice: slice) -> Tuple[np.ndarray, ChunkPositions]:
    """This rank's physical pages (int32) of a chunk of ``logical_pages`` at request
    positions ``index_slice``, and their positions (empty, with the ``problem``, when the
    chunk cannot be sent)."""
    logical = np.asarray(logical_pages, dtype=np.int64)
    positions = np.arange(index_slice.start, index_slice.stop, dtype=np.int64)
    problem = None
    if positions.size != logical.size:
        problem = (f"the chunk has {logical.size} pages but its position range "
                   f"[{index_slice.start}, {index_slice.stop}) covers {positions.size}")
    elif logical.size and int(logical.min()) <= DUMMY_PAGE:
        problem = (f"the chunk's page table holds page {int(logical.min())} (the dummy "
                   "page or below); no CP rank owns it, so decode would miss that page")
    if problem:
        return np.empty(0, dtype=np.int32), ChunkPositions.of(np.empty(0), logical.size, index_slice.stop, problem)
    physical, owned = layout.filter_owned_pages_np(logical, positions)
    return physical.astype(np.int32), ChunkPositions.of(owned, logical.size, index_slice.stop)


@dataclass(frozen=True)
class Destination:
    """One decode target of a room, as the checks before enqueueing see it."""

    name: str  #: ``host:port``
    pages: int  #: pages decode preallocated after its prefix (``len(dst_kv_indices)``)
    hisparse: bool = False
    relayout: bool = False  #: decode runs another decode-CP layout (SGLang 0.5.23's DCP relayout)


def chunk_problem(physical_pages, positions, kv_buffer_pages: int,
                  destinations: Iterable[Destination], is_last_chunk: bool = False) -> Optional[str]:
    """Why this rank must not enqueue a chunk (``physical_pages`` at ``positions``, as
    :func:`filter_chunk` returned them) for ``destinations``; None when it may.

    A last chunk must end exactly where decode's preallocated pages end: decode treats the
    request as complete once every rank's last chunk and the aux data arrived, and would
    decode from any page after the end that no rank sent. That happens when prefill and
    decode hold different prompts -- stock SGLang's refused prefill (input over
    ``max_req_input_len``) runs and sends a one-token stand-in (``Req.set_finish_with_abort``)
    while decode preallocated the whole prompt."""
    if not isinstance(positions, np.ndarray):
        return (f"the chunk arrived with a page range ({positions!r}) instead of page positions: the "
                f"shared-KV page filter did not run (is SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1?)")
    if getattr(positions, "problem", None):
        return positions.problem
    physical_pages = np.asarray(physical_pages)
    if physical_pages.shape != positions.shape:
        return f"{physical_pages.size} pages but {positions.size} positions"
    if physical_pages.size:
        low, high = int(physical_pages.min()), int(physical_pages.max())
        if low < 1 or high >= kv_buffer_pages:
            return (f"physical KV page {low if low < 1 else high} is outside this rank's registered "
                    f"pages [1, {kv_buffer_pages})")
        if int(positions.min()) < 0:
            return f"negative page position {int(positions.min())}"
    for dst in destinations:
        if dst.hisparse:
            return (f"decode {dst.name} runs HiSparse, whose page-range "
                    "transfer cannot take page positions; not supported with shared KV")
        if dst.relayout:
            return (f"decode {dst.name} runs another decode context-parallel (DCP) layout, whose "
                    "relayout transfer sends whole chunks, not page positions; not supported with shared KV "
                    "(give decode the prefill's --dcp-size)")
        if positions.size and int(positions.max()) >= dst.pages:
            return (f"page position {int(positions.max())} is outside the {dst.pages} "
                    f"pages decode {dst.name} preallocated (positions count from "
                    "the decode prefix)")
        end = getattr(positions, "chunk_end", None)
        if is_last_chunk and end is not None and end != dst.pages:
            return (f"the request ends at page {end} on prefill but decode {dst.name} preallocated "
                    f"{dst.pages} pages for it (both count from the decode prefix): prefill and decode "
                    "hold different prompts, so decode would answer from pages nobody sent -- e.g. the "
                    "prefill refused the prompt (\"Input length ... exceeds the maximum allowed "
                    "length\") and ran a one-token stand-in, or the two servers got different inputs")
    return None


def kv_descriptors(physical_pages, positions, dst_kv_indices, layers: int) -> int:
    """Mooncake descriptors of one chunk write: contiguous runs x layers."""
    dst = np.asarray(dst_kv_indices)[np.asarray(positions)]
    return contiguous_runs(np.asarray(physical_pages, dtype=np.int64), dst.astype(np.int64)) * layers


# ------------------------------------------------------------- NSA index state
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


def own_state_pages(layout: CpSharedKVLayout, logical_pages,
                    pages_per_layer: int) -> Tuple[Optional[OwnedStatePages], Optional[str]]:
    """The index pages this rank owns of a request's NSA page list (over the whole
    sequence), or why it cannot send them: ``(entry, None)`` or ``(None, problem)``."""
    logical = np.asarray(logical_pages, dtype=np.int64).reshape(-1)
    if logical.size and int(logical.min()) <= DUMMY_PAGE:
        return None, (f"the request's NSA index page list holds page {int(logical.min())} (the dummy "
                      "page or below); no CP rank owns it, so decode would miss it")
    physical, positions = layout.filter_owned_pages_np(logical, np.arange(logical.size))
    if physical.size and int(physical.max()) >= pages_per_layer:
        return None, (f"physical index page {int(physical.max())} is outside this rank's registered "
                      f"index pages [1, {pages_per_layer})")
    return OwnedStatePages(physical.astype(np.int32), positions, int(logical.size)), None


def state_pages_to_send(entry: OwnedStatePages, dst_pages) -> Tuple[np.ndarray, np.ndarray, int]:
    """Source and destination index pages (int32) of ``entry`` against decode's list of
    the sequence's pages, and that list's length. Owned positions beyond decode's list
    are not sent (fewer than ``len(entry)`` pages come back), as SGLang truncates a longer
    prefill list to decode's."""
    dst_all = np.asarray(dst_pages if dst_pages is not None else [], dtype=np.int64).reshape(-1)
    keep = entry.positions < dst_all.size
    src = entry.physical_pages[keep]
    dst = dst_all[entry.positions[keep]].astype(np.int32)
    return src, dst, int(dst_all.size)


# ---------------------------------------------------------- runs and batches
def contiguous_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> int:
    """Runs contiguous on both sides: Mooncake descriptors per layer for this page list."""
    if src_pages.size == 0:
        return 0
    breaks = (np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)
    return 1 + int(np.count_nonzero(breaks))


def bounded_batches(blocks: Sequence, limit: int) -> List[list]:
    """``blocks`` (Mooncake ``(src, dst, length)`` descriptors) in order, in batches of at
    most ``limit``; one (possibly empty) batch when they fit."""
    blocks = blocks if isinstance(blocks, list) else list(blocks)
    if len(blocks) <= limit:
        return [blocks]
    return [blocks[i:i + limit] for i in range(0, len(blocks), limit)]


def tcp_lane_settings(environ: Mapping[str, str] = os.environ) -> Tuple[int, int]:
    """The TCP lane's (queued, pending) entries per peer as Mooncake reads them from
    ``environ``: a value it would not take stands for its default."""
    def read(name: str) -> int:
        text = environ.get(name, "").strip()
        low, high = TCP_LANE_RANGE
        return int(text) if text.isascii() and text.isdigit() and low <= int(text) <= high else TCP_LANE_DEFAULT

    return read(TCP_LANE_QUEUE_ENV), read(TCP_LANE_PENDING_ENV)


def rejected_batch_cause(ret: int, number: int, batches: int, batch: Sequence, peer: str, limit: int,
                         environ: Mapping[str, str] = os.environ) -> str:
    """The cause text of batch ``number`` of ``batches`` that Mooncake refused with ``ret``.

    Any non-zero return ends here (RDMA or TCP, a dead or restarted decode, a timeout), so
    the TCP lane is named only as a possibility, and only for a batch large enough to hit it."""
    nbytes = sum(length for _, _, length in batch)
    queued, pending = tcp_lane_settings(environ)
    lane = f"{TCP_LANE_QUEUE_ENV} + {TCP_LANE_PENDING_ENV} = {queued} + {pending}"
    head = (f"Mooncake batch_transfer_sync_write returned {ret} for batch {number} of "
            f"{batches} ({len(batch)} descriptors, {nbytes} bytes) to {peer}")
    # NOTE: half the lane: another write of this rank to the same peer can be in flight at
    # the same time (another transfer queue, or SGLang's per-layer writes with a custom
    # memory pool), and the two share the peer's admission.
    if 2 * len(batch) < queued + pending:
        return (f"{head}; that is well under what Mooncake's TCP transport admits per peer (about {lane} "
                "entries), so the lane limit is not the cause: the decode peer is likely unreachable, "
                "restarted or dead (its Mooncake session gone), or the transport failed or timed out "
                "(RDMA or TCP; see Mooncake's log)")
    return (f"{head}; if Mooncake's TCP transport is in use (no RDMA), the batch is near or above what it "
            f"admits per peer, about {lane} entries (Mooncake's defaults: {TCP_LANE_DEFAULT} + "
            f"{TCP_LANE_DEFAULT}), shared by this rank's writes in flight to that peer: keep "
            f"{MAX_DESCRIPTORS_ENV} (now {limit}) well under it, or raise both; otherwise the decode peer "
            "is unreachable or restarted, or the transport failed or timed out (see Mooncake's log)")


def resolve_max_descriptors_per_batch(environ: Mapping[str, str] = os.environ) -> int:
    """Descriptors per Mooncake batch: the explicit setting, else the default capped by
    the TCP lane's queue size when that is configured lower. An explicit setting above
    what the TCP lane admits at once is kept, with a WARNING: on TCP such a batch is
    refused while serving, and the peer may keep failing afterwards."""
    explicit = environ.get(MAX_DESCRIPTORS_ENV, "").strip()
    if explicit:
        try:
            value = int(explicit)
        except ValueError:
            value = 0
        if value < 1:
            raise CpSharedKVTransferError(f"{MAX_DESCRIPTORS_ENV}={explicit!r} must be a positive integer")
        queued, pending = tcp_lane_settings(environ)
        if value > queued + pending:
            logger.warning(
                "%s=%d exceeds what Mooncake's TCP transport admits per peer at once (about %s + %s = %d + %d "
                "entries): on TCP (no RDMA) a batch that large is refused and the request fails; lower %s or "
                "raise both (with RDMA this does not apply).", MAX_DESCRIPTORS_ENV, value, TCP_LANE_QUEUE_ENV,
                TCP_LANE_PENDING_ENV, queued, pending, MAX_DESCRIPTORS_ENV)
        return value
    # (an unset or out-of-range lane reads as Mooncake's default, which is the default here too)
    return min(DEFAULT_MAX_DESCRIPTORS_PER_BATCH, tcp_lane_settings(environ)[0])


__all__ = [
    "TCP_LANE_QUEUE_ENV", "TCP_LANE_PENDING_ENV", "TCP_LANE_DEFAULT", "TCP_LANE_RANGE",
    "MAX_DESCRIPTORS_ENV", "DEFAULT_MAX_DESCRIPTORS_PER_BATCH", "CpSharedKVTransferError",
    "ChunkPositions", "filter_chunk", "Destination", "chunk_problem", "kv_descriptors",
    "OwnedStatePages", "own_state_pages", "state_pages_to_send",
    "contiguous_runs", "bounded_batches", "tcp_lane_settings", "rejected_batch_cause",
    "resolve_max_descriptors_per_batch",
]
