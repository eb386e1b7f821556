"""The in-seq CP all-gather hook on CUDA, in one process: the plugin path runs the Triton
re-range after the all-gather and returns SGLang's ``cp_all_gather_rerange_output``
bytes; a kernel that raises falls back after the same single all-gather; debug mode runs
SGLang's function. The attention-CP group is a stand-in whose all-gather writes a
synthesized gathered buffer (test_kernels.py compares the kernel alone with SGLang's
split/cat; this file covers the hook around it). Skipped without CUDA.
"""

from types import SimpleNamespace

import pytest
import torch

import sglang_cp_shared_kv_kernel as K
from sglang_cp_shared_kv.settings.config import DEBUG_ENV
from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward import hooks
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE

DEVICE = "cuda"


class GatherStandIn:
    """The attention-CP group of one rank: its all-gather writes ``gathered`` (every
    rank's padded rows) and records what it was asked."""

    world_size = 2

    def __init__(self, gathered):
        self.gathered, self.calls = gathered, []

    def cp_all_gather_into_tensor_async(self, output, input_, stream):
        self.calls.append((tuple(output.shape), output.dtype, tuple(input_.shape), stream))
        output.copy_(self.gathered)


@pytest.fixture
def cp(monkeypatch):
    from sglang.srt import server_args as sa
    from sglang.srt.layers.utils import cp_utils

    from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

    monkeypatch.setattr(sa, "_global_server_args", SimpleNamespace(
        enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode="in-seq-split", enable_symm_mem=False))
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    launches = []
    real = K.rerange_rows
    monkeypatch.setattr(K, "rerange_rows", lambda *a, **k: (launches.append(1), real(*a, **k))[1])
    pool = CpSharedNSATokenToKVPool(
        2 * PAGE * 2, context=CpSharedKVContext(CpSharedKVLayout(PAGE, 2, 0)), page_size=PAGE, kv_lora_rank=512,
        dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=1, device=DEVICE, index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=576)
    yield SimpleNamespace(cp_utils=cp_utils, monkeypatch=monkeypatch, pool=pool, launches=launches)


def batch(cp, seed, width):
    """(this rank's rows, forward batch, stand-in group, CP size) of a random in-seq split."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    rank = int(torch.randint(0, n, (1,), generator=g))
    total = int(torch.randint(2 * n, 20000 if width < 1000 else 3000, (1,), generator=g))
    metadata = cp.cp_utils.prepare_context_parallel_metadata(total, rank, n, [total])
    slot = -(-total // n)
    gathered = torch.randn(n * slot, width, generator=g).bfloat16().to(DEVICE)
    rows = gathered[rank * slot: rank * slot + metadata.per_rank_actual_token[rank]].clone()
    group = GatherStandIn(gathered)
    cp.monkeypatch.setattr(cp.cp_utils, "get_attention_cp_group", lambda: group)
    return rows, SimpleNamespace(token_to_kv_pool=cp.pool, attn_cp_metadata=metadata), group, n


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("width", [576, 128, 7168])  # latent, index key, hidden
def test_hook_runs_the_kernel_and_equals_sglang(cp, seed, width):
    rows, fb, group, n = batch(cp, seed, width)
    stream = torch.cuda.current_stream()
    theirs = cp.cp_utils.cp_all_gather_rerange_output(rows, n, fb, stream)
    their_calls, group.calls = group.calls, []
    ours = hooks.all_gather_in_seq_order(cp.cp_utils.cp_all_gather_rerange_output, rows, n, fb, stream)
    assert same_bytes(ours, theirs)
    assert group.calls == their_calls and len(their_calls) == 1
    assert cp.launches == [1] and not cp.pool.context.kernels.failed


def test_failing_kernel_falls_back_after_the_same_all_gather(cp):
    rows, fb, group, n = batch(cp, 11, 576)
    stream = torch.cuda.current_stream()
    theirs = cp.cp_utils.cp_all_gather_rerange_output(rows, n, fb, stream)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    cp.monkeypatch.setattr(K, "rerange_rows", broken)
    for _ in range(2):  # the failing launch, then the remembered fallback
        group.calls = []
        ours = hooks.all_gather_in_seq_order(cp.cp_utils.cp_all_gather_rerange_output, rows, n, fb, stream)
        assert same_bytes(ours, theirs) and len(group.calls) == 1
    # this rank's failure waits for the CP group's agreement point (forward/agreement.py), which
    # this single hook call does not reach; test_rank_agreement.py runs the group's decision
    kernels = cp.pool.context.kernels
    assert set(kernels.failed_here) == {"rerange_in_seq"} and kernels.failed == set()


def test_debug_mode_runs_sglang(cp):
    rows, fb, group, n = batch(cp, 12, 128)
    cp.monkeypatch.setenv(DEBUG_ENV, "1")
    called = []

    def original(*args):
        called.append(args)
        return cp.cp_utils.cp_all_gather_rerange_output(*args)

    hooks.all_gather_in_seq_order(original, rows, n, fb, None)
    assert len(called) == 1 and cp.launches == []
