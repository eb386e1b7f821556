"""The forward-path hooks: straight through on a stock pool, loud on unsupported batches."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward.in_flight import ForwardInFlight
from sglang_cp_shared_kv.forward.hooks import (
    all_gather_in_seq_order,
    attach_batch_state,
    batch_state_of,
    forward_extend_on_dense_view,
    index_key_kept_local,
    latent_kept_local,
    store_index_k_owned_and_dense,
)
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.kv_geometry import mla_kv_cache_dim
from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

POOL_KWARGS = dict(page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=1,
                   device="cpu", index_head_dim=128, enable_memory_saver=False,
                   kv_cache_dim=mla_kv_cache_dim("bf16"))


def _batch(pool, mode_name="EXTEND", batch_size=1):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(
        forward_mode=getattr(ForwardMode, mode_name), batch_size=batch_size, input_ids=torch.zeros(3),
        req_pool_indices=torch.zeros(batch_size, dtype=torch.int64), seq_lens=torch.tensor([3] * batch_size),
        out_cache_loc=torch.tensor([64, 65, 66]), seq_lens_sum=3 * batch_size,
        extend_prefix_lens_cpu=[0] * batch_size, extend_seq_lens_cpu=[3] * batch_size, token_to_kv_pool=pool,
    )


def test_stock_pool_passes_straight_through():
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    pool = NSATokenToKVPool(4 * PAGE, **POOL_KWARGS)
    fb = _batch(pool)
    backend = SimpleNamespace(forward_metadata=object())
    metadata = backend.forward_metadata
    assert attach_batch_state("result", backend, fb) == "result"
    assert backend.forward_metadata is metadata and not hasattr(fb, "uses_cp_shared_kv")

    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "stock"

    assert store_index_k_owned_and_dense(original, "indexer", fb, 0, "key", act_quant="q") == "stock"
    assert calls[-1] == (("indexer", fb, 0, "key"), {"act_quant": "q"})
    out = forward_extend_on_dense_view(original, "backend", "q", "k", "v", "layer", fb, save_kv_cache=True,
                                       k_rope="kr", topk_indices="t")
    assert out == "stock"
    assert calls[-1] == (("backend", "q", "k", "v", "layer", fb),
                         {"save_kv_cache": True, "k_rope": "kr", "topk_indices": "t"})
    assert index_key_kept_local(original, "indexer", "q_lora", "x", "positions", False, fb) == "stock"
    assert calls[-1] == (("indexer", "q_lora", "x", "positions", False), {"forward_batch": fb})
    assert latent_kept_local(original, "attention", "latent", fb, "k_nope", "k_pe") == "stock"
    assert calls[-1] == (("attention", "latent", fb, "k_nope", "k_pe"), {})


def test_the_index_key_gather_stays_local_only_inside_get_q_k_of_a_local_writes_forward():
    """The re-range hook returns this rank's rows untouched (no collective) exactly while the
    pool keeps in-seq gathers local, which ``index_key_kept_local`` sets around SGLang's
    ``Indexer._get_q_k_bf16`` of a local-writes forward, and nowhere else."""
    pool = _shared_pool()
    fb = SimpleNamespace(token_to_kv_pool=pool, attn_cp_metadata=None)
    rows = torch.ones(4, 8)
    sglang = []

    def gather(*args):
        sglang.append(args)
        return "gathered"

    pool.in_flight = ForwardInFlight(batch_state=None, agreement=pool.context.agreement)
    with pool.in_flight.gathers_in_seq_kept_local():
        assert all_gather_in_seq_order(gather, rows, 2, fb, None) is rows
    assert not sglang and not pool.in_flight.gathers_kept_local
    assert all_gather_in_seq_order(gather, rows, 2, fb, None) == "gathered"  # no metadata: SGLang's


def _shared_pool():
    return CpSharedNSATokenToKVPool(4 * PAGE, context=CpSharedKVContext(CpSharedKVLayout(PAGE, 2, 0)), **POOL_KWARGS)


def test_idle_batch_on_shared_pool_has_no_state():
    fb = _batch(_shared_pool(), "IDLE")
    attach_batch_state(None, SimpleNamespace(forward_metadata=None), fb)
    assert batch_state_of(fb) is None


def test_decode_on_shared_pool_is_refused():
    with pytest.raises(NotImplementedError, match="only prefill .* runs here"):
        attach_batch_state(None, SimpleNamespace(forward_metadata=None), _batch(_shared_pool(), "DECODE"))


def test_multi_request_prefill_batch_is_refused():
    with pytest.raises(NotImplementedError, match="a prefill batch of 2 requests"):
        attach_batch_state(None, SimpleNamespace(forward_metadata=None), _batch(_shared_pool(), "EXTEND", 2))
