"""scripts/compare_upstream_kv_sharding.py: our side and its re-implemented upstream formulas on
hand-computed values (any SGLang); upstream's real classes only where SGLang 0.5.23 is installed,
and 0.5.12's compute-owner allocator only where 0.5.12.post1 is."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from sglang_cp_shared_kv.releases import installed, v0512
from sglang_cp_shared_kv.pool.kv_geometry import NsaModelShape
from sglang_cp_shared_kv.pool.planner import plan_capacity

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_upstream_kv_sharding",
                                               ROOT / "scripts" / "compare_upstream_kv_sharding.py")
cmp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cmp)

GLM5 = NsaModelShape.load("glm-5")
DSV32 = NsaModelShape.load("deepseek-v3.2")


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ours_exposes_n_times_physical_with_no_persistent_scratch(n, dtype):
    for shape in (GLM5, DSV32):
        ours = cmp.ours_capacity(shape, n, dtype, 40.0, 131072)
        plan = plan_capacity(shape, n, dtype, kv_gb_per_rank=40.0)
        assert ours["persistent_scratch_bytes"] == 0
        assert ours["physical_tokens"] == plan.physical_tokens_per_rank
        assert ours["logical_tokens"] == n * ours["physical_tokens"]
        assert ours["row_bytes"] == {"bf16": 1152, "fp8_e4m3": 656}[dtype] + 132
        # the transient view is per layer: one request's pages, not a share of the budget
        assert 0 < ours["transient_view_bytes_per_layer"] < ours["transient_view_bytes_with_prefetch"]


def test_upstream_scratch_formula_on_hand_computed_values():
    # page_interleave.py: rows = 8 * ceil_align(context, N * page) + ceil_align(chunk, page) + page, x 2 slots
    assert cmp.upstream_scratch_bytes(131072, 4, 64, 8192, 708) == 2 * (8 * 131072 + 8192 + 64) * 708 == 1_496_474_112
    # unaligned context and chunk: 100,000 -> 100,352 (196 x 512), 8,100 -> 8,128
    assert cmp.upstream_scratch_bytes(100000, 8, 64, 8100, 1284) == 2 * (8 * 100352 + 8128 + 64) * 1284 == 2_082_668_544
    # a 32K context: 8 x 32,768 + 8,192 + 64 rows per slot
    assert cmp.upstream_scratch_bytes(32768, 2, 64, 8192, 708) == 2 * 270_400 * 708


def test_chunk_gather_formula_on_hand_computed_values():
    assert cmp.chunk_gather_bytes(GLM5, 8192, 1) == 8192 * (576 + 256)  # trtllm fp8 latent + bf16 index key
    assert cmp.chunk_gather_bytes(GLM5, 8192, 2) == 8192 * (1152 + 256)
    # docs/performance.md: SGLang's bf16 gathers of an 8K chunk, N = 2: 5.77 MB received per rank
    assert cmp.received(cmp.chunk_gather_bytes(GLM5, 8192, 2), 2) == 5_767_168


def test_ours_history_gather_is_n_blocks_of_owned_pages():
    pages = list(range(1, 512 + 1))  # a 32K prompt on fresh interleaved pages, last 8K chunk
    row = cmp.ours_gather(GLM5, 4, "fp8_e4m3", pages, 384, 8192)
    assert row["history_block_pages"] == 96  # 384 history pages / 4
    assert row["history_recv"] == 3 * 96 * 64 * 788
    assert row["chunk_recv_local_writes"] == 3 * 32 * 64 * 788
    assert row["chunk_recv_sglang_bf16"] == 3 * 8192 * 1408 // 4


def test_ours_pd_on_interleaved_pages_is_owned_pages_times_layers():
    pages, page_ends = list(range(1, 513)), [128, 256, 384, 512]
    for n in (2, 4, 8):
        for rank in cmp.ours_pd(GLM5, n, pages, page_ends):
            assert rank == {"pages": 512 // n, "kv": 512 // n * 78, "index": 512 // n * 78}


@pytest.mark.skipif(installed.INSTALLED is not v0512.RELEASE,
                    reason="the compute-owner allocator runs on SGLang 0.5.12.post1")
def test_ours_pd_on_compute_owner_pages_matches_the_measured_transfer():
    # docs/results/bench_pd_transfer_h200_host_16cores.json: GLM-5 fp8, 32K in 8K chunks, N = 2, compute-owner
    ends = [8192, 16384, 24576, 32768]
    (pages,) = cmp.compute_owner_pages([(2, 256 + 4, ends)])
    ranks = cmp.ours_pd(GLM5, 2, pages, [e // 64 for e in ends])
    assert [(r["kv"], r["index"]) for r in ranks] == [(624, 390), (312, 312)]


def test_repository_cites_and_literals_resolve():
    assert cmp.cite("docs/performance.md", "in-seq all-gathers of its **bf16** KV").startswith("docs/performance.md:")
    assert cmp.literal("python/sglang_cp_shared_kv/pool/kv_geometry.py", "KV_CACHE_DTYPES") == ("bf16", "fp8_e4m3")
    with pytest.raises(LookupError):
        cmp.cite("docs/performance.md", "no such text anywhere \x00")


def test_upstream_real_classes_match_the_formulas():
    """SGLang 0.5.23 only: its real sizing, allocator and gather plan against the cited formulas."""
    pytest.importorskip("sglang.srt.mem_cache.page_interleave")
    up = cmp.Upstream(8192)
    try:
        _check_upstream(up)
    finally:
        up.close()


def _check_upstream(up):
    theirs, spec, allocator = up.capacity(up.kvc("glm-5", GLM5, 131072, "fp8_e4m3"), 4, 40 << 30)
    assert theirs["row_bytes"] == 576 + 132 and theirs["persistent_scratch_bytes"] == 1_496_474_112
    assert theirs["scratch_formula_matches"] and theirs["logical_tokens"] == 4 * theirs["physical_tokens"]
    assert theirs["physical_tokens"] == (40 * 2**30 - 1_496_474_112) // (78 * 708) // 64 * 64
    ends = [8192, 16384, 24576, 32768]
    slots = up.request_slots(allocator, ends)
    assert up.history_gather(spec, 576, slots, 24576, 32768) == 4 * 96 * 64 * 708
    pages = (slots[::64] // 64).numpy()
    assert np.array_equal(pages, np.arange(4, 4 + 512))  # fresh pool: rotation base 0, logical pages N, N + 1, ...
    assert all(r == {"pages": 128, "kv": 128 * 78, "index": 128 * 78}
               for r in cmp.Upstream.pd(78, 4, pages, [e // 64 for e in ends]))
