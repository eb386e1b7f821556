"""Metrics: SGLang's capacity gauges stay logical, ours add the physical side."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.observability import metrics

from sglang_cp_shared_kv import plugin
from sglang_cp_shared_kv.context import CapacitySplit, CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool
from sglang_cp_shared_kv_testing.support import shared_kv_kwargs

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")


def _scrape():
    from prometheus_client import REGISTRY, generate_latest

    return generate_latest(REGISTRY).decode()


def _value(text, name):
    lines = [l for l in text.splitlines() if l.startswith(name + "{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else None


def test_physical_gauges_beside_logical_capacity(tiny_nsa_model):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**shared_kv_kwargs(tiny_nsa_model))
    collector = SchedulerMetricsCollector(labels={"model_name": "tiny", "moe_ep_rank": 0},
                                          server_args=server_args)
    constants = dict(max_running_requests_under_SLO=None, engine_startup_time=1.0,
                     engine_load_weights_time=1.0, page_size=64, context_len=8192,
                     startup_available_gpu_memory_gb=1.0)

    def scheduler(split):
        """What the hook reads of SGLang's Scheduler once ``init_model_worker`` ran: its
        model runner's pool (a stock one when the flag is off)."""
        kwargs = dict(page_size=64, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=1,
                      device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576)
        if split is None:
            pool = NSATokenToKVPool(2 * 64, **kwargs)
        else:
            context = CpSharedKVContext(CpSharedKVLayout(64, split.cp_size, split.cp_rank), split=split)
            pool = CpSharedNSATokenToKVPool(2 * 64 * split.cp_size, context=context, **kwargs)
        return SimpleNamespace(enable_metrics=True, metrics_collector=collector,
                               tp_worker=SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=pool)))

    collector.emit_constants(max_total_num_tokens=1024, num_pages=16, **constants)
    assert metrics.emit_physical_capacity("result", scheduler(None)) == "result"  # flag off: nothing added
    text = _scrape()
    assert _value(text, "sglang:max_total_num_tokens") == 1024
    assert "sglang:cp_shared_kv_physical_tokens_per_rank{" not in text

    split = CapacitySplit(physical_tokens_per_rank=1024, logical_tokens=4096, cp_size=4, cp_rank=2,
                          page_size=64, kv_gb_per_rank=0.5, max_running_requests=8)
    collector.emit_constants(max_total_num_tokens=4096, num_pages=64, **constants)
    metrics.emit_physical_capacity(None, scheduler(split))
    text = _scrape()
    assert _value(text, "sglang:max_total_num_tokens") == 4096  # logical, as the scheduler sees it
    assert _value(text, "sglang:cp_shared_kv_physical_tokens_per_rank") == 1024
    assert _value(text, "sglang:cp_shared_kv_cp_size") == 4
    assert _value(text, "sglang:cp_shared_kv_kv_gb_per_rank") == 0.5


def test_the_gauges_are_set_right_after_sglang_emits_its_constants():
    """SGLang emits its constant gauges at the end of ``Scheduler.init_model_worker``; the
    hooked mixin method is the next call of ``Scheduler.__init__``. Read from the source:
    the scheduler module does not import without a GPU."""
    import ast
    import importlib.util
    from pathlib import Path

    [spec] = [s for s in plugin.HOOKS if s.hook is metrics.emit_physical_capacity]
    assert spec.target.endswith("SchedulerMetricsMixin.install_device_timer_on_runners")
    assert spec.hook_type == "after"
    source = Path(importlib.util.find_spec("sglang.srt.managers.scheduler").origin).read_text()
    scheduler = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = {f.name: f for f in scheduler.body if isinstance(f, ast.FunctionDef)}
    assert "SchedulerMetricsMixin" in [ast.unparse(b) for b in scheduler.bases]
    assert "install_device_timer_on_runners" not in methods  # the mixin's method is the one called
    calls = [ast.unparse(s.value.func) for s in methods["__init__"].body
             if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
    after = calls[calls.index("self.init_model_worker") + 1]
    assert after == "self.install_device_timer_on_runners"
    assert "self.metrics_collector.emit_constants(" in ast.unparse(methods["init_model_worker"])


def test_forwards_are_counted_by_write_path():
    """Every forward counts how its chunk's rows reached the shards, in the context and, with
    --enable-metrics, in ``sglang:cp_shared_kv_prefill_forwards_total{cp_rank,index,mla}``."""
    quiet = CpSharedKVContext(CpSharedKVLayout(64, 2, 0))
    quiet.count_write_path("local", "local")
    assert quiet.write_paths == {("local", "local"): 1}
    counted = CpSharedKVContext(CpSharedKVLayout(64, 2, 1), metrics_enabled=True)
    for path in [("local", "local"), ("local", "local"), ("local", "gathered"), ("gathered", "gathered")]:
        counted.count_write_path(*path)
    text = _scrape()
    name = "sglang:cp_shared_kv_prefill_forwards_total"
    assert f'{name}{{cp_rank="1",index="local",mla="local"}} 2.0' in text
    assert f'{name}{{cp_rank="1",index="local",mla="gathered"}} 1.0' in text
    assert f'{name}{{cp_rank="1",index="gathered",mla="gathered"}} 1.0' in text
    assert 'cp_rank="0"' not in "".join(line for line in text.splitlines() if line.startswith(name))
