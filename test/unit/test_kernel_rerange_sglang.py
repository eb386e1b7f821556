"""The in-seq re-range (kernel fallback and segment list) equals SGLang's own
``cp_all_gather_rerange_output`` on CPU: SGLang's metadata from
``prepare_context_parallel_metadata``, SGLang's split/cat, with only the collective
replaced by a stand-in that writes a known all-gather output."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv_testing.support import sglang_cp_utils_on_cpu

K = pytest.importorskip("sglang_cp_shared_kv_kernel")


class _GatherStandIn:
    """The attention-CP group: its all-gather writes ``gathered`` into the output."""

    def __init__(self, gathered):
        self.gathered = gathered

    def cp_all_gather_into_tensor_async(self, output, input_, stream):
        output.copy_(self.gathered)


@pytest.fixture
def sglang_cp(monkeypatch):
    cp_utils = sglang_cp_utils_on_cpu(monkeypatch)
    monkeypatch.setattr(cp_utils, "is_allocation_symmetric", lambda: False)
    monkeypatch.setattr(cp_utils, "use_symmetric_memory", lambda *a, **k: nullcontext())
    return cp_utils, monkeypatch


@pytest.mark.parametrize("n,total", [(n, t) for n in range(1, 9) for t in (3, 16, 37, 129) if t >= n])
def test_rerange_equals_sglang_cp_all_gather_rerange_output(sglang_cp, n, total):
    cp_utils, monkeypatch = sglang_cp
    metadata = cp_utils.prepare_context_parallel_metadata(total, 0, n, [total])
    gathered = torch.randn(n * -(-total // n), 7).bfloat16()
    monkeypatch.setattr(cp_utils, "get_attention_cp_group", lambda: _GatherStandIn(gathered))
    rank_rows = gathered[: -(-total // n)]
    theirs = cp_utils.cp_all_gather_rerange_output(rank_rows, n, SimpleNamespace(attn_cp_metadata=metadata), None)

    lists = (metadata.max_rank_len, metadata.per_rank_actual_token, metadata.reverse_split_len,
             metadata.cp_reverse_index)
    assert torch.equal(K.rerange_in_seq_reference(gathered, *lists), theirs)
    assert torch.equal(KernelDispatch().rerange_in_seq(gathered, metadata), theirs)  # CPU: the fallback
    out = torch.empty_like(theirs)
    for src, dst, rows in K.in_seq_segments(*lists):
        out[dst:dst + rows] = gathered[src:src + rows]
    assert torch.equal(out, theirs)
