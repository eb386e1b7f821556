"""A prefix loaded back from HiCache's host tier (L2) or fetched from its storage tier (L3) on a
sharded CP prefill goes to decode like a freshly computed one: N = 2, 3 prefill CP ranks (gloo,
SGLang 0.5.12.post1's real HiRadixCache and Mooncake store on loopback) each send their own pages
over the real Mooncake engine, and decode's bytes equal the flag-off HiCache run's, bit for bit
(``sglang_cp_shared_kv_testing.hicache_pd_v0512``)."""

import pytest

from sglang_cp_shared_kv_testing.hicache_pd_v0512 import (
    TIER_ROOMS,
    check_decode_got_the_flag_off_bytes,
    check_every_rank_sent_the_pages_it_holds,
    check_the_control_is_caught_on_rank_1,
    run_hicache_pd,
)
from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master
from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip

PAGE = 64


@pytest.fixture(scope="module")
def master():
    mooncake_engine_or_skip()
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module", params=[(2, "bf16"), (3, "fp8_e4m3")], ids=lambda p: f"N={p[0]}-{p[1]}")
def pd_run(request, master):
    n, dtype_name = request.param
    # NOTE: prefetch_threshold one page, as in the storage tests (SGLang's default is 256 tokens)
    return n, run_hicache_pd(n, dtype_name, master.extra_config(prefetch_threshold=PAGE))


@pytest.mark.parametrize("name", TIER_ROOMS)
def test_decode_receives_the_flag_off_runs_bytes_after_a_load_back(pd_run, name):
    check_decode_got_the_flag_off_bytes(*pd_run, name)


@pytest.mark.parametrize("name", TIER_ROOMS)
def test_every_rank_sends_exactly_the_pages_it_holds(pd_run, name):
    check_every_rank_sent_the_pages_it_holds(*pd_run, name)


def test_the_control_with_one_zeroed_page_on_rank_1_is_caught_there(pd_run):
    check_the_control_is_caught_on_rank_1(*pd_run)
