"""scripts/bench_pd_transfer.py builds the request it claims to (no processes started)."""

import numpy as np
import pytest

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv_testing.support import load_script
from sglang_cp_shared_kv.transfer.pages import contiguous_runs


def load_bench():
    return load_script("bench_pd_transfer")


def test_glm5_request_plan():
    bench = load_bench()
    args = bench.parse_args([])
    geometry = bench.rig.model_geometry(bench.config_path(args.model_config), args.kv_cache_dtype)
    assert (geometry.layers, geometry.kv_cache_dim, geometry.kv_page_bytes, geometry.index_page_bytes) == (
        78, 656, 64 * 656, 64 * 132)
    pages = 32768 // 64
    for n in (1, 2, 4):
        plan = bench.plan_for(n, geometry, *bench.request_layout(n, pages, "interleaved", args), args)
        instance = plan["instances"]["X"]
        assert instance["shared"] == (n > 1) and instance["procs"] == [f"P{i}" for i in range(n)]
        assert instance["physical_pages"] == (pages if n == 1 else pages // n)
        assert [r["chunk_ends"] for r in plan["rooms"]] == [[8192, 16384, 24576, 32768]] * (args.repeats + 1)
        assert plan["decode"]["pages"] >= pages


def test_replicated_descriptor_count_is_sglangs_grouping():
    bench = load_bench()
    contiguous = np.arange(1, 513)
    assert bench.replicated_descriptors(512, [8192, 16384, 24576, 32768], 78, contiguous) == (4 * 78, 78)
    every_other = 2 * np.arange(1, 513)  # no two destination pages adjacent
    kv, state = bench.replicated_descriptors(512, [8192, 16384, 24576, 32768], 78, every_other)
    assert kv == state == 512 * 78


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_compute_owner_pages_send_two_runs_per_chunk(n):
    """With the pages the plugin's allocator hands the request (compute-owner), every rank
    sends each 8K chunk as at most two runs contiguous on both sides (one per zigzag
    segment; decode's pages in one run), against one run per page interleaved."""
    bench = load_bench()
    args = bench.parse_args([])
    pages = 32768 // 64
    for layout, bound in (("compute-owner", lambda owned: 2), ("interleaved", lambda owned: owned)):
        logical, physical_pages = bench.request_layout(n, pages, layout, args)
        assert sorted(logical) == sorted(set(logical)) and len(logical) == pages
        for start in range(0, pages, 128):  # one 8K-token chunk = 128 pages
            chunk = np.asarray(logical[start:start + 128])
            positions = np.arange(start, start + 128)
            for rank in range(n):
                lay = CpSharedKVLayout(64, n, rank)
                physical, owned_positions = lay.filter_owned_pages_np(chunk, positions)
                assert physical.max() <= physical_pages
                runs = contiguous_runs(physical, owned_positions + 1)  # decode pages 1..P in order
                assert runs <= bound(len(physical)), (layout, n, rank, start, runs)
                if layout == "interleaved":
                    assert runs == len(physical)
