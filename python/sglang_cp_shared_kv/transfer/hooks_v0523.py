"""The PD transfer hooks whose SGLang 0.5.23 targets changed shape (``plugin._hooks_v0523``,
block "PD transfer of each rank's shard"); the rest of that block is :mod:`.hooks`' own.

What 0.5.23 changed under them:

* the startup check: 0.5.23's manager can also be a page-sharded one (upstream
  ``--enable-kv-cache-sharding``) or defer decode's allocation to the end of the prefill
  (``--disaggregation-decode-allocation-policy prefill_complete``); neither runs with the
  shard transfer, and both are refused when the manager starts;
* non-zero CP ranks skip the DSA index pages (``CommonKVManager.
  _should_skip_cp_replicated_state_transfer``): SGLang assumes every CP rank holds the same
  index pages. Under the flag each rank holds only its own, so every rank sends them;
* ``sync_status_to_decode_endpoint`` is gone: ``CommonKVManager.conclude_transfer`` records
  the reason and sends the terminal status (to every decode target of the room at once);
* a prompt the prefill refuses at intake is retired there (``PrefillBootstrapQueue.add``:
  ``is_unadmitted_reject`` -> ``Scheduler.retire_unadmitted_request``, or the capacity check
  in ``create_sender``) with no sender, so nothing tells decode, which registered the room
  with every prefill rank and fails it only at its waiting timeout (0.5.12.post1 sent a
  one-token stand-in, which the flag rejects before enqueueing). Under the flag each rank
  tells decode itself.

Like :mod:`.hooks`, each hook is thin and passes straight through without the flag.
"""

from __future__ import annotations

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG, shares_kv
from sglang_cp_shared_kv.transfer.pages import CpSharedKVTransferError
from sglang_cp_shared_kv.transfer.prefill import prefill_transfer
from sglang_cp_shared_kv.transfer.rooms import concludes_failed


def prepare_prefill_transfer(result, kv_mgr, *args, **kwargs):
    """AFTER ``MooncakeKVManager.__init__``: refuse what 0.5.23's manager can be and the shard
    transfer cannot run with, then validate and announce as on 0.5.12.post1."""
    if (shares_kv(getattr(kv_mgr, "server_args", None))
            and kv_mgr.disaggregation_mode == sg.DisaggregationMode.PREFILL):
        problems = []
        if kv_mgr.kv_shard_size > 1:
            problems.append("the manager shards DSA pages itself (--enable-kv-cache-sharding); drop it, the "
                            "flag shards the pool")
        if kv_mgr.deferred_bootstrap is not None:
            problems.append("decode allocates only once the prefill is done "
                            "(--disaggregation-decode-allocation-policy prefill_complete), whose deferred "
                            "bootstrap the shard transfer does not handle; leave the policy at its default")
        if problems:
            raise CpSharedKVTransferError(f"{FLAG}: the PD transfer of KV shards cannot run: " + "; ".join(problems))
    prefill_transfer(kv_mgr)
    return result


def every_rank_sends_its_index_pages(original, kv_mgr, *args, **kwargs):
    """AROUND ``MooncakeKVManager._should_skip_cp_replicated_state_transfer`` (inherited from
    ``CommonKVManager``): never skip under the flag, where each CP rank holds only the index
    pages it owns (:meth:`.shard_writes.ShardWrites.send_state` sends exactly those)."""
    if prefill_transfer(kv_mgr) is not None:
        return False
    return original(kv_mgr, *args, **kwargs)


def report_failure_cause_to_decode(original, kv_mgr, **conclusion):
    """AROUND ``MooncakeKVManager.conclude_transfer`` (inherited from ``CommonKVManager``;
    keyword-only: ``bootstrap_room``, ``status``, ``targets``, ``failure_reason``): ahead of a
    Failed status (asked for, or a Success SGLang turns into one: a withheld aux write), tell
    each decode target why (same sockets, so decode reads the cause first), and let SGLang
    record the reason with the failed write's cause appended."""
    context = prefill_transfer(kv_mgr)
    room = conclusion.get("bootstrap_room")
    if context is None or not concludes_failed(kv_mgr, room, conclusion.get("status")):
        return original(kv_mgr, **conclusion)
    if room not in kv_mgr.request_status:
        # NOTE: SGLang concludes nothing for a room already cleared (its sender read the record);
        # the cause of its failed write is dropped here, else the next room failing on this
        # worker thread would take it for its own
        context.write_failures.take()
        return original(kv_mgr, **conclusion)
    targets = conclusion.get("targets")
    told = targets if targets is not None else kv_mgr._room_notify_targets(room)
    conclusion["failure_reason"] = context.report_failure(kv_mgr, room, told, conclusion.get("failure_reason"))
    return original(kv_mgr, **conclusion)


def fail_room_refused_at_intake(original, queue, req, *args, **kwargs):
    """AROUND ``PrefillBootstrapQueue.add``: a request it leaves without a sender was refused at
    intake (its two ways out without one: ``is_unadmitted_reject`` and the capacity check, each
    leaving SGLang's ``FINISH_ABORT`` on the request); under the flag decode hears at once
    that the room will not arrive, with SGLang's reason, instead of after its waiting timeout
    (:meth:`.room_failures.RoomFailureNotices.fail_refused_room`)."""
    result = original(queue, req, *args, **kwargs)
    room = getattr(req, "bootstrap_room", None)
    # NOTE: a warmup or /health_generate request (FAKE_BOOTSTRAP_HOST, room 0 or the DP rank)
    # has no decode to tell: SGLang's refusal of one is not a failed transfer
    if (room is None or getattr(req, "disagg_kv_sender", None) is not None
            or getattr(req, "bootstrap_host", None) == sg.FAKE_BOOTSTRAP_HOST):
        return result
    context = prefill_transfer(queue.kv_manager)
    if context is not None:
        reason = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
        context.fail_refused_room(queue.kv_manager, room, getattr(reason, "message", None) or "no reason given")
    return result


__all__ = ["prepare_prefill_transfer", "every_rank_sends_its_index_pages", "report_failure_cause_to_decode",
           "fail_room_refused_at_intake"]
