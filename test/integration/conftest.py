"""Fixtures for tests that drive the real SGLang 0.5.12.post1 classes on a CPU machine."""

import contextlib
import json

import pytest
import torch

from sglang_cp_shared_kv_testing.support import TINY_DSV3, TINY_DSV32, free_port


def _model_dir(tmp_path_factory, name, config):
    path = tmp_path_factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def tiny_nsa_model(tmp_path_factory):
    return _model_dir(tmp_path_factory, "tiny-dsv32", TINY_DSV32)


@pytest.fixture(scope="session")
def tiny_mla_model(tmp_path_factory):
    return _model_dir(tmp_path_factory, "tiny-dsv3", TINY_DSV3)


@pytest.fixture(scope="session")
def plugin_loaded():
    """SGLang's own plugin loader, as every SGLang process runs it; the installed entry
    point ``cp_shared_kv`` registers our hooks and the loader applies them."""
    from sglang.srt.plugins import load_plugins

    from sglang_cp_shared_kv.hook_check import registered_hooks
    from sglang_cp_shared_kv.releases import installed, v0512

    on_cpu = contextlib.nullcontext()
    if installed.INSTALLED is v0512.RELEASE:
        from sglang_cp_shared_kv_testing.hicache_rig_v0512 import hicache_on_cpu

        # the HiCache hooks' targets import memory_pool_host, which imports sgl_kernel.kvcacheio (CUDA)
        # (0.5.23's host pools import it only on CUDA/ROCm: nothing to stand in for the hooks)
        on_cpu = hicache_on_cpu()
    with on_cpu:
        load_plugins()
    hooks = registered_hooks()
    assert hooks, "the cp_shared_kv entry point did not register hooks (is the package installed?)"
    return hooks


@pytest.fixture
def pretend_hopper(monkeypatch):
    """ServerArgs asks the CUDA device for its compute capability when it picks the NSA
    defaults; answer as the H200 (sm90) this feature targets would."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


@pytest.fixture
def all_cp_ranks_env(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    monkeypatch.delenv("SGLANG_DISAGG_STAGING_BUFFER", raising=False)


@pytest.fixture(scope="module")
def gloo_world_of_one():
    """A one-process gloo group (torch's default one, made here if nothing has made it; never
    torn down, since SGLang's world, made later, reuses it): a stand-in for the attention-CP
    group's or the decode queue's attention-TP CPU side, whose collectives are then trivial."""
    import torch.distributed as dist
    from types import SimpleNamespace

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return SimpleNamespace(cpu_group=dist.group.WORLD, ranks=[0])


@pytest.fixture(scope="session")
def sglang_world_of_one():
    """SGLang's model-parallel state for one process over gloo (TP = attention TP = 1),
    which the memory-pool configurator queries."""
    from sglang.srt.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")
    yield


@pytest.fixture
def triton_standins(monkeypatch):
    """Swap SGLang's Triton kernels that cannot run on a CPU (allocator, MLA store, fp8 KV
    quantization, index quantization and index buffer accessors) for the torch equivalents
    in sglang_cp_shared_kv_testing/torch_standins.py, which test/gpu proves equal to the
    real kernels. The only place CPU tests replace SGLang code (the CP harness installs the
    same table)."""
    from sglang_cp_shared_kv_testing import torch_standins

    torch_standins.install(monkeypatch.setattr)
