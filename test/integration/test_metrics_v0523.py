"""Metrics on SGLang 0.5.23: the physical gauges beside SGLang's logical constants, set right
after 0.5.23's ``Scheduler.emit_metrics_constants`` when its observability config has
``--enable-metrics``, with the labels of 0.5.23's real ``SchedulerMetricsCollector``.
Runs only where sglang 0.5.23 is installed (``.venv-0.5.23``); 0.5.12.post1's: test_metrics.py."""

import inspect
from types import SimpleNamespace

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.observability import metrics  # noqa: E402
from sglang_cp_shared_kv.context import CapacitySplit, CpSharedKVContext  # noqa: E402
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv_testing.cpu_kv_configurator import CpuDsaRank, interleave_prefill_server_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")
SPLIT = CapacitySplit(physical_tokens_per_rank=2048, logical_tokens=6144, cp_size=3, cp_rank=1, page_size=64,
                      kv_gb_per_rank=0.25, max_running_requests=4)


_COLLECTOR = []


def _gauge(name):
    from prometheus_client import REGISTRY, generate_latest

    lines = [line for line in generate_latest(REGISTRY).decode().splitlines() if line.startswith(name + "{")]
    return [(line.split("{", 1)[1].split("}")[0], float(line.rsplit(" ", 1)[1])) for line in lines]


def _scheduler(server_args, split):
    """What the hook reads of 0.5.23's Scheduler after its model worker is up: the model
    runner's pool (whose context holds the split; None: the flag off) and the collector."""
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

    pool = None if split is None else SimpleNamespace()
    runner = SimpleNamespace(token_to_kv_pool=pool)
    if split is not None:
        from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin

        pool = type("SharedPool", (CpSharedPoolMixin,), {})()
        pool.context = CpSharedKVContext(CpSharedKVLayout(64, split.cp_size, split.cp_rank), split=split)
        runner.token_to_kv_pool = pool
    if not _COLLECTOR:  # NOTE: one per process: its gauges register in prometheus' one registry
        _COLLECTOR.append(SchedulerMetricsCollector(labels={"model_name": "tiny-0523", "moe_ep_rank": 0},
                                                    server_args=server_args))
    return SimpleNamespace(metrics_collector=_COLLECTOR[0], tp_worker=SimpleNamespace(model_runner=runner))


@pytest.mark.parametrize("metrics_on", [False, True])  # (off first: nothing set yet)
def test_physical_gauges_follow_sglangs_constants(tiny_nsa_model, metrics_on):
    extra = ("--enable-metrics",) if metrics_on else ()
    rank = CpuDsaRank(interleave_prefill_server_args(tiny_nsa_model, *extra, tp=3), available_bytes=0, tp_rank=1)
    with rank.active():
        assert metrics.emit_physical_capacity_with_constants("result", _scheduler(rank.server_args, None)) == "result"
        metrics.emit_physical_capacity_with_constants(None, _scheduler(rank.server_args, SPLIT))
    mine = [value for labels, value in _gauge("sglang:cp_shared_kv_physical_tokens_per_rank")
            if 'model_name="tiny-0523"' in labels]
    assert mine == ([2048.0] if metrics_on else [])
    if metrics_on:
        assert [v for labels, v in _gauge("sglang:cp_shared_kv_cp_size") if "tiny-0523" in labels] == [3.0]


def test_the_hooked_method_is_where_0523_emits_its_constants():
    from sglang.srt.managers.scheduler import Scheduler

    source = inspect.getsource(inspect.unwrap(Scheduler.emit_metrics_constants))
    assert "self.metrics_collector.emit_constants(" in source and "enable_metrics" in source
    init = inspect.getsource(inspect.unwrap(Scheduler.__init__))
    assert "self.emit_metrics_constants()" in init  # once, at startup
