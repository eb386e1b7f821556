"""The flag on a decode server on SGLang 0.5.23: its startup check and its admission guard
(the 0.5.12.post1 hooks are :mod:`.decode.server`, which holds what both share: the refusal
decision, the answer and the startup line).

Why the guard is still needed: 0.5.23's ``DecodePreallocQueue._check_if_req_exceed_kv_capacity``
asks the allocator for a ceiling first (``prealloc_ceiling_fits``); the paged allocator of a
DSA pool has none (it answers None), and the check then refuses only a prompt longer than the
pool, as 0.5.12.post1's does. ``pop_preallocated`` still admits the queue in order and stops at
the first request it cannot take, and it takes a request only once the pool covers its prompt
*in whole pages* plus the reserved decode tokens (``_prealloc_required_tokens``)::

    ceil_page(P) + num_reserved_decode_tokens  <=  pool tokens

so a request above that waits at the head of the queue for good, and every request behind it
(``test_decode_admission_v0523.py`` shows it with SGLang's own ``pop_preallocated``). For a pool
of whole pages (SGLang rounds it down to a page) that bound is exactly
:class:`~.decode_admission.DecodeAdmission`'s ``P + reserved <= pool`` with the reserve taken in
whole pages (:func:`admission_of`); with the default 512 reserved tokens and 64-token pages the
figures are 0.5.12.post1's.

Two hooks (``plugin._hooks_v0523``):

* ``DecodePreallocQueue.__init__`` AFTER (:func:`check_decode_server`): 0.5.23's constructor
  takes fewer arguments (the parallel ranks come from ``get_parallel()``); the hook reads the
  queue's attributes only. Flag on: every hook in place, the decode settings valid in this
  process (``settings.server_args_v0523.validate_in_scheduler``, the decode role's checks), the line;
* ``DecodePreallocQueue._check_if_req_exceed_kv_capacity`` AROUND
  (:func:`refuse_what_decode_can_never_hold`): SGLang's own check first (its ceiling, its
  prompt-longer-than-the-pool refusal and its message stand), then the bound. The answer goes
  through ``scheduler.output_streamer`` (0.5.23 moved ``stream_output`` there).
"""

from __future__ import annotations

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv.settings.config import guards_decode
from sglang_cp_shared_kv.decode.admission import DecodeAdmission
from sglang_cp_shared_kv.decode.server import answer_refusal, log_guard, refusal_of
from sglang_cp_shared_kv.settings.server_args_v0523 import validate_in_scheduler


def admission_of(queue) -> DecodeAdmission:
    """The admission bound of a 0.5.23 ``DecodePreallocQueue`` (its own figures, read now).

    0.5.23 charges the prompt in whole pages: ``ceil_page(P) + R <= pool`` holds, for a pool of
    whole pages, exactly when ``P + ceil_page(R) <= pool``; the reserve is counted in whole pages."""
    page = int(queue.token_to_kv_pool_allocator.page_size)
    reserved = int(queue.num_reserved_decode_tokens)
    return DecodeAdmission(pool_tokens=int(queue.max_total_num_tokens),
                           reserved_decode_tokens=-(-reserved // page) * page)


def refuse_what_decode_can_never_hold(original, queue, req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._check_if_req_exceed_kv_capacity`` (True: the request was
    refused and answered)."""
    if original(queue, req, *args, **kwargs):
        return True
    message = refusal_of(queue, req, admission_of(queue))
    if message is None:
        return False
    answer_refusal(req, message, queue.scheduler.output_streamer.stream_output)
    return True


def check_decode_server(result, queue, *args, **kwargs):
    """AFTER ``DecodePreallocQueue.__init__`` (each decode scheduler process, at startup)."""
    server_args = queue.scheduler.server_args
    if guards_decode(server_args):
        hook_check.require_hooks_applied("decode scheduler process")
        validate_in_scheduler(server_args)
        log_guard(admission_of(queue))
    return result


__all__ = ["admission_of", "check_decode_server", "refuse_what_decode_can_never_hold"]
