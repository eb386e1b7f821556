"""The flag on a decode server (:func:`.settings.config.guards_decode`): its startup check, its
admission guard, which refuses at once a request it can never hold
(:class:`.decode.admission.DecodeAdmission`: why, and the bound), and on 0.5.12.post1 the hold
of a failed room's pages until every prefill rank stopped writing there
(:mod:`.decode.failed_room_holds`). Without the flag the decode server is stock.

The hooks here are SGLang 0.5.12.post1's; 0.5.23's are :mod:`.decode.server_v0523`. What both
releases share is here: the refusal decision (:func:`refusal_of`), the answer
(:func:`answer_refusal`) and the startup line (:func:`log_guard`)."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Callable, Optional

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.settings.config import FLAG, guards_decode
from sglang_cp_shared_kv.decode.admission import DecodeAdmission
from sglang_cp_shared_kv.decode.failed_room_holds import (
    HOLD_REQUEST_ATTR,
    FailedRoomHolds,
    HoldRequest,
    SlotsHeldBack,
)
from sglang_cp_shared_kv.settings.server_args import validate
from sglang_cp_shared_kv.transfer.decode import room_drains

logger = logging.getLogger(__name__)


# --------------------------------------------------------------- shared by every release
def refusal_of(queue, req, admission: DecodeAdmission) -> Optional[str]:
    """The flag's verdict on a request SGLang's own capacity check let through: the message
    refusing it, or None (admit as stock). Flag off, or a request SGLang has ended already (an
    input-length or session error reaches the queue aborted, and its own message stands): None."""
    if not guards_decode(queue.scheduler.server_args) or req.finished_reason is not None:
        return None
    problem = admission.refusal(len(req.origin_input_ids))
    return None if problem is None else f"Request {req.rid}: {problem}"


def answer_refusal(req, message: str, stream_output: Callable) -> None:
    """End ``req`` as SGLang's own capacity refusal does: HTTP 400, ``finish_reason`` abort."""
    logger.error(message)  # NOTE: the level of SGLang's own capacity refusal beside it
    sg.prepare_abort(req, message, status_code=HTTPStatus.BAD_REQUEST)
    stream_output([req], req.return_logprob)


def log_guard(bound: DecodeAdmission) -> None:
    """The decode scheduler's startup line: the bound and the ``--context-length`` within it."""
    logger.info("%s (decode): a request whose prompt + %d reserved decode tokens exceeds this pool's %d "
                "tokens is refused at once (HTTP 400); --context-length <= %d keeps every request within it.",
                FLAG, bound.reserved_decode_tokens, bound.pool_tokens, bound.longest_context())


# ------------------------------------------------------- SGLang 0.5.12.post1's hooks
def admission_of(queue) -> DecodeAdmission:
    """The admission bound of a ``DecodePreallocQueue`` (its own figures, read now)."""
    return DecodeAdmission(pool_tokens=int(queue.max_total_num_tokens),
                           reserved_decode_tokens=int(queue.num_reserved_decode_tokens))


def refuse_what_decode_can_never_hold(original, queue, req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._check_if_req_exceed_kv_capacity`` (True: the request
    was refused and answered). SGLang's own check first; then, flag on, :class:`DecodeAdmission`'s
    bound (:func:`refusal_of`)."""
    if original(queue, req, *args, **kwargs):
        return True
    message = refusal_of(queue, req, admission_of(queue))
    if message is None:
        return False
    answer_refusal(req, message, queue.scheduler.stream_output)
    return True


def check_decode_server(result, queue, *args, **kwargs):
    """AFTER ``DecodePreallocQueue.__init__`` (each decode scheduler process, at startup):
    flag on, every hook in place and the configuration valid here too (a node of a
    multi-node decode may run with another environment), then one INFO line."""
    server_args = queue.scheduler.server_args
    if guards_decode(server_args):
        hook_check.require_hooks_applied("decode scheduler process")
        model_config = getattr(queue.scheduler, "model_config", None)  # the scheduler's: no second one built
        validate(server_args, hf_config=getattr(model_config, "hf_config", None))
        log_guard(admission_of(queue))
    return result


# ------------------------------- SGLang 0.5.12.post1: a failed room's pages held until drained
_HOLDS_ATTR = "_cp_shared_kv_failed_room_holds"


def failed_room_holds(transfer_queue) -> Optional[FailedRoomHolds]:
    """The holds of a ``DecodeTransferQueue`` (None: flag off, or a release whose decode holds
    failed rooms itself)."""
    return transfer_queue.__dict__.get(_HOLDS_ATTR)


def hold_failed_rooms(result, transfer_queue, *args, **kwargs):
    """AFTER ``DecodeTransferQueue.__init__``: flag on, the queue's :class:`FailedRoomHolds`, and
    its metadata-slot allocator seen through :class:`SlotsHeldBack`."""
    server_args = transfer_queue.scheduler.server_args
    if guards_decode(server_args) and not installed.INSTALLED.deferred_decode_release:
        allocator = transfer_queue.req_to_metadata_buffer_idx_allocator
        holds = FailedRoomHolds(allocator.free, metrics=bool(getattr(server_args, "enable_metrics", False)))
        transfer_queue.req_to_metadata_buffer_idx_allocator = SlotsHeldBack(allocator, holds)
        setattr(transfer_queue, _HOLDS_ATTR, holds)
        logger.info("%s (decode): a failed request's pages and metadata slot are held until every prefill rank "
                    "has stopped writing them (at most %g s).", FLAG, holds.hold_s)
    return result


def pop_transferred_holding_failed_rooms(original, transfer_queue, *args, **kwargs):
    """AROUND ``DecodeTransferQueue.pop_transferred``: for its duration, each queued request
    carries what the release of a failed one needs (:class:`HoldRequest`)."""
    holds = failed_room_holds(transfer_queue)
    if holds is None:
        return original(transfer_queue, *args, **kwargs)
    marked = []
    for decode_req in transfer_queue.queue:
        # NOTE: SGLang's PD warmup queues a FakeKVReceiver, which has no manager (and no
        # prefill writing into its pages): nothing to hold
        kv_mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)
        drains = room_drains(kv_mgr) if kv_mgr is not None else None
        if drains is not None:
            setattr(decode_req.req, HOLD_REQUEST_ATTR, HoldRequest(holds, drains, decode_req.metadata_buffer_index))
            marked.append(decode_req.req)
    try:
        return original(transfer_queue, *args, **kwargs)
    finally:
        for req in marked:
            req.__dict__.pop(HOLD_REQUEST_ATTR, None)


def release_unless_held(original, req, tree_cache, *args, **kwargs):
    """AROUND ``mem_cache.common.release_kv_cache`` (every caller): a failed room's release,
    asked for inside ``pop_transferred``, is held (:meth:`FailedRoomHolds.defer`); every
    other is SGLang's, at once."""
    asked = getattr(req, HOLD_REQUEST_ATTR, None)
    if asked is not None and asked.holds.defer(req, lambda: original(req, tree_cache, *args, **kwargs)):
        return None
    return original(req, tree_cache, *args, **kwargs)


def release_drained_rooms(result, scheduler, *args, **kwargs):
    """AFTER ``SchedulerDisaggregationDecodeMixin.process_decode_queue`` (every decode rank,
    every loop): release the holds every rank finds ready (one agreed all-reduce while any is
    out; here rather than in ``pop_transferred``, which SGLang skips while retracted requests
    wait for memory the holds may be keeping)."""
    queue = getattr(scheduler, "disagg_decode_transfer_queue", None)
    holds = failed_room_holds(queue) if queue is not None else None
    if holds is not None:
        holds.release_ready(queue.gloo_group)
    return result


def busy_while_holding(result, scheduler, *args, for_health_check: bool = False, **kwargs):
    """AFTER ``Scheduler.is_fully_idle``: not idle while a failed room's pages are held (SGLang's
    idle check would count them as leaked; a flush would reset the pool under a late write).
    The health check's answer is SGLang's."""
    if not result or for_health_check or (args and args[0]):
        return result
    queue = getattr(scheduler, "disagg_decode_transfer_queue", None)
    holds = failed_room_holds(queue) if queue is not None else None
    return not (holds is not None and len(holds))


__all__ = ["admission_of", "answer_refusal", "busy_while_holding", "check_decode_server", "failed_room_holds",
           "hold_failed_rooms", "log_guard", "pop_transferred_holding_failed_rooms", "refusal_of",
           "refuse_what_decode_can_never_hold", "release_drained_rooms", "release_unless_held"]
