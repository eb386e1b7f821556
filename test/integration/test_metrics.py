"""Metrics: SGLang's capacity gauges stay logical, ours add the physical side."""

import pytest
from testing_support import shared_kv_kwargs

from sglang_cp_shared_kv import capacity
from sglang_cp_shared_kv.capacity import CapacitySplit

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")


def _scrape():
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def _value(text, name):
    lines = [l for l in text.splitlines() if l.startswith(name + "{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else None


def test_physical_gauges_beside_logical_capacity(tiny_nsa_model, monkeypatch):
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**shared_kv_kwargs(tiny_nsa_model))
    collector = SchedulerMetricsCollector(labels={"model_name": "tiny", "moe_ep_rank": 0},
                                          server_args=server_args)
    constants = dict(max_running_requests_under_SLO=None, engine_startup_time=1.0,
                     engine_load_weights_time=1.0, page_size=64, context_len=8192,
                     startup_available_gpu_memory_gb=1.0)

    monkeypatch.setattr(capacity, "_current_split", None)  # flag off: nothing added
    collector.emit_constants(max_total_num_tokens=1024, num_pages=16, **constants)
    text = _scrape()
    assert _value(text, "sglang:max_total_num_tokens") == 1024
    assert "sglang:cp_shared_kv_physical_tokens_per_rank{" not in text

    split = CapacitySplit(physical_tokens_per_rank=1024, logical_tokens=4096, cp_size=4, cp_rank=2,
                          page_size=64, kv_gb_per_rank=0.5, max_running_requests=8)
    monkeypatch.setattr(capacity, "_current_split", split)
    collector.emit_constants(max_total_num_tokens=4096, num_pages=64, **constants)
    text = _scrape()
    assert _value(text, "sglang:max_total_num_tokens") == 4096  # logical, as the scheduler sees it
    assert _value(text, "sglang:cp_shared_kv_physical_tokens_per_rank") == 1024
    assert _value(text, "sglang:cp_shared_kv_cp_size") == 4
    assert _value(text, "sglang:cp_shared_kv_kv_gb_per_rank") == 0.5
