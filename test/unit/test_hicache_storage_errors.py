"""A storage backend call that raises on one CP rank (``hicache.storage``; a stand-in backend,
SGLang's own result type of a query): each is this rank's own pages failing in the shape its
caller reads (False for each own page of a fetch or a store, v1 and v2; a query that finds none of its pages, the
sharded query's and 0.5.12.post1's narrowed one alike), logged once with the exception, the rank,
the operation and its pages, and counted (``HostTierCounts.storage_errors`` and
``sglang:cp_shared_kv_hicache_storage_errors_total``). The CP group's agreement over these
results is the L3 tests' (test/integration/test_hicache_l3_v*.py, ``BACKEND_RAISES``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional

import prometheus_client
import pytest
import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.hicache.host_lanes import HostPageRule
from sglang_cp_shared_kv.hicache.metrics import HICACHE_STORAGE_ERRORS_METRIC, HostTierCounts
from sglang_cp_shared_kv.hicache.storage import ShardedStorage
from sglang_cp_shared_kv.hicache.storage_v0512 import PrefetchLaneStorage

PAGE = 64
N, RANK = 2, 1
KEYS = ["h0", "h1", "h2", "h3"]
HOST_INDICES = torch.arange(len(KEYS) * PAGE)  # host pages 0..3: lanes 0, 1, 0, 1 at N = 2
OWN = [1, 3]  # this rank's pages among them


@dataclasses.dataclass
class Transfer:
    """Stands in for SGLang's PoolTransfer (a v2 batch of one pool)."""

    name: str
    host_indices: torch.Tensor
    keys: Optional[List[str]] = None


class UnreachableBackend:
    """Every call raises, as a Mooncake client whose master is out of reach might."""

    def _raise(self, *args, **kwargs):
        raise ConnectionError("master unreachable")

    batch_get_v1 = batch_set_v1 = batch_get_v2 = batch_set_v2 = batch_exists = batch_exists_v2 = _raise


def _storage(storage_class=ShardedStorage, metrics_enabled=False):
    counts = HostTierCounts(RANK, metrics_enabled)
    storage = storage_class(UnreachableBackend(), HostPageRule(CpSharedKVLayout(PAGE, N, RANK)), counts)
    return storage, counts


def _errors_logged(caplog, operation: str, pages: int) -> None:
    records = [r for r in caplog.records if r.name.startswith("sglang_cp_shared_kv.hicache")]
    assert len(records) == 1, [r.getMessage() for r in records]
    record = records[0]
    assert record.levelno >= logging.WARNING and record.exc_info[0] is ConnectionError
    message = record.getMessage()
    assert f"CP rank {RANK}" in message and f"a {operation} of {pages} page(s)" in message, message


def _expected(own_ok: bool) -> List[bool]:
    return [own_ok if page in OWN else True for page in range(len(KEYS))]


@pytest.mark.parametrize("call, operation", [("batch_get_v1", "fetch"), ("batch_set_v1", "store")])
def test_a_raising_v1_fetch_or_store_fails_this_ranks_pages_only(caplog, call, operation):
    storage, counts = _storage()
    with caplog.at_level(logging.WARNING):
        assert getattr(storage, call)(KEYS, HOST_INDICES) == _expected(own_ok=False)
    _errors_logged(caplog, operation, len(OWN))
    assert counts.storage_errors == {"fetch": 0, "store": 0, "query": 0, operation: 1}
    assert counts.pages == {"backed_up": 0, "loaded_back": 0, "stored": 0, "fetched": 0}


@pytest.mark.parametrize("call, operation", [("batch_get_v2", "fetch"), ("batch_set_v2", "store")])
def test_a_raising_v2_fetch_or_store_fails_this_ranks_pages_of_each_pool(caplog, call, operation):
    storage, counts = _storage()
    transfers = [Transfer("indexer", HOST_INDICES, list(KEYS))]
    with caplog.at_level(logging.WARNING):
        assert getattr(storage, call)(transfers) == {"indexer": _expected(own_ok=False)}
    _errors_logged(caplog, operation, len(OWN))
    assert counts.storage_errors[operation] == 1 and sum(counts.storage_errors.values()) == 1


def test_a_raising_existence_query_finds_no_page_in_the_shape_of_each_call(caplog):
    storage, counts = _storage()
    with caplog.at_level(logging.WARNING):
        assert storage.batch_exists(KEYS) == 0
    _errors_logged(caplog, "query", len(KEYS))
    caplog.clear()
    storage.raises.answered("query")  # (a new streak: its first raise is logged in full)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        miss = storage.batch_exists_v2(KEYS, [Transfer("indexer", HOST_INDICES)])
    # (SGLang's own result type, as its caller reads it)
    assert isinstance(miss, sg.PoolTransferResult) and (miss.kv_hit_pages, miss.extra_pool_hit_pages) == (0, {})
    _errors_logged(caplog, "query", len(KEYS))
    assert counts.storage_errors == {"fetch": 0, "store": 0, "query": 2}


def test_a_raising_query_narrowed_to_the_lane_ends_the_hit_at_this_ranks_first_page(caplog):
    """0.5.12.post1's prefetch query asks for this rank's pages only; finding none of them, this
    rank's hit is its first own page (the group's MIN then ends the hit there)."""
    storage, counts = _storage(PrefetchLaneStorage)
    with storage.query_for(HOST_INDICES), caplog.at_level(logging.WARNING):
        assert storage.batch_exists(KEYS) == OWN[0]
    _errors_logged(caplog, "query", len(OWN))
    assert counts.storage_errors["query"] == 1


def test_a_call_that_does_not_raise_is_neither_logged_nor_counted(caplog):
    storage, counts = _storage()
    storage.backend.batch_exists = lambda keys, extra_info=None: len(keys)
    with caplog.at_level(logging.WARNING):
        assert storage.batch_exists(KEYS) == len(KEYS)
    assert not [r for r in caplog.records if r.name.startswith("sglang_cp_shared_kv")]
    assert sum(counts.storage_errors.values()) == 0


def test_an_outage_logs_one_traceback_then_a_line_a_minute_then_its_end(caplog, monkeypatch):
    """Every raise is counted; the log has the streak's first raise with its traceback, one
    ERROR line per ``REPEAT_S`` while it lasts, and a WARNING when the operation answers again.
    Each operation has its own streak."""
    storage, counts = _storage()
    now = [1000.0]
    storage.raises.clock = lambda: now[0]

    def ours():
        records = [r for r in caplog.records if r.name.startswith("sglang_cp_shared_kv")]
        caplog.clear()
        return records

    with caplog.at_level(logging.INFO):
        storage.batch_exists(KEYS)
        (first,) = ours()
        assert first.levelno == logging.ERROR and first.exc_info[0] is ConnectionError
        for _ in range(5):  # within the minute: counted, not logged
            now[0] += 1
            storage.batch_exists(KEYS)
        assert ours() == []
        storage.batch_get_v1(KEYS, HOST_INDICES)  # another operation: its own first raise
        (fetch,) = ours()
        assert fetch.exc_info[0] is ConnectionError and "a fetch of" in fetch.getMessage()
        now[0] = 1000.0 + storage.raises.REPEAT_S
        storage.batch_exists(KEYS)
        (repeat,) = ours()
        assert repeat.levelno == logging.ERROR and not repeat.exc_info
        assert "still raises: 7 query call(s)" in repeat.getMessage(), repeat.getMessage()
        storage.backend.batch_exists = lambda keys, extra_info=None: len(keys)
        assert storage.batch_exists(KEYS) == len(KEYS)
        (end,) = ours()
        assert end.levelno == logging.WARNING and "answers a query again after 7 call(s)" in end.getMessage()
        storage.batch_exists(KEYS)
        assert ours() == []
    assert counts.storage_errors == {"fetch": 1, "store": 0, "query": 7}


@pytest.mark.parametrize("call", ["batch_get_v1", "batch_set_v1"])
def test_an_own_page_the_backend_gave_no_result_for_failed(call):
    """A backend answering fewer results than this rank's keys (a broken contract): the pages
    without a result count as failed, never as fetched or stored (a fetched page enters the tree)."""
    storage, counts = _storage()
    setattr(storage.backend, call, lambda keys, host_indices, extra_info=None: [True] * (len(keys) - 1))
    assert getattr(storage, call)(KEYS, HOST_INDICES) == [page != OWN[-1] for page in range(len(KEYS))]


def test_the_prometheus_counter_counts_each_raise_by_rank_and_operation():
    storage, _counts = _storage(metrics_enabled=True)
    labels = {"cp_rank": str(RANK), "operation": "fetch"}
    before = prometheus_client.REGISTRY.get_sample_value(HICACHE_STORAGE_ERRORS_METRIC, labels) or 0
    storage.batch_get_v1(KEYS, HOST_INDICES)
    storage.batch_get_v2([Transfer("indexer", HOST_INDICES, list(KEYS))])
    assert prometheus_client.REGISTRY.get_sample_value(HICACHE_STORAGE_ERRORS_METRIC, labels) == before + 2


def test_an_unknown_operation_is_refused():
    with pytest.raises(ValueError, match="operation must be one of"):
        HostTierCounts(RANK, False).count_storage_error("prefetch")
