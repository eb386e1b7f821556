"""The flag on a decode server (:func:`.settings.config.guards_decode`): its startup check, and its
admission guard, which refuses at once a request it can never hold
(:class:`.decode.admission.DecodeAdmission`: why, and the bound). Without the flag the
decode server is stock.

The hooks here are SGLang 0.5.12.post1's; 0.5.23's are :mod:`.decode.server_v0523`. What both
releases share is here: the refusal decision (:func:`refusal_of`), the answer
(:func:`answer_refusal`) and the startup line (:func:`log_guard`)."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Callable, Optional

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG, guards_decode
from sglang_cp_shared_kv.decode.admission import DecodeAdmission
from sglang_cp_shared_kv.settings.server_args import validate

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


__all__ = ["admission_of", "answer_refusal", "check_decode_server", "log_guard", "refusal_of",
           "refuse_what_decode_can_never_hold"]
