"""The forward-path hooks: straight through on a stock pool, loud on unsupported batches."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward.hooks import (
    attach_batch_state,
    batch_state_of,
    forward_extend_on_dense_view,
    store_index_k_owned_and_dense,
)
from sglang_cp_shared_kv.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.kv_geometry import mla_kv_cache_dim
from sglang_cp_shared_kv.pool import CpSharedNSATokenToKVPool

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
