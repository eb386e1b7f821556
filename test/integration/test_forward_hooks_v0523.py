"""The 0.5.23 forward-path hooks (``forward/hooks_v0523.py``) on 0.5.23's real classes: straight
through on a stock pool; on a shared-KV pool, refusals of what a prefill rank cannot run, and
the index store of a batch SGLang runs unsplit (its fused prepare-and-store) routed into the
dense view, this rank's rows into its shard. The hooks inside whole forwards, N = 2, 3, 4, 8:
test_cp_harness_v0523.py. Runs only where sglang 0.5.23 is installed (``.venv-0.5.23``)."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.forward import batch_state  # noqa: E402
from sglang_cp_shared_kv.forward.hooks_v0523 import (  # noqa: E402
    attach_batch_state,
    forward_extend_on_dense_view,
    fused_index_k_owned_and_dense,
    store_index_k_owned_and_dense,
)
from sglang_cp_shared_kv.forward.materialize import index_rows  # noqa: E402
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE  # noqa: E402
from sglang_cp_shared_kv_testing.cp_rig import BatchItem  # noqa: E402
from sglang_cp_shared_kv_testing.torch_standins import act_quant_reference  # noqa: E402

N, RANK = 2, 0
LAYER = 1


@pytest.fixture
def rig(monkeypatch):
    """Rank 0 of 2 (0.5.23's DSA pools, published without DCP), the index-K kernels as their
    torch stand-ins; no CP group is needed: the batches here have no history to gather."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_cp_shared_kv_testing import torch_standins
    from sglang_cp_shared_kv_testing.cp_rig_v0523 import InterleaveRig

    torch_standins.install(monkeypatch.setattr)
    monkeypatch.setattr(batch_state, "cp_device_group", lambda layout: None)
    monkeypatch.setattr(batch_state, "check_cp_group", lambda state: None)  # no group to check against
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        yield InterleaveRig(RANK, N, "bf16", group=None, physical_pages=6)


def _first_chunk(rig, extend_len, pool):
    req = rig.new_request()
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    locs = rig.allocator.alloc_extend(t(0), t(0), t(extend_len), t(extend_len), t(-1), extend_len)
    rig.req_to_token[req.slot, :extend_len] = locs.to(torch.int32)
    return locs, rig._batch(pool, [BatchItem(req, 0, extend_len)], locs, [0]), req


def _recording():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "stock"

    return calls, original


def test_stock_pool_passes_straight_through(rig):
    from sglang.srt.model_executor.forward_context import forward_context

    _, (fb, backend, ctx), _ = _first_chunk(rig, 70, rig.replicated)
    metadata = backend.forward_metadata
    assert attach_batch_state("result", backend, fb) == "result" and backend.forward_metadata is metadata
    calls, original = _recording()
    with forward_context(ctx):
        assert store_index_k_owned_and_dense(original, "indexer", fb, LAYER, "key", act_quant="q") == "stock"
        assert calls[-1] == (("indexer", fb, LAYER, "key"), {"act_quant": "q", "out_cache_loc": None})
        assert fused_index_k_owned_and_dense(original, "indexer", "raw", "pos", fb, LAYER, "q") == "stock"
        assert calls[-1] == (("indexer", "raw", "pos", fb, LAYER, "q"), {"out_cache_loc": None})
    assert forward_extend_on_dense_view(original, backend, "q", "k", "v", "layer", fb, save_kv_cache=True,
                                        k_rope="kr") == "stock"
    assert calls[-1] == ((backend, "q", "k", "v", "layer", fb), {"save_kv_cache": True, "k_rope": "kr"})
    assert not rig.shared.context.write_paths


def test_a_decode_forward_on_a_shared_kv_prefill_rank_is_refused(rig):
    # (a prefill batch of several requests runs: test_cp_harness_v0523.py's batched_requests)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    _, (fb, backend, _), _ = _first_chunk(rig, 70, rig.shared)
    fb.forward_mode = ForwardMode.DECODE
    with pytest.raises(NotImplementedError, match="only prefill .* runs here"):
        attach_batch_state(None, backend, fb)


def test_an_unsplit_batchs_fused_index_store_lands_in_the_dense_view_and_the_owned_rows_in_the_shard(rig):
    """A chunk shorter than the CP group runs unsplit on every rank and SGLang stores its index
    keys with ``_fused_k_prepare_and_store``, whose non-fused path ends in
    ``_store_index_k_cache(out_cache_loc=...)``: under the hook SGLang's own code writes the
    chunk at its dense locations into the dense view (the inner store passes straight
    through), this rank's rows are copied into its shard, and what the indexer then reads
    equals a stock pool's."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.model_executor.forward_context import forward_context

    indexer = SimpleNamespace(block_size=128, scale_fmt=None)
    inner = []

    def sglang_prepare_and_store(indexer, key_raw, positions, forward_batch, layer_id, act_quant,
                                 out_cache_loc=None):
        """What 0.5.23's fallback does after preparing the keys: its own store at the locations
        it is given (through the hook, as the registry rebinds the method)."""
        def store(*args, **kwargs):
            inner.append(kwargs["out_cache_loc"])
            return Indexer._store_index_k_cache(*args, **kwargs)

        store_index_k_owned_and_dense(store, indexer, forward_batch, layer_id, key_raw * 2, act_quant=act_quant,
                                      out_cache_loc=out_cache_loc)

    locs, (fb, backend, ctx), req = _first_chunk(rig, 3 * PAGE - 5, rig.shared)
    fb_r, backend_r, ctx_r = rig._batch(rig.replicated, [BatchItem(req, 0, locs.numel())], locs, [0])
    attach_batch_state(None, backend, fb)
    key = torch.randn(locs.numel(), 128).to(torch.bfloat16)
    with forward_context(ctx):
        # (SGLang's unsplit path passes the batch's own out_cache_loc)
        fused_index_k_owned_and_dense(sglang_prepare_and_store, indexer, key, None, fb, LAYER, act_quant_reference,
                                      out_cache_loc=fb.out_cache_loc)
    with forward_context(ctx_r):
        sglang_prepare_and_store(indexer, key, None, fb_r, LAYER, act_quant_reference, out_cache_loc=locs)
    state = rig.shared.in_flight.batch_state
    assert len(inner) == 2 and torch.equal(inner[0], state.dense_out_locs) and torch.equal(inner[1], locs)
    owned = rig.layout.owned_by_this_rank(locs, validate=False)
    assert 0 < int(owned.sum()) < locs.numel()  # rank 0 owns some of the chunk's pages, not all
    physical = rig.layout.logical_locs_to_physical(locs[owned], validate=False)
    stock_rows = index_rows(rig.replicated.index_k_with_scale_buffer[LAYER], locs[owned], PAGE)
    assert torch.equal(index_rows(rig.shared.physical_index_buffer(LAYER), physical, PAGE), stock_rows)
    lens, rows = torch.tensor([locs.numel()]), locs.numel()
    got = rig.shared.get_index_k_scale_buffer(LAYER, lens, backend.forward_metadata.real_page_table, rows, rows)
    want = rig.replicated.get_index_k_scale_buffer(LAYER, lens, backend_r.forward_metadata.real_page_table, rows, rows)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert rig.shared.context.write_paths == {("gathered", "gathered"): 1}


def test_a_store_at_other_locations_than_the_batchs_is_recorded_and_goes_to_the_planned_rows(rig):
    """Other locations than the batch's could differ on one rank alone: recorded for the
    forward's agreement point (which fails every rank: test_rank_agreement.py), and the store
    goes to the batch's planned rows meanwhile, so the rank stays in step."""
    from sglang.srt.model_executor.forward_context import forward_context

    locs, (fb, backend, ctx), _ = _first_chunk(rig, 70, rig.shared)
    attach_batch_state(None, backend, fb)
    calls, original = _recording()
    with forward_context(ctx):
        store_index_k_owned_and_dense(original, "indexer", fb, LAYER, torch.zeros(70, 128),
                                      out_cache_loc=locs.flip(0))
    fault = rig.shared.context.agreement.fault
    assert fault.check == "chunk_locations" and fault.layer == LAYER
    assert "other than the batch's out_cache_loc" in fault.message
    assert torch.equal(calls[-1][1]["out_cache_loc"], rig.shared.in_flight.batch_state.dense_out_locs)


def test_a_chunk_with_another_row_count_than_the_batchs_is_recorded_and_replaced_by_zeros(rig):
    """A store handed fewer rows than the batch's out_cache_loc (a rank's own rows, or rows
    SGLang narrowed for a kernel) would place them at the wrong locations: recorded, named,
    for the agreement point; SGLang's store gets zeros of the batch's shape instead, so the
    rank issues the same collectives as the others until then."""
    from sglang.srt.model_executor.forward_context import forward_context

    _, (fb, backend, ctx), _ = _first_chunk(rig, 70, rig.shared)
    attach_batch_state(None, backend, fb)
    calls, original = _recording()
    with forward_context(ctx):
        store_index_k_owned_and_dense(original, "indexer", fb, LAYER, torch.ones(35, 128))
    fault = rig.shared.context.agreement.fault
    assert (fault.check, fault.layer) == ("chunk_rows", LAYER)
    assert "the index key chunk has 35 rows for the batch's 70" in fault.message
    (stored,) = [args[3] for args, _ in calls]
    assert stored.shape == (70, 128) and not stored.any()
