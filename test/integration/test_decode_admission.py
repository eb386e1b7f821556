"""The decode server's admission, on SGLang's own ``DecodePreallocQueue``.

Stock SGLang 0.5.12.post1 admits decode's queue in order and stops at the first request it
cannot take; a request above ``decode_admission.DecodeAdmission``'s bound is never taken
and blocks every request behind it (shown here with SGLang's own ``pop_preallocated``).
With the flag on the decode server such a request fails at once; without it, stock.

The queue is SGLang's class with its admission arithmetic (``pop_preallocated``,
``_allocatable_token_budgets``, ``_check_if_req_exceed_kv_capacity``) and a real paged
allocator over a CPU NSA pool; what lies past the admission decision (``_pre_alloc``: the
request's pages and its metadata to prefill) is replaced by a recorder, and so is the
scheduler (an empty or a busy one) and the receivers (handshake done).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.decode.admission import (
    DEFAULT_RESERVED_DECODE_TOKENS,
    DecodeAdmission,
    decode_pool_tokens_for_context,
)
from sglang_cp_shared_kv.decode.server import admission_of

pytestmark = pytest.mark.usefixtures("plugin_loaded")

PAGE = 64
POOL_PAGES = 32  # NOTE: a 2,048-token pool: small, and a multiple of the page like SGLang's
RESERVED = DEFAULT_RESERVED_DECODE_TOKENS


def _pool_allocator():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    from sglang_cp_shared_kv_testing.pd.geometry import Geometry

    tokens = POOL_PAGES * PAGE
    geometry = Geometry(layers=1, kv_lora_rank=64, qk_rope_head_dim=64, dtype="bf16", kv_cache_dim=128)
    pool = NSATokenToKVPool(tokens, **geometry.pool_kwargs())
    return PagedTokenToKVPoolAllocator(tokens, PAGE, torch.bfloat16, "cpu", pool, need_sort=False)


def _req(rid: str, prompt_tokens: int, max_new_tokens: int = 8):
    """A request as decode's queue receives it: max_new_tokens as SGLang's scheduler leaves it.

    NOTE: ``Scheduler.init_req_max_new_tokens`` caps it at pool - ceil_page(P) - page - 1
    before the queue sees the request; its module does not import on a CPU (sgl_kernel), so
    the cap is applied here, the one expression of it that matters."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    capped = min(max_new_tokens, POOL_PAGES * PAGE - -(-prompt_tokens // PAGE) * PAGE - PAGE - 1)
    return Req(rid, "", list(range(2, 2 + prompt_tokens)), SamplingParams(max_new_tokens=max(0, capped)))


class _Admitted(Exception):
    """Raised by the recorder that stands for ``_pre_alloc``: the queue took this request."""


def _queue(flag_on: bool, running=()):
    """SGLang's ``DecodePreallocQueue`` with its admission state (module docstring);
    ``running``: (prompt tokens, max_new_tokens) of requests decoding now, their tokens
    taken from the pool."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)  # no KV manager, no network
    allocator = _pool_allocator()
    running_reqs = []
    for i, (prompt, new) in enumerate(running):
        req = _req(f"running-{i}", prompt, new)
        assert allocator.alloc(-(-prompt // PAGE) * PAGE) is not None
        running_reqs.append(req)
    answered = []
    queue.__dict__.update(
        token_to_kv_pool_allocator=allocator, token_to_kv_pool=allocator.get_kvcache(),
        req_to_token_pool=SimpleNamespace(available_size=lambda: 8),
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
        transfer_queue=SimpleNamespace(queue=[], enable_staging=False), tree_cache=None,
        max_total_num_tokens=POOL_PAGES * PAGE, num_reserved_decode_tokens=RESERVED,
        queue=[], retracted_queue=[], pending_reqs=[],
        scheduler=SimpleNamespace(
            server_args=SimpleNamespace(enable_nsa_prefill_cp_shared_kv=flag_on, disaggregation_mode="decode",
                                        disaggregation_decode_enable_radix_cache=False),
            running_batch=SimpleNamespace(reqs=running_reqs), waiting_queue=[], last_batch=None,
            enable_priority_scheduling=False, enable_hisparse=False,
            stream_output=lambda reqs, return_logprob: answered.extend(reqs)),
    )

    def pre_alloc(req, *args, **kwargs):
        raise _Admitted(req.rid)

    queue._pre_alloc = pre_alloc
    return queue, answered


def _enqueue(queue, req):
    """``DecodePreallocQueue.add`` up to the receiver: SGLang's refusal check (hooked), then
    the request waits for preallocation with its handshake done. True: refused."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    if queue._check_if_req_exceed_kv_capacity(req):
        return True
    queue.queue.append(DecodeRequest(req=req, kv_receiver=SimpleNamespace(), waiting_for_input=True))
    return False


def _admitted_now(queue):
    """The request SGLang's ``pop_preallocated`` takes first now, or None."""
    try:
        queue.pop_preallocated()
    except _Admitted as taken:
        return taken.args[0]
    return None


@pytest.mark.parametrize("new_tokens", [8, 1500], ids=["few-new-tokens", "many-new-tokens"])
@pytest.mark.parametrize("running", [(), ((700, 64),)], ids=["idle", "busy"])
def test_stock_decode_never_takes_a_request_over_the_bound_and_blocks_the_queue(running, new_tokens):
    queue, answered = _queue(flag_on=False, running=running)
    bound = admission_of(queue)
    prompt = bound.pool_tokens - RESERVED + 1  # one token over the bound; shorter than the pool
    assert prompt < queue.max_total_num_tokens and bound.refusal(prompt) is not None
    assert not _enqueue(queue, _req("over", prompt, new_tokens))  # stock: not refused
    assert not _enqueue(queue, _req("short-behind-it", 64))
    for _ in range(3):  # every scheduler pass alike: nobody is taken, nothing answered
        assert _admitted_now(queue) is None
    assert [d.req.rid for d in queue.queue] == ["over", "short-behind-it"] and answered == []


@pytest.mark.parametrize("new_tokens", [8, 1500], ids=["few-new-tokens", "many-new-tokens"])
def test_stock_decode_takes_a_request_at_the_bound_once_idle(new_tokens):
    """The bound is exact: a prompt one token shorter is taken by an idle decode, whatever
    max_new_tokens the client asked for (the scheduler has capped it to the pool)."""
    queue, _ = _queue(flag_on=False)
    bound = admission_of(queue)
    prompt = bound.pool_tokens - RESERVED
    assert bound.refusal(prompt) is None
    assert not _enqueue(queue, _req("at-bound", prompt, new_tokens))
    assert _admitted_now(queue) == "at-bound"


def test_with_the_flag_decode_refuses_it_at_once_and_the_queue_moves_on():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    queue, answered = _queue(flag_on=True)
    bound = admission_of(queue)
    over = _req("over", bound.pool_tokens - RESERVED + 1)
    assert _enqueue(queue, over)  # refused before it waits
    assert answered == [over] and isinstance(over.finished_reason, FINISH_ABORT)
    reason = over.finished_reason.to_json()
    assert reason["status_code"] == 400
    assert FLAG in reason["message"] and f"need {bound.pool_tokens + 1} KV tokens" in reason["message"]
    assert f"a pool of at least {bound.pool_tokens + PAGE} tokens" in reason["message"]  # whole pages
    assert f"--context-length of at most {bound.longest_context()}" in reason["message"]
    assert not _enqueue(queue, _req("short-behind-it", 64))
    assert _admitted_now(queue) == "short-behind-it"


def test_with_the_flag_a_request_at_the_bound_and_sglangs_own_refusals_are_unchanged():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    queue, answered = _queue(flag_on=True)
    bound = admission_of(queue)
    assert not _enqueue(queue, _req("at-bound", bound.pool_tokens - RESERVED))
    assert answered == []
    longer_than_pool = _req("longer-than-pool", bound.pool_tokens + 1)
    assert _enqueue(queue, longer_than_pool)  # SGLang's own message, not ours
    assert "exceeds the maximum number of tokens" in longer_than_pool.finished_reason.to_json()["message"]
    # a request SGLang ended before the queue (input too long for its limit, a session error)
    # keeps SGLang's message: the queue streams it out itself
    ended = _req("ended-by-sglang", bound.pool_tokens - RESERVED + 1)
    ended.finished_reason = FINISH_ABORT("Input length exceeds the maximum allowed length", 400)
    assert not _enqueue(queue, ended)
    assert ended.finished_reason.to_json()["message"] == "Input length exceeds the maximum allowed length"


def test_a_context_length_within_the_bound_keeps_every_request_admissible():
    """What deploy.md tells a user: with --context-length C <= longest_context() on both
    servers, SGLang's tokenizer keeps every prompt below C, and no request is over; the
    planner's decode pool for C (whole pages) is the smallest pool that does that."""
    bound = DecodeAdmission(pool_tokens=POOL_PAGES * PAGE, reserved_decode_tokens=RESERVED)
    context = bound.longest_context()
    assert all(bound.refusal(prompt) is None for prompt in range(1, context))
    assert bound.refusal(context) is not None  # one more token than such a prompt can have
    for context in (context, 202_752, 163_840, 1000):
        pool = decode_pool_tokens_for_context(context)
        assert pool % PAGE == 0
        assert DecodeAdmission(pool, RESERVED).longest_context() >= context
        assert DecodeAdmission(pool - PAGE, RESERVED).longest_context() < context


def test_each_decode_scheduler_checks_its_own_configuration_at_startup(tiny_nsa_model, monkeypatch, caplog,
                                                                        pretend_hopper):
    """AFTER ``DecodePreallocQueue.__init__``: the hooks and the configuration checked in the
    scheduler process too (a node of a multi-node decode may run with another environment)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_shared_kv.decode.server import check_decode_server
    from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError
    from sglang_cp_shared_kv_testing.support import decode_guard_kwargs

    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    queue, _ = _queue(flag_on=True)
    queue.scheduler.server_args = ServerArgs(**decode_guard_kwargs(tiny_nsa_model))
    with caplog.at_level("INFO", logger="sglang_cp_shared_kv.decode.server"):
        assert check_decode_server("init result", queue) == "init result"
    assert f"exceeds this pool's {POOL_PAGES * PAGE} tokens is refused at once" in caplog.text
    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    with pytest.raises(CpSharedKVConfigError, match="SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not set"):
        check_decode_server(None, queue)
    queue.scheduler.server_args.enable_nsa_prefill_cp_shared_kv = False  # flag off: stock, nothing checked
    assert check_decode_server(None, queue) is None
