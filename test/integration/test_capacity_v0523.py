"""The capacity split on SGLang 0.5.23's real ``KVCacheConfigurator.configure`` (CPU rig
``sglang_cp_shared_kv_testing/cpu_kv_configurator.py``), flag on, for CP rank r of a DSA interleave prefill:
the hooks of ``capacity_dsa`` against what stock 0.5.23 builds for the same rank. Runs
only where sglang 0.5.23 is installed (``.venv-0.5.23``)."""

import logging

import pytest

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.pool import capacity_v0523 as capacity_dsa  # noqa: E402
from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator  # noqa: E402
from sglang_cp_shared_kv.pool.capacity import PHYSICAL_TOKENS_ATTR  # noqa: E402
from sglang_cp_shared_kv.settings.config import FLAG  # noqa: E402
from sglang_cp_shared_kv.pool.kv_pool_v0523 import CpSharedDSATokenToKVPool  # noqa: E402
from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError  # noqa: E402
from sglang_cp_shared_kv_testing.cpu_kv_configurator import CpuDsaRank, interleave_prefill_server_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")

BUDGET = 64 << 20  # bytes of "free GPU memory" each rank profiles
PAGE = 64


class Rank(CpuDsaRank):
    """A rig rank whose attention-CP group is the one-process stand-in."""

    def __init__(self, model, *extra, cp_group, tp=4, tp_rank=0, budget=BUDGET):
        super().__init__(interleave_prefill_server_args(model, *extra, tp=tp), available_bytes=budget,
                         tp_rank=tp_rank)
        self.cp_group = cp_group

    def configure(self):
        with self.active():
            from sglang.srt.runtime_context import get_parallel

            with get_parallel().override(attn_cp_group=self.cp_group):
                return self.configurator().configure(pre_model_load_memory=0)


class Lines(logging.Handler):
    """The messages of one logger. NOTE: not pytest's caplog: resolving 0.5.23's server
    arguments reconfigures the root logger's handlers, caplog's among them."""

    def __init__(self, name):
        super().__init__(logging.INFO)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        self.level_before, self.logger.level = self.logger.level, logging.INFO
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.level = self.level_before


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_logical_capacity_is_n_times_what_stock_builds_per_rank(tiny_nsa_model, gloo_world_of_one, tp):
    stock = Rank(tiny_nsa_model, cp_group=gloo_world_of_one, tp=tp, tp_rank=tp - 1).configure()
    with Lines("sglang_cp_shared_kv.pool.capacity") as lines:
        shared_rank = Rank(tiny_nsa_model, FLAG, cp_group=gloo_world_of_one, tp=tp, tp_rank=tp - 1)
        shared = shared_rank.configure()
    pool, alloc = shared.token_to_kv_pool, shared.token_to_kv_pool_allocator
    physical = stock.max_total_num_tokens
    assert getattr(shared.memory_pool_config, PHYSICAL_TOKENS_ATTR) == physical
    assert shared.max_total_num_tokens == physical // PAGE * tp * PAGE
    assert isinstance(pool, CpSharedDSATokenToKVPool) and type(alloc) is CpSharedInterleavedPagesAllocator
    assert pool.physical_size == physical and pool.size == alloc.size == alloc.available_size() == tp * physical
    assert (pool.cp_layout.cp_rank, pool.cp_layout.cp_size) == (tp - 1, tp)
    # per-rank memory and the request pool are what the flag-off rank builds
    assert pool.get_kv_size_bytes() == stock.token_to_kv_pool.get_kv_size_bytes()
    assert shared.max_running_requests == stock.max_running_requests
    assert shared.req_to_token_pool.size == stock.req_to_token_pool.size
    [line] = lines
    for field in (f"physical_tokens_per_rank={physical}", f"logical_tokens={tp * physical}", f"cp_size={tp}",
                  f"cp_rank={tp - 1}", "shard_policy=page_interleaved"):
        assert field in line
    chunk = sg.resolved_view(shared_rank.server_args).chunked_prefill_size
    assert chunk and f"chunked_prefill_size={chunk}" in line
    assert "stored where they are computed" not in line  # interleave: every page's rows come from every rank
    assert pool.context.split.logical_tokens == tp * physical


def test_max_total_tokens_caps_the_physical_pool(tiny_nsa_model, gloo_world_of_one):
    shared = Rank(tiny_nsa_model, FLAG, "--max-total-tokens", "640", cp_group=gloo_world_of_one).configure()
    assert getattr(shared.memory_pool_config, PHYSICAL_TOKENS_ATTR) == 640
    assert shared.max_total_num_tokens == 4 * 640 and shared.token_to_kv_pool.physical_size == 640


def test_flag_off_builds_the_stock_classes(tiny_nsa_model, gloo_world_of_one):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    stock = Rank(tiny_nsa_model, cp_group=gloo_world_of_one).configure()
    assert type(stock.token_to_kv_pool) is DSATokenToKVPool
    assert type(stock.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator
    assert not hasattr(stock.memory_pool_config, PHYSICAL_TOKENS_ATTR)


def test_the_scheduler_process_revalidates_before_any_pool_is_built(tiny_nsa_model, gloo_world_of_one,
                                                                    monkeypatch):
    rank = Rank(tiny_nsa_model, FLAG, cp_group=gloo_world_of_one)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    built = []
    monkeypatch.setattr(CpSharedDSATokenToKVPool, "__init__", lambda *a, **k: built.append(a))
    with pytest.raises(CpSharedKVConfigError, match="SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"):
        rank.configure()
    assert not built


def test_the_split_is_applied_once(tiny_nsa_model, gloo_world_of_one):
    rank = Rank(tiny_nsa_model, FLAG, cp_group=gloo_world_of_one)
    config = rank.configure().memory_pool_config
    with rank.active():
        with pytest.raises(RuntimeError, match="applied twice"):
            capacity_dsa.split_capacity(config, rank.configurator())


def test_pools_built_without_the_split_are_refused(tiny_nsa_model, gloo_world_of_one, monkeypatch):
    """Never a logical layout over pools sized as if the split had run when it did not."""
    monkeypatch.setattr(capacity_dsa, "split_into_logical", lambda config, layout: config)
    with pytest.raises(RuntimeError, match="without the capacity split"):
        Rank(tiny_nsa_model, FLAG, cp_group=gloo_world_of_one).configure()
