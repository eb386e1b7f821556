"""The shared-KV pool and allocator on SGLang 0.5.23's real ``DSATokenToKVPool`` and
``PagedTokenToKVPoolAllocator`` (CPU; 0.5.23 stores MLA rows with its own CPU path where
Triton is absent). Runs only where sglang 0.5.23 is installed (``.venv-0.5.23``)."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator  # noqa: E402
from sglang_cp_shared_kv.context import CpSharedKVContext  # noqa: E402
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv.pool.kv_pool_v0523 import CpSharedDSATokenToKVPool, use_cp_shared_dsa_pool_classes  # noqa: E402

PAGE = 64
#: DeepSeek-V3.2's latent (512 + 64) and index-K head (128); fp8 rows are 656 bytes
KWARGS = {"bf16": dict(page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=2,
                       device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576),
          "fp8": dict(page_size=PAGE, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
                      layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656)}


def stock_pool(tokens, dtype_name="bf16"):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1):  # what a published server answers without DCP
        return DSATokenToKVPool(tokens, **KWARGS[dtype_name])


def shared_pool(physical, n, rank=0, dtype_name="bf16"):
    context = CpSharedKVContext(CpSharedKVLayout(page_size=PAGE, cp_size=n, cp_rank=rank))
    return CpSharedDSATokenToKVPool(physical * n, context=context, **KWARGS[dtype_name])


class Layer:
    layer_id = 1


@pytest.fixture
def published_without_dcp():
    """What a published 0.5.23 server without DCP answers for the widths its MLA store reads."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        yield


@pytest.mark.parametrize("dtype_name", ["bf16", "fp8"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_buffers_are_a_stock_pool_of_the_physical_size(n, dtype_name):
    physical = 5 * PAGE
    pool, stock = shared_pool(physical, n, n - 1, dtype_name), stock_pool(physical, dtype_name)
    assert pool.size == pool.logical_size == n * physical and pool.physical_size == physical
    for mine, theirs in zip(pool.kv_buffer + pool.index_k_with_scale_buffer,
                            stock.kv_buffer + stock.index_k_with_scale_buffer):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    assert pool.get_kv_size_bytes() == stock.get_kv_size_bytes()
    assert pool.stores_packed_fp8 == (dtype_name == "fp8") == stock.dsa_kv_cache_store_fp8


@pytest.mark.parametrize("kwargs, named", [
    ({"index_kpool": 2}, "index_kpool=2"),
    ({"skip_topk_layers": [False, True]}, "top-k"),
    ({"dcp_replicated": True}, "DCP-replicated"),
])
def test_index_layouts_without_one_page_per_logical_page_are_refused(kwargs, named):
    context = CpSharedKVContext(CpSharedKVLayout(page_size=PAGE, cp_size=2, cp_rank=0))
    with pytest.raises(ValueError, match=named):
        CpSharedDSATokenToKVPool(4 * PAGE, context=context, **KWARGS["bf16"], **kwargs)


@pytest.mark.usefixtures("published_without_dcp")
@pytest.mark.parametrize("dtype_name", ["bf16", "fp8"])
@pytest.mark.parametrize("n", [2, 3])
def test_each_rank_stores_exactly_its_pages_as_a_replicated_pool_holds_them(n, dtype_name, monkeypatch):
    """The MLA store of 0.5.23 (``set_mla_kv_buffer(layer, loc_info, ...)``, ``KVWriteLoc``
    or a bare tensor): every rank keeps its owned rows at their physical rows, byte for
    byte what the stock pool of the logical size holds there, and writes nothing else."""
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_cp_shared_kv_testing.torch_standins import quantize_k_cache_separate_reference

    # NOTE: fp8 quantises with a Triton kernel; both pools use the same stand-in (0.5.12's,
    # proven equal to 0.5.12's kernel on a GPU): what is checked is where the bytes go
    monkeypatch.setattr(memory_pool, "quantize_k_cache_separate", quantize_k_cache_separate_reference)

    physical = 3 * PAGE
    replicated = stock_pool(n * physical, dtype_name)
    ranks = [shared_pool(physical, n, r, dtype_name) for r in range(n)]
    torch.manual_seed(n)
    tokens = n * physical
    loc = torch.arange(PAGE, PAGE + tokens - PAGE, dtype=torch.int64)  # every logical page but the dummy 0
    loc = loc[torch.randperm(loc.numel())]
    k_nope, k_rope = torch.randn(loc.numel(), 1, 512), torch.randn(loc.numel(), 1, 64)
    replicated.set_mla_kv_buffer(Layer(), loc, k_nope.to(torch.bfloat16), k_rope.to(torch.bfloat16))
    for rank, pool in enumerate(ranks):
        wrapped = KVWriteLoc(loc) if rank % 2 else loc
        pool.set_mla_kv_buffer(Layer(), wrapped, k_nope.to(torch.bfloat16), k_rope.to(torch.bfloat16))
    layout = ranks[0].cp_layout
    stored = torch.zeros(PAGE + tokens, dtype=torch.int64)
    for rank, pool in enumerate(ranks):
        owned = loc[ranks[rank].cp_layout.owned_by_this_rank(loc, validate=False)]
        physical_locs = ranks[rank].cp_layout.logical_locs_to_physical(owned)
        assert torch.equal(pool.kv_buffer[1][physical_locs], replicated.kv_buffer[1][owned])
        written = torch.zeros(pool.kv_buffer[1].shape[0], dtype=torch.bool)
        written[physical_locs] = True
        assert not pool.kv_buffer[1][~written].view(torch.uint8).any()  # nothing else written
        assert not pool.kv_buffer[0].view(torch.uint8).any()  # nor another layer
        stored[owned] += 1
    assert torch.equal(stored[loc], torch.ones_like(loc)) and layout.cp_size == n


def test_a_store_on_behalf_of_another_layer_is_refused():
    pool = shared_pool(2 * PAGE, 2)
    rows = torch.zeros(1, 1, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="on behalf of layer 1"):
        pool.set_mla_kv_buffer(Layer(), torch.tensor([PAGE]), *rows, layer_id_override=0)


def test_reads_and_location_addressed_paths_refuse_instead_of_corrupting():
    pool = shared_pool(2 * PAGE, 2)
    with pytest.raises(RuntimeError, match="without a materialized dense view"):
        pool.get_key_buffer(1)
    with pytest.raises(RuntimeError, match="outside a shared-KV index store"):
        pool.get_index_k_with_scale_buffer(1)
    for call in (lambda: pool.move_kv_cache(torch.tensor([PAGE]), torch.tensor([2 * PAGE])),
                 lambda: pool.get_cpu_copy(torch.tensor([PAGE])),
                 lambda: pool.set_kv_buffer(Layer(), torch.tensor([PAGE]), None, None),
                 lambda: pool.get_mla_kv_buffer(Layer(), torch.tensor([PAGE]))):
        with pytest.raises(NotImplementedError, match="not supported on a shared-KV prefill rank"):
            call()


def test_swap_is_scoped_to_the_configurators_build():
    from sglang.srt.mem_cache import kv_cache_configurator as configurator
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    context = CpSharedKVContext(CpSharedKVLayout(page_size=PAGE, cp_size=2, cp_rank=1))
    with use_cp_shared_dsa_pool_classes(context):
        assert issubclass(configurator.DSATokenToKVPool, CpSharedDSATokenToKVPool)
        assert configurator.DSATokenToKVPool.bound_context is context
        assert configurator.PagedTokenToKVPoolAllocator is CpSharedInterleavedPagesAllocator
    assert configurator.DSATokenToKVPool is DSATokenToKVPool
    assert configurator.PagedTokenToKVPoolAllocator is PagedTokenToKVPoolAllocator


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_allocator_hands_out_the_whole_logical_range_interleaved(n, monkeypatch):
    """Under interleave CP no page has a computing rank: a chunk's pages are SGLang's
    free-list order, the whole logical range is usable, every rank's shard fills evenly."""
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")  # every allocation checked in range
    physical_pages = 4
    pool = shared_pool(physical_pages * PAGE, n)
    alloc = CpSharedInterleavedPagesAllocator(pool.size, PAGE, torch.bfloat16, "cpu", pool, True)
    stock_order = alloc.free_pages.clone()
    assert alloc.available_size() == n * physical_pages * PAGE
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    tokens = n * physical_pages * PAGE  # one request over the whole logical pool, 2N+ pages
    locs = alloc.alloc_extend(t(0), t(0), t(tokens), t(tokens), t(-1), tokens)
    pages = locs[::PAGE] // PAGE
    assert torch.equal(pages, stock_order[: pages.numel()])  # SGLang's order: no compute-owner reordering
    owners = pool.cp_layout.owner_for_logical_pages(pages)
    assert torch.equal(torch.bincount(owners, minlength=n), torch.full((n,), physical_pages))
    assert alloc.available_size() == 0 and alloc.stats.compute_owner_chunks == 0


@pytest.fixture
def index_k_standins(monkeypatch):
    """0.5.23's index-K store and read are Triton; both pools get the same torch stand-ins
    (0.5.12's, written to the same contract and proven equal to 0.5.12's kernels on a GPU):
    what is checked is which buffer and rows the pool sends them to."""
    from sglang.kernels.ops.kvcache import dsa_index_k_cache

    from sglang_cp_shared_kv_testing.torch_standins import get_k_and_s_reference, set_k_and_s_reference

    monkeypatch.setattr(dsa_index_k_cache, "_set_k_and_s_triton", set_k_and_s_reference)
    monkeypatch.setattr(dsa_index_k_cache, "_get_k_and_s_triton", get_k_and_s_reference)


@pytest.mark.usefixtures("index_k_standins")
def test_index_k_goes_to_the_named_target_and_is_read_from_the_dense_view():
    """The indexer's store (``set_index_k_scale_buffer``, through 0.5.23's ``SetKAndS``) writes
    where the forward names (``index_writes_into``: the shard or a dense view), the bytes a
    stock pool's ``IndexKeyCache`` stores at those rows; its read (``get_index_k_scale_buffer``,
    ``GetKAndS``) reads the layer's dense view, never the shard."""
    physical = 4 * PAGE
    pool, stock = shared_pool(physical, 2, 1), stock_pool(physical)
    torch.manual_seed(0)
    locs = torch.arange(PAGE, 3 * PAGE)
    keys = torch.randn(locs.numel(), 128).to(torch.float8_e4m3fn)
    scales = torch.rand(locs.numel(), 1)
    with pytest.raises(RuntimeError, match="outside a shared-KV index store"):
        pool.set_index_k_scale_buffer(1, locs, keys, scales)
    stock.set_index_k_scale_buffer(1, locs, keys, scales)
    shard = pool.physical_index_buffer(1)
    with pool.index_writes_into(1, shard):
        pool.set_index_k_scale_buffer(1, locs, keys, scales)
    assert torch.equal(shard, stock.index_k_with_scale_buffer[1])
    assert not pool.index_k_with_scale_buffer[0].any()  # another layer untouched
    view = torch.zeros_like(shard)
    with pool.index_writes_into(1, view):
        pool.set_index_k_scale_buffer(1, locs, keys, scales)
    assert torch.equal(view, shard)
    read = dict(seq_len_tensor=torch.tensor([locs.numel()]), page_indices=torch.tensor([[1, 2]]),
                seq_len_sum=locs.numel(), max_seq_len=locs.numel())
    with pytest.raises(RuntimeError, match="without a materialized dense view"):
        pool.get_index_k_scale_buffer(1, **read)
    shard.zero_()  # the read must come from the view
    pool.in_flight = SimpleNamespace(mla_view=None, index_view=(1, view))  # the two fields a pool reads
    for mine, theirs in zip(pool.get_index_k_scale_buffer(1, **read), stock.get_index_k_scale_buffer(1, **read)):
        assert torch.equal(mine, theirs)
