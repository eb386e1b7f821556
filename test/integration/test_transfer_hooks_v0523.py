"""The PD transfer hooks whose targets changed in SGLang 0.5.23, one by one, in process,
against 0.5.23's real Mooncake classes (a ``MooncakeKVManager`` whose constructor is
skipped: no engine, no sockets; its status messages are recorded). Runs only where sglang
0.5.23 is installed (``.venv-0.5.23``). The hooks 0.5.23 kept the shape of are pinned in
test_transfer_hooks.py (0.5.12.post1) and run on 0.5.23 end to end in
test_transfer_mooncake_e2e.py.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang.srt.disaggregation.base.conn import KVPoll, StateType  # noqa: E402
from sglang.srt.disaggregation.common import conn as common  # noqa: E402
from sglang.srt.disaggregation.common.utils import FastQueue  # noqa: E402
from sglang.srt.disaggregation.mooncake import conn  # noqa: E402
from sglang.srt.disaggregation import utils as disagg_utils  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from sglang_cp_shared_kv import plugin  # noqa: E402
from sglang_cp_shared_kv.settings.config import FLAG_DEST  # noqa: E402
from sglang_cp_shared_kv.transfer import hooks as transfer  # noqa: E402
from sglang_cp_shared_kv.transfer import hooks_v0523 as hooks_dsa  # noqa: E402
from sglang_cp_shared_kv.transfer import prefill  # noqa: E402
from sglang_cp_shared_kv.transfer.failure_cause import CAUSE_PREFIX, parse_failure_cause  # noqa: E402
from sglang_cp_shared_kv.transfer.pages import ChunkPositions, CpSharedKVTransferError, OwnedStatePages  # noqa: E402
from sglang_cp_shared_kv.transfer.rooms import FAILED_ATTR, send_failure_cause  # noqa: E402

PAGE = 64
LAYERS = 3
KV_ITEM = PAGE * 16
STATE_ITEM = PAGE * 132
DECODE = ("127.0.0.1", 5555)


def stock(owner, name):
    """SGLang's own ``owner.name``, also where another test of this process applied the
    plugin's hooks (the registry wraps in place, the original kept as ``__wrapped__``, and
    rebinds the name in every module that imported it, this one included)."""
    return inspect.unwrap(getattr(owner, name))


def stock_filter():
    return stock(disagg_utils, "filter_kv_indices_for_cp_rank")


class Manager(conn.MooncakeKVManager):
    """0.5.23's real manager without its constructor; the status socket records frames."""

    def __init__(self):  # no engine, no sockets
        self.sent = []

    def _send_multipart_locked(self, endpoint, parts, is_ipv6=False):
        self.sent.append((endpoint, list(parts)))

    def _connect(self, endpoint, is_ipv6=False):
        sent = self.sent
        return SimpleNamespace(send_multipart=lambda parts: sent.append((endpoint, list(parts))))


def make_manager(*, shared=True, cp_size=2, cp_rank=1, physical_pages=10, mode=DisaggregationMode.PREFILL):
    mgr = Manager()
    pages = physical_pages + 1
    mgr.server_args = SimpleNamespace(**{FLAG_DEST: shared}, enable_metrics=False)
    mgr.disaggregation_mode = mode
    mgr.is_mla_backend, mgr.is_hybrid_mla_backend = True, False
    mgr.enable_all_cp_ranks_for_transfer = True
    mgr.attn_cp_size, mgr.attn_cp_rank = cp_size, cp_rank
    mgr.attn_tp_size, mgr.attn_tp_rank, mgr.pp_size, mgr.pp_rank = 1, 0, 1, 0
    mgr.kv_shard_size, mgr.kv_shard_rank, mgr.deferred_bootstrap = 1, 0, None
    mgr.kv_args = SimpleNamespace(
        page_size=PAGE, kv_data_ptrs=[1000 * (i + 1) for i in range(LAYERS)], kv_data_lens=[pages * KV_ITEM] * LAYERS,
        kv_item_lens=[KV_ITEM] * LAYERS, state_types=[StateType.DSA],
        state_data_ptrs=[[9000 * (i + 1) for i in range(LAYERS)]], state_data_lens=[[pages * STATE_ITEM] * LAYERS],
        state_item_lens=[[STATE_ITEM] * LAYERS], engine_rank=0)
    mgr.request_status, mgr.transfer_infos, mgr.decode_kv_args_table = {}, {}, {}
    mgr.failure_records, mgr.failure_lock = {}, threading.Lock()
    mgr.transfer_queues = [FastQueue()]
    # what CommonKVManager.__init__ sets and update_status / conclude_transfer read
    mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms, mgr._staging_outstanding = {}, set(), {}
    return mgr


def ready_room(mgr, room, dst_pages, dst_state=()):
    info = conn.TransferInfo(room=room, endpoint=DECODE[0], dst_port=DECODE[1], mooncake_session_id="127.0.0.1:7000",
                             dst_kv_indices=np.asarray(dst_pages, dtype=np.int32), dst_aux_index=3,
                             dst_state_indices=[list(dst_state)], required_dst_info_num=1, is_dummy=False)
    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.transfer_infos[room] = {info.mooncake_session_id: info}
    mgr.decode_kv_args_table[info.mooncake_session_id] = SimpleNamespace(requires_dcp_relayout=False)
    return info


def queued(mgr):
    """The chunks SGLang's add_transfer_request put on the transfer queue."""
    out = []
    while mgr.transfer_queues[0]._buf:  # FastQueue has no non-blocking read
        out.append(mgr.transfer_queues[0].get())
    return out


def test_table_0523_hooks_what_0523_has():
    """Every target of 0.5.23's transfer block exists in 0.5.23; hooks_dsa holds exactly the
    three whose targets changed shape and the intake refusal's (new in 0.5.23); maybe_release_metadata_buffer is not hooked (0.5.23
    aborts every queue through the sender, and calls it on a requeue that is not an abort)."""
    import pkgutil

    specs = [s for s in plugin.hooks_for(v0523.RELEASE)
             if s.hook.__module__ in (transfer.__name__, hooks_dsa.__name__)]
    for spec in specs:
        owner, name = spec.target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), name)), spec.target
    assert {s.hook for s in specs if s.hook.__module__ == hooks_dsa.__name__} == {
        hooks_dsa.prepare_prefill_transfer, hooks_dsa.every_rank_sends_its_index_pages,
        hooks_dsa.report_failure_cause_to_decode, hooks_dsa.fail_room_refused_at_intake}
    assert not any("metadata_buffer" in s.target or "sync_status" in s.target for s in specs)


# ------------------------------------------------------------- the chunk filter
@pytest.mark.parametrize("shared", [False, True])
def test_filter_takes_0523s_total_pages(shared):
    """0.5.23 calls the filter with the request's ``total_pages`` (its split bounds ranks by
    position): flag off that is stock's answer exactly; flag on, this rank's owned pages."""
    mgr = make_manager(shared=shared, cp_size=2, cp_rank=1)
    logical = np.array([3, 4, 5, 6, 7], dtype=np.int32)
    got_pages, got_slice = transfer.filter_owned_pages(stock_filter(), mgr, logical, slice(4, 9),
                                                       total_pages=12)
    if not shared:
        stock_pages, stock_slice = stock_filter()(mgr, logical, slice(4, 9), total_pages=12)
        assert got_slice == stock_slice and got_pages.tolist() == stock_pages.tolist()
        assert prefill.built_prefill_transfer(mgr) is None
        return
    # owner(p) = (p - 1) mod 2: rank 1 owns 4 and 6, at positions 5 and 7, physical pages 2 and 3
    assert isinstance(got_slice, ChunkPositions) and got_slice.tolist() == [5, 7] and got_slice.chunk_pages == 5
    assert got_pages.tolist() == [2, 3]


# --------------------------------------------------------------- enqueueing
def test_enqueue_hands_0523s_chunk_keywords_to_sglang():
    """0.5.23's add_transfer_request takes the token count and the early-send and index
    events; the chunk SGLang queues carries them with this rank's pages and positions."""
    mgr = make_manager()
    ready_room(mgr, 7, dst_pages=np.arange(100, 110), dst_state=np.arange(200, 210))
    pages, positions = transfer.filter_owned_pages(stock_filter(), mgr, np.arange(1, 5),
                                                   slice(0, 4), total_pages=10)
    early_send = object()
    transfer.enqueue_owned_chunk(stock(Manager, "add_transfer_request"), mgr, 7, pages, positions, False,
                                 aux_index=None, state_indices=None, num_kv_tokens=256, wait_event=early_send,
                                 indices_event=None, trace_ctx=None)
    (chunk,) = queued(mgr)
    assert chunk.prefill_kv_indices.tolist() == [1, 2] and chunk.index_slice.tolist() == [1, 3]
    assert chunk.num_kv_tokens == 256 and chunk.wait_event is early_send
    assert mgr.transfer_infos[7][DECODE[0] + ":7000"].dst_kv_indices[chunk.index_slice].tolist() == [101, 103]

    # the last chunk: the DSA index page list (decode's suffix, as 0.5.23 sends it) becomes this rank's
    pages, positions = transfer.filter_owned_pages(stock_filter(), mgr, np.arange(5, 11),
                                                   slice(4, 10), total_pages=10)
    state = [np.arange(1, 11)]
    transfer.enqueue_owned_chunk(stock(Manager, "add_transfer_request"), mgr, 7, pages, positions, True, aux_index=3,
                                 state_indices=state, num_kv_tokens=384)
    (last,) = queued(mgr)
    assert isinstance(last.state_indices[0], OwnedStatePages)
    assert last.state_indices[0].positions.tolist() == [1, 3, 5, 7, 9]
    assert prefill.transfer_stats(mgr)["kv_pages"] == 2 + 3


def test_a_chunk_beyond_decodes_pages_is_rejected_before_sglang_queues_it():
    mgr = make_manager()
    ready_room(mgr, 8, dst_pages=[100, 101])
    pages, positions = transfer.filter_owned_pages(stock_filter(), mgr, np.arange(1, 5),
                                                   slice(0, 4), total_pages=4)
    transfer.enqueue_owned_chunk(stock(Manager, "add_transfer_request"), mgr, 8, pages, positions, True, aux_index=1,
                                 state_indices=None, num_kv_tokens=256)
    (empty,) = queued(mgr)  # SGLang's worker fails it: send_aux is withheld for the room
    assert empty.is_last_chunk and empty.prefill_kv_indices.size == 0
    assert "outside the 2 pages decode" in mgr.failure_records[8]
    # 0.5.23's worker then: send_aux (withheld: nothing submitted, so 0, else SGLang would
    # poison this rank's drain ACK), all polls True -> conclude_transfer(Success), which the
    # failure record turns into Failed; decode hears the rejection, then Failed
    submitted = []
    rc = transfer.send_aux_unless_failed(lambda *a: submitted.append(a) or 0, mgr,
                                         mgr.transfer_infos[8][DECODE[0] + ":7000"], 1, [0])
    assert rc == 0 and submitted == []
    status = hooks_dsa.report_failure_cause_to_decode(
        lambda m, **kw: common.CommonKVManager.conclude_transfer(m, **kw), mgr, bootstrap_room=8,
        status=KVPoll.Success, targets=[DECODE], failure_reason=None)
    assert status == KVPoll.Failed and mgr.request_status[8] == KVPoll.Failed
    cause, failed = _frames(mgr)
    assert "rejected room 8 before enqueueing" in parse_failure_cause(cause)[1]
    assert failed[:2] == [b"8", b"0"]
    assert 8 not in mgr._deferred_ack_poisoned_rooms  # decode's ABORT gets this rank's ACK


def test_a_withheld_aux_without_a_failure_record_still_fails_the_write():
    """An aux write withheld for a room with no failure record on this rank (its abort was told
    to a late registration, record=False): -1 as before, SGLang fails the room itself."""
    mgr = make_manager()
    info = ready_room(mgr, 16, dst_pages=[100])
    prefill.prefill_transfer(mgr)
    setattr(info, FAILED_ATTR, "the prefill aborted the request")
    assert transfer.send_aux_unless_failed(lambda *a: 0, mgr, info, 1, [0]) == -1


@pytest.mark.parametrize("decode", ["hisparse", "dcp relayout"])
def test_a_decode_target_0523_cannot_send_positions_to_is_refused(decode):
    """0.5.23 marks a HiSparse decode by its device pages per room and a decode of another DCP
    layout by its registration (the relayout transfer sends whole chunks): both refused."""
    mgr = make_manager()
    info = ready_room(mgr, 15, dst_pages=[100, 101])
    if decode == "hisparse":
        info.dst_device_kv_indices = np.asarray([300, 301], dtype=np.int32)
    else:
        mgr.decode_kv_args_table[info.mooncake_session_id].requires_dcp_relayout = True
    pages, positions = transfer.filter_owned_pages(stock_filter(), mgr, np.arange(1, 3),
                                                   slice(0, 2), total_pages=2)
    transfer.enqueue_owned_chunk(stock(Manager, "add_transfer_request"), mgr, 15, pages, positions, True, aux_index=1)
    assert ("runs HiSparse" if decode == "hisparse" else "--dcp-size") in mgr.failure_records[15]


# ------------------------------------------------- index pages from every rank
@pytest.mark.parametrize("shared", [False, True])
def test_every_cp_rank_sends_its_index_pages(shared):
    """Stock 0.5.23 sends the DSA index pages from CP rank 0 only; under the flag rank 1 holds
    (and sends) its own, so its skip flags say: send."""
    stock_skip = stock(common.CommonKVManager, "_should_skip_cp_replicated_state_transfer")

    class Hooked(Manager):
        def _should_skip_cp_replicated_state_transfer(self):
            return hooks_dsa.every_rank_sends_its_index_pages(stock_skip, self)

    mgr = make_manager(shared=shared, cp_size=2, cp_rank=1)
    mgr.__class__ = Hooked
    with get_parallel().override(enable_dsa_cache_layer_split=False, enable_cp_tp_group_sharing=False):
        skip_kv, skip_state = mgr._get_dsa_cache_transfer_skip_flags(None)
        assert (skip_kv, skip_state) == (False, not shared)
        assert stock_skip(mgr) is True  # what 0.5.23 does without the hook


# --------------------------------------------------- the failure's cause to decode
def _frames(mgr):
    return [parts for _, parts in mgr.sent]


def test_a_failed_write_names_its_cause_on_both_sides():
    """0.5.23's worker concludes a failed KV chunk with conclude_failure: decode gets the cause
    first, then SGLang's Failed status; the prefill's record ends with the write's cause."""
    mgr = make_manager()
    ready_room(mgr, 9, dst_pages=[100, 101])
    context = prefill.prefill_transfer(mgr)
    context.write_failures.put("Mooncake batch_transfer_sync_write returned -1 for batch 2 of 3")

    def conclude(original_self, **kw):
        return common.CommonKVManager.conclude_transfer(original_self, **kw)

    status = hooks_dsa.report_failure_cause_to_decode(
        conclude, mgr, bootstrap_room=9, status=KVPoll.Failed, targets=None,
        failure_reason="Failed to send kv chunk of 9 to 127.0.0.1:5555")
    assert status == KVPoll.Failed and mgr.request_status[9] == KVPoll.Failed
    cause, failed = _frames(mgr)
    room, text = parse_failure_cause(cause)
    assert room == 9 and text.startswith("prefill CP rank 1 of 2: Failed to send kv chunk")
    assert failed == [b"9", b"0", b"1"]  # room, KVPoll.Failed, this rank's sender id
    assert mgr.failure_records[9] == "Failed to send kv chunk of 9 to 127.0.0.1:5555: Mooncake " \
                                     "batch_transfer_sync_write returned -1 for batch 2 of 3"


def test_a_rejected_room_concludes_with_the_rejection():
    """A room rejected before enqueueing fails at its withheld aux write; 0.5.23 concludes it
    with "Failed to send aux data", and decode is told the rejection instead."""
    mgr = make_manager()
    ready_room(mgr, 10, dst_pages=[100])
    pages, positions = transfer.filter_owned_pages(stock_filter(), mgr, np.arange(1, 3),
                                                   slice(0, 2), total_pages=2)
    transfer.enqueue_owned_chunk(stock(Manager, "add_transfer_request"), mgr, 10, pages, positions, True, aux_index=1)
    hooks_dsa.report_failure_cause_to_decode(
        lambda m, **kw: common.CommonKVManager.conclude_transfer(m, **kw), mgr, bootstrap_room=10,
        status=KVPoll.Failed, targets=[DECODE], failure_reason="Failed to send aux data of 10")
    cause, failed = _frames(mgr)
    assert "rejected room 10 before enqueueing" in parse_failure_cause(cause)[1]
    assert "rejected room 10" in mgr.failure_records[10]  # the first root cause is kept


def test_a_cleared_rooms_write_cause_is_not_pinned_on_the_next_failing_room():
    """A KV write fails for a room the scheduler cleared meanwhile: SGLang concludes nothing
    for it, and its cause must not stay on the worker thread for the next room that fails
    without a write of its own (a rejection) to report as its own."""
    mgr = make_manager()
    ready_room(mgr, 17, dst_pages=[100])
    context = prefill.prefill_transfer(mgr)
    context.write_failures.put("Mooncake batch_transfer_sync_write returned -1 for batch 1 of 1 (room 17)")
    del mgr.request_status[17]  # the sender cleared it (an abort)

    def conclude(m, **kw):
        return common.CommonKVManager.conclude_transfer(m, **kw)

    assert hooks_dsa.report_failure_cause_to_decode(
        conclude, mgr, bootstrap_room=17, status=KVPoll.Failed, targets=None,
        failure_reason="Failed to send kv chunk of 17") is None and mgr.sent == []
    ready_room(mgr, 18, dst_pages=[100])
    hooks_dsa.report_failure_cause_to_decode(
        conclude, mgr, bootstrap_room=18, status=KVPoll.Failed, targets=[DECODE],
        failure_reason="Failed to send aux data of 18")
    cause, _ = _frames(mgr)
    assert "room 17" not in parse_failure_cause(cause)[1] and "room 17" not in mgr.failure_records[18]
    assert prefill.transfer_stats(mgr).get("failed_kv_writes", 0) == 0


def test_the_cause_goes_out_under_sglangs_per_endpoint_send_lock():
    """0.5.23 shares one cached PUSH socket per decode endpoint across its sender threads and
    sends under a per-endpoint lock (an abort ACK from the bootstrap thread, a status from a
    transfer worker); the cause message must take that lock too, or frames of two messages
    interleave on the socket (decode's receiver thread dies on the mixed message, libzmq may
    abort the prefill). Real 0.5.23 ``_connect`` / ``_send_multipart_locked``, ZMQ on loopback."""
    import zmq

    class Sockets(conn.MooncakeKVManager):
        AUX_DATA_HEADER = conn.MooncakeKVManager.AUX_DATA_HEADER

        def __init__(self):  # only the socket state CommonKVManager.__init__ sets
            self._zmq_ctx, self._socket_lock = zmq.Context(), threading.Lock()
            self._socket_cache, self._monitor_cache, self._socket_send_locks = {}, {}, {}
            self.defer_decode_allocation = False

    mgr = Sockets()
    pull = mgr._zmq_ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        mgr._connect(endpoint)  # SGLang's first send made the socket and its lock
        with mgr._socket_send_locks[endpoint]:  # another SGLang thread is sending
            sender = threading.Thread(target=send_failure_cause, args=(mgr, "127.0.0.1", port, 19, "why"))
            sender.start()
            assert not pull.poll(300), "the cause went out while SGLang held the endpoint's send lock"
        sender.join(10)
        assert pull.poll(5000)
        assert parse_failure_cause(pull.recv_multipart()) == (19, "why")
    finally:
        pull.close(linger=0)
        for sock in [*mgr._socket_cache.values(), *mgr._monitor_cache.values()]:
            sock.close(linger=0)
        mgr._zmq_ctx.term()


@pytest.mark.parametrize("case", ["flag off", "success", "cleared room"])
def test_conclude_passes_through(case):
    mgr = make_manager(shared=case != "flag off")
    ready_room(mgr, 11, dst_pages=[100])
    if case == "cleared room":
        del mgr.request_status[11]
    calls = []
    kwargs = dict(bootstrap_room=11, status=KVPoll.Success if case == "success" else KVPoll.Failed,
                  failure_reason=None if case == "success" else "why")
    hooks_dsa.report_failure_cause_to_decode(lambda m, **kw: calls.append(kw) or "stock", mgr, **kwargs)
    assert calls == [kwargs] and mgr.sent == []


# ------------------------------------------------------------------ startup
@pytest.mark.parametrize("what, fix", [("kv_shard_size", "--enable-kv-cache-sharding"),
                                       ("deferred_bootstrap", "prefill_complete")])
def test_startup_refuses_what_0523s_manager_can_be(what, fix):
    mgr = make_manager()
    setattr(mgr, what, 2 if what == "kv_shard_size" else object())
    with pytest.raises(CpSharedKVTransferError, match=fix):
        hooks_dsa.prepare_prefill_transfer(None, mgr)
    flag_off = make_manager(shared=False)
    setattr(flag_off, what, 2 if what == "kv_shard_size" else object())
    assert hooks_dsa.prepare_prefill_transfer("result", flag_off) == "result"
    assert prefill.built_prefill_transfer(flag_off) is None


def test_startup_builds_the_shard_transfer_state():
    mgr = make_manager(cp_size=3, cp_rank=2)
    hooks_dsa.prepare_prefill_transfer(None, mgr)
    context = prefill.built_prefill_transfer(mgr)
    assert context.layout.cp_rank == 2 and context.buffers.state_buffer_pages == {0: 11}  # StateType.DSA found


# ------------------------------------------------------------------ decode side
def test_decode_names_the_cause_in_0523s_error():
    """KVTransferError moved to disaggregation/common/conn.py in 0.5.23: decode keeps the
    cause (0.5.23's _handle_aux_data) and names it in CommonKVReceiver.failure_exception's error."""
    from sglang_cp_shared_kv.transfer.failure_cause import encode_failure_cause

    decode = make_manager(shared=False, mode=DisaggregationMode.DECODE)
    decode.request_status[12] = KVPoll.Failed
    decode.failure_records[12] = decode.DEFAULT_PREFILL_FAILURE_REASON
    message = encode_failure_cause(decode.AUX_DATA_HEADER, 12, "prefill CP rank 1 of 2: index write failed")
    assert message[5].startswith(CAUSE_PREFIX)
    assert transfer.accept_failure_cause(stock(Manager, "_handle_aux_data"), decode, message) is None
    receiver = SimpleNamespace(kv_mgr=decode, bootstrap_room=12, clear=lambda: None, conclude_state=None)
    with pytest.raises(common.KVTransferError) as error:
        transfer.failure_exception_with_cause(common.CommonKVReceiver.failure_exception, receiver)
    assert "it might be dead; cause: prefill CP rank 1 of 2: index write failed" in str(error.value)


# ------------------------------------------------------------------ aborts
def test_0523_aborts_a_waiting_request_through_the_sender():
    """0.5.23's prefill releases a request aborted in its waiting queue by aborting its sender
    first (release_aborted_prefill_waiting_req), so the hook on CommonKVSender.abort tells
    decode at once; maybe_release_metadata_buffer needs no hook."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    mgr = make_manager()
    ready_room(mgr, 13, dst_pages=[100, 101])
    told = []
    prefill.prefill_transfer(mgr)._abort_notices = SimpleNamespace(send=lambda *a: told.append(a))

    class Sender(common.CommonKVSender):
        def __init__(self):  # no bootstrap
            self.kv_mgr, self.bootstrap_room, self.conclude_state = mgr, 13, None
            self._owns_bootstrap_room = True
            self.trace_ctx = SimpleNamespace(abort=lambda **kw: None, trace_req_finish=lambda: None)

        def abort(self):
            return transfer.fail_aborted_room_on_decode(stock(common.CommonKVSender, "abort"), self)

    released = []
    scheduler = SimpleNamespace(clear_pending_chunk_send=lambda req: None,
                                req_to_metadata_buffer_idx_allocator=SimpleNamespace(free=released.append))
    req = SimpleNamespace(disagg_kv_sender=Sender(), metadata_buffer_index=4, pending_bootstrap=True,
                          kv=SimpleNamespace(holds_kv=False, holds_mamba=False))
    SchedulerDisaggregationPrefillMixin.release_aborted_prefill_waiting_req(scheduler, req)
    assert released == [4] and mgr.request_status[13] == KVPoll.Failed
    ((remote, port, (cause, status)),) = told
    assert (remote, port) == DECODE and "aborted the request" in parse_failure_cause(cause)[1]
    assert status == [b"13", b"0", b"1"]


# ------------------------------------------------- a prompt refused at intake
def _refused_request(room, message="Input length (9000) exceeds the maximum allowed length (8186)"):
    """A real 0.5.23 ``Req`` as the scheduler's intake leaves a prompt it refuses
    (``validate_input_length`` -> ``Req.set_finish_with_abort``), for bootstrap room ``room``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"room-{room}", "", list(range(2, 40)), SamplingParams(max_new_tokens=4))
    req.bootstrap_room, req.bootstrap_host = room, "127.0.0.1"
    with get_parallel().override(tp_rank=0):
        req.set_finish_with_abort(message)
    return req


def _unrefused_request(room, *, tokens):
    """A real 0.5.23 ``Req`` of ``tokens`` prompt tokens that intake has not refused, for ``room``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"room-{room}", "", list(range(2, 2 + tokens)), SamplingParams(max_new_tokens=4))
    req.bootstrap_room, req.bootstrap_host = room, "127.0.0.1"
    return req


def _intake(mgr, req, *, max_input_len=8192):
    """0.5.23's real ``PrefillBootstrapQueue.add`` under the hook, on a queue holding what it
    reads; the requests the scheduler retired and answered."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    out = SimpleNamespace(retired=[], answered=[])
    queue = SimpleNamespace(
        kv_manager=mgr, queue=[], max_input_len=max_input_len,
        scheduler=SimpleNamespace(retire_unadmitted_request=out.retired.append,
                                  output_streamer=SimpleNamespace(stream_output=lambda reqs, lp: out.answered.extend(reqs))))
    for name in ("create_sender", "_check_if_req_exceed_kv_capacity"):  # SGLang's own, on this queue
        setattr(queue, name, getattr(PrefillBootstrapQueue, name).__get__(queue))
    hooks_dsa.fail_room_refused_at_intake(stock(PrefillBootstrapQueue, "add"), queue, req, 1)
    assert not queue.queue and req.disagg_kv_sender is None  # refused: no sender, nothing queued
    return out


def _register(mgr, room, session, required=1):
    """What 0.5.23's bootstrap thread does when decode registers ``room`` with this rank: the
    target into ``transfer_infos``, and once all ``required`` are in, WaitingForInput (hooked)."""
    info = conn.TransferInfo(room=room, endpoint=DECODE[0], dst_port=DECODE[1], mooncake_session_id=session,
                             dst_kv_indices=np.asarray([100], dtype=np.int32), dst_aux_index=3,
                             dst_state_indices=[[]], required_dst_info_num=required, is_dummy=False)
    mgr.transfer_infos.setdefault(room, {})[session] = info
    if len(mgr.transfer_infos[room]) == required:
        mgr.req_to_decode_prefix_len[room] = 0
        transfer.fail_late_registration_of_aborted_room(stock(Manager, "update_status"), mgr, room,
                                                        KVPoll.WaitingForInput)


def _refusals(frames):
    """(cause texts, Failed status frames) among the frames sent."""
    causes = [parse_failure_cause(f)[1] for f in frames if parse_failure_cause(f)]
    return causes, [f for f in frames if not parse_failure_cause(f)]


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_a_prompt_refused_at_intake_after_decode_registered_fails_there_at_once(cp_rank):
    """0.5.23 retires a prompt its intake refuses (PrefillBootstrapQueue.add: is_unadmitted_reject)
    without a sender: under the flag the rank tells decode, registered already, the cause (SGLang's
    refusal) and Failed at once, then forgets SGLang's entries for the room (no sender clears them)."""
    mgr = make_manager(cp_rank=cp_rank)
    mgr.req_to_decode_prefix_len = {}
    told = []
    prefill.prefill_transfer(mgr)._abort_notices = SimpleNamespace(send=lambda r, p, m: told.append(((r, p), m)))
    _register(mgr, 31, "127.0.0.1:7000")
    assert mgr.request_status[31] == KVPoll.WaitingForInput
    out = _intake(mgr, _refused_request(31))
    assert [r.bootstrap_room for r in out.retired] == [31]  # SGLang's own retirement ran
    ((target, frames),) = told
    causes, statuses = _refusals(frames)
    assert target == DECODE and statuses == [[b"31", b"0", str(cp_rank).encode()]]
    assert causes == [f"prefill CP rank {cp_rank} of 2: room 31 ends unsent: the prefill refused the request at "
                      "intake: Input length (9000) exceeds the maximum allowed length (8186)"]
    assert 31 not in mgr.request_status and 31 not in mgr.transfer_infos and 31 not in mgr.req_to_decode_prefix_len
    assert prefill.transfer_stats(mgr)["refused_requests"] == 1
    assert not len(prefill.built_prefill_transfer(mgr)._refused_unregistered)


def test_a_prompt_refused_at_intake_before_decode_registered_is_told_on_registration():
    """Refused before decode registered the room (two decode targets: one before, one after the
    refusal): the one registered is told at once, the other when it registers, each once; then
    SGLang's entries are dropped and the rank's memory of the room too."""
    mgr = make_manager()
    mgr.req_to_decode_prefix_len = {}
    told = []
    prefill.prefill_transfer(mgr)._abort_notices = SimpleNamespace(send=lambda r, p, m: told.append(m))
    _register(mgr, 32, "127.0.0.1:7000", required=2)
    _intake(mgr, _refused_request(32))
    assert len(told) == 1 and 32 in mgr.transfer_infos  # (its count of registered targets kept)
    assert prefill.built_prefill_transfer(mgr)._refused_unregistered.get(32) is not None
    _register(mgr, 32, "127.0.0.1:7001", required=2)
    assert len(told) == 2
    causes, statuses = _refusals(told[1])
    assert "refused the request at intake" in causes[0] and statuses == [[b"32", b"0", b"1"]]
    assert 32 not in mgr.request_status and 32 not in mgr.transfer_infos
    assert prefill.built_prefill_transfer(mgr)._refused_unregistered.get(32) is None
    _register(mgr, 33, "127.0.0.1:7000")  # another room's registration: nothing of 32's
    assert len(told) == 2


def test_a_registration_completing_during_the_refusal_is_told(monkeypatch):
    """The one interleaving of the two threads: the scheduler's refusal has read the room's
    targets (none yet) under the registration lock when the bootstrap thread registers decode
    and marks the room WaitingForInput. The bootstrap thread's hook waits for the lock (it does
    not skip on the refused-room map, still empty then) and tells decode once the refusal lets
    go; skipping, decode would have heard of the room only at its waiting timeout."""
    from sglang_cp_shared_kv.transfer import room_failures

    mgr = make_manager()
    mgr.req_to_decode_prefix_len = {}
    told = []
    prefill.prefill_transfer(mgr)._abort_notices = SimpleNamespace(send=lambda r, p, m: told.append(m))
    registering = threading.Thread(target=_register, args=(mgr, 36, "127.0.0.1:7000"))
    snapshot = room_failures.room_targets

    def targets_then_registration(kv_mgr, room):
        targets = snapshot(kv_mgr, room)
        if threading.current_thread() is not registering and not registering.is_alive() and not told:
            registering.start()  # (its hook now waits for the lock this thread holds)
            registering.join(0.5)
        return targets

    monkeypatch.setattr(room_failures, "room_targets", targets_then_registration)
    _intake(mgr, _refused_request(36))
    registering.join(10)
    assert not registering.is_alive()
    (frames,) = told
    causes, statuses = _refusals(frames)
    assert "refused the request at intake" in causes[0] and statuses == [[b"36", b"0", b"1"]]
    assert 36 not in mgr.request_status and 36 not in mgr.transfer_infos
    assert prefill.built_prefill_transfer(mgr)._refused_unregistered.get(36) is None


def test_a_prompt_over_the_capacity_check_is_refused_the_same_way():
    """PrefillBootstrapQueue.add's other way out without a sender: create_sender's capacity check
    (a prompt over the queue's max_input_len, SGLang's prepare_abort): decode told with its reason."""
    mgr = make_manager()
    mgr.req_to_decode_prefix_len = {}
    told = []
    prefill.prefill_transfer(mgr)._abort_notices = SimpleNamespace(send=lambda r, p, m: told.append(m))
    _register(mgr, 34, "127.0.0.1:7000")
    req = _unrefused_request(34, tokens=198)
    out = _intake(mgr, req, max_input_len=100)
    assert out.answered == [req] and not out.retired
    (frames,) = told
    assert "intake: Request room-34 exceeds the maximum number of tokens: 198 > 100" in _refusals(frames)[0][0]


@pytest.mark.parametrize("how", ["is_unadmitted_reject", "capacity check"])
def test_a_warmup_request_refused_at_intake_is_not_a_failed_transfer(how):
    """SGLang's own fake requests (the PD warmup, ``--warmups prefill_shapes`` up to 32K tokens,
    ``/health_generate``: FAKE_BOOTSTRAP_HOST, room 0) have no decode: a refusal at intake tells
    no one, counts no refused transfer and keeps no room for a registration that never comes.
    A real request's refusal of the same room is still told (the control)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    mgr = make_manager()
    mgr.req_to_decode_prefix_len = {}
    context = prefill.prefill_transfer(mgr)
    told = []
    context._abort_notices = SimpleNamespace(send=lambda r, p, m: told.append(m))
    for host in (FAKE_BOOTSTRAP_HOST, "127.0.0.1"):
        req = _refused_request(0) if how == "is_unadmitted_reject" else _unrefused_request(0, tokens=198)
        req.bootstrap_host = host
        out = _intake(mgr, req, max_input_len=100)
        assert (out.retired if how == "is_unadmitted_reject" else out.answered) == [req]  # SGLang's refusal ran
        if host == FAKE_BOOTSTRAP_HOST:
            assert told == [] and prefill.transfer_stats(mgr)["refused_requests"] == 0
            assert context._refused_unregistered.get(0) is None
    assert prefill.transfer_stats(mgr)["refused_requests"] == 1 and context._refused_unregistered.get(0) is not None


def test_flag_off_a_prompt_refused_at_intake_is_stock():
    """Flag off: SGLang's retirement alone, nothing sent, SGLang's entries for the room untouched
    (stock decode fails the room at its waiting timeout)."""
    mgr = make_manager(shared=False)
    mgr.req_to_decode_prefix_len = {}
    _register(mgr, 35, "127.0.0.1:7000")
    out = _intake(mgr, _refused_request(35))
    assert len(out.retired) == 1 and mgr.sent == [] and mgr.request_status[35] == KVPoll.WaitingForInput
    assert prefill.built_prefill_transfer(mgr) is None


# ------------------------------------------- the index pages through maybe_send_extra
@pytest.mark.parametrize("write_rc", [0, -1])
def test_index_pages_through_0523s_maybe_send_extra(write_rc, monkeypatch):
    """0.5.23's real maybe_send_extra (DSA branch, _send_kvcache_generic) under the hooks sends
    this rank's index pages to their sequence positions on decode; a write Mooncake refuses is
    recorded with its cause, which then leads the reason of 0.5.23's conclude_failure, on
    prefill and to decode."""
    mgr = make_manager(cp_size=2, cp_rank=1)
    mgr.state_strides_validated, mgr.enable_custom_mem_pool, mgr.max_transfer_batch_indices = set(), False, 0
    mgr.kv_args.state_layer_ids, mgr.kv_args.state_dim_per_tensor, mgr.kv_args.prefill_start_layer = [[]], [[]], 0
    info = ready_room(mgr, 14, dst_pages=np.arange(100, 106), dst_state=np.arange(200, 206))
    context = prefill.prefill_transfer(mgr)
    state = [np.arange(1, 7)]  # logical pages 1..6: rank 1 owns 2, 4, 6 (physical 1, 2, 3) at positions 1, 3, 5
    assert context.own_state_pages_in_place(state) is None
    registration = SimpleNamespace(dst_state_data_ptrs=[[50_000 * (i + 1) for i in range(LAYERS)]],
                                   dst_state_item_lens=[[STATE_ITEM] * LAYERS], dst_state_dim_per_tensor=[[]],
                                   dst_state_layer_ids=[[]], dst_attn_tp_size=1)
    writes = []

    def engine(self, session, blocks):  # the engine's batch write, as _transfer_data hands it over
        writes.extend(blocks)
        return write_rc

    class Hooked(Manager):
        def _transfer_data(self, session, blocks):
            return transfer.write_in_bounded_batches(engine, self, session, blocks)

    mgr.__class__ = Hooked
    # NOTE: what a published 0.5.23 server without unified memory or upstream KV sharding answers
    monkeypatch.setattr(conn, "get_memory", lambda: SimpleNamespace(enable_unified_memory=False))
    with get_parallel().override(enable_kv_cache_sharding=False):
        rc = transfer.send_owned_state_pages(stock(Manager, "maybe_send_extra"), mgr, info, state, None, registration)
    assert rc == write_rc
    owned = ((1, 201), (2, 203), (3, 205))  # (physical index page, decode's page at its position)
    assert sorted(writes) == sorted((9000 * (layer + 1) + p * STATE_ITEM, 50_000 * (layer + 1) + d * STATE_ITEM,
                                     STATE_ITEM) for layer in range(LAYERS) for p, d in owned)
    if write_rc == 0:
        assert 14 not in mgr.failure_records and prefill.transfer_stats(mgr)["state_pages"] == 3
        return
    assert "writing the NSA index state of room 14 (3 pages" in mgr.failure_records[14]
    hooks_dsa.report_failure_cause_to_decode(
        lambda m, **kw: common.CommonKVManager.conclude_transfer(m, **kw), mgr, bootstrap_room=14,
        status=KVPoll.Failed, targets=None, failure_reason="Failed to send state components of 14")
    cause, failed = _frames(mgr)
    assert "batch_transfer_sync_write returned -1" in parse_failure_cause(cause)[1] and failed[1] == b"0"
    assert "writing the NSA index state of room 14" in mgr.failure_records[14]  # the root cause is kept
