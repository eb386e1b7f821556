"""The sharded HiCache tier's Prometheus metrics (with ``--enable-metrics``), one definition
for every release's host pool: pages each CP rank copied, by direction, its host tokens, and its
storage tier's (L3) backend calls that raised, by operation."""

from __future__ import annotations

from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric

#: pages each CP rank copied, by direction (``cp_rank``, ``direction`` labels)
HICACHE_PAGES_METRIC = "sglang:cp_shared_kv_hicache_pages_total"

#: the directions of ``sglang:cp_shared_kv_hicache_pages_total`` (and of the host pools'
#: ``pages_copied``): device -> host, host -> device, host -> storage (L3), storage -> host
COPY_DIRECTIONS = ("backed_up", "loaded_back", "stored", "fetched")

#: storage tier (L3) backend calls that raised on each CP rank, by operation (``cp_rank``,
#: ``operation`` labels)
HICACHE_STORAGE_ERRORS_METRIC = "sglang:cp_shared_kv_hicache_storage_errors_total"

#: the operations of ``sglang:cp_shared_kv_hicache_storage_errors_total`` (and of the host pools'
#: ``counts.storage_errors``): a fetch or a store of the rank's pages, an existence query
STORAGE_OPERATIONS = ("fetch", "store", "query")


def hicache_pages_counter():
    return prometheus_metric(
        "counter", HICACHE_PAGES_METRIC,
        "Pages a CP rank copied under shared KV (each rank only its own pages): backed_up from its "
        "device pool to host memory, loaded_back from host memory, stored to the HiCache storage "
        "tier (L3), fetched from it.",
        ("cp_rank", "direction"))


def hicache_storage_errors_counter():
    return prometheus_metric(
        "counter", HICACHE_STORAGE_ERRORS_METRIC,
        "Storage tier (L3) backend calls that raised on a CP rank under shared KV, by operation: a fetch "
        "or a store (the rank's pages in it taken as failed) or an existence query (taken as finding none); "
        "the CP group's agreed hit then ends before those pages on every rank.",
        ("cp_rank", "operation"))


def hicache_host_tokens_gauge():
    # NOTE: "mostrecent": SGLang runs Prometheus in multiprocess mode; one value per (rank, kind)
    return prometheus_metric(
        "gauge", "sglang:cp_shared_kv_hicache_host_tokens",
        "HiCache host pool tokens under shared KV: physical (this CP rank's host memory) and logical "
        "(the CP group's host tier, N times a rank's).",
        ("cp_rank", "kind"), multiprocess_mode="mostrecent")


class HostTierCounts:
    """One CP rank's host tier in numbers, for both releases' host pools: the pages it copied, by
    direction (``pages``: :data:`COPY_DIRECTIONS`), its storage backend calls that raised, by
    operation (``storage_errors``: :data:`STORAGE_OPERATIONS`), and, with ``--enable-metrics``,
    the same in ``sglang:cp_shared_kv_hicache_pages_total`` and ``…_hicache_storage_errors_total``
    and its host tokens in ``…_hicache_host_tokens``."""

    def __init__(self, cp_rank: int, metrics_enabled: bool):
        self.cp_rank = str(cp_rank)
        self.metrics_enabled = metrics_enabled
        self.pages = dict.fromkeys(COPY_DIRECTIONS, 0)
        self.storage_errors = dict.fromkeys(STORAGE_OPERATIONS, 0)

    def count(self, direction: str, pages: int) -> None:
        """``pages`` more of this rank's pages copied ``direction``."""
        if direction not in self.pages:
            raise ValueError(f"count_copied_pages: direction must be one of {COPY_DIRECTIONS}, got {direction!r}")
        self.pages[direction] += pages
        if self.metrics_enabled:
            hicache_pages_counter().labels(cp_rank=self.cp_rank, direction=direction).inc(pages)

    def count_storage_error(self, operation: str) -> None:
        """One more of this rank's storage backend calls of ``operation`` raised."""
        if operation not in self.storage_errors:
            raise ValueError(f"count_storage_error: operation must be one of {STORAGE_OPERATIONS}, got {operation!r}")
        self.storage_errors[operation] += 1
        if self.metrics_enabled:
            hicache_storage_errors_counter().labels(cp_rank=self.cp_rank, operation=operation).inc()

    def publish_host_tokens(self, physical: int, logical: int) -> None:
        if self.metrics_enabled:
            gauge = hicache_host_tokens_gauge()
            gauge.labels(cp_rank=self.cp_rank, kind="physical").set(physical)
            gauge.labels(cp_rank=self.cp_rank, kind="logical").set(logical)


__all__ = ["COPY_DIRECTIONS", "HICACHE_PAGES_METRIC", "HICACHE_STORAGE_ERRORS_METRIC", "HostTierCounts",
           "STORAGE_OPERATIONS", "hicache_host_tokens_gauge", "hicache_pages_counter", "hicache_storage_errors_counter"]
