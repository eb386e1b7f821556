"""The sgl-kernel Triton kernels on a GPU: each bit-equal to its torch reference, the two
stores bit-equal to SGLang's own write paths read back from a real ``NSATokenToKVPool``,
the re-range equal to SGLang's ``cp_all_gather_rerange_output``, and the plugin's
dispatch (sglang_cp_shared_kv.kernels) running the kernels. Skipped without CUDA
(test/gpu/conftest.py).

Run on the H200: python -m pytest -q test/gpu/test_kernels.py
"""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

import sglang_cp_shared_kv_kernel as K
from sglang_cp_shared_kv import kernels
from sglang_cp_shared_kv.settings.config import DEBUG_ENV
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE

DEVICE = "cuda"
SEEDS = range(6)


# ---------------------------------------------------------------------- helpers
def random_chunk(seed, min_rows=1, max_rows=6000):
    """A chunk on random logical pages, a random CP size and rank, the rows that rank
    owns and their physical locations (as the batch state computes them)."""
    g = torch.Generator().manual_seed(seed)
    rows_total = int(torch.randint(min_rows, max_rows + 1, (1,), generator=g))
    n = int(torch.randint(1, 9, (1,), generator=g))
    rank = int(torch.randint(0, n, (1,), generator=g))
    start = int(torch.randint(0, PAGE, (1,), generator=g))  # the chunk starts inside a page
    pages = -(-(start + rows_total) // PAGE)
    seq_pages = torch.randperm(4 * pages, generator=g)[:pages] + 1
    positions = torch.arange(rows_total) + start
    out_cache_loc = (seq_pages[positions // PAGE] * PAGE + positions % PAGE).to(DEVICE)
    pad = int(torch.randint(0, 8, (1,), generator=g))  # SGLang's padding rows on location 0
    out_cache_loc = torch.cat([out_cache_loc, torch.zeros(pad, dtype=torch.int64, device=DEVICE)])
    layout = CpSharedKVLayout(PAGE, n, rank)
    rows = layout.owned_by_this_rank(out_cache_loc).nonzero().squeeze(1)
    physical = layout.logical_locs_to_physical(out_cache_loc[rows])
    physical_slots = (4 * pages // n + 2) * PAGE
    return g, out_cache_loc, rows, physical, physical_slots


def nsa_pool(slots, dtype):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    return NSATokenToKVPool(slots, page_size=PAGE, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64,
                            layer_num=1, device=DEVICE, index_head_dim=128, enable_memory_saver=False,
                            kv_cache_dim=656 if dtype == torch.float8_e4m3fn else 576)


LAYER = SimpleNamespace(layer_id=0)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def latent_rows(g, n_rows, dtype=torch.bfloat16):
    """(n, 576) rows over six orders of magnitude; k_nope / k_rope are strided views of
    them, as in the model (split of the latent cache)."""
    scale = torch.logspace(-3, 3, n_rows)[torch.randperm(n_rows, generator=g)]
    return (torch.randn(n_rows, 576, generator=g) * scale[:, None]).to(dtype).to(DEVICE)


# -------------------------------------------------------------------- MLA store
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_store_equals_reference_and_sglang_pool(seed, dtype):
    g, out_cache_loc, rows, physical, slots = random_chunk(seed)
    latent = latent_rows(g, out_cache_loc.numel(), dtype)
    k_nope, k_rope = latent[:, :512].unsqueeze(1), latent[:, 512:].unsqueeze(1)

    stock, ours = nsa_pool(slots, dtype), nsa_pool(slots, dtype)
    if rows.numel():  # as the shared-KV pool does: SGLang's store is never called empty
        stock.set_mla_kv_buffer(LAYER, physical, k_nope.index_select(0, rows), k_rope.index_select(0, rows))
    K.store_mla_rows(ours.kv_buffer[0], rows, physical, k_nope, k_rope)
    reference = torch.zeros_like(ours.kv_buffer[0])
    K.store_mla_rows_reference(reference, rows, physical, k_nope, k_rope)
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(ours.kv_buffer[0]), as_bytes(stock.kv_buffer[0]))
    assert torch.equal(as_bytes(ours.kv_buffer[0]), as_bytes(reference))
    if rows.numel():
        nope, rope = ours.get_mla_kv_buffer(LAYER, physical)  # SGLang's reader
        assert torch.equal(nope, k_nope[rows]) and torch.equal(rope, k_rope[rows])


def _fp8_latent(g, n_rows):
    latent = latent_rows(g, n_rows)
    if n_rows > 2:
        latent[1, 256:384] = 0  # an all-zero tile: scale 0
        latent[2, :512] = 0  # a row of zero tiles
    return latent


@pytest.mark.parametrize("seed", SEEDS)
def test_mla_store_fp8_equals_sglang_pool(seed):
    """Bit-equal to SGLang's quantize_k_cache_separate + set_mla_kv_buffer_triton."""
    g, out_cache_loc, rows, physical, slots = random_chunk(seed)
    latent = _fp8_latent(g, out_cache_loc.numel())
    k_nope, k_rope = latent[:, :512].unsqueeze(1), latent[:, 512:].unsqueeze(1)

    stock, ours = nsa_pool(slots, torch.float8_e4m3fn), nsa_pool(slots, torch.float8_e4m3fn)
    assert stock.nsa_kv_cache_store_fp8
    if rows.numel():
        stock.set_mla_kv_buffer(LAYER, physical, k_nope.index_select(0, rows), k_rope.index_select(0, rows))
    K.store_mla_rows_fp8(ours.kv_buffer[0], rows, physical, k_nope, k_rope)
    torch.cuda.synchronize()
    assert torch.equal(ours.kv_buffer[0], stock.kv_buffer[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_mla_store_fp8_dense_chunk_write_equals_sglang(seed):
    """rows=None: every row of the chunk at its dense location (the current-region write)."""
    g, out_cache_loc, *_ = random_chunk(seed, max_rows=3000)
    latent = _fp8_latent(g, out_cache_loc.numel())
    dense_locs = (torch.randperm(out_cache_loc.numel() + 2 * PAGE, generator=g)[: out_cache_loc.numel()]
                  + PAGE).to(DEVICE)
    slots = out_cache_loc.numel() + 3 * PAGE
    stock, ours = nsa_pool(slots, torch.float8_e4m3fn), nsa_pool(slots, torch.float8_e4m3fn)
    stock.set_mla_kv_buffer(LAYER, dense_locs, latent[:, :512], latent[:, 512:])
    K.store_mla_rows_fp8(ours.kv_buffer[0], None, dense_locs, latent[:, :512], latent[:, 512:])
    assert torch.equal(ours.kv_buffer[0], stock.kv_buffer[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_mla_store_fp8_reference_is_within_one_rounding(seed):
    """The torch reference divides exactly, the kernel (like SGLang) with div.full.f32:
    scales may differ in the last bits, fp8 codes by one step at a rounding boundary;
    the rope bytes are identical."""
    g, out_cache_loc, rows, physical, slots = random_chunk(seed)
    latent = latent_rows(g, out_cache_loc.numel())
    ours = torch.zeros(slots, 1, 656, dtype=torch.uint8, device=DEVICE)
    reference = torch.zeros_like(ours)
    K.store_mla_rows_fp8(ours, rows, physical, latent[:, :512], latent[:, 512:])
    K.store_mla_rows_fp8_reference(reference, rows, physical, latent[:, :512], latent[:, 512:])
    a, b = ours[physical, 0], reference[physical, 0]
    assert torch.equal(a[:, 528:], b[:, 528:])
    scale_a, scale_b = a[:, 512:528].contiguous().view(torch.float32), b[:, 512:528].contiguous().view(torch.float32)
    assert torch.allclose(scale_a, scale_b, rtol=4e-7, atol=0)  # div.full.f32: at most 2 ulp
    codes_a, codes_b = a[:, :512].int(), b[:, :512].int()
    differ = codes_a != codes_b
    assert ((codes_a - codes_b).abs()[differ] == 1).all()
    assert int(differ.sum()) <= differ.numel() // 200  # seen: 0.12% of codes on random rows


# ------------------------------------------------------------------ index store
def _store_index_with_sglang(pool, locs, key):
    """SGLang's ``Indexer._store_index_k_cache`` (its fused CUDA store on this machine)."""
    from sglang.jit_kernel.fused_store_index_cache import can_use_nsa_fused_store
    from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer

    if not can_use_nsa_fused_store(torch.bfloat16, torch.int64, PAGE):
        pytest.skip("SGLang's fused index store JIT kernel does not build here (needs apache-tvm-ffi and nvcc)")
    indexer = SimpleNamespace(block_size=128, scale_fmt=None)
    batch = SimpleNamespace(out_cache_loc=locs, token_to_kv_pool=pool)
    Indexer._store_index_k_cache(indexer, batch, 0, key)


@pytest.mark.parametrize("seed", SEEDS)
def test_index_store_equals_reference_and_sglang_fused_store(seed):
    g, out_cache_loc, rows, physical, slots = random_chunk(seed)
    scale = torch.logspace(-6, 3, out_cache_loc.numel())[torch.randperm(out_cache_loc.numel(), generator=g)]
    key = (torch.randn(out_cache_loc.numel(), 128, generator=g) * scale[:, None]).bfloat16().to(DEVICE)
    key[0] = 0
    stock, ours = nsa_pool(slots, torch.bfloat16), nsa_pool(slots, torch.bfloat16)
    if rows.numel():
        _store_index_with_sglang(stock, physical, key.index_select(0, rows))
    K.store_index_rows(ours.index_k_with_scale_buffer[0], rows, physical, key)
    reference = torch.zeros_like(ours.index_k_with_scale_buffer[0])
    K.store_index_rows_reference(reference, rows, physical, key)
    torch.cuda.synchronize()
    assert torch.equal(ours.index_k_with_scale_buffer[0], stock.index_k_with_scale_buffer[0])
    assert torch.equal(ours.index_k_with_scale_buffer[0], reference)

    # every row at dense locations (the current-region write)
    dense_slots = key.shape[0] + 2 * PAGE
    dense_locs = (torch.randperm(dense_slots - PAGE, generator=g)[: key.shape[0]] + PAGE).to(DEVICE)
    stock, ours = nsa_pool(dense_slots, torch.bfloat16), nsa_pool(dense_slots, torch.bfloat16)
    _store_index_with_sglang(stock, dense_locs, key)
    K.store_index_rows(ours.index_k_with_scale_buffer[0], None, dense_locs, key)
    assert torch.equal(ours.index_k_with_scale_buffer[0], stock.index_k_with_scale_buffer[0])


# --------------------------------------------------------------------- owner copy
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_owner_copy_of_mla_rows_equals_its_reference(seed, fmt):
    """The owned rows of a chunk stored in a dense view, copied to the shard: the same bytes
    as the reference copy, and as the fused owner store of the same rows."""
    g, out_cache_loc, rows, physical, slots = random_chunk(seed)
    latent = torch.randn(out_cache_loc.numel(), 576, generator=g).bfloat16().to(DEVICE)
    k_nope, k_rope = latent[:, :512].unsqueeze(1), latent[:, 512:].unsqueeze(1)
    dense_locs = torch.randperm(out_cache_loc.numel() + 64, generator=g)[: out_cache_loc.numel()].to(DEVICE)
    if fmt == "fp8":
        dense = torch.zeros(out_cache_loc.numel() + 64, 1, 656, dtype=torch.uint8, device=DEVICE)
        K.store_mla_rows_fp8(dense, None, dense_locs, k_nope, k_rope)
        store = K.store_mla_rows_fp8
    else:
        dense = torch.zeros(out_cache_loc.numel() + 64, 1, 576, dtype=torch.bfloat16, device=DEVICE)
        K.store_mla_rows(dense, None, dense_locs, k_nope, k_rope)
        store = K.store_mla_rows
    ours, ref, stored = (torch.zeros(slots, *dense.shape[1:], dtype=dense.dtype, device=DEVICE) for _ in range(3))
    K.copy_mla_rows(ours, physical, dense, dense_locs[rows])
    K.copy_mla_rows_reference(ref, physical, dense, dense_locs[rows])
    store(stored, rows, physical, k_nope, k_rope)
    assert torch.equal(ours, ref) and torch.equal(ours, stored)


@pytest.mark.parametrize("seed", SEEDS)
def test_owner_copy_of_index_rows_equals_its_reference(seed):
    g, out_cache_loc, rows, physical, slots = random_chunk(seed)
    key = torch.randn(out_cache_loc.numel(), 128, generator=g).bfloat16().to(DEVICE)
    dense_pages = out_cache_loc.numel() // PAGE + 3
    dense_locs = torch.randperm(dense_pages * PAGE, generator=g)[: out_cache_loc.numel()].to(DEVICE)
    dense = torch.zeros(dense_pages, PAGE * 132, dtype=torch.uint8, device=DEVICE)
    K.store_index_rows(dense, None, dense_locs, key)
    ours, ref, stored = (torch.zeros(slots // PAGE, PAGE * 132, dtype=torch.uint8, device=DEVICE) for _ in range(3))
    K.copy_index_rows(ours, physical, dense, dense_locs[rows])
    K.copy_index_rows_reference(ref, physical, dense, dense_locs[rows])
    K.store_index_rows(stored, rows, physical, key)
    assert torch.equal(ours, ref) and torch.equal(ours, stored)


# ---------------------------------------------------------------------- page pack
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("page_bytes", [PAGE * 1152, PAGE * 656, PAGE * 132])
def test_pack_pages_equals_index_select(seed, page_bytes):
    g = torch.Generator().manual_seed(seed)
    shard_pages = int(torch.randint(2, 3000, (1,), generator=g))
    shard = torch.randint(-2**62, 2**62, (shard_pages, page_bytes // 8), dtype=torch.int64,
                          generator=g).to(DEVICE)
    send = torch.randint(0, shard_pages, (int(torch.randint(0, 1500, (1,), generator=g)),),
                         generator=g).to(DEVICE)
    assert torch.equal(K.pack_pages(shard, send), shard.index_select(0, send))
    dense = torch.zeros(send.numel() + 9, page_bytes // 8, dtype=torch.int64, device=DEVICE)
    K.pack_pages(shard, send, out=dense[4:4 + send.numel()])
    assert torch.equal(dense[4:4 + send.numel()], shard.index_select(0, send))
    assert not dense[:4].any() and not dense[4 + send.numel():].any()


# --------------------------------------------------------------------- page remap
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_page_inverse_and_remap_equal_references(seed, dtype):
    from sglang_cp_shared_kv.forward.dense_layout import build_dense_page_map

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    tokens = int(torch.randint(1, 131072, (1,), generator=g))
    pages = -(-tokens // PAGE)
    logical_pages = 4 * pages * n
    seq_pages = (torch.randperm(logical_pages - 1, generator=g)[:pages] + 1).to(DEVICE)
    page_map = build_dense_page_map(CpSharedKVLayout(PAGE, n, n - 1), seq_pages,
                                    int(torch.randint(0, pages + 1, (1,), generator=g)))
    inverse = K.build_page_inverse(seq_pages, page_map.dense_page, logical_pages)
    assert torch.equal(inverse, K.build_page_inverse_reference(seq_pages, page_map.dense_page, logical_pages))

    positions = torch.arange(tokens, device=DEVICE)
    table = (seq_pages[positions // PAGE] * PAGE + positions % PAGE).to(dtype)
    remapped = K.remap_locs(table, inverse, PAGE)
    assert torch.equal(remapped, K.remap_locs_reference(table, inverse, PAGE))
    assert torch.equal(remapped.long(), page_map.dense_token_table(tokens, tokens))
    topk = table[torch.randint(0, tokens, (257, 2048), generator=g).to(DEVICE)]
    topk[:, -300:] = -1
    assert torch.equal(K.remap_locs(topk, inverse, PAGE), K.remap_locs_reference(topk, inverse, PAGE))
    assert torch.equal(K.remap_locs(seq_pages, inverse, 1), page_map.dense_page)


# ------------------------------------------------------------------------ rerange
class _GatherStandIn:
    def __init__(self, gathered):
        self.gathered = gathered

    def cp_all_gather_into_tensor_async(self, output, input_, stream):
        output.copy_(self.gathered)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("width,dtype", [(576, torch.bfloat16), (128, torch.bfloat16), (7168, torch.bfloat16),
                                         (3, torch.bfloat16), (5, torch.uint8)])
def test_rerange_equals_sglang(monkeypatch, seed, width, dtype):
    from sglang.srt.layers.attention.nsa import utils as nsa_utils
    from sglang.srt.layers.utils import cp_utils

    monkeypatch.setattr(nsa_utils, "is_nsa_prefill_cp_round_robin_split", lambda: False)
    monkeypatch.setattr(nsa_utils, "is_nsa_enable_prefill_cp", lambda: True)
    monkeypatch.setattr(cp_utils, "is_allocation_symmetric", lambda: False)
    monkeypatch.setattr(cp_utils, "use_symmetric_memory", lambda *a, **k: nullcontext())
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    total = int(torch.randint(n, 40000 if width < 1000 else 9000, (1,), generator=g))
    metadata = cp_utils.prepare_context_parallel_metadata(total, 0, n, [total])
    max_len = -(-total // n)
    gathered = torch.randint(0, 120, (n * max_len, width), generator=g).to(dtype).to(DEVICE)
    monkeypatch.setattr(cp_utils, "get_attention_cp_group", lambda: _GatherStandIn(gathered))
    theirs = cp_utils.cp_all_gather_rerange_output(gathered[:max_len], n,
                                                   SimpleNamespace(attn_cp_metadata=metadata),
                                                   torch.cuda.current_stream())
    lists = (metadata.max_rank_len, metadata.per_rank_actual_token, metadata.reverse_split_len,
             metadata.cp_reverse_index)
    assert torch.equal(K.rerange_in_seq(gathered, *lists), theirs)
    assert torch.equal(K.rerange_in_seq_reference(gathered, *lists), theirs)
    dispatch = KernelDispatch()
    assert torch.equal(dispatch.rerange_in_seq(gathered, metadata), theirs)
    assert not dispatch.failed


# ------------------------------------------------------------ the plugin's dispatch
def test_plugin_dispatch_runs_the_kernels_on_cuda(monkeypatch, caplog):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    dispatch = KernelDispatch()
    g, out_cache_loc, rows, physical, slots = random_chunk(99, min_rows=500)
    latent = latent_rows(g, out_cache_loc.numel())
    buffer = torch.zeros(slots, 1, 656, dtype=torch.uint8, device=DEVICE)
    stock_calls = []
    dispatch.store_mla_rows(buffer, rows, physical, latent[:, :512], latent[:, 512:], packed_fp8=True,
                            stock=lambda: stock_calls.append("mla"))
    dispatch.store_index_rows(torch.zeros(slots // PAGE, PAGE * 132, dtype=torch.uint8, device=DEVICE), rows,
                              physical, latent[:, :128].contiguous(), stock=lambda: stock_calls.append("index"))
    shard = torch.randint(0, 2**40, (50, 1056), dtype=torch.int64, device=DEVICE)
    send = torch.tensor([3, 0, 49], device=DEVICE)
    assert torch.equal(dispatch.pack_pages(shard, send), shard[send])
    inverse = dispatch.build_page_inverse(torch.tensor([5, 2], device=DEVICE), torch.tensor([1, 2], device=DEVICE), 8)
    assert dispatch.remap_locs(torch.tensor([5 * 64 + 1, -1], device=DEVICE), inverse, 64).tolist() == [65, -1]
    assert stock_calls == [] and not dispatch.failed
    assert not [r for r in caplog.records if r.name == kernels.logger.name]

    monkeypatch.setenv(DEBUG_ENV, "1")  # debug: the checked (stock) path
    dispatch.store_mla_rows(buffer, rows, physical, latent[:, :512], latent[:, 512:], packed_fp8=True,
                            stock=lambda: stock_calls.append("mla"))
    assert stock_calls == ["mla"]
