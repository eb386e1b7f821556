"""On SGLang 0.5.23 (interleave CP), shared KV is bit-exact against the replicated baseline on
N = 2, 3, 4, 8 CP ranks (sglang_cp_shared_kv_testing/cp_harness_v0523.py says what runs real
and what is compared): bf16 and fp8 KV, every scenario of ``INTERLEAVE_SCENARIOS``, the
one-layer-ahead MLA history prefetch at N = 2, 3, 4, the randomized soak (one request per batch, and
up to three) at N = 3.
Runs only where sglang 0.5.23 is installed (``.venv-0.5.23``).

NOTE: kept to what CI's two cores allow beside the 0.5.12.post1 harness (about 14 minutes):
the scenarios run with the debug checks on (they add checks, not a different path), the
soak with them alternating forward by forward.
"""

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv_testing.cp_harness import assert_clean  # noqa: E402
from sglang_cp_shared_kv_testing.cp_harness_v0523 import run_interleave_cp_group  # noqa: E402

#: each scenario's chunk lengths (cp_scenarios.py): SGLang deals a chunk out only when it has
#: at least N tokens, else every rank runs all of it
CHUNKS = {"single_chunk": (437,), "chunked_prefill": (200, 130, 256, 77), "radix_prefix_hit": (500, 300),
          "prefix_mid_page": (100, 90, 1), "fewer_pages_than_ranks": (70, 5, 10), "full_view_fallback": (300, 150),
          "batched_requests": (430, 142, 355, 3)}  # a batch: its requests' tokens together
DTYPES = ("bf16", "fp8_e4m3")
PREFETCH_N = (2, 3, 4)
PREFETCH_SCENARIOS = ("chunked_prefill", "radix_prefix_hit", "full_view_fallback", "batched_requests")
SOAK_N = (3,)


@pytest.fixture(scope="module", params=[2, 3, 4, 8], ids=lambda n: f"N{n}")
def group(request, tiny_nsa_model):
    n = request.param
    jobs = [(name, dtype, "on") for dtype in DTYPES for name in CHUNKS]
    jobs += [("corrupted_shard_is_detected", dtype, "off") for dtype in DTYPES]
    if n in SOAK_N:
        jobs += [(name, dtype, "alternate") for dtype in DTYPES for name in ("soak", "batched_soak")]
    if n in PREFETCH_N:
        jobs += [(name, dtype, "off", {"prefetch": True}) for dtype in DTYPES for name in PREFETCH_SCENARIOS]
    return n, run_interleave_cp_group(n, jobs, tiny_nsa_model, timeout_s=900)


@pytest.mark.parametrize("scenario", sorted(CHUNKS))
def test_scenario_bit_exact(group, scenario):
    """Every index K/scale read, top-k, KV row a kernel could read, reference attention output
    and owned shard row equals the replicated pool's; SGLang's interleave all-gathers returned
    the chunk in token order; each chunk SGLang deals out was dealt out, the rest ran unsplit."""
    n, results = group
    outcomes = assert_clean(results, scenario)
    assert len([k for k in outcomes if "prefetch" not in k]) == len(DTYPES)
    for key, outcome in outcomes.items():
        stats = outcome["stats"]
        assert stats["forwards"] == len(CHUNKS[scenario]) and stats["topk_rows"] > 0, key
        assert stats["split_forwards"] == sum(chunk >= n for chunk in CHUNKS[scenario]), (key, stats)
        assert stats["write_paths"] == {"index=gathered,mla=gathered": len(CHUNKS[scenario])}, key


def test_batches_of_several_requests(group):
    """A batch's requests share one dense map: a request absent from some ranks' tables (it
    has no query token there) and a radix prefix listed by three requests of one batch
    (placed once) stay bit-exact on every rank, every request's rows compared where the rank's
    tables hold it and every rank's shard compared whole."""
    n, results = group
    for key, outcome in assert_clean(results, "batched_requests").items():
        stats = outcome["stats"]
        assert stats["requests_without_rows"] > 0, (key, stats)  # some rank held no query of a request
        assert stats["pages_listed_twice"] >= 2 * 3, (key, stats)  # 3 pages listed thrice, on every rank
        assert stats["shard_rows_compared"] > 0, key


def test_each_chunk_row_is_stored_once_per_layer_then_copied_to_its_owner(group):
    """Per layer one SGLang index store and one MLA store of the whole chunk (into the dense
    views) and one owner copy of each into the shard. In the full view (a layer whose chunk
    another writer stored before, through the pool: only the owned rows, if any) the MLA
    owner copy is left out."""
    n, results = group
    for key, outcome in assert_clean(results, "chunked_prefill").items():
        stats = outcome["stats"]
        layers = stats["layers"]
        assert stats["kernel_calls"] == {"sglang_index_store": layers, "copy_index_rows": layers,
                                         "store_mla_rows": layers, "copy_mla_rows": layers}, key
    for key, outcome in assert_clean(results, "full_view_fallback").items():
        stats, full_view_layers = outcome["stats"], 3  # layers (0, 1), then (1,)
        calls, layers = stats["kernel_calls"], stats["layers"]
        assert calls["sglang_index_store"] == calls["copy_index_rows"] == layers, key
        assert calls["copy_mla_rows"] == layers - full_view_layers, key
        assert layers - full_view_layers <= calls["store_mla_rows"] <= layers, key


def test_soak_bit_exact(group):
    n, results = group
    if n not in SOAK_N:
        pytest.skip(f"the soak runs at N in {SOAK_N}")
    for key, outcome in assert_clean(results, "soak").items():
        assert outcome["stats"]["mixes"] == 200 and outcome["stats"]["split_forwards"] > 0, key
    for key, outcome in assert_clean(results, "batched_soak").items():  # up to 3 requests per batch
        stats = outcome["stats"]
        assert stats["mixes"] == 120 and stats["forwards"] > stats["mixes"], (key, stats)
        assert stats["requests_without_rows"] > 0 and stats["pages_listed_twice"] > 0, (key, stats)


def test_prefetch_bit_exact_over_its_own_communicator(group):
    """Phase 8 on 0.5.23: each layer's MLA history gathered one layer ahead on a second group
    (asynchronously), bit-exact."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"prefetch runs at N in {PREFETCH_N}")
    runs = {k: v for k, v in results.items() if "prefetch=True" in k}
    assert len(runs) == len(DTYPES) * len(PREFETCH_SCENARIOS)
    for key, outcome in runs.items():
        assert not outcome["errors"], (key, outcome["errors"])
        per_rank = outcome["stats"]["all_gathers_per_rank"]
        assert len(per_rank) == n and all(set(g) == {"compute/sync", "prefetch/async"} for g in per_rank), key


def test_corrupted_shard_is_detected(group):
    """Negative control: one corrupted history page on one rank is caught by the comparison."""
    n, results = group
    runs = {k: v for k, v in results.items() if k.startswith("corrupted_shard_is_detected/")}
    assert len(runs) == len(DTYPES) and all(v["stats"]["detected"] for v in runs.values()), runs
