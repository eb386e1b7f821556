"""One process-wide home for the plugin's Prometheus objects.

Every gauge and counter of the plugin is obtained here, by name::

    pages = prometheus_metric("counter", "sglang:cp_shared_kv_transfer_pages_total",
                              "Pages a prefill CP rank sent ...", ("cp_rank", "kind"))
    pages.labels(cp_rank="0", kind="kv").inc(12)

The first call creates the object in prometheus_client's default registry (the one
SGLang's ``/metrics`` endpoint serves, multiprocess mode included); every later call
with the same name returns that same object.

NOTE: the registry is process-wide and refuses a second registration of a name, while a
process can build more than one shared-KV pool (two engines, or tests building several
configurations). So the objects are cached per process. They hold no per-runner state:
each caller keeps its own labels (``cp_rank``, SGLang's scheduler labels). A second
request for a name with another kind or other label names is a programming error and is
refused here, loudly, instead of inside prometheus_client.

Pure: imports prometheus_client lazily, on first use (it is only needed with
``--enable-metrics``), and nothing of SGLang.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Tuple

_KINDS = ("counter", "gauge")

_metrics: Dict[str, Tuple[str, Tuple[str, ...], Any]] = {}
_lock = threading.Lock()


def prometheus_metric(kind: str, name: str, documentation: str, labelnames: Tuple[str, ...], **options: Any):
    """The process's ``kind`` ("counter" or "gauge") called ``name``, created on first use.

    ``options`` go to the constructor on creation (e.g. ``multiprocess_mode`` for a gauge).
    """
    if kind not in _KINDS:
        raise ValueError(f"prometheus_metric: kind must be one of {_KINDS}, got {kind!r}")
    labelnames = tuple(labelnames)
    with _lock:
        known = _metrics.get(name)
        if known is None:
            import prometheus_client

            factory = prometheus_client.Counter if kind == "counter" else prometheus_client.Gauge
            known = (kind, labelnames, factory(name, documentation, labelnames=labelnames, **options))
            _metrics[name] = known
        if known[:2] != (kind, labelnames):
            raise ValueError(
                f"prometheus_metric: {name} is already a {known[0]} with labels {known[1]}; "
                f"asked for a {kind} with labels {labelnames}")
        return known[2]


__all__ = ["prometheus_metric"]
