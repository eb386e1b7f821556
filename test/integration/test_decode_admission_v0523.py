"""The decode server's admission on SGLang 0.5.23's own ``DecodePreallocQueue`` (the 0.5.23
twin of ``test_decode_admission.py``). Runs only where sglang 0.5.23 is installed
(``.venv-0.5.23``).

What stock 0.5.23 does: its capacity check (``_check_if_req_exceed_kv_capacity``) asks the
allocator for a ceiling, which the paged allocator of a DSA pool does not have, and then refuses
only a prompt longer than the pool, as 0.5.12.post1 did; ``pop_preallocated`` admits the queue
in order, stops at the first request it cannot take, and takes one only once the pool covers its
prompt in whole pages plus the reserved decode tokens. A request above that bound is never
taken and blocks every request behind it, as on 0.5.12.post1. With the flag on the decode
server (``decode_server_dsa``) such a request fails at once; without it, stock.

The queue is SGLang's class, built by its own constructor in a decode scheduler's runtime
context (``create_context``, role ``"scheduler"``, from a decode server's resolved arguments),
with its admission arithmetic and a real paged allocator over a CPU ``DSATokenToKVPool``; the
plugin's hooks are applied by SGLang's loader. Replaced: the KV manager (its constructor opens
Mooncake), what lies past the admission decision (``_pre_alloc``: the request's pages and its
metadata to prefill) by a recorder, the scheduler (an empty or a busy one) and the receivers
(handshake done).
"""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.settings.config import FLAG  # noqa: E402
from sglang_cp_shared_kv.decode.admission import DEFAULT_RESERVED_DECODE_TOKENS  # noqa: E402
from sglang_cp_shared_kv.decode.server_v0523 import admission_of  # noqa: E402
from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError  # noqa: E402
from sglang_cp_shared_kv_testing.support import free_port  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")

PAGE = 64
POOL_PAGES = 32  # NOTE: a 2,048-token pool: small, and whole pages like SGLang's
POOL = POOL_PAGES * PAGE
RESERVED = DEFAULT_RESERVED_DECODE_TOKENS  # 0.5.23's --num-reserved-decode-tokens default too
#: a reserve that is not whole pages: 0.5.23 charges the prompt in whole pages beside it
UNEVEN_RESERVED = 500


def decode_server_args(model, *extra, flag=True):
    """The resolved ``ServerArgs`` of a one-GPU PD decode server of a DSA model."""
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(
        ["--model-path", model, "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cuda", "--tp", "1",
         "--page-size", str(PAGE), "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
         *([FLAG] if flag else []), *extra])
    server_args.resolve_once()
    return server_args


def _pool_allocator():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    pool = DSATokenToKVPool(POOL, page_size=PAGE, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=64,
                            layer_num=1, device="cpu", index_head_dim=128, enable_memory_saver=False,
                            kv_cache_dim=128)
    return PagedTokenToKVPoolAllocator(POOL, PAGE, torch.bfloat16, "cpu", pool, need_sort=False)


class _Admitted(Exception):
    """Raised by the recorder that stands for ``_pre_alloc``: the queue took this request."""


class _Receiver:
    """A receiver whose handshake is done (polls ``WaitingForInput``)."""

    def poll(self):
        from sglang.srt.disaggregation.base.conn import KVPoll

        return KVPoll.WaitingForInput

    def clear(self):
        pass


class Decode:
    """A decode scheduler process: its runtime context and SGLang's ``DecodePreallocQueue``
    (module docstring); ``answered``: what the queue streamed out."""

    def __init__(self, stack: ExitStack, server_args, gloo_group, monkeypatch, running=()):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.runtime_context import SpawnRanks, create_context, get_disagg, get_parallel, use_context

        context = create_context(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        stack.enter_context(use_context(context))
        stack.enter_context(get_parallel().override(attn_tp_group=gloo_group))
        monkeypatch.setattr(DecodePreallocQueue, "_init_kv_manager", lambda queue: SimpleNamespace())
        allocator = _pool_allocator()
        running_reqs = []
        for i, (prompt, new) in enumerate(running):
            running_reqs.append(self.req(f"running-{i}", prompt, new))
            assert allocator.alloc(-(-prompt // PAGE) * PAGE) is not None
        self.answered = []
        self.scheduler = SimpleNamespace(
            server_args=server_args, random_seed=0, tp_worker=SimpleNamespace(is_hybrid_swa=False),
            running_batch=SimpleNamespace(reqs=running_reqs), waiting_queue=[], last_batch=None,
            enable_priority_scheduling=False, enable_hisparse=False, enable_lora=False, enable_decode_hicache=False,
            output_streamer=SimpleNamespace(stream_output=lambda reqs, return_logprob: self.answered.extend(reqs)))
        self.queue = DecodePreallocQueue(
            req_to_token_pool=SimpleNamespace(available_size=lambda: 8), token_to_kv_pool_allocator=allocator,
            draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
            metadata_buffers=None, scheduler=self.scheduler, transfer_queue=SimpleNamespace(queue=[]),
            tree_cache=None, gpu_id=0, bootstrap_port=free_port(), max_total_num_tokens=POOL,
            num_reserved_decode_tokens=get_disagg().num_reserved_decode_tokens,
            transfer_backend=TransferBackend.MOONCAKE)

        def pre_alloc(req, *args, **kwargs):
            raise _Admitted(req.rid)

        self.queue._pre_alloc = pre_alloc

    def req(self, rid: str, prompt_tokens: int, max_new_tokens: int = 8):
        """A request as decode's queue receives it: ``max_new_tokens`` as the scheduler leaves it
        (``Scheduler`` caps it with the allocator's ``max_new_tokens_for_memory``; its module is not
        driven here, so the cap is applied with the same call)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        capped = _pool_allocator().max_new_tokens_for_memory(prompt_tokens, max_new_tokens, token_capacity=POOL,
                                                             sliding_window_size=None, chunk_size=None)
        return Req(rid, "", list(range(2, 2 + prompt_tokens)), SamplingParams(max_new_tokens=capped))

    def enqueue(self, req) -> bool:
        """``DecodePreallocQueue.add`` up to the receiver: SGLang's refusal check (hooked), then
        the request waits for preallocation with its handshake done. True: refused."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        if self.queue._check_if_req_exceed_kv_capacity(req):
            return True
        self.queue.queue.append(DecodeRequest(req=req, kv_receiver=_Receiver(), waiting_for_input=True))
        return False

    def admitted_now(self):
        """The request SGLang's ``pop_preallocated`` takes first now, or None."""
        try:
            self.queue.pop_preallocated()
        except _Admitted as taken:
            return taken.args[0]
        return None

    def waiting(self):
        return [d.req.rid for d in self.queue.queue]


@pytest.fixture
def decode(tiny_nsa_model, gloo_world_of_one, monkeypatch):
    """``decode(flag_on, *extra_args, running=())``: a decode scheduler's queue (:class:`Decode`)."""
    with ExitStack() as stack:
        def make(flag_on: bool, *extra, running=()):
            server_args = decode_server_args(tiny_nsa_model, *extra, flag=flag_on)
            return Decode(stack, server_args, gloo_world_of_one, monkeypatch, running)

        yield make


# ------------------------------------------------------------------ stock 0.5.23
@pytest.mark.parametrize("new_tokens", [8, 1500], ids=["few-new-tokens", "many-new-tokens"])
@pytest.mark.parametrize("running", [(), ((700, 64),)], ids=["idle", "busy"])
def test_stock_0523_decode_never_takes_a_request_over_the_bound_and_blocks_the_queue(decode, running, new_tokens):
    """The fact on 0.5.23: SGLang's own check does not refuse a prompt shorter than the pool,
    and ``pop_preallocated`` never takes it while it needs more than the pool with the reserve:
    it stays at the head of the queue, and the request behind it with it."""
    server = decode(False, running=running)
    assert server.queue.num_reserved_decode_tokens == RESERVED and server.queue.max_total_num_tokens == POOL
    assert server.queue.token_to_kv_pool_allocator.prealloc_ceiling_fits(POOL + 1, POOL + 1) is None  # no ceiling
    prompt = POOL - RESERVED + 1  # one token over the bound; shorter than the pool
    assert not server.enqueue(server.req("over", prompt, new_tokens))  # stock: not refused
    assert not server.enqueue(server.req("short-behind-it", 64))
    for _ in range(3):  # every scheduler pass alike: nobody is taken, nothing answered
        assert server.admitted_now() is None
    assert server.waiting() == ["over", "short-behind-it"] and server.answered == []


@pytest.mark.parametrize("reserved", [RESERVED, UNEVEN_RESERVED])
@pytest.mark.parametrize("new_tokens", [8, 1500], ids=["few-new-tokens", "many-new-tokens"])
def test_stock_0523_takes_a_request_exactly_within_the_guards_bound_once_idle(decode, reserved, new_tokens):
    """The bound is exact against an idle stock decode, whatever max_new_tokens the client asked
    for: the longest prompt the guard admits is taken, one token more never is. 0.5.23 charges
    the prompt in whole pages, so a reserve of 500 tokens bounds as one of 512 (8 pages)."""
    bound = admission_of(decode(False, "--num-reserved-decode-tokens", str(reserved)).queue)
    assert bound.reserved_decode_tokens == -(-reserved // PAGE) * PAGE
    longest = bound.pool_tokens - bound.reserved_decode_tokens
    for prompt, taken in ((longest, True), (longest + 1, False), (POOL - reserved, reserved % PAGE == 0)):
        server = decode(False, "--num-reserved-decode-tokens", str(reserved))
        assert (bound.refusal(prompt) is None) == taken
        assert not server.enqueue(server.req("it", prompt, new_tokens))
        assert server.admitted_now() == ("it" if taken else None), prompt


def test_stock_0523_refuses_only_a_prompt_longer_than_the_pool(decode):
    server = decode(False)
    longer_than_pool = server.req("longer-than-pool", POOL + 1)
    assert server.enqueue(longer_than_pool)
    message = longer_than_pool.finished_reason.to_json()["message"]
    assert "exceeds the maximum number of tokens" in message and server.answered == [longer_than_pool]


# ------------------------------------------------------------------ the flag on decode
def test_with_the_flag_decode_refuses_it_at_once_and_the_queue_moves_on(decode):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    server = decode(True)
    bound = admission_of(server.queue)
    over = server.req("over", POOL - RESERVED + 1)
    assert server.enqueue(over)  # refused before it waits
    assert server.answered == [over] and isinstance(over.finished_reason, FINISH_ABORT)
    reason = over.finished_reason.to_json()
    assert reason["status_code"] == 400
    assert FLAG in reason["message"] and f"need {POOL + 1} KV tokens" in reason["message"]
    assert f"a pool of at least {POOL + PAGE} tokens" in reason["message"]  # whole pages
    assert f"--context-length of at most {bound.longest_context()}" in reason["message"]
    assert not server.enqueue(server.req("short-behind-it", 64))
    assert server.admitted_now() == "short-behind-it"


def test_with_the_flag_an_uneven_reserve_is_bounded_in_whole_pages(decode):
    """A prompt stock 0.5.23 would keep waiting although prompt + reserve fits the pool (its
    prompt is charged in whole pages) is refused too; the longest it takes is admitted."""
    server = decode(True, "--num-reserved-decode-tokens", str(UNEVEN_RESERVED))
    prompt = POOL - UNEVEN_RESERVED  # prompt + 500 fits 2,048 tokens; its 24 pages + 500 do not
    assert server.enqueue(server.req("over-in-pages", prompt))
    assert not server.enqueue(server.req("longest", POOL - -(-UNEVEN_RESERVED // PAGE) * PAGE))
    assert server.admitted_now() == "longest"


def test_with_the_flag_a_request_at_the_bound_and_sglangs_own_refusals_are_unchanged(decode):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    server = decode(True)
    assert not server.enqueue(server.req("at-bound", POOL - RESERVED))
    assert server.answered == []
    longer_than_pool = server.req("longer-than-pool", POOL + 1)
    assert server.enqueue(longer_than_pool)  # SGLang's own message, not ours
    assert "exceeds the maximum number of tokens" in longer_than_pool.finished_reason.to_json()["message"]
    assert FLAG not in longer_than_pool.finished_reason.to_json()["message"]
    # a request SGLang ended before the queue (input too long for its limit, a session error)
    # keeps SGLang's message: the queue streams it out itself
    ended = server.req("ended-by-sglang", POOL - RESERVED + 1)
    ended.finished_reason = FINISH_ABORT("Input length exceeds the maximum allowed length", 400)
    assert not server.enqueue(ended)
    assert ended.finished_reason.to_json()["message"] == "Input length exceeds the maximum allowed length"
    assert server.admitted_now() == "at-bound" and server.answered == [longer_than_pool, ended]


# ------------------------------------------------------------------ startup
@pytest.fixture
def guard_log():
    """The messages of ``decode_server``'s logger (the startup line). NOTE: not caplog:
    resolving 0.5.23's server arguments reconfigures the root logger's handlers."""
    import logging

    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("sglang_cp_shared_kv.decode.server")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_each_decode_scheduler_checks_its_own_configuration_at_startup(decode, guard_log, monkeypatch):
    """AFTER ``DecodePreallocQueue.__init__`` (its constructor, hooked by SGLang's loader): the
    hooks and the decode settings checked in the scheduler process too (a node of a multi-node
    decode may run with another environment), then the line; flag off, nothing."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from sglang_cp_shared_kv.hook_check import missing_hooks
    from sglang_cp_shared_kv.plugin import hooks_for

    assert missing_hooks(hooks_for(v0523.RELEASE)) == []
    assert hasattr(DecodePreallocQueue.__init__, "__wrapped__")  # the constructor SGLang runs is the hooked one
    decode(True)
    assert any(f"exceeds this pool's {POOL} tokens is refused at once" in m
               and f"--context-length <= {POOL - RESERVED + 1}" in m for m in guard_log)
    count = len(guard_log)
    # HiSparse admits by its own logical pool, which the bound does not model
    with pytest.raises(CpSharedKVConfigError, match="--enable-hisparse: HiSparse admits decode requests"):
        decode(True, "--enable-hisparse")
    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    with pytest.raises(CpSharedKVConfigError, match="SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not set"):
        decode(True)
    decode(False)  # flag off: stock, nothing checked (the environment is still missing)
    decode(False, "--enable-hisparse")
    assert len(guard_log) == count

