"""Prometheus figures for shared KV, beside SGLang's own.

SGLang's capacity and usage metrics (``sglang:max_total_num_tokens``, token usage,
``num_pages``) stay *logical*: they describe what the scheduler can admit. With the
flag on, ``SchedulerMetricsCollector.emit_constants`` AFTER adds the physical side:

* ``sglang:cp_shared_kv_physical_tokens_per_rank`` - tokens one rank's pool stores;
* ``sglang:cp_shared_kv_cp_size`` - ranks the logical capacity is spread over;
* ``sglang:cp_shared_kv_kv_gb_per_rank`` - the per-rank KV buffers in GB (2**30 B).
"""

from __future__ import annotations

from typing import Dict, Tuple

from sglang_cp_shared_kv.capacity import current_split

_GAUGES = (
    ("physical_tokens_per_rank", "KV tokens one CP rank physically stores (shared KV)."),
    ("cp_size", "CP ranks the logical KV capacity is sharded over (shared KV)."),
    ("kv_gb_per_rank", "KV cache buffers per CP rank in GB (shared KV)."),
)
_gauges: Dict[Tuple[str, Tuple[str, ...]], object] = {}


def _gauge(field: str, doc: str, labelnames: Tuple[str, ...]):
    from prometheus_client import Gauge

    key = (field, labelnames)
    if key not in _gauges:
        _gauges[key] = Gauge(
            name=f"sglang:cp_shared_kv_{field}",
            documentation=doc,
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
    return _gauges[key]


def emit_physical_capacity(result, collector, *args, **kwargs):
    """AFTER ``SchedulerMetricsCollector.emit_constants``."""
    split = current_split()
    if split is None:  # flag off, or no shared-KV pool in this process
        return result
    labels = dict(collector.labels)
    for field, doc in _GAUGES:
        _gauge(field, doc, tuple(labels)).labels(**labels).set(getattr(split, field))
    return result
