"""Prometheus figures for shared KV, beside SGLang's own.

SGLang's capacity and usage metrics (``sglang:max_total_num_tokens``, token usage,
``num_pages``) stay *logical*: they describe what the scheduler can admit. With the
flag on and ``--enable-metrics``, the hook below adds the physical side, with the same
labels as SGLang's gauges:

* ``sglang:cp_shared_kv_physical_tokens_per_rank`` - tokens one rank's pool stores;
* ``sglang:cp_shared_kv_cp_size`` - ranks the logical capacity is spread over;
* ``sglang:cp_shared_kv_kv_gb_per_rank`` - the per-rank KV buffers in GB (2**30 B).

Counters kept where they are counted: the PD transfer's (``transfer/stats.py``) and the
prefill forwards by write path (``context.CpSharedKVContext.count_write_path``). Every
gauge and counter comes from :mod:`sglang_cp_shared_kv.observability.prometheus_registry` (one object per
name and process).

The figures come from the scheduler's own model runner (its pool's context), not from
any process-wide record. NOTE: SGLang emits its constants at the end of
``Scheduler.init_model_worker``, but ``sglang.srt.managers.scheduler`` does not import
without a GPU, so a hook there could not be verified on CPU machines. ``Scheduler.__init__``
calls ``SchedulerMetricsMixin.install_device_timer_on_runners`` right after it
(0.5.12.post1 ``managers/scheduler.py:437-438``), once, with the model worker and the
metrics collector in place: our gauges are set AFTER that call. On 0.5.23 SGLang emits its
constants in a method of their own, ``Scheduler.emit_metrics_constants`` (and its scheduler
module imports on a CPU): our gauges are set AFTER it, when its observability config has
``--enable-metrics`` (the scheduler keeps no flag of its own there).
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.pool.capacity import context_of
from sglang_cp_shared_kv.context import CapacitySplit
from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric

_GAUGES = (
    ("physical_tokens_per_rank", "KV tokens one CP rank physically stores (shared KV)."),
    ("cp_size", "CP ranks the logical KV capacity is sharded over (shared KV)."),
    ("kv_gb_per_rank", "KV cache buffers per CP rank in GB (shared KV)."),
)


def emit_capacity(collector, split: CapacitySplit) -> None:
    """Set our gauges, labelled as ``collector`` (SGLang's ``SchedulerMetricsCollector``)."""
    labels = dict(collector.labels)
    for field, doc in _GAUGES:
        gauge = prometheus_metric("gauge", f"sglang:cp_shared_kv_{field}", doc, tuple(labels),
                                  multiprocess_mode="mostrecent")
        gauge.labels(**labels).set(getattr(split, field))


def scheduler_split(scheduler) -> Optional[CapacitySplit]:
    """The capacity split of the scheduler's model runner (None: flag off, or no pool)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    context = context_of(runner)
    return None if context is None else context.split


def _emit_for(scheduler) -> None:
    """Our gauges beside the scheduler's constants (nothing when the flag is off)."""
    split = scheduler_split(scheduler)
    collector = getattr(scheduler, "metrics_collector", None)
    if split is not None and collector is not None:
        emit_capacity(collector, split)


def emit_physical_capacity(result, scheduler, *args, **kwargs):
    """AFTER ``SchedulerMetricsMixin.install_device_timer_on_runners`` (0.5.12.post1: the
    scheduler's next call after ``init_model_worker``, where SGLang emits its own constants)."""
    if getattr(scheduler, "enable_metrics", False):
        _emit_for(scheduler)
    return result


def emit_physical_capacity_with_constants(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.emit_metrics_constants`` (0.5.23)."""
    if sg.get_observability().enable_metrics:
        _emit_for(scheduler)
    return result
