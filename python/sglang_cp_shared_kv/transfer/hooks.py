"""The PD transfer hooks (``plugin.HOOKS``, block "PD transfer of each rank's shard"; on
SGLang 0.5.23 the same block of ``plugin._hooks_v0523`` takes these where their targets kept
their shape, and :mod:`.hooks_v0523`'s where they changed).

Each one is thin: it finds the manager's shard-transfer state
(:func:`.prefill.prefill_transfer`, None unless the flag is on and the manager is a
prefill one) and passes straight through to SGLang without it; with it, the work is a
named method of :class:`.prefill.PrefillShardTransfer` (its startup checks, or a method of
its chunk admission, its writes or its failure notices). The decode hooks act only on the
cause message (:mod:`.decode`).
"""

from __future__ import annotations

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG, shares_kv
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin
from sglang_cp_shared_kv.transfer.decode import (
    StatusObserver,
    keep_drained_notice,
    keep_failure_cause,
    note_failed_room,
    note_late_success,
    room_drains,
    with_cause,
)
from sglang_cp_shared_kv.transfer.pages import CpSharedKVTransferError
from sglang_cp_shared_kv.transfer.prefill import built_prefill_transfer, prefill_transfer
from sglang_cp_shared_kv.transfer.room_drain import DrainingQueue
from sglang_cp_shared_kv.transfer.rooms import room_targets


# ------------------------------------------------------------ prefill hooks
def prepare_prefill_transfer(result, kv_mgr, *args, **kwargs):
    """AFTER ``MooncakeKVManager.__init__``: validate and announce at startup, not at the
    first request."""
    prefill_transfer(kv_mgr)
    return result


def check_transfer_matches_pool(kv_mgr, queue, *args, **kwargs):
    """AFTER ``PrefillBootstrapQueue._init_kv_manager``: the manager it returns must see the
    pool this rank built (the queue holds that pool)."""
    context = prefill_transfer(kv_mgr)
    if context is not None:
        pool = queue.token_to_kv_pool
        if not isinstance(pool, CpSharedPoolMixin):
            raise CpSharedKVTransferError(
                f"{FLAG}: the prefill bootstrap queue registers a {type(pool).__name__}, not the shared-KV pool")
        context.check_pool(pool)
    return kv_mgr


def filter_owned_pages(original, kv_mgr, kv_indices, index_slice, *args, **kwargs):
    """AROUND ``disaggregation.utils.filter_kv_indices_for_cp_rank`` (imported by name by
    every backend; the hook registry rebinds those names too). ``args``/``kwargs``: what a
    release adds (0.5.23: the request's ``total_pages``, which its position-bounded split
    needs and the owner filter does not)."""
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(kv_mgr, kv_indices, index_slice, *args, **kwargs)
    return context.owned_pages(kv_indices, index_slice)


def enqueue_owned_chunk(original, kv_mgr, *args, **kwargs):
    """AROUND ``MooncakeKVManager.add_transfer_request``: validate before enqueueing
    (0.5.23's extra keywords travel with the chunk)."""
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(kv_mgr, *args, **kwargs)
    return context.enqueue(original, kv_mgr, *args, **kwargs)


def write_in_bounded_batches(original, kv_mgr, *args, **kwargs):
    """AROUND ``MooncakeKVManager._transfer_data`` (every KV, state and aux write)."""
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(kv_mgr, *args, **kwargs)
    return context.write(original, kv_mgr, *args, **kwargs)


def send_owned_state_pages(original, kv_mgr, *args, **kwargs):
    """AROUND ``MooncakeKVManager.maybe_send_extra``: send only the state pages this rank
    owns."""
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(kv_mgr, *args, **kwargs)
    return context.send_state(original, kv_mgr, *args, **kwargs)


def send_aux_unless_failed(original, kv_mgr, *args, **kwargs):
    """AROUND ``MooncakeKVManager.send_aux``: no aux for a room that already failed."""
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(kv_mgr, *args, **kwargs)
    return context.send_aux(original, kv_mgr, *args, **kwargs)


def fail_aborted_room_on_decode(original, sender, *args, **kwargs):
    """AROUND ``CommonKVSender.abort`` (a request aborted in the bootstrap or in-flight
    queue): with shared KV, decode hears at once that the room will not arrive, instead of
    after its waiting timeout."""
    context = prefill_transfer(sender.kv_mgr)
    if context is not None:
        context.fail_unsent_room(sender.kv_mgr, sender.bootstrap_room,
                                 "the prefill aborted the request before sending all of its KV")
    return original(sender, *args, **kwargs)


def fail_unsent_room_on_release(original, req, *args, **kwargs):
    """AROUND ``disaggregation.prefill.release_req_to_metadata_buffer``: SGLang's prefill
    calls it for a request aborted in its waiting queue (bootstrapped, nothing sent; the
    sender is dropped without a word to decode) and for finished transfers (concluded:
    nothing to do)."""
    sender = getattr(req, "disagg_kv_sender", None)
    kv_mgr = getattr(sender, "kv_mgr", None)
    # NOTE: SGLang's warmup request has a FakeKVSender: the real manager, no room, no decode
    room = getattr(sender, "bootstrap_room", None)
    context = prefill_transfer(kv_mgr) if kv_mgr is not None and room is not None else None
    if context is not None:
        # record=False: SGLang drops this sender without reading its failure (no failure_exception)
        context.fail_unsent_room(kv_mgr, room, "the prefill aborted the request before it ran", record=False)
    return original(req, *args, **kwargs)


def fail_late_registration_of_aborted_room(original, kv_mgr, room, status, *args, **kwargs):
    """AROUND ``MooncakeKVManager.update_status`` (inherited from ``CommonKVManager``):
    decode registering a room this prefill rank aborted earlier hears at once that it failed."""
    result = original(kv_mgr, room, status, *args, **kwargs)
    context = built_prefill_transfer(kv_mgr)  # NOTE: never builds one: this runs for every status change
    if context is not None:
        context.tell_late_registration(kv_mgr, room, status)
    return result


def report_failure_cause_to_decode(original, kv_mgr, remote, dst_port, room, status, prefill_rank):
    """AROUND ``MooncakeKVManager.sync_status_to_decode_endpoint``: ahead of a Failed
    status, tell decode why (same socket, so decode reads the cause first)."""
    context = prefill_transfer(kv_mgr)
    if context is not None and status == sg.KVPoll.Failed:
        context.report_failure(kv_mgr, room, [(remote, dst_port)])
    return original(kv_mgr, remote, dst_port, room, status, prefill_rank)


def drain_markers_reach_the_worker(original, kv_mgr, queue, *args, **kwargs):
    """AROUND ``MooncakeKVManager.transfer_worker`` (0.5.12.post1; each worker thread, which the
    manager's ``__init__`` starts): with the flag, the worker takes its chunks through
    :class:`.room_drain.DrainingQueue`, which runs the drain markers among them."""
    if (shares_kv(getattr(kv_mgr, "server_args", None))
            and kv_mgr.disaggregation_mode == sg.DisaggregationMode.PREFILL):
        queue = DrainingQueue(queue)
    return original(kv_mgr, queue, *args, **kwargs)


def drain_room_failed_by_the_group(original, sender, *args, **kwargs):
    """AROUND ``MooncakeKVSender.failure_exception`` (0.5.12.post1): SGLang's prefill calls it on
    every CP rank once the group agreed the room failed (its poll's MIN), whatever this rank's
    own status, and it clears the room: the room's drain markers go out, so decode hears when
    this rank's last write of it is done (:meth:`.room_failures.RoomFailureNotices.drain_failed_room`)."""
    kv_mgr = sender.kv_mgr
    context = prefill_transfer(kv_mgr)
    if context is None:
        return original(sender, *args, **kwargs)
    room = sender.bootstrap_room
    targets = room_targets(kv_mgr, room)  # (before SGLang's clear drops them)
    try:
        return original(sender, *args, **kwargs)  # (raises SGLang's KVTransferError)
    finally:
        context.drain_failed_room(kv_mgr, room, targets)


# ------------------------------------------------------------- decode hooks
def accept_failure_cause(original, kv_mgr, msg, *args, **kwargs):
    """AROUND ``MooncakeKVManager._handle_aux_data`` (decode): keep a shared-KV prefill's
    failure cause or drained notice for the room; every other message is SGLang's."""
    if keep_failure_cause(kv_mgr, msg) or keep_drained_notice(kv_mgr, msg):
        return None
    return original(kv_mgr, msg, *args, **kwargs)


def watch_late_successes(original, kv_mgr, *args, **kwargs):
    """AROUND ``MooncakeKVManager.start_decode_thread`` (0.5.12.post1, a decode manager, at its
    start): where the plugin holds failed rooms (:func:`.decode.room_drains`), the receiver
    thread reads its socket through :class:`.decode.StatusObserver`, so a prefill rank's
    Success for a room decode gave up still counts (:func:`.decode.note_late_success`)."""
    if room_drains(kv_mgr) is not None:
        kv_mgr.server_socket = StatusObserver(kv_mgr.server_socket, lambda msg: note_late_success(kv_mgr, msg))
    return original(kv_mgr, *args, **kwargs)


def failure_exception_with_cause(original, receiver, *args, **kwargs):
    """AROUND ``MooncakeKVReceiver.failure_exception`` (decode): name the prefill's cause;
    first note what the failed room waits for, before SGLang clears it (:func:`.decode.note_failed_room`)."""
    note_failed_room(receiver)
    try:
        return original(receiver, *args, **kwargs)
    except sg.KVTransferError as exc:
        replacement = with_cause(receiver.kv_mgr, exc)
        if replacement is None:
            raise
        raise replacement from exc


__all__ = [
    "prepare_prefill_transfer", "check_transfer_matches_pool", "filter_owned_pages", "enqueue_owned_chunk",
    "write_in_bounded_batches", "send_owned_state_pages", "send_aux_unless_failed",
    "fail_aborted_room_on_decode", "fail_unsent_room_on_release", "fail_late_registration_of_aborted_room",
    "report_failure_cause_to_decode", "drain_markers_reach_the_worker", "drain_room_failed_by_the_group",
    "accept_failure_cause", "failure_exception_with_cause", "watch_late_successes",
]
