"""Decode, the flag on (SGLang 0.5.12.post1): a failed room's pages and metadata slot stay held
until every prefill rank has stopped writing them (``decode.failed_room_holds``).

Stock 0.5.12.post1 frees them in the ``pop_transferred`` that sees the room Failed, while the
prefill's other CP ranks may still write chunks of it (design.md, "A failed room's pages on
decode"). Here SGLang's own ``DecodeTransferQueue.pop_transferred`` runs with the plugin's
hooks applied, on a real ``ReqToMetadataIdxAllocator``, real ``MooncakeKVReceiver`` objects
over a decode ``MooncakeKVManager`` (constructors skipped: no engine, no sockets), a one-rank
gloo group for SGLang's poll, and a recording tree cache; the prefill's drained notice reaches
the manager through SGLang's ``_handle_aux_data`` (hooked). The release agreed by N decode ranks
runs in gloo processes (``sglang_cp_shared_kv_testing.decode_holds``).
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from sglang_cp_shared_kv.decode import server as decode_server
from sglang_cp_shared_kv.settings.config import FAILED_ROOM_HOLD_ENV, FLAG_DEST, failed_room_hold_s
from sglang_cp_shared_kv.transfer.decode import FailedRoom, room_drains
from sglang_cp_shared_kv.transfer.failure_cause import encode_drained_notice

pytestmark = pytest.mark.usefixtures("plugin_loaded")

FAILED_ROOM, OTHER_ROOM = 41, 42


@pytest.fixture
def one_rank_group(sglang_world_of_one):
    """A gloo group of this process alone: decode's attention-TP group (SGLang all-reduces the
    receivers' polls over it, the holds their ready flags)."""
    from sglang.srt.distributed import parallel_state as ps

    return ps.get_tp_group().cpu_group


def decode_manager(flag: bool = True):
    from sglang.srt.disaggregation.mooncake import conn
    from sglang.srt.disaggregation.utils import DisaggregationMode

    class Manager(conn.MooncakeKVManager):
        def __init__(self):  # no engine, no sockets
            pass

    mgr = Manager()
    mgr.server_args = SimpleNamespace(**{FLAG_DEST: flag}, disaggregation_mode="decode", enable_metrics=False)
    mgr.disaggregation_mode = DisaggregationMode.DECODE
    mgr.request_status, mgr.failure_records, mgr.failure_lock = {}, {}, threading.Lock()
    mgr.required_prefill_response_num_table, mgr.prefill_response_tracker = {}, {}
    return mgr


def receiver(mgr, room: int, status, *, expected: int, succeeded=()):
    """A room as decode's transfer queue holds it: registered, ``expected`` prefill senders."""
    from sglang.srt.disaggregation.mooncake import conn

    mgr.request_status[room] = status
    mgr.required_prefill_response_num_table[room] = expected
    mgr.prefill_response_tracker[room] = set(succeeded)
    if status == 0:  # KVPoll.Failed: what SGLang's receiver thread records with it
        mgr.failure_records[room] = "Failed to get kvcache from prefill instance, it might be dead"
    recv = object.__new__(conn.MooncakeKVReceiver)
    recv.kv_mgr, recv.bootstrap_room, recv.conclude_state, recv.init_time = mgr, room, None, None
    return recv


class TreeCache:
    """Records SGLang's release of a request (``release_kv_cache`` -> ``cache_finished_req``)."""

    def __init__(self):
        self.released = []

    def cache_finished_req(self, req, is_insert=True):
        self.released.append((req.rid, is_insert))
        req.req_pool_idx = None


def transfer_queue(group, *, flag: bool = True, slots: int = 4):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    streamed = []
    scheduler = SimpleNamespace(server_args=SimpleNamespace(**{FLAG_DEST: flag}, disaggregation_mode="decode",
                                                            enable_metrics=False),
                                spec_algorithm=None, enable_metrics=False, enable_hisparse=False,
                                stream_output=lambda reqs, *_: streamed.extend(r.rid for r in reqs))
    allocator = ReqToMetadataIdxAllocator(slots)
    queue = DecodeTransferQueue(group, allocator, 0, None, scheduler, TreeCache())
    scheduler.disagg_decode_transfer_queue = queue
    return queue, scheduler, allocator, streamed


def enqueue(queue, allocator, recv, rid: str):
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", [2, 3, 4], SamplingParams(max_new_tokens=4))
    req.bootstrap_room, req.req_pool_idx = recv.bootstrap_room, 0
    queue.queue.append(DecodeRequest(req=req, kv_receiver=recv, metadata_buffer_index=allocator.alloc()))
    return req


def drained(mgr, room: int, prefill_rank: int):
    """The prefill rank's drained notice, as decode's receiver thread hands it to SGLang."""
    notice = encode_drained_notice(mgr.AUX_DATA_HEADER, room, prefill_rank)
    assert mgr._handle_aux_data(notice) is None  # (kept by the plugin; SGLang never parses it)


def release_round(scheduler):
    """What the hooked ``process_decode_queue`` does after SGLang's work, every loop."""
    decode_server.release_drained_rooms(None, scheduler)


def test_a_failed_rooms_pages_and_slot_wait_for_every_prefill_rank(one_rank_group, caplog):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    queue, scheduler, allocator, streamed = transfer_queue(one_rank_group)
    mgr = decode_manager()
    failed_req = enqueue(queue, allocator, receiver(mgr, FAILED_ROOM, KVPoll.Failed, expected=3, succeeded={0}),
                         "failed")
    waiting_req = enqueue(queue, allocator, receiver(mgr, OTHER_ROOM, KVPoll.Transferring, expected=3), "waiting")
    slot = queue.queue[0].metadata_buffer_index
    free_before = allocator.available_size()

    assert queue.pop_transferred() == []
    # the request failed at once, as stock: answered, out of the queue ...
    assert isinstance(failed_req.finished_reason, FINISH_ABORT) and streamed == ["failed"]
    assert [d.req.rid for d in queue.queue] == ["waiting"]
    # ... but its pages and metadata slot are held (rank 0's Success came before the failure)
    assert queue.tree_cache.released == [] and allocator.available_size() == free_before
    assert room_drains(mgr).failure(FAILED_ROOM) == FailedRoom(expected=3, succeeded=frozenset({0}))
    assert not decode_server.busy_while_holding(True, scheduler)
    assert decode_server.busy_while_holding(True, scheduler, for_health_check=True)  # SGLang's answer
    drained(mgr, FAILED_ROOM, 2)
    release_round(scheduler)
    assert queue.tree_cache.released == []  # prefill rank 1 may still write
    with caplog.at_level(logging.DEBUG, logger="sglang_cp_shared_kv.decode"):
        drained(mgr, FAILED_ROOM, 1)
        release_round(scheduler)
    assert queue.tree_cache.released == [("failed", False)]  # SGLang's own release, not inserted
    assert allocator.available_size() == free_before + 1 and allocator.free_slots[-1] == slot
    assert decode_server.busy_while_holding(True, scheduler)
    assert "every prefill rank is done" in caplog.text and "WARNING" not in caplog.text
    assert room_drains(mgr).failure(FAILED_ROOM) is None  # forgotten
    release_round(scheduler)
    assert len(queue.tree_cache.released) == 1 and waiting_req.finished_reason is None


def test_a_drained_notice_before_decode_saw_the_failure_counts(one_rank_group):
    """The notice travels on the worker's socket, the Failed status on another: either may come first."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    queue, scheduler, allocator, _ = transfer_queue(one_rank_group)
    mgr = decode_manager()
    recv = receiver(mgr, FAILED_ROOM, KVPoll.Transferring, expected=2)
    enqueue(queue, allocator, recv, "failed")
    drained(mgr, FAILED_ROOM, 0)
    drained(mgr, FAILED_ROOM, 1)
    mgr.request_status[FAILED_ROOM] = KVPoll.Failed
    queue.pop_transferred()
    assert queue.tree_cache.released == []  # held until the agreed release ...
    release_round(scheduler)
    assert queue.tree_cache.released == [("failed", False)]  # ... in the same loop


class Socket:
    """Decode's receiving socket: hands out the messages put on it, in order."""

    def __init__(self, *messages):
        self.messages = list(messages)

    def recv_multipart(self):
        return self.messages.pop(0)


def status(room: int, poll, prefill_rank: int):
    """SGLang's status message (``sync_status_to_decode_endpoint``'s three frames)."""
    return [str(room).encode("ascii"), str(int(poll)).encode("ascii"), str(prefill_rank).encode("ascii")]


def test_a_success_for_a_room_decode_gave_up_counts_as_that_ranks_drain(one_rank_group):
    """A rank that sent all of a room before its group agreed on Failed, or whose decode failed
    the room alone (an abort on decode), sends a Success that SGLang ignores for a cleared
    room: the receiver thread's socket, watched from its start, counts it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_cp_shared_kv.transfer import hooks as transfer

    queue, scheduler, allocator, _ = transfer_queue(one_rank_group)
    mgr = decode_manager()
    started = []
    mgr.server_socket = Socket(status(FAILED_ROOM, KVPoll.Success, 1), status(OTHER_ROOM, KVPoll.Success, 0))
    transfer.watch_late_successes(lambda m: started.append(m), mgr)  # (SGLang's start_decode_thread)
    assert started == [mgr] and type(mgr.server_socket).__name__ == "StatusObserver"
    enqueue(queue, allocator, receiver(mgr, FAILED_ROOM, KVPoll.Failed, expected=2, succeeded={0}), "failed")
    receiver(mgr, OTHER_ROOM, KVPoll.Transferring, expected=1)  # (tracked: its Success is SGLang's)
    queue.pop_transferred()
    release_round(scheduler)
    assert queue.tree_cache.released == []
    assert mgr.server_socket.recv_multipart() == status(FAILED_ROOM, KVPoll.Success, 1)  # SGLang reads it, as ever
    assert mgr.server_socket.recv_multipart() == status(OTHER_ROOM, KVPoll.Success, 0)
    assert room_drains(mgr).heard(OTHER_ROOM) == frozenset()  # (kept aside: it never failed)
    release_round(scheduler)
    assert queue.tree_cache.released == [("failed", False)]
    flag_off = decode_manager(flag=False)
    flag_off.server_socket = socket = Socket()
    transfer.watch_late_successes(lambda m: None, flag_off)
    assert flag_off.server_socket is socket


def test_a_success_read_just_before_its_room_fails_still_counts(one_rank_group):
    """The receiver thread sees rank 1's Success while SGLang still tracks the room; the room
    fails before SGLang's own handling reads it (the snapshot lacks rank 1), and SGLang then
    drops it as a status for a cleared room. The Success kept aside counts: the hold ends on
    it, not at its bound (the default 30 s here)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_cp_shared_kv.transfer import hooks as transfer

    queue, scheduler, allocator, _ = transfer_queue(one_rank_group)
    mgr = decode_manager()
    mgr.server_socket = Socket(status(FAILED_ROOM, KVPoll.Success, 1))
    transfer.watch_late_successes(lambda m: None, mgr)
    receiver(mgr, FAILED_ROOM, KVPoll.Transferring, expected=2, succeeded={0})
    assert mgr.server_socket.recv_multipart() == status(FAILED_ROOM, KVPoll.Success, 1)  # (observed, tracked)
    assert room_drains(mgr).heard(FAILED_ROOM) == frozenset()  # not failed: nothing counts yet
    enqueue(queue, allocator, receiver(mgr, FAILED_ROOM, KVPoll.Failed, expected=2, succeeded={0}), "failed")
    queue.pop_transferred()
    release_round(scheduler)
    assert queue.tree_cache.released == [("failed", False)]
    assert room_drains(mgr).heard(FAILED_ROOM) == frozenset()  # released: forgotten


def test_a_silent_prefill_rank_releases_at_the_timeout_with_a_warning(one_rank_group, monkeypatch, caplog):
    from prometheus_client import REGISTRY
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_cp_shared_kv.decode.failed_room_holds import HOLDS_METRIC

    monkeypatch.setenv(FAILED_ROOM_HOLD_ENV, "0.2")
    queue, scheduler, allocator, _ = transfer_queue(one_rank_group)
    queue.scheduler.server_args.enable_metrics = True
    decode_server.hold_failed_rooms(None, queue)  # (again, with metrics: the fixture's holds are replaced)
    mgr = decode_manager()
    enqueue(queue, allocator, receiver(mgr, FAILED_ROOM, KVPoll.Failed, expected=2, succeeded={1}), "failed")
    before = REGISTRY.get_sample_value(f"{HOLDS_METRIC}", {"how": "timeout"}) or 0
    queue.pop_transferred()
    release_round(scheduler)
    assert queue.tree_cache.released == []
    import time

    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger="sglang_cp_shared_kv.decode"):
        release_round(scheduler)
    assert queue.tree_cache.released == [("failed", False)]
    assert "only ranks [1] of 2 told they were done" in caplog.text and FAILED_ROOM_HOLD_ENV in caplog.text
    assert REGISTRY.get_sample_value(f"{HOLDS_METRIC}", {"how": "timeout"}) == before + 1


@pytest.mark.parametrize("case", ["flag off", "a corrupted transfer"])
def test_what_is_not_a_flag_on_failed_room_is_released_at_once(one_rank_group, case):
    """Flag off: stock. A Success whose metadata turns out corrupted (SGLang aborts it in
    ``_commit_transfer_to_req``) has every prefill rank done: no hold."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    queue, scheduler, allocator, _ = transfer_queue(one_rank_group, flag=case != "flag off")
    mgr = decode_manager(flag=case != "flag off")
    if case == "flag off":
        assert decode_server.failed_room_holds(queue) is None
        enqueue(queue, allocator, receiver(mgr, FAILED_ROOM, KVPoll.Failed, expected=2), "failed")
        free_before = allocator.available_size()
        queue.pop_transferred()
        assert queue.tree_cache.released == [("failed", False)] and allocator.available_size() == free_before + 1
        assert room_drains(mgr) is None
        return
    req = SimpleNamespace(rid="corrupt", bootstrap_room=OTHER_ROOM)
    holds = decode_server.failed_room_holds(queue)
    from sglang_cp_shared_kv.decode.failed_room_holds import HOLD_REQUEST_ATTR, HoldRequest

    setattr(req, HOLD_REQUEST_ATTR, HoldRequest(holds, room_drains(mgr), 0))
    assert not holds.defer(req, lambda: None) and len(holds) == 0


def test_sglangs_warmup_request_with_a_fake_receiver_passes_through(one_rank_group):
    """SGLang's PD warmup queues a ``FakeKVReceiver`` (no manager, no prefill writing): the
    flag-on ``pop_transferred`` hands it to SGLang unmarked. (The first GPU PD run of the hold,
    2026-12-07, crashed every flag-on decode at warmup on ``receiver.kv_mgr``.)"""
    from sglang.srt.disaggregation.fake.conn import FakeKVReceiver
    from sglang_cp_shared_kv.decode.failed_room_holds import HOLD_REQUEST_ATTR

    from sglang.srt.disaggregation.base.conn import KVPoll

    queue, _, allocator, streamed = transfer_queue(one_rank_group)
    # a real failed room beside it (/health_generate sends the same fake request while serving)
    enqueue(queue, allocator, receiver(decode_manager(), OTHER_ROOM, KVPoll.Failed, expected=2), "failed")
    fake = FakeKVReceiver(None, "2.2.2.2:8998", bootstrap_room=FAILED_ROOM)
    req = enqueue(queue, allocator, SimpleNamespace(bootstrap_room=FAILED_ROOM), "warmup")
    queue.queue[-1].kv_receiver = fake
    holds = decode_server.failed_room_holds(queue)
    assert queue.pop_transferred() == [] and not hasattr(req, HOLD_REQUEST_ATTR)
    assert [d.req.rid for d in queue.queue] == ["warmup"] and streamed == ["failed"]
    assert len(holds) == 1 and queue.tree_cache.released == []  # the failed room held, as designed


def test_a_failed_room_noted_before_sglang_clears_it():
    """The hooked ``failure_exception`` reads the room's expected count and Success senders
    before SGLang's ``clear`` drops them, and still raises SGLang's error."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import KVTransferError

    mgr = decode_manager()
    recv = receiver(mgr, FAILED_ROOM, KVPoll.Failed, expected=4, succeeded={0, 3})
    with pytest.raises(KVTransferError):
        recv.failure_exception()
    assert FAILED_ROOM not in mgr.required_prefill_response_num_table  # SGLang's clear ran
    assert room_drains(mgr).failure(FAILED_ROOM) == FailedRoom(expected=4, succeeded=frozenset({0, 3}))
    flag_off = decode_manager(flag=False)
    with pytest.raises(KVTransferError):
        receiver(flag_off, FAILED_ROOM, KVPoll.Failed, expected=4).failure_exception()
    assert room_drains(flag_off) is None
    drained(flag_off, FAILED_ROOM, 1)  # (swallowed all the same: SGLang would log a length mismatch)


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_hold_that_is_not_a_positive_number_of_seconds_is_refused(monkeypatch, value):
    monkeypatch.setenv(FAILED_ROOM_HOLD_ENV, value)
    with pytest.raises(ValueError, match=f"{FAILED_ROOM_HOLD_ENV}=.*positive number of seconds"):
        failed_room_hold_s()


@pytest.mark.parametrize("n", [2, 3])
def test_every_decode_rank_releases_a_hold_in_the_same_call(n):
    """Decode's attention-TP ranks allocate in lockstep: a hold one rank finds ready (all heard,
    or its clock ran out) waits until every rank does, then goes on every rank at once."""
    from sglang_cp_shared_kv_testing.decode_holds import ROUNDS, run_hold_agreement

    per_rank = run_hold_agreement(n)
    expected = [released for _, _, released in ROUNDS]
    for rank in per_rank:
        assert rank["per_round"] == expected
        assert rank["released"] == [1, 2] and rank["freed"] == [11, 12] and rank["left"] == 0
