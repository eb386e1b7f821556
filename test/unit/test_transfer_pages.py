"""The shard transfer's arithmetic and cause format, alone: transfer.pages and
transfer.failure_cause, which import neither SGLang nor torch (checked in a fresh
interpreter by test/test_repository.py). What the hooks do with them against SGLang's
classes, including that the ranks partition every chunk, is in
test/integration/test_transfer_hooks.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.transfer.failure_cause import (
    CAUSE_LENGTH_FIELD,
    MAX_CAUSE_BYTES,
    BoundedRooms,
    encode_failure_cause,
    parse_failure_cause,
)
from sglang_cp_shared_kv.transfer import pages
from sglang_cp_shared_kv.transfer.pages import (
    DEFAULT_MAX_DESCRIPTORS_PER_BATCH,
    MAX_DESCRIPTORS_ENV,
    TCP_LANE_QUEUE_ENV,
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

AUX_DATA_HEADER = b"AUX_DATA"  # SGLang's MooncakeKVManager.AUX_DATA_HEADER (opaque here)
#: Mooncake's names (checked against the installed engine; docs/transfer.md), spelled out here
QUEUED, PENDING = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"


# ------------------------------------------------------------ chunk filter
@pytest.mark.parametrize("rank,pages,start,expected_physical,expected_positions", [
    (1, range(1, 10), 10, [1, 2], [11, 15]),  # docs/design.md#reference-values, N = 4
    (2, range(9, 15), 8, [3], [10]),
])
def test_filter_reference_values(rank, pages, start, expected_physical, expected_positions):
    pages = np.asarray(list(pages), dtype=np.int32)
    physical, positions = filter_chunk(CpSharedKVLayout(PAGE, 4, rank), pages, slice(start, start + pages.size))
    assert physical.dtype == np.int32 and positions.dtype == np.int64
    assert physical.tolist() == expected_physical and positions.tolist() == expected_positions
    assert isinstance(positions, ChunkPositions) and positions.chunk_pages == pages.size
    assert positions.problem is None


@pytest.mark.parametrize("pages,index_slice,expected", [
    ([1, 2, 3], slice(0, 4), "the chunk has 3 pages but its position range [0, 4) covers 4"),
    ([1, 0, 3], slice(0, 3), "holds page 0 (the dummy page or below)"),
])
def test_a_chunk_that_cannot_be_sent_carries_its_problem(pages, index_slice, expected):
    physical, positions = filter_chunk(CpSharedKVLayout(PAGE, 2, 0), np.asarray(pages, np.int32), index_slice)
    assert physical.size == 0 and positions.size == 0 and positions.chunk_pages == 3
    assert expected in positions.problem
    assert chunk_problem(physical, positions, 11, []) == positions.problem


def test_positions_index_decodes_pages_like_a_plain_array():
    """SGLang's worker does ``req.dst_kv_indices[index_slice]`` with what the filter returned."""
    _, positions = filter_chunk(CpSharedKVLayout(PAGE, 4, 1), np.arange(1, 10, dtype=np.int32), slice(10, 19))
    dst = np.arange(100, 130, dtype=np.int32)
    picked = dst[positions]
    assert type(picked) is np.ndarray and picked.dtype == np.int32 and picked.tolist() == [111, 115]
    assert type(np.asarray(positions)) is np.ndarray
    assert int(positions.min()) == 11 and len(positions) == 2


# ------------------------------------------------------- checks before enqueueing
def _owned(rank=0, cp_size=2, pages=(1, 2, 3, 4), start=0):
    pages = np.asarray(pages, np.int32)
    return filter_chunk(CpSharedKVLayout(PAGE, cp_size, rank), pages, slice(start, start + pages.size))


@pytest.mark.parametrize("case,expected", [
    ("position beyond decode's pages", "page position 4 is outside the 4 pages decode 127.0.0.1:5555"),
    ("physical page beyond the pool", "physical KV page 11 is outside this rank's registered pages [1, 11)"),
    ("hisparse decode", "decode 127.0.0.1:5555 runs HiSparse"),
    ("dcp relayout decode", "give decode the prefill's --dcp-size"),
    ("page range", "the shared-KV page filter did not run"),
    ("negative position", "negative page position -1"),
    ("pages and positions differ", "2 pages but 1 positions"),
])
def test_chunk_problems(case, expected):
    physical, positions = _owned()
    dst = Destination("127.0.0.1:5555", pages=4)
    if case == "position beyond decode's pages":
        physical, positions = _owned(pages=[1, 2, 3, 4, 5])
    elif case == "physical page beyond the pool":
        physical, positions = _owned(pages=[1, 2, 3, 21])
    elif case == "hisparse decode":
        dst = Destination("127.0.0.1:5555", pages=4, hisparse=True)
    elif case == "dcp relayout decode":
        dst = Destination("127.0.0.1:5555", pages=4, relayout=True)
    elif case == "page range":
        positions = slice(0, 2)
    elif case == "negative position":
        positions = np.array([-1, 0])
    elif case == "pages and positions differ":
        positions = np.array([0])
    assert expected in chunk_problem(physical, positions, 11, [dst])


def test_a_sendable_chunk_has_no_problem():
    physical, positions = _owned(pages=[1, 2, 3, 4])
    assert chunk_problem(physical, positions, 11, [Destination("d:1", 4), Destination("d:2", 5)]) is None
    physical, positions = _owned(rank=1, cp_size=4, pages=[1])  # owns nothing of it
    assert physical.size == 0 and chunk_problem(physical, positions, 11, [Destination("d:1", 1)]) is None


def test_a_last_chunk_must_end_where_decode_pages_end():
    """Stock prefill sends a refused prompt's one-token stand-in as a complete request;
    decode preallocated the whole prompt and would answer from pages nobody sent."""
    physical, positions = _owned(pages=[7])  # the stand-in: one page at position 0
    assert positions.chunk_end == 1
    whole_prompt = Destination("127.0.0.1:5555", pages=172)
    problem = chunk_problem(physical, positions, 11, [whole_prompt], is_last_chunk=True)
    assert "the request ends at page 1 on prefill but decode 127.0.0.1:5555 preallocated 172 pages" in problem
    assert "refused the prompt" in problem
    # Not the last chunk: the request goes on, nothing to say yet.
    assert chunk_problem(physical, positions, 11, [whole_prompt]) is None
    # A last chunk ending exactly at decode's end, owned or not by this rank.
    for rank in (0, 1):
        physical, positions = _owned(rank=rank, pages=[1, 2, 3, 4], start=168)
        assert positions.chunk_end == 172
        assert chunk_problem(physical, positions, 11, [whole_prompt], is_last_chunk=True) is None
    # An empty last chunk (everything already sent) ends where the previous one did.
    physical, positions = _owned(pages=[], start=172)
    assert chunk_problem(physical, positions, 11, [whole_prompt], is_last_chunk=True) is None


def test_kv_descriptors_count_runs_on_decode():
    physical, positions = _owned(rank=1, cp_size=2, pages=[5, 6, 7, 8, 9, 10])  # owns 6, 8, 10
    assert kv_descriptors(physical, positions, [50, 51, 52, 53, 54, 55], layers=3) == 3 * 3
    assert kv_descriptors(physical, positions, [50, 51, 50, 52, 51, 53], layers=3) == 1 * 3


# ----------------------------------------------------------- runs and batches
@pytest.mark.parametrize("src,dst,runs", [
    ([], [], 0),
    ([4], [9], 1),
    ([1, 2, 3], [5, 6, 7], 1),
    ([1, 2, 3], [5, 7, 8], 2),
    ([1, 3, 4], [5, 6, 7], 2),
    ([1, 2, 3, 4], [10, 9, 8, 7], 4),
])
def test_contiguous_runs(src, dst, runs):
    assert contiguous_runs(np.asarray(src, np.int64), np.asarray(dst, np.int64)) == runs


def test_bounded_batches():
    blocks = [(i, 100 + i, 10) for i in range(7)]
    batches = bounded_batches(blocks, 3)
    assert [len(b) for b in batches] == [3, 3, 1] and [x for b in batches for x in b] == blocks
    assert bounded_batches(blocks, 7) == [blocks] and bounded_batches(iter(blocks), 8) == [blocks]
    assert bounded_batches([], 3) == [[]]


def test_a_small_rejected_batch_does_not_blame_the_lane():
    """Every non-zero return gets this text (RDMA, a dead or restarted decode, a timeout):
    a batch far under what the TCP lane admits points at the peer instead."""
    cause = rejected_batch_cause(-1, 2, 3, [(0, 0, 10)] * 3, "peer", 3, environ={})
    assert "returned -1 for batch 2 of 3 (3 descriptors, 30 bytes) to peer" in cause
    assert "the lane limit is not the cause" in cause and "unreachable, restarted or dead" in cause
    assert f"{QUEUED} + {PENDING} = 1024 + 1024" in cause
    assert "was full" not in cause and "if Mooncake's TCP transport" not in cause


def test_a_rejected_batch_near_the_lane_names_both_settings_as_a_possibility():
    cause = rejected_batch_cause(-3, 1, 1, [(0, 0, 10)] * 1024, "peer", 1024, environ={})
    assert "returned -3 for batch 1 of 1 (1024 descriptors, 10240 bytes) to peer" in cause
    assert "if Mooncake's TCP transport is in use" in cause and "not the cause" not in cause
    assert f"about {QUEUED} + {PENDING} = 1024 + 1024 entries (Mooncake's defaults: 1024 + 1024)" in cause
    assert f"keep {MAX_DESCRIPTORS_ENV} (now 1024) well under it" in cause and "unreachable or restarted" in cause
    # the lane this process's engine runs with, as it reads the two settings
    lane = {QUEUED: "8", PENDING: "4"}
    near = rejected_batch_cause(-1, 1, 1, [(0, 0, 10)] * 6, "peer", 6, environ=lane)
    assert f"{QUEUED} + {PENDING} = 8 + 4" in near and "if Mooncake's TCP transport" in near
    assert "not the cause" in rejected_batch_cause(-1, 1, 1, [(0, 0, 10)] * 5, "peer", 6, environ=lane)


def test_the_lane_settings_read_as_mooncake_reads_them():
    assert (TCP_LANE_QUEUE_ENV, pages.TCP_LANE_PENDING_ENV) == (QUEUED, PENDING)
    assert pages.tcp_lane_settings({}) == (1024, 1024)
    assert pages.tcp_lane_settings({QUEUED: "65535", PENDING: " 1 "}) == (65535, 1)
    for ignored in ("0", "65536", "100000", "-5", "lots", "\u00b2", ""):  # Mooncake: "Invalid ..., using default"
        assert pages.tcp_lane_settings({QUEUED: ignored, PENDING: ignored}) == (1024, 1024)


def test_batch_size_setting():
    assert resolve_max_descriptors_per_batch({}) == DEFAULT_MAX_DESCRIPTORS_PER_BATCH == 1024
    assert resolve_max_descriptors_per_batch({TCP_LANE_QUEUE_ENV: "300"}) == 300
    assert resolve_max_descriptors_per_batch({TCP_LANE_QUEUE_ENV: "16384"}) == 1024
    assert resolve_max_descriptors_per_batch({TCP_LANE_QUEUE_ENV: "lots"}) == 1024
    assert resolve_max_descriptors_per_batch({MAX_DESCRIPTORS_ENV: " 4096 ", TCP_LANE_QUEUE_ENV: "300"}) == 4096
    for bad in ("0", "-3", "many"):
        with pytest.raises(CpSharedKVTransferError, match=MAX_DESCRIPTORS_ENV):
            resolve_max_descriptors_per_batch({MAX_DESCRIPTORS_ENV: bad})


def test_an_explicit_batch_size_above_the_lane_warns_at_startup(caplog):
    """Kept (RDMA has no such lane), but said once at startup: on TCP it fails while serving."""
    with caplog.at_level(logging.WARNING, logger=pages.__name__):
        assert resolve_max_descriptors_per_batch({}) == 1024
        assert resolve_max_descriptors_per_batch({MAX_DESCRIPTORS_ENV: "2048"}) == 2048
        assert resolve_max_descriptors_per_batch({MAX_DESCRIPTORS_ENV: "100", QUEUED: "60", PENDING: "40"}) == 100
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger=pages.__name__):
        assert resolve_max_descriptors_per_batch({MAX_DESCRIPTORS_ENV: "2049"}) == 2049
        assert resolve_max_descriptors_per_batch({MAX_DESCRIPTORS_ENV: "101", QUEUED: "60", PENDING: "40"}) == 101
    first, second = caplog.records
    assert first.levelno == logging.WARNING and f"{MAX_DESCRIPTORS_ENV}=2049 exceeds" in first.getMessage()
    assert f"{QUEUED} + {PENDING} = 1024 + 1024" in first.getMessage()
    assert f"{MAX_DESCRIPTORS_ENV}=101 exceeds" in second.getMessage() and "= 60 + 40" in second.getMessage()


# ------------------------------------------------------------- NSA index state
def test_state_pages_by_sequence_position():
    entry, problem = own_state_pages(CpSharedKVLayout(PAGE, 2, 1), np.array([3, 4, 5, 6, 7, 8, 9, 10]), 11)
    assert problem is None and isinstance(entry, OwnedStatePages)
    assert entry.positions.tolist() == [1, 3, 5, 7] and entry.physical_pages.tolist() == [2, 3, 4, 5]
    assert entry.physical_pages.dtype == np.int32 and len(entry) == 4 and entry.sequence_pages == 8


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_ranks_partition_the_index_state(cp_size):
    logical = np.random.default_rng(cp_size).choice(np.arange(1, 300), size=37, replace=False)
    entries = [own_state_pages(CpSharedKVLayout(PAGE, cp_size, r), logical, 300)[0] for r in range(cp_size)]
    assert sorted(p for e in entries for p in e.positions.tolist()) == list(range(37))


def test_state_pages_that_cannot_be_sent():
    layout = CpSharedKVLayout(PAGE, 2, 0)
    assert "NSA index page list holds page 0" in own_state_pages(layout, [1, 2, 0, 4], 11)[1]
    entry, problem = own_state_pages(layout, [1, 2, 3, 21], 11)
    assert entry is None and "physical index page 11 is outside this rank's registered index pages [1, 11)" in problem


def test_state_pages_against_decodes_list():
    entry, _ = own_state_pages(CpSharedKVLayout(PAGE, 2, 0), [11, 12, 13, 14, 15], 11)  # positions 0, 2, 4
    src, dst, decode_pages = state_pages_to_send(entry, [90, 91, 92, 93, 94])
    assert src.tolist() == [6, 7, 8] and dst.tolist() == [90, 92, 94] and dst.dtype == np.int32
    assert decode_pages == 5
    src, dst, decode_pages = state_pages_to_send(entry, [90, 91, 92])  # decode's list is shorter
    assert src.tolist() == [6, 7] and dst.tolist() == [90, 92] and decode_pages == 3 and src.size < len(entry)
    src, dst, decode_pages = state_pages_to_send(entry, None)
    assert src.size == dst.size == decode_pages == 0


# ------------------------------------------------------------- failure cause
@pytest.mark.parametrize("text", ["prefill CP rank 1 of 2: lane full", "", "ünïcode ✓ | a: b"])
def test_failure_cause_round_trip(text):
    frames = encode_failure_cause(AUX_DATA_HEADER, 18, text)
    assert frames[:5] == [AUX_DATA_HEADER, b"18", b"0", b"0", CAUSE_LENGTH_FIELD]
    assert parse_failure_cause(frames) == (18, text)


def test_a_long_cause_is_cut():
    room, text = parse_failure_cause(encode_failure_cause(AUX_DATA_HEADER, 7, "x" * 10_000))
    assert room == 7 and text == "x" * MAX_CAUSE_BYTES


@pytest.mark.parametrize("msg", [
    [AUX_DATA_HEADER, b"19", b"0", b"1", b"\x00\x00\x00\x02", b"ab"],  # an ordinary AUX_DATA message
    [AUX_DATA_HEADER, b"19", b"0", b"0", CAUSE_LENGTH_FIELD, b"some other payload"],
    [AUX_DATA_HEADER, b"room", b"0", b"0", CAUSE_LENGTH_FIELD, b"sglang-cp-shared-kv failure cause:x"],
    [AUX_DATA_HEADER, b"19", b"0", b"0", CAUSE_LENGTH_FIELD],
])
def test_other_messages_are_not_causes(msg):
    assert parse_failure_cause(msg) is None


def test_bounded_rooms():
    rooms = BoundedRooms(bound=3)
    for room in range(5):
        rooms.put(room, f"cause {room}")
    assert len(rooms) == 3 and rooms.get(0) is None and rooms.get(4) == "cause 4"
    rooms.put(4, "second rank", append=True)
    assert rooms.pop(4) == "cause 4 | second rank" and rooms.pop(4) is None
    rooms.put(2, "replaced")
    assert rooms.get(2) == "replaced"
