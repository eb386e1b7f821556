"""A prefix loaded back from HiCache's host tier (L2) or fetched from its storage tier (L3) on a
sharded CP prefill goes to decode like a freshly computed one, on SGLang 0.5.23: N = 2, 3, 4
prefill CP ranks (interleave CP over gloo, 0.5.23's real UnifiedRadixCache, HybridCacheController
and Mooncake store on loopback) each send their own KV and index pages over the real Mooncake
engine, and decode's bytes equal the flag-off HiCache run's, bit for bit; a page zeroed on rank 1
is caught (``sglang_cp_shared_kv_testing.hicache_pd_v0523``, the 0.5.23 seam of
``hicache_pd_v0512``, whose checks these are)."""

import pytest

from sglang_cp_shared_kv.releases import installed, v0523
from sglang_cp_shared_kv_testing import hicache_pd_v0512 as hicache_pd  # the run, rooms and checks of both releases
from sglang_cp_shared_kv_testing.hicache_pd_v0523 import run_hicache_pd_v0523
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import PAGE
from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master
from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip

pytestmark = pytest.mark.skipif(installed.INSTALLED is not v0523.RELEASE,
                                reason=f"needs sglang {v0523.RELEASE.version}")


@pytest.fixture(scope="module")
def master():
    mooncake_engine_or_skip()
    with mooncake_master() as running:
        yield running


# (odd N catches a modulo bug in who holds which page; fp8 packs its rows differently)
@pytest.fixture(scope="module", params=[(2, "bf16"), (3, "fp8_e4m3"), (4, "bf16")], ids=lambda p: f"N={p[0]}-{p[1]}")
def pd_run(request, master):
    n, dtype_name = request.param
    # NOTE: prefetch_threshold one page, as in the storage tests (SGLang's default is 256 tokens)
    return n, run_hicache_pd_v0523(n, dtype_name, master.extra_config(prefetch_threshold=PAGE))


@pytest.mark.parametrize("name", hicache_pd.TIER_ROOMS)
def test_decode_receives_the_flag_off_runs_bytes_after_a_load_back(pd_run, name):
    hicache_pd.check_decode_got_the_flag_off_bytes(*pd_run, name)


@pytest.mark.parametrize("name", hicache_pd.TIER_ROOMS)
def test_every_rank_sends_exactly_the_pages_it_holds(pd_run, name):
    hicache_pd.check_every_rank_sent_the_pages_it_holds(*pd_run, name)


def test_the_control_with_one_zeroed_page_on_rank_1_is_caught_there(pd_run):
    hicache_pd.check_the_control_is_caught_on_rank_1(*pd_run)
