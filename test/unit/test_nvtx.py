"""NVTX ranges: off by default and then nothing is pushed; on, one named range per use."""

import torch

from sglang_cp_shared_kv import nvtx
from sglang_cp_shared_kv.config import NVTX_ENV


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
