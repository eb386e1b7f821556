"""The PD transfer hooks one by one, in process, against SGLang's real Mooncake classes
(a ``MooncakeKVManager`` whose constructor is skipped: no engine, no sockets).

The end-to-end behaviour over the real transfer engine is in
test_transfer_mooncake_e2e.py; here each hook's contract is pinned exactly: what it hands
to SGLang, what it rejects, and that with the flag off it is a pure pass-through.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cp_shared_kv import plugin
from sglang_cp_shared_kv.settings.config import FLAG_DEST
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.transfer import hooks as transfer
from sglang_cp_shared_kv.transfer import prefill, shard_writes
from sglang_cp_shared_kv.transfer.failure_cause import parse_drained_notice, parse_failure_cause
from sglang_cp_shared_kv.transfer.pages import (
    MAX_DESCRIPTORS_ENV,
    CpSharedKVTransferError,
    OwnedStatePages,
    resolve_max_descriptors_per_batch,
)

PAGE = 64
LAYERS = 3
KV_ITEM = PAGE * 16  # bytes of one page of one layer (opaque to the transfer path)
STATE_ITEM = PAGE * 132


def _conn():
    from sglang.srt.disaggregation.mooncake import conn

    return conn


class Recorder:
    """An ``original`` that records its calls and returns a fixed value."""

    def __init__(self, result=0):
        self.calls = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result(*args, **kwargs) if callable(self.result) else self.result


def make_manager(*, shared=True, cp_size=2, cp_rank=0, physical_pages=10, mode="prefill", metrics=False,
                 all_cp_ranks=True, mla=True):
    """A real ``MooncakeKVManager`` instance with the attributes the transfer path reads."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode

    conn = _conn()

    class Manager(conn.MooncakeKVManager):
        def __init__(self):  # no engine, no sockets
            self.sent_frames = []

        def _connect(self, endpoint, is_ipv6=False):
            frames = self.sent_frames
            return SimpleNamespace(send_multipart=lambda parts: frames.append((endpoint, list(parts))))

    mgr = Manager()
    pages = physical_pages + 1
    mgr.server_args = SimpleNamespace(**{FLAG_DEST: shared}, enable_metrics=metrics)
    mgr.disaggregation_mode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    mgr.is_mla_backend = mla
    mgr.enable_all_cp_ranks_for_transfer = all_cp_ranks
    mgr.attn_cp_size, mgr.attn_cp_rank = cp_size, cp_rank
    mgr.attn_tp_rank, mgr.pp_size, mgr.pp_rank = 0, 1, 0
    mgr.kv_args = SimpleNamespace(
        page_size=PAGE, kv_data_ptrs=[1000 * (i + 1) for i in range(LAYERS)], kv_data_lens=[pages * KV_ITEM] * LAYERS,
        kv_item_lens=[KV_ITEM] * LAYERS, state_types=[StateType.NSA],
        state_data_ptrs=[[9000 * (i + 1) for i in range(LAYERS)]], state_data_lens=[[pages * STATE_ITEM] * LAYERS],
        state_item_lens=[[STATE_ITEM] * LAYERS])
    mgr.request_status, mgr.transfer_infos, mgr.decode_kv_args_table = {}, {}, {}
    mgr.failure_records, mgr.failure_lock = {}, threading.Lock()
    if mode == "prefill":  # (SGLang's default SGLANG_DISAGGREGATION_QUEUE_SIZE is 4; two show the count)
        from sglang.srt.disaggregation.common.utils import FastQueue

        mgr.transfer_queues = [FastQueue(), FastQueue()]
    return mgr


def transfer_info(room, dst_pages, dst_state=None, session="127.0.0.1:7000"):
    conn = _conn()
    return conn.TransferInfo(room=room, endpoint="127.0.0.1", dst_port=5555, mooncake_session_id=session,
                             dst_kv_indices=np.asarray(dst_pages, dtype=np.int32), dst_aux_index=3,
                             dst_state_indices=[list(dst_state if dst_state is not None else [])],
                             required_dst_info_num=1, is_dummy=False)


def ready_room(mgr, room, dst_pages, dst_state=None):
    from sglang.srt.disaggregation.base.conn import KVPoll

    info = transfer_info(room, dst_pages, dst_state)
    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.transfer_infos[room] = {info.mooncake_session_id: info}
    mgr.decode_kv_args_table[info.mooncake_session_id] = SimpleNamespace(enable_hisparse=False)
    return info


# ------------------------------------------------------------------ flag off
def test_plugin_table_has_every_transfer_hook():
    ours = {s.target.rsplit(".", 2)[-2] + "." + s.target.rsplit(".", 1)[-1]: s.hook_type
            for s in plugin.HOOKS if s.hook.__module__ == transfer.__name__}
    assert ours == {
        "utils.filter_kv_indices_for_cp_rank": "around",
        "MooncakeKVManager.__init__": "after",
        "PrefillBootstrapQueue._init_kv_manager": "after",
        "MooncakeKVManager.add_transfer_request": "around",
        "MooncakeKVManager._transfer_data": "around",
        "MooncakeKVManager.maybe_send_extra": "around",
        "MooncakeKVManager.send_aux": "around",
        "MooncakeKVManager.sync_status_to_decode_endpoint": "around",
        "MooncakeKVManager._handle_aux_data": "around",
        "MooncakeKVReceiver.failure_exception": "around",
        "CommonKVSender.abort": "around",
        "prefill.release_req_to_metadata_buffer": "around",
        "MooncakeKVManager.update_status": "around",
        "MooncakeKVManager.transfer_worker": "around",
        "MooncakeKVSender.failure_exception": "around",
        "MooncakeKVManager.start_decode_thread": "around",
    }


def test_flag_off_every_prefill_hook_passes_straight_through():
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(shared=False)
    before = dict(mgr.__dict__)
    cases = [
        (transfer.filter_owned_pages, (np.arange(4), slice(0, 4)), {}),
        (transfer.enqueue_owned_chunk, (7, np.arange(3), slice(0, 3), True), {"aux_index": 1, "state_indices": [[1]]}),
        (transfer.write_in_bounded_batches, ("s", [(1, 2, 3)] * 5000), {}),
        (transfer.send_owned_state_pages, ("req", [[1, 2]], "executor", "info"), {}),
        (transfer.send_aux_unless_failed, ("req", 1, [5]), {}),
        (transfer.report_failure_cause_to_decode, ("127.0.0.1", 5555, 7, KVPoll.Failed, 0), {}),
        (transfer.fail_late_registration_of_aborted_room, (7, KVPoll.WaitingForInput), {}),
    ]
    for hook, args, kwargs in cases:
        original = Recorder(result=object())
        assert hook(original, mgr, *args, **kwargs) is original.result
        assert len(original.calls) == 1
        called_args, called_kwargs = original.calls[0]
        assert called_args[0] is mgr and called_kwargs == kwargs
        assert all(a is b for a, b in zip(called_args[1:], args)), hook.__name__
    assert transfer.prepare_prefill_transfer(None, mgr) is None
    assert mgr.__dict__ == before and mgr.sent_frames == []  # nothing added, nothing sent
    assert prefill.transfer_stats(mgr) is None


def test_flag_off_filter_is_sglangs_own_split():
    """Flag off, the CP transfer split is exactly SGLang's, for contiguous and scattered
    page ids alike (the stock split assumes contiguous ids: it drops the others)."""
    from sglang.srt.disaggregation.utils import page_indices_to_cp_rank_page_indices

    def stock_filter(kv_mgr, kv_indices, index_slice):  # SGLang's function, unwrapped by the registry
        import inspect

        from sglang.srt.disaggregation import utils

        return inspect.unwrap(utils.filter_kv_indices_for_cp_rank)(kv_mgr, kv_indices, index_slice)

    rng = np.random.default_rng(0)
    for cp_size in (2, 3, 4):
        for rank in range(cp_size):
            mgr = make_manager(shared=False, cp_size=cp_size, cp_rank=rank)
            for pages in (np.arange(5, 30), rng.choice(200, size=25, replace=False)):
                pages = pages.astype(np.int32)
                ours = transfer.filter_owned_pages(stock_filter, mgr, pages, slice(4, 29))
                theirs = stock_filter(mgr, pages, slice(4, 29))
                assert np.array_equal(ours[0], theirs[0]) and ours[1] == theirs[1]
    scattered = np.array([40, 3, 17, 90], dtype=np.int32)
    kept = [page_indices_to_cp_rank_page_indices(scattered, 4, r, 2) for r in range(2)]
    assert sum(k.size for k in kept) < scattered.size  # SGLang's own behaviour, left as is


# ------------------------------------------------------------- page filter
@pytest.mark.parametrize("rank,pages,start,expected_physical,expected_positions", [
    (1, range(1, 10), 10, [1, 2], [11, 15]),  # docs/design.md#reference-values, N = 4
    (2, range(9, 15), 8, [3], [10]),
])
def test_filter_reference_values(rank, pages, start, expected_physical, expected_positions):
    mgr = make_manager(cp_size=4, cp_rank=rank)
    pages = np.asarray(list(pages), dtype=np.int32)
    physical, positions = transfer.filter_owned_pages(Recorder(), mgr, pages, slice(start, start + pages.size))
    assert physical.dtype == np.int32 and positions.dtype == np.int64
    assert physical.tolist() == expected_physical and positions.tolist() == expected_positions


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_ranks_partition_every_chunk(cp_size):
    rng = np.random.default_rng(cp_size)
    for _ in range(20):
        pages = rng.choice(np.arange(1, 400), size=int(rng.integers(1, 40)), replace=False).astype(np.int32)
        start = int(rng.integers(0, 100))
        seen = []
        for rank in range(cp_size):
            mgr = make_manager(cp_size=cp_size, cp_rank=rank, physical_pages=400)
            physical, positions = transfer.filter_owned_pages(Recorder(), mgr, pages, slice(start, start + pages.size))
            layout = CpSharedKVLayout(PAGE, cp_size, rank)
            assert np.array_equal(layout.physical_pages_to_logical_np(physical), pages[positions - start])
            seen.extend(positions.tolist())
        assert sorted(seen) == list(range(start, start + pages.size))  # each position exactly once


# ------------------------------------------------------------ enqueueing
def test_enqueue_passes_owned_pages_and_translates_the_index_state_in_place():
    mgr = make_manager(cp_size=2, cp_rank=1)
    ready_room(mgr, 7, dst_pages=[50, 51, 52, 53, 54, 55], dst_state=[60 + i for i in range(8)])
    logical = np.array([5, 6, 7, 8, 9, 10], dtype=np.int32)  # positions 2..7 of an 8-page sequence
    physical, positions = transfer.filter_owned_pages(Recorder(), mgr, logical, slice(0, 6))
    state = [np.array([3, 4, 5, 6, 7, 8, 9, 10])]
    original = Recorder()
    transfer.enqueue_owned_chunk(original, mgr, 7, physical, positions, True, aux_index=2, state_indices=state)
    (args, kwargs), = original.calls
    assert args[1:] == (7, physical, positions, True) and kwargs["aux_index"] == 2
    owned = kwargs["state_indices"][0]
    assert owned is state[0] and isinstance(owned, OwnedStatePages)  # the same list SGLang counts
    assert owned.positions.tolist() == [1, 3, 5, 7] and owned.physical_pages.tolist() == [2, 3, 4, 5]
    assert len(owned) == 4 and owned.sequence_pages == 8
    stats = prefill.transfer_stats(mgr)
    assert stats["kv_pages"] == 3 and stats["kv_chunk_pages"] == 6
    assert stats["kv_descriptors"] == 3 * LAYERS  # decode pages 51, 53, 55: one run per page
    assert stats["recent_chunks"][-1] == {"room": 7, "positions": [1, 5], "chunk_pages": 6, "owned_pages": 3,
                                          "descriptors": 9, "last": True}


def test_a_chunk_the_rank_owns_nothing_of_is_not_enqueued_unless_it_is_the_last():
    mgr = make_manager(cp_size=4, cp_rank=3)
    ready_room(mgr, 8, dst_pages=list(range(100, 103)))
    for last in (False, True):
        physical, positions = transfer.filter_owned_pages(Recorder(), mgr, np.array([1, 2, 3], np.int32), slice(0, 3))
        assert physical.size == 0
        original = Recorder()
        transfer.enqueue_owned_chunk(original, mgr, 8, physical, positions, last, aux_index=0 if last else None,
                                     state_indices=[np.array([1, 2, 3])] if last else None)
        assert len(original.calls) == int(last)
    assert [c["owned_pages"] for c in prefill.transfer_stats(mgr)["recent_chunks"]] == [0, 0]


def _rejected(mgr, room, chunk_pages, index_slice, state=None, last=True):
    physical, positions = transfer.filter_owned_pages(Recorder(), mgr, np.asarray(chunk_pages, np.int32), index_slice)
    original = Recorder()
    transfer.enqueue_owned_chunk(original, mgr, room, physical, positions, last, aux_index=4 if last else None,
                                 state_indices=state)
    return original


@pytest.mark.parametrize("case,expected", [
    ("position beyond decode's pages", "page position 4 is outside the 4 pages decode 127.0.0.1:5555"),
    ("dummy page", "holds page 0 (the dummy page or below)"),
    ("physical page beyond the pool", "physical KV page 11 is outside this rank's registered pages [1, 11)"),
    ("dummy page in the index state", "NSA index page list holds page 0"),
    ("hisparse decode", "runs HiSparse"),
    ("a refused prompt's one-token stand-in", "the request ends at page 1 on prefill but decode 127.0.0.1:5555 "
                                              "preallocated 4 pages"),
])
def test_rejected_before_enqueueing_and_reported_through_sglangs_worker(case, expected):
    mgr = make_manager(cp_size=2, cp_rank=0, physical_pages=10)
    info = ready_room(mgr, 9, dst_pages=[70, 71, 72, 73], dst_state=list(range(80, 86)))
    chunk, state = [1, 2, 3, 4], None
    if case == "position beyond decode's pages":
        chunk = [1, 2, 3, 4, 5]
    elif case == "dummy page":
        chunk = [1, 0, 3, 4]
    elif case == "physical page beyond the pool":
        chunk = [1, 2, 3, 21]
    elif case == "dummy page in the index state":
        state = [np.array([1, 2, 0, 4])]
    elif case == "hisparse decode":
        mgr.decode_kv_args_table[info.mooncake_session_id].enable_hisparse = True
    elif case == "a refused prompt's one-token stand-in":
        chunk, state = [1], [np.array([1])]
    original = _rejected(mgr, 9, chunk, slice(0, len(chunk)), state)
    # SGLang's worker gets one empty last chunk, so it reports the failure to decode itself
    (args, kwargs), = original.calls
    assert args[1] == 9 and args[2].size == 0 and args[3].size == 0 and args[4] is True
    assert kwargs == {"aux_index": 4, "state_indices": None}
    assert expected in mgr.failure_records[9] and "rejected room 9 before enqueueing" in mgr.failure_records[9]
    # later chunks of the room are dropped; its aux write is withheld (-> Failed on both sides)
    later = Recorder()
    transfer.enqueue_owned_chunk(later, mgr, 9, np.array([1], np.int32), np.array([0]), True, aux_index=4)
    assert later.calls == []
    aux = Recorder()
    assert transfer.send_aux_unless_failed(aux, mgr, info, 4, [1]) == -1 and aux.calls == []
    assert prefill.transfer_stats(mgr)["rejected_requests"] == 1


def test_a_page_range_instead_of_positions_is_rejected():
    mgr = make_manager()
    ready_room(mgr, 10, dst_pages=[1, 2, 3])
    original = Recorder()
    transfer.enqueue_owned_chunk(original, mgr, 10, np.array([1, 2], np.int32), slice(0, 2), False)
    assert "page filter did not run" in mgr.failure_records[10]


def test_chunks_of_failed_or_unknown_rooms_go_to_sglang_unchanged():
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager()
    ready_room(mgr, 11, dst_pages=[1])
    mgr.request_status[11] = KVPoll.Failed
    for room in (11, 12):  # failed; unknown (a dummy rank's)
        original = Recorder()
        transfer.enqueue_owned_chunk(original, mgr, room, np.array([1], np.int32), slice(0, 1), False)
        assert len(original.calls) == 1 and original.calls[0][0][3] == slice(0, 1)
    assert mgr.failure_records == {}


# -------------------------------------------------------------- batching
def test_batch_size_setting(monkeypatch):
    monkeypatch.delenv(MAX_DESCRIPTORS_ENV, raising=False)
    monkeypatch.delenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", raising=False)
    assert resolve_max_descriptors_per_batch() == 1024
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "300")
    assert resolve_max_descriptors_per_batch() == 300
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "16384")
    assert resolve_max_descriptors_per_batch() == 1024
    monkeypatch.setenv(MAX_DESCRIPTORS_ENV, "4096")
    assert resolve_max_descriptors_per_batch() == 4096
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(MAX_DESCRIPTORS_ENV, bad)
        with pytest.raises(CpSharedKVTransferError, match=MAX_DESCRIPTORS_ENV):
            resolve_max_descriptors_per_batch()


def test_writes_are_split_into_bounded_batches_and_a_failure_names_its_cause(monkeypatch, caplog):
    monkeypatch.setenv(MAX_DESCRIPTORS_ENV, "3")
    mgr = make_manager()
    blocks = [(i, 100 + i, 10) for i in range(7)]
    original = Recorder(result=0)
    assert transfer.write_in_bounded_batches(original, mgr, "peer", blocks) == 0
    assert [len(args[2]) for args, _ in original.calls] == [3, 3, 1]
    assert [b for args, _ in original.calls for b in args[2]] == blocks
    stats = prefill.transfer_stats(mgr)
    assert (stats["write_batches"], stats["write_descriptors"], stats["write_bytes"]) == (3, 7, 70)

    failing = Recorder(result=lambda kv_mgr, session, batch: -1 if batch[0][0] == 3 else 0)
    with caplog.at_level(logging.ERROR, logger=shard_writes.__name__):
        assert transfer.write_in_bounded_batches(failing, mgr, "peer", blocks) == -1
    assert len(failing.calls) == 2  # stops at the failing batch
    cause = prefill.prefill_transfer(mgr).write_failures.take()
    assert "returned -1 for batch 2 of 3 (3 descriptors, 30 bytes) to peer" in cause
    assert "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" in cause and cause in caplog.text
    assert prefill.prefill_transfer(mgr).write_failures.take() is None  # reported once


# ------------------------------------------------------- index state, aux
def _state_entry(mgr, logical):
    state = [np.asarray(logical)]
    prefill.prefill_transfer(mgr).own_state_pages_in_place(state)
    return state


def test_index_state_goes_by_sequence_position():
    mgr = make_manager(cp_size=2, cp_rank=0)
    req = transfer_info(13, dst_pages=[1], dst_state=[90, 91, 92, 93, 94])
    state = _state_entry(mgr, [11, 12, 13, 14, 15])  # rank 0 owns 11, 13, 15 -> positions 0, 2, 4
    original = Recorder(result=0)
    assert transfer.send_owned_state_pages(original, mgr, req, state, "executor", "registration") == 0
    (args, _), = original.calls
    sent_req, src, executor, registration = args[1:]
    assert src[0].tolist() == [6, 7, 8] and sent_req.dst_state_indices[0].tolist() == [90, 92, 94]
    assert dataclasses.replace(sent_req, dst_state_indices=req.dst_state_indices) == req  # nothing else changed
    assert (executor, registration) == ("executor", "registration")
    assert prefill.transfer_stats(mgr)["state_pages"] == 3


def test_index_positions_beyond_decodes_list_are_not_sent(caplog):
    mgr = make_manager(cp_size=2, cp_rank=0)
    req = transfer_info(14, dst_pages=[1], dst_state=[90, 91, 92])
    state = _state_entry(mgr, [11, 12, 13, 14, 15])
    original = Recorder(result=0)
    with caplog.at_level(logging.WARNING, logger=shard_writes.__name__):
        transfer.send_owned_state_pages(original, mgr, req, state, None, None)
    (args, _), = original.calls
    assert args[2][0].tolist() == [6, 7] and args[1].dst_state_indices[0].tolist() == [90, 92]
    assert "decode sent 3 NSA index pages for a 5-page sequence" in caplog.text


def test_a_failed_index_write_fails_the_request_instead_of_being_ignored():
    mgr = make_manager(cp_size=2, cp_rank=1)
    req = transfer_info(15, dst_pages=[1], dst_state=[90, 91, 92, 93])
    state = _state_entry(mgr, [11, 12, 13, 14])
    context = prefill.prefill_transfer(mgr)

    def failing_extra(kv_mgr, *args):
        context.write_failures.put("Mooncake batch_transfer_sync_write returned -1 (lane full)")
        return -1

    assert transfer.send_owned_state_pages(failing_extra, mgr, req, state, None, None) == -1
    message = mgr.failure_records[15]
    assert message.startswith("prefill CP rank 1 of 2: writing the NSA index state of room 15 (2 pages")
    assert message.endswith("failed: Mooncake batch_transfer_sync_write returned -1 (lane full)")
    aux = Recorder(result=0)
    assert transfer.send_aux_unless_failed(aux, mgr, req, 2, [1]) == -1 and aux.calls == []
    # the next request on this thread is not affected
    assert transfer.send_aux_unless_failed(aux, mgr, transfer_info(16, [1]), 2, [1]) == 0
    assert prefill.transfer_stats(mgr)["failed_state_writes"] == 1


def test_a_failed_aux_write_is_recorded_with_its_cause():
    mgr = make_manager()
    context = prefill.prefill_transfer(mgr)

    def failing_aux(kv_mgr, *args):
        context.write_failures.put("returned -1 for batch 1 of 1")
        return -1

    assert transfer.send_aux_unless_failed(failing_aux, mgr, transfer_info(17, [1]), 2, [1]) == -1
    assert "writing the request metadata (aux) of room 17" in mgr.failure_records[17]
    assert mgr.failure_records[17].endswith("returned -1 for batch 1 of 1")


# ------------------------------------------------------ failure to decode
def test_decode_hears_the_cause_just_before_the_failed_status():
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=1)
    mgr.request_status[18] = KVPoll.Failed
    context = prefill.prefill_transfer(mgr)
    mgr.record_failure(18, "Failed to send kv chunk of 18 to 127.0.0.1:5555")  # SGLang's own text
    context.write_failures.put("Mooncake batch_transfer_sync_write returned -1 for batch 2 of 2")
    order = []
    original = Recorder(result=lambda *a: order.append("status"))
    mgr.sent_frames = order
    transfer.report_failure_cause_to_decode(original, mgr, "127.0.0.1", 5555, 18, KVPoll.Failed, 1)
    (endpoint, frames), status = order
    assert status == "status" and endpoint == "tcp://127.0.0.1:5555"
    assert frames[:5] == [mgr.AUX_DATA_HEADER, b"18", b"0", b"0", b"\xff\xff\xff\xff"]
    expected = ("prefill CP rank 1 of 2: Failed to send kv chunk of 18 to 127.0.0.1:5555: "
                "Mooncake batch_transfer_sync_write returned -1 for batch 2 of 2")
    assert parse_failure_cause(frames) == (18, expected)
    assert mgr.failure_records[18] == expected.split(": ", 1)[1]  # the prefill's own record names it too
    success = Recorder()
    transfer.report_failure_cause_to_decode(success, mgr, "127.0.0.1", 5555, 18, KVPoll.Success, 1)
    assert len(order) == 2 and len(success.calls) == 1  # no message for a success


def test_decode_keeps_the_cause_and_names_it_in_the_failure():
    from sglang.srt.disaggregation.base.conn import KVPoll

    conn = _conn()
    decode = make_manager(shared=False, mode="decode")
    decode.request_status[19] = KVPoll.Failed
    marker = [conn.MooncakeKVManager.AUX_DATA_HEADER, b"19", b"0", b"0", b"\xff\xff\xff\xff",
              b"sglang-cp-shared-kv failure cause:prefill CP rank 0 of 2: index write failed"]
    stock = Recorder()
    assert transfer.accept_failure_cause(stock, decode, marker) is None and stock.calls == []
    ordinary = [conn.MooncakeKVManager.AUX_DATA_HEADER, b"19", b"0", b"1", b"\x00\x00\x00\x02", b"ab"]
    transfer.accept_failure_cause(stock, decode, ordinary)
    assert stock.calls == [((decode, ordinary), {})]

    receiver = SimpleNamespace(kv_mgr=decode, bootstrap_room=19)

    def stock_failure(recv):
        raise conn.KVTransferError(19, "Failed to get kvcache from prefill instance, it might be dead")

    with pytest.raises(conn.KVTransferError) as exc:
        transfer.failure_exception_with_cause(stock_failure, receiver)
    assert str(exc.value) == ("KVTransferError(bootstrap_room=19): Failed to get kvcache from prefill instance, "
                              "it might be dead; cause: prefill CP rank 0 of 2: index write failed")
    with pytest.raises(conn.KVTransferError) as again:  # consumed: a later failure is SGLang's alone
        transfer.failure_exception_with_cause(stock_failure, receiver)
    assert "cause:" not in str(again.value)


def test_causes_from_several_ranks_are_all_named():
    from sglang.srt.disaggregation.base.conn import KVPoll

    conn = _conn()
    decode = make_manager(shared=False, mode="decode")
    decode.request_status[23] = KVPoll.Failed
    for rank in (0, 1):
        transfer.accept_failure_cause(Recorder(), decode, [
            conn.MooncakeKVManager.AUX_DATA_HEADER, b"23", b"0", b"0", b"\xff\xff\xff\xff",
            f"sglang-cp-shared-kv failure cause:prefill CP rank {rank} of 2: lane full".encode()])

    def stock_failure(recv):
        raise conn.KVTransferError(23, "Failed to get kvcache from prefill instance, it might be dead")

    with pytest.raises(conn.KVTransferError, match="cause: prefill CP rank 0 of 2: lane full [|] prefill CP rank 1"):
        transfer.failure_exception_with_cause(stock_failure, SimpleNamespace(kv_mgr=decode, bootstrap_room=23))


def test_a_cause_for_a_finished_room_is_dropped():
    conn = _conn()
    decode = make_manager(shared=False, mode="decode")
    marker = [conn.MooncakeKVManager.AUX_DATA_HEADER, b"20", b"0", b"0", b"\xff\xff\xff\xff",
              b"sglang-cp-shared-kv failure cause:late"]
    transfer.accept_failure_cause(Recorder(), decode, marker)
    assert decode.__dict__.get("_cp_shared_kv_failure_causes") is None


def test_a_decode_without_the_plugin_drops_the_cause_message_harmlessly(caplog):
    """SGLang's own AUX_DATA handler (unwrapped) logs a length mismatch and writes nothing."""
    import inspect

    import torch

    conn = _conn()
    buffer = torch.zeros(64, dtype=torch.uint8)
    decode = make_manager(shared=False, mode="decode")
    decode.kv_args.aux_data_ptrs, decode.kv_args.aux_item_lens = [buffer.data_ptr()], [16]
    marker = [conn.MooncakeKVManager.AUX_DATA_HEADER, b"21", b"0", b"0", b"\xff\xff\xff\xff",
              b"sglang-cp-shared-kv failure cause:" + b"x" * 40]
    stock_handler = inspect.unwrap(conn.MooncakeKVManager._handle_aux_data)
    with caplog.at_level(logging.ERROR):
        stock_handler(decode, marker)
    assert "AUX_DATA length mismatch for bootstrap_room 21" in caplog.text
    assert int(buffer.sum()) == 0


# ------------------------------------------------------------ set-up checks
@pytest.mark.parametrize("change,expected", [
    (dict(mla=False), "not an MLA pool"),
    (dict(all_cp_ranks=False), "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not 1"),
    (dict(cp_size=1), "attention CP size is 1"),
])
def test_a_configuration_that_cannot_shard_stops_at_manager_start(change, expected):
    mgr = make_manager(**change)
    with pytest.raises(CpSharedKVTransferError, match=expected):
        transfer.prepare_prefill_transfer(None, mgr)


def shared_pool(cp_size, cp_rank, physical_pages):
    """A real shared-KV pool (CPU) as one rank builds it: ``physical_pages`` per rank."""
    import torch

    from sglang_cp_shared_kv.context import CpSharedKVContext
    from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

    return CpSharedNSATokenToKVPool(
        physical_pages * PAGE * cp_size, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16,
        qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=576, context=CpSharedKVContext(CpSharedKVLayout(PAGE, cp_size, cp_rank)))


def test_the_manager_must_see_the_pool_the_rank_was_built_with():
    # what PrefillBootstrapQueue holds: the pool this rank built (CP rank 1 of 2, 10 pages)
    queue = SimpleNamespace(token_to_kv_pool=shared_pool(cp_size=2, cp_rank=1, physical_pages=10))
    with pytest.raises(CpSharedKVTransferError, match="built for"):
        transfer.check_transfer_matches_pool(make_manager(cp_size=2, cp_rank=0), queue)
    transfer.check_transfer_matches_pool(make_manager(cp_size=2, cp_rank=1, physical_pages=10), queue)


def test_decode_managers_never_shard():
    mgr = make_manager(shared=True, mode="decode")
    assert transfer.prepare_prefill_transfer(None, mgr) is None and prefill.prefill_transfer(mgr) is None


def test_prometheus_counters_with_metrics_on():
    from prometheus_client import REGISTRY

    mgr = make_manager(cp_size=2, cp_rank=1, metrics=True)
    ready_room(mgr, 22, dst_pages=list(range(10, 14)))
    physical, positions = transfer.filter_owned_pages(Recorder(), mgr, np.array([1, 2, 3, 4], np.int32), slice(0, 4))
    before = REGISTRY.get_sample_value("sglang:cp_shared_kv_transfer_pages_total", {"cp_rank": "1", "kind": "kv"}) or 0
    transfer.enqueue_owned_chunk(Recorder(), mgr, 22, physical, positions, False)
    after = REGISTRY.get_sample_value("sglang:cp_shared_kv_transfer_pages_total", {"cp_rank": "1", "kind": "kv"})
    assert after - before == 2


# ------------------------------------------------- a request the prefill aborted
class Notices:
    """Records what the abort path sends to decode (in place of its ZMQ sockets)."""

    def __init__(self):
        self.sent = []

    def send(self, remote, dst_port, messages):
        self.sent.append((remote, dst_port, messages))


@pytest.mark.parametrize("where", ["sender.abort", "waiting-queue release"])
def test_an_aborted_request_is_failed_on_decode_at_once(where, caplog):
    """Stock SGLang drops an aborted request on prefill without a word to decode, which then
    holds its preallocated pages until its waiting timeout (300 s). With shared KV the abort
    sends decode the cause and SGLang's Failed status at once; later chunks are dropped."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=1)
    info = ready_room(mgr, 21, dst_pages=[70, 71, 72, 73])
    notices = prefill.prefill_transfer(mgr)._abort_notices = Notices()
    sender = SimpleNamespace(kv_mgr=mgr, bootstrap_room=21, aux_index=5)
    original = Recorder(result="done")
    with caplog.at_level(logging.INFO, logger="sglang_cp_shared_kv.transfer"):
        if where == "sender.abort":
            assert transfer.fail_aborted_room_on_decode(original, sender) == "done"
        else:
            req = SimpleNamespace(disagg_kv_sender=sender, metadata_buffer_index=5)
            assert transfer.fail_unsent_room_on_release(original, req, "allocator") == "done"
    assert len(original.calls) == 1  # SGLang's own abort / release still runs
    (remote, port, (cause, status)), = notices.sent
    assert (remote, port) == ("127.0.0.1", 5555)
    assert status == [b"21", str(KVPoll.Failed).encode(), b"1"]  # room, Failed, this rank's sender id
    room, text = parse_failure_cause(cause)
    assert room == 21 and text.startswith("prefill CP rank 1 of 2: room 21 ends unsent: the prefill aborted")
    if where == "sender.abort":
        assert mgr.failure_records[21] == text  # SGLang's failure_exception reads it next
    else:
        assert 21 not in mgr.failure_records  # SGLang drops this sender unread: a record would stay for good
    stats = prefill.transfer_stats(mgr)
    assert stats["aborted_requests"] == 1 and stats["rejected_requests"] == 0
    assert "decode told it failed (1 target(s))" in caplog.text and "ERROR" not in caplog.text
    # a chunk still to come (in flight) is dropped, its aux write withheld
    later = Recorder()
    transfer.enqueue_owned_chunk(later, mgr, 21, np.array([1], np.int32), np.array([0]), True, aux_index=5)
    assert later.calls == []
    assert transfer.send_aux_unless_failed(Recorder(), mgr, info, 5, [1]) == -1
    # twice (abort, then release) tells decode once
    transfer.fail_unsent_room_on_release(Recorder(), SimpleNamespace(disagg_kv_sender=sender))
    assert len(notices.sent) == 1


def test_the_prefill_warmup_request_with_its_fake_sender_is_released_untouched():
    """SGLang's PD prefill warms up with a request to its fake bootstrap host, whose
    ``FakeKVSender`` (disaggregation/fake/conn.py) carries the real manager but no room; its
    release must pass through. Found at the first flag-on PD prefill on a GPU (one H200,
    2026-12-03): the hook read ``sender.bootstrap_room`` and the warmup stopped every CP
    rank's scheduler ("'FakeKVSender' object has no attribute 'bootstrap_room'")."""
    from sglang.srt.disaggregation.fake.conn import FakeKVSender

    mgr = make_manager(cp_size=2, cp_rank=1)
    notices = prefill.prefill_transfer(mgr)._abort_notices = Notices()
    sender = FakeKVSender(mgr, "fake-bootstrap-host", 0, [0], 0)
    original = Recorder(result="released")
    req = SimpleNamespace(disagg_kv_sender=sender, metadata_buffer_index=3)
    assert transfer.fail_unsent_room_on_release(original, req, "allocator") == "released"
    assert len(original.calls) == 1 and notices.sent == []
    assert prefill.transfer_stats(mgr)["aborted_requests"] == 0


def test_an_abort_before_decode_registered_is_told_when_it_registers(caplog):
    """SGLang's bootstrap thread sets a room WaitingForInput once decode registered it; a room
    this rank aborted before that is failed on decode then (stock: decode waits for its
    timeout), once, and no other room or status is touched."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=3, cp_rank=2)
    info = ready_room(mgr, 23, dst_pages=[70, 71])
    del mgr.transfer_infos[23]
    mgr.request_status[23] = KVPoll.Bootstrapping
    notices = prefill.prefill_transfer(mgr)._abort_notices = Notices()
    sender = SimpleNamespace(kv_mgr=mgr, bootstrap_room=23, aux_index=1)
    with caplog.at_level(logging.INFO, logger="sglang_cp_shared_kv.transfer"):
        transfer.fail_aborted_room_on_decode(Recorder(), sender)
        assert notices.sent == [] and "0 decode target(s) told, the rest when they register" in caplog.text
        assert mgr.failure_records[23].endswith("before sending all of its KV")
        update = Recorder(result="stock")
        # another room, or another status of this room: nothing
        assert transfer.fail_late_registration_of_aborted_room(update, mgr, 99, KVPoll.WaitingForInput) == "stock"
        transfer.fail_late_registration_of_aborted_room(update, mgr, 23, KVPoll.Bootstrapping)
        assert notices.sent == [] and len(update.calls) == 2
        mgr.transfer_infos[23] = {info.mooncake_session_id: info}  # decode registers
        transfer.fail_late_registration_of_aborted_room(update, mgr, 23, KVPoll.WaitingForInput)
        transfer.fail_late_registration_of_aborted_room(update, mgr, 23, KVPoll.WaitingForInput)
    # (the drained notice too: a target that registered after the abort was never written to)
    (remote, port, (cause, status, drained)), = notices.sent
    assert status == [b"23", str(KVPoll.Failed).encode(), b"2"] and parse_failure_cause(cause)[0] == 23
    assert parse_drained_notice(drained) == (23, 2)
    assert len(update.calls) == 4  # SGLang's update_status ran every time
    assert prefill.transfer_stats(mgr)["aborted_requests"] == 1


def test_an_abort_during_registration_tells_each_decode_target_once():
    """A room with two decode targets (decode TP2), one registered when the prefill aborts:
    that one is told at once, the other when it registers, and neither twice."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=0)
    first = ready_room(mgr, 24, dst_pages=[70, 71])
    second = dataclasses.replace(first, mooncake_session_id="127.0.0.1:7001", dst_port=5556)
    first.required_dst_info_num = second.required_dst_info_num = 2
    mgr.request_status[24] = KVPoll.Bootstrapping
    notices = prefill.prefill_transfer(mgr)._abort_notices = Notices()
    transfer.fail_aborted_room_on_decode(Recorder(), SimpleNamespace(kv_mgr=mgr, bootstrap_room=24, aux_index=1))
    assert [port for _, port, _ in notices.sent] == [5555]
    mgr.transfer_infos[24][second.mooncake_session_id] = second  # the second target registers
    transfer.fail_late_registration_of_aborted_room(Recorder(), mgr, 24, KVPoll.WaitingForInput)
    transfer.fail_late_registration_of_aborted_room(Recorder(), mgr, 24, KVPoll.WaitingForInput)
    assert [port for _, port, _ in notices.sent] == [5555, 5556]
    assert all(parse_failure_cause(messages[0])[0] == 24 for _, _, messages in notices.sent)
    # the late one never had a chunk: drained with its Failed (the first one's comes behind the
    # room's chunks, from the transfer queues)
    assert [len(messages) for _, _, messages in notices.sent] == [2, 3]
    assert parse_drained_notice(notices.sent[1][2][2]) == (24, 0)


def test_an_abort_while_decode_registers_other_targets_never_raises():
    """SGLang's bootstrap thread adds targets to ``transfer_infos[room]`` while the scheduler
    aborts the room; reading them there must not raise "dictionary changed size during
    iteration" (which would take the prefill scheduler down)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=0)
    info = ready_room(mgr, 25, dst_pages=[70, 71])
    info.required_dst_info_num = 1 << 30  # never complete: every abort reads the targets
    context = prefill.prefill_transfer(mgr)
    context._abort_notices = Notices()
    targets = mgr.transfer_infos[25]
    stop = threading.Event()

    def register():
        n = 0
        while not stop.is_set():
            n += 1
            targets[f"s{n}"] = info
            if len(targets) > 64:
                targets.clear()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=register)
    thread.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            mgr.request_status[25] = KVPoll.Bootstrapping
            context._rejected.pop(25)
            assert context.fail_unsent_room(mgr, 25, "aborted")
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


def test_a_rejected_rooms_aux_write_stays_withheld_however_many_rooms_fail_after_it():
    """The room map that remembers rejections is bounded; the aux guard must not depend on it
    (else a burst of later failures lets this rank report Success for a room it rejected)."""
    from sglang_cp_shared_kv.transfer.failure_cause import MAX_TRACKED_ROOMS

    mgr = make_manager(cp_size=2, cp_rank=0, physical_pages=10)
    info = ready_room(mgr, 9, dst_pages=[70, 71, 72, 73])
    _rejected(mgr, 9, [1, 0, 3, 4], slice(0, 4))
    context = prefill.prefill_transfer(mgr)
    for room in range(1000, 1000 + MAX_TRACKED_ROOMS + 1):
        context._rejected.put(room, "another failure")
    assert context._rejected.get(9) is None  # forgotten by the bounded map ...
    aux = Recorder()
    assert transfer.send_aux_unless_failed(aux, mgr, info, 4, [1]) == -1 and aux.calls == []  # ... not by the guard


@pytest.mark.parametrize("case", ["concluded", "flag off", "no sender"])
def test_an_abort_with_nothing_to_tell_decode_changes_nothing(case):
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(shared=case != "flag off")
    ready_room(mgr, 22, dst_pages=[70, 71])
    if case == "concluded":
        mgr.request_status[22] = KVPoll.Success
    context = prefill.prefill_transfer(mgr)
    notices = Notices()
    if context is not None:
        context._abort_notices = notices
    sender = None if case == "no sender" else SimpleNamespace(kv_mgr=mgr, bootstrap_room=22, aux_index=1)
    original = Recorder()
    if sender is not None:
        transfer.fail_aborted_room_on_decode(original, sender)
    transfer.fail_unsent_room_on_release(original, SimpleNamespace(disagg_kv_sender=sender))
    assert notices.sent == [] and 22 not in mgr.failure_records


def test_the_failed_status_frames_are_sglangs():
    """decode parses (room, KVPoll value, sender id); the plugin's pure encoder writes Failed as 0."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_cp_shared_kv.transfer.failure_cause import encode_failed_status

    assert encode_failed_status(7, 3) == [b"7", str(int(KVPoll.Failed)).encode("ascii"), b"3"]


# ------------------------------------- a failed room: drained notices (SGLang 0.5.12.post1)
STOP = "stop"  # put behind a queue's markers so a worker's get returns once they are taken


def take_all(queue) -> list:
    """What SGLang's transfer worker takes from ``queue`` (through the plugin's queue) until
    :data:`STOP`, in order."""
    from sglang_cp_shared_kv.transfer.room_drain import DrainingQueue

    queue.put(STOP)
    draining, taken = DrainingQueue(queue), []
    while (item := draining.get()) != STOP:
        taken.append(item)
    return taken


def sender(mgr, room, conclude_state=None):
    conn = _conn()
    sender = object.__new__(conn.MooncakeKVSender)
    sender.kv_mgr, sender.bootstrap_room, sender.conclude_state = mgr, room, conclude_state
    return sender


def failure_exception(sender):
    """SGLang's ``MooncakeKVSender.failure_exception`` through the plugin's hook, as SGLang's
    prefill calls it once its group agreed the room failed (it clears the room and raises)."""
    import inspect

    from sglang.srt.disaggregation.mooncake.conn import KVTransferError, MooncakeKVSender

    with pytest.raises(KVTransferError):
        transfer.drain_room_failed_by_the_group(inspect.unwrap(MooncakeKVSender.failure_exception), sender)


@pytest.mark.parametrize("own_status", ["Success", "Transferring", "Failed"])
def test_a_room_the_group_failed_tells_decode_drained_after_every_queue_passed_its_marker(own_status):
    """SGLang's prefill calls ``failure_exception`` on every CP rank once the group agreed a room
    failed, whatever the rank's own status (a rank may have sent all of it), and clears it; a
    chunk taken earlier may still be written. The drained notice leaves only once each transfer
    queue has passed the marker (every chunk ahead of it done), once, to each real target."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_cp_shared_kv.transfer.failure_cause import encode_drained_notice

    mgr = make_manager(cp_size=3, cp_rank=1)
    info = ready_room(mgr, 31, dst_pages=[70, 71])
    dummy = dataclasses.replace(info, mooncake_session_id="127.0.0.1:7009", dst_port=5599, is_dummy=True)
    mgr.transfer_infos[31][dummy.mooncake_session_id] = dummy
    mgr.request_status[31] = getattr(KVPoll, own_status)
    mgr.transfer_queues[0].put("chunk of room 31")
    failure_exception(sender(mgr, 31, conclude_state=KVPoll.Success if own_status == "Success" else None))
    assert 31 not in mgr.transfer_infos and 31 not in mgr.request_status  # SGLang's clear ran
    assert mgr.sent_frames == []
    assert take_all(mgr.transfer_queues[0]) == ["chunk of room 31"]  # the chunk first, then the marker
    assert mgr.sent_frames == []  # one queue still holds its marker
    assert take_all(mgr.transfer_queues[1]) == []
    notice = encode_drained_notice(mgr.AUX_DATA_HEADER, 31, 1)
    assert mgr.sent_frames == [("tcp://127.0.0.1:5555", notice)]  # the real target, once (no dummy)
    failure_exception(sender(mgr, 31))  # again: no second marker
    assert take_all(mgr.transfer_queues[0]) == [] and len(mgr.sent_frames) == 1


def test_a_rank_that_sent_all_of_a_room_the_group_then_failed_still_tells_decode():
    """SGLang's transfer worker drops a room's targets once this rank's last chunk is written
    (its Success is sent); the group may agree on Failed after that (another rank failed), and
    decode, which gave the room up at the first Failed, ignored that Success. The drained
    notice goes to the endpoints the room's first chunk had."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=0)
    ready_room(mgr, 36, dst_pages=[70, 71])
    physical, positions = transfer.filter_owned_pages(Recorder(), mgr, np.array([1, 2], np.int32), slice(0, 2))
    transfer.enqueue_owned_chunk(Recorder(), mgr, 36, physical, positions, True, aux_index=1)
    mgr.request_status[36] = KVPoll.Success
    del mgr.transfer_infos[36]  # what the worker does once this rank's part is sent
    failure_exception(sender(mgr, 36, conclude_state=KVPoll.Success))
    assert take_all(mgr.transfer_queues[0]) == take_all(mgr.transfer_queues[1]) == []
    assert [(endpoint, parse_drained_notice(frames)) for endpoint, frames in mgr.sent_frames] == [
        ("tcp://127.0.0.1:5555", (36, 0))]


def test_a_room_the_group_failed_on_a_flag_off_prefill_puts_no_marker():
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(shared=False)
    ready_room(mgr, 32, dst_pages=[70])
    mgr.request_status[32] = KVPoll.Failed
    original = Recorder(result="raised")
    assert transfer.drain_room_failed_by_the_group(original, sender(mgr, 32)) == "raised"
    assert len(original.calls) == 1
    assert all(not queue._buf for queue in mgr.transfer_queues) and mgr.sent_frames == []


def test_an_abort_drains_the_room_once_and_later_chunks_stay_out():
    """The abort path tells decode Failed at once (scheduler thread); the drained notice follows
    once the chunks already queued are done, and the clear after it adds no second marker."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=0)
    ready_room(mgr, 33, dst_pages=[70, 71, 72])
    prefill.prefill_transfer(mgr)._abort_notices = Notices()
    mgr.transfer_queues[1].put("queued chunk")
    transfer.fail_aborted_room_on_decode(Recorder(), SimpleNamespace(kv_mgr=mgr, bootstrap_room=33, aux_index=1))
    later = Recorder()
    transfer.enqueue_owned_chunk(later, mgr, 33, np.array([1], np.int32), np.array([0]), True, aux_index=1)
    assert later.calls == []  # nothing enqueued behind the marker
    mgr.request_status[33] = KVPoll.Failed
    failure_exception(sender(mgr, 33))
    assert take_all(mgr.transfer_queues[0]) == [] and mgr.sent_frames == []
    assert take_all(mgr.transfer_queues[1]) == ["queued chunk"]
    assert [parse_drained_notice(frames) for _, frames in mgr.sent_frames] == [(33, 0)]


def test_the_worker_takes_chunks_through_the_draining_queue_only_with_the_flag_on_a_prefill():
    from sglang.srt.disaggregation.common.utils import FastQueue

    from sglang_cp_shared_kv.transfer.room_drain import DrainingQueue

    for mgr, wrapped in ((make_manager(), True), (make_manager(shared=False), False),
                         (make_manager(mode="decode"), False)):
        queue, worker = FastQueue(), Recorder(result=None)
        transfer.drain_markers_reach_the_worker(worker, mgr, queue, "executor")
        (args, _), = worker.calls
        assert args[0] is mgr and args[2] == "executor"
        assert isinstance(args[1], DrainingQueue) is wrapped and (args[1] is queue) is not wrapped


def test_a_drained_notice_that_raises_never_stops_the_worker(caplog):
    """SGLang's worker loop dies with any exception it sees (the prefill is then dead)."""
    from sglang.srt.disaggregation.common.utils import FastQueue

    from sglang_cp_shared_kv.transfer.room_drain import put_drain_markers

    def broken():
        raise OSError("socket gone")

    queue = FastQueue()
    put_drain_markers([queue], 34, broken)
    queue.put("next chunk")
    with caplog.at_level(logging.ERROR, logger="sglang_cp_shared_kv.transfer"):
        assert take_all(queue) == ["next chunk"]
    assert "the drained notice of room 34 failed" in caplog.text and "socket gone" in caplog.text


def test_drain_markers_in_a_real_worker_thread_follow_every_write_before_them():
    """A worker thread taking chunks slowly (each a write that takes time): the drained notice
    of a room is sent after the last chunk queued before the clear was written, never before."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = make_manager(cp_size=2, cp_rank=1)
    ready_room(mgr, 35, dst_pages=[70, 71])
    written = []

    def worker(queue):
        while (item := queue.get()) != STOP:
            time.sleep(0.05)  # the write
            written.append((item, len(mgr.sent_frames)))

    from sglang_cp_shared_kv.transfer.room_drain import DrainingQueue

    threads = [threading.Thread(target=worker, args=(DrainingQueue(q),)) for q in mgr.transfer_queues]
    for n in range(3):
        mgr.transfer_queues[n % 2].put(f"chunk {n}")
    for thread in threads:
        thread.start()
    mgr.request_status[35] = KVPoll.Failed
    failure_exception(sender(mgr, 35))
    for queue in mgr.transfer_queues:
        queue.put(STOP)
    for thread in threads:
        thread.join(10)
    assert sorted(item for item, _ in written) == ["chunk 0", "chunk 1", "chunk 2"]
    assert all(notices_before == 0 for _, notices_before in written)  # no notice before any write
    assert [parse_drained_notice(frames) for _, frames in mgr.sent_frames] == [(35, 1)]
