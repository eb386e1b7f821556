"""The sharded HiCache storage tier (L3) on SGLang 0.5.23, CP groups of N = 2, 3, 4 CPU processes
(gloo): 0.5.23's real UnifiedRadixCache, HybridCacheController, host pools (KV + DSA index K) and
Mooncake backend against a real Mooncake store on loopback
(``sglang_cp_shared_kv_testing.hicache_l3_v0523``). Each rank stores and fetches only its own
pages under keys naming the CP size; the bytes loaded back after a prefetch equal what was
written (and the stock run's), bf16 and fp8; a lost object or a failed fetch on one rank shortens
the group's hit on every rank alike, and so does a backend call that raises on one rank (a fetch,
an existence query or a store), counted and logged there; a group of another CP size misses; the
key tag of the extra config is applied once; no host page leaks (stock frees a prefetch's host
pages on the scheduler thread, by agreed counts, on every rank alike)."""

import pytest

from sglang_cp_shared_kv.releases import installed, v0523
from sglang_cp_shared_kv_testing.hicache_l3_checks import (
    PAGE,
    check_backend_error_contained,
    check_no_leak,
    check_other_cp_size_misses,
    check_own_pages,
    check_round_trip,
    check_the_miss_check_fails_without_cp_size_keys,
)
from sglang_cp_shared_kv_testing.hicache_l3_v0523 import (
    BACKEND_RAISES,
    CASES,
    OTHER_CP_SIZE,
    SIZE_BLIND_CONTROL,
    TAGGED,
    run_storage_group,
)
from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master
from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip

pytestmark = pytest.mark.skipif(installed.INSTALLED is not v0523.RELEASE,
                                reason=f"needs sglang {v0523.RELEASE.version}")

ALL = CASES + BACKEND_RAISES + (TAGGED, OTHER_CP_SIZE, SIZE_BLIND_CONTROL)
CASE = {case.name: case for case in ALL}
SHARDED = [case.name for case in ALL if case.flag and not case.size_blind_keys]


@pytest.fixture(scope="module")
def master():
    mooncake_engine_or_skip()
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def group_run(request, master, tiny_nsa_model):
    # NOTE: prefetch_threshold one page: SGLang revokes a prefetch whose hit is shorter (256
    # tokens by default), and the lost-page cases hit one to three pages
    extra = master.extra_config(prefetch_threshold=PAGE)
    # each group size stores under its own keys (<hash>@cp<N>) in the one store the module shares
    return request.param, extra, run_storage_group(request.param, tiny_nsa_model, extra)


@pytest.mark.parametrize("name", list(CASE))
def test_the_prefetched_pages_load_back_bit_identical_and_every_rank_agrees(group_run, name):
    check_round_trip(CASE[name], group_run[2])


@pytest.mark.parametrize("name", list(CASE))
def test_no_host_page_leaks_and_the_host_tier_is_n_times(group_run, name):
    """(Each rank's host tier audited with nothing left in device or host memory.)"""
    n, _extra, ranks = group_run
    assert all(cases[name]["detached"] for cases in ranks), [cases[name]["detach_message"] for cases in ranks]
    check_no_leak(CASE[name], ranks, n)


@pytest.mark.parametrize("name", SHARDED)
def test_each_rank_stores_and_fetches_only_its_own_pages_under_keys_naming_the_cp_size(group_run, name):
    # (0.5.23 ignores a prefetch of a request it already tracks: started twice, fetched once)
    check_own_pages(CASE[name], group_run[2])


def test_stock_storage_keys_name_no_cp_size_and_one_rank_stores(group_run):
    n, _extra, ranks = group_run
    for rank, cases in enumerate(ranks):
        stock = cases["stock"]
        assert stock["stored"]["mla_stock"] == stock["stored"]["index_stock"] == [1] * CASE["stock"].pages, rank
        assert stock["stored"]["mla_ours"] == [0] * CASE["stock"].pages, rank
        assert not stock["sharded"] and stock["backup_skip"] == (rank != 0), rank


def test_the_key_tag_is_applied_once(group_run):
    """0.5.23 tags every key once (existence, store and fetch alike): the tagged group stores and
    hits like the untagged one, its objects under the tag."""
    n, _extra, ranks = group_run
    for rank, cases in enumerate(ranks):
        tagged, plain = cases[TAGGED.name], cases["sharded"]
        assert tagged["key_prefix"].startswith(f"tag{n}_") and not plain["key_prefix"].startswith("tag"), rank
        assert tagged["host_hit_length"] == TAGGED.pages * PAGE, rank


def test_a_group_of_another_cp_size_misses_cleanly(group_run):
    """A request this group stored, still in the store, prefetched again under the keys of a
    group of N + 1: no page found, nothing fetched, nothing leaked."""
    check_other_cp_size_misses(OTHER_CP_SIZE, group_run[2])


def test_the_other_cp_size_check_fails_when_keys_do_not_name_the_cp_size(group_run):
    """The negative control: the same round trip and lookup with keys that name no CP size
    (``<hash>@cp`` for a group of any size) finds and loads back the whole request under the keys
    of a group of N + 1, so the check above fails on it."""
    check_the_miss_check_fails_without_cp_size_keys(SIZE_BLIND_CONTROL, group_run[2])


def test_the_external_l3_layout_is_off_under_the_flag_saying_why(group_run):
    """A router's own lookup in the store (the startup handshake's layout) builds stock's keys,
    which a sharded group never writes: the flag's layout is off and names the @cp<N> keys; stock's,
    on the same store, describes its KV and index-K objects."""
    from sglang_cp_shared_kv.hicache.hooks_v0523 import SHARDED_L3_LAYOUT_REASON

    for rank, cases in enumerate(group_run[2]):
        stock = cases["stock"]["l3_layout"]
        assert stock["enabled"] and stock["backend"] == "mooncake", (rank, stock)
        assert len(stock["hicache_object_layout"]["pools"]) == 2, (rank, stock)  # KV and the index-K sidecar
        for name in SHARDED:
            ours = cases[name]["l3_layout"]
            assert not ours["enabled"] and ours["reason"] == SHARDED_L3_LAYOUT_REASON, (rank, name, ours)
            assert ours["hicache_object_layout"]["pools"] == [] and ours["page_size"] == PAGE, (rank, name)


@pytest.mark.parametrize("name", [case.name for case in BACKEND_RAISES])
def test_a_backend_call_raising_on_one_rank_is_its_own_pages_failing_counted_and_logged(group_run, name):
    """One CP rank's backend raises on every call of a fetch, an existence query or a store. Stock
    0.5.23 catches each of these itself, a fetch batch as none of its pages (the group's hit 0);
    under the flag the sharded storage turns the raise into that rank's own pages failing, counted
    and logged on it alone, so the hit ends where it does on 0.5.12.post1 (the tests above; a
    fetch raising on rank 0, which holds the first page, also frees every host page of the
    prefetch it fetched nothing into)."""
    check_backend_error_contained(CASE[name], group_run[2])
