"""The flag on a decode server (:func:`.config.guards_decode`): its startup check, and its
admission guard, which refuses at once a request it can never hold
(:class:`.decode_admission.DecodeAdmission`: why, and the bound). Without the flag the
decode server is stock."""

from __future__ import annotations

import logging
from http import HTTPStatus

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.config import FLAG, guards_decode
from sglang_cp_shared_kv.decode_admission import DecodeAdmission
from sglang_cp_shared_kv.server_args import validate

logger = logging.getLogger(__name__)


def admission_of(queue) -> DecodeAdmission:
    """The admission bound of a ``DecodePreallocQueue`` (its own figures, read now)."""
    return DecodeAdmission(pool_tokens=int(queue.max_total_num_tokens),
                           reserved_decode_tokens=int(queue.num_reserved_decode_tokens))


def refuse_what_decode_can_never_hold(original, queue, req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._check_if_req_exceed_kv_capacity`` (True: the request
    was refused and answered). SGLang's own check first; then, flag on, :class:`DecodeAdmission`'s
    bound, for a request SGLang has not ended already (an input-length or session error reaches
    the queue aborted, and its own message stands)."""
    if original(queue, req, *args, **kwargs):
        return True
    if not guards_decode(queue.scheduler.server_args) or req.finished_reason is not None:
        return False
    problem = admission_of(queue).refusal(len(req.origin_input_ids))
    if problem is None:
        return False
    message = f"Request {req.rid}: {problem}"
    logger.error(message)  # NOTE: the level of SGLang's own capacity refusal beside it
    sg.prepare_abort(req, message, status_code=HTTPStatus.BAD_REQUEST)
    queue.scheduler.stream_output([req], req.return_logprob)
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
        bound = admission_of(queue)
        logger.info("%s (decode): a request whose prompt + %d reserved decode tokens exceeds this pool's %d "
                    "tokens is refused at once (HTTP 400); --context-length <= %d keeps every request within it.",
                    FLAG, bound.reserved_decode_tokens, bound.pool_tokens, bound.longest_context())
    return result


__all__ = ["admission_of", "refuse_what_decode_can_never_hold", "check_decode_server"]
