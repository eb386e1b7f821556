"""NVTX ranges: off by default and then nothing is pushed; on, one named range per use."""

import torch

from sglang_cp_shared_kv.observability import nvtx
from sglang_cp_shared_kv.settings.config import NVTX_ENV


def _recording(monkeypatch):
    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return pushed


def test_off_pushes_nothing(monkeypatch):
    monkeypatch.delenv(NVTX_ENV, raising=False)
    pushed = _recording(monkeypatch)
    for _ in range(3):
        with nvtx.marked("materialize:mla:gather"):
            pass
    assert pushed == []
    assert nvtx.marked("a") is nvtx.marked("b")  # one shared no-op context, nothing allocated per use


def test_on_pushes_one_named_range(monkeypatch):
    monkeypatch.setenv(NVTX_ENV, "1")
    pushed = _recording(monkeypatch)
    with nvtx.marked("owner_write"):
        pushed.append("work")
    assert pushed == ["cp_shared_kv:owner_write", "work", "pop"]


def test_on_without_a_gpu_pushes_nothing(monkeypatch):
    monkeypatch.setenv(NVTX_ENV, "1")
    pushed = _recording(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with nvtx.marked("owner_write"):
        pass
    assert pushed == []


def test_a_pd_write_marks_each_batch_once(monkeypatch):
    """The prefill side's Mooncake write (``PrefillShardTransfer.write``, split into bounded
    batches) pushes one ``pd:batch`` range around each batch's write and nothing else."""
    from sglang_cp_shared_kv.transfer.prefill import PrefillShardTransfer
    from sglang_cp_shared_kv.transfer.stats import TransferStats

    monkeypatch.setenv(NVTX_ENV, "1")
    pushed = _recording(monkeypatch)
    # NOTE: built without a Mooncake manager: a successful write reads only these two
    transfer = PrefillShardTransfer.__new__(PrefillShardTransfer)
    transfer.max_descriptors_per_batch, transfer.stats = 3, TransferStats()

    def engine_write(kv_mgr, session, batch):
        pushed.append(f"write {len(batch)}")
        return 0

    blocks = [(i, 100 + i, 10) for i in range(7)]
    assert transfer.write(engine_write, None, "peer", blocks) == 0
    assert pushed == ["cp_shared_kv:pd:batch", "write 3", "pop"] * 2 + ["cp_shared_kv:pd:batch", "write 1", "pop"]
