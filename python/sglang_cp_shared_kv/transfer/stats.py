"""What a prefill rank sent under shared KV: in-process counters and Prometheus counters.

:class:`TransferStats` is always kept (``prefill.transfer_stats(kv_mgr)`` reads it); the
Prometheus counters exist only with ``--enable-metrics`` (:class:`RankCounters` with
``enabled=False`` counts nothing):

* ``sglang:cp_shared_kv_transfer_pages_total{cp_rank,kind=kv|state}``
* ``sglang:cp_shared_kv_transfer_descriptors_total{cp_rank,kind=kv|state}``
* ``sglang:cp_shared_kv_transfer_failures_total{cp_rank,kind=kv|state|aux|rejected|aborted|refused}``
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Dict

from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric


class TransferStats:
    """What one prefill rank sent, cumulative; ``recent_chunks`` keeps the last chunks."""

    FIELDS = (
        "kv_chunks", "kv_chunk_pages", "kv_pages", "kv_descriptors",
        "state_pages", "state_descriptors",
        "write_batches", "write_descriptors", "write_bytes",
        "failed_writes", "failed_state_writes", "failed_aux_writes", "rejected_requests",
        "aborted_requests", "refused_requests",
    )

    def __init__(self, recent: int = 256):
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = dict.fromkeys(self.FIELDS, 0)
        self._recent_chunks: collections.deque = collections.deque(maxlen=recent)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += int(delta)

    def record_chunk(self, record: Dict[str, Any]) -> None:
        with self._lock:
            self._recent_chunks.append(record)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
            out["recent_chunks"] = [dict(r) for r in self._recent_chunks]
        return out


_COUNTERS = {
    "pages": ("sglang:cp_shared_kv_transfer_pages_total",
              "Pages a prefill CP rank sent to decode under shared KV (kind: kv | state)."),
    "descriptors": ("sglang:cp_shared_kv_transfer_descriptors_total",
                    "Mooncake transfer descriptors (contiguous runs x layers) a prefill CP rank "
                    "issued under shared KV (kind: kv | state)."),
    "failures": ("sglang:cp_shared_kv_transfer_failures_total",
                 "Requests a prefill CP rank failed under shared KV "
                 "(kind: kv | state | aux | rejected | aborted | refused)."),
}


def prometheus_counters() -> Dict[str, Any]:
    """The process's transfer counters (``pages``, ``descriptors``, ``failures``)."""
    return {metric: prometheus_metric("counter", name, doc, ("cp_rank", "kind"))
            for metric, (name, doc) in _COUNTERS.items()}


class RankCounters:
    """One CP rank's view of the Prometheus counters (nothing counted when disabled)."""

    def __init__(self, cp_rank: int, enabled: bool):
        self._rank_label = str(cp_rank)
        self._counters = prometheus_counters() if enabled else None

    def count(self, metric: str, kind: str, amount: int = 1) -> None:
        if self._counters is not None and amount:
            self._counters[metric].labels(cp_rank=self._rank_label, kind=kind).inc(amount)


__all__ = ["TransferStats", "prometheus_counters", "RankCounters"]
