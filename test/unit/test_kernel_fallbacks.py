"""sglang_cp_shared_kv.kernels: when the Triton kernel runs, when the fallback does, and
what gets logged (one warning per failing kernel or missing package, nothing on success)."""

import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv import kernels
from sglang_cp_shared_kv.config import DEBUG_ENV

LOGGER = "sglang_cp_shared_kv.kernels"


@pytest.fixture(autouse=True)
def fresh_dispatch(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    kernels.reset_for_tests()
    yield
    kernels.reset_for_tests()


@pytest.fixture
def on_cuda(monkeypatch):
    """Dispatch as if the tensors lived on a CUDA device."""
    monkeypatch.setattr(kernels, "_all_on_cuda", lambda tensors: True)


class FakePackage:
    """Records kernel calls; ``broken`` names kernels that raise."""

    def __init__(self, broken=()):
        self.calls = []
        self.broken = set(broken)

    def __getattr__(self, name):
        def kernel(*args, **kwargs):
            self.calls.append(name)
            if name in self.broken:
                raise RuntimeError(f"{name} exploded")
            return "kernel-result"
        return kernel


def _install(monkeypatch, package):
    monkeypatch.setattr(kernels, "_package_module", package)
    return package


def _mla_args(n=4):
    latent = torch.randn(n, 576).bfloat16()
    return (torch.zeros(8, 1, 576, dtype=torch.bfloat16), torch.arange(n), torch.arange(n) + 2,
            latent[:, :512], latent[:, 512:])


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_cpu_tensors_take_the_fallback_silently(monkeypatch, caplog):
    package = _install(monkeypatch, FakePackage())
    stock = []
    kernels.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: stock.append(1))
    pages = torch.arange(12, dtype=torch.int64).view(4, 3)
    assert torch.equal(kernels.pack_pages(pages, torch.tensor([2, 0])), pages[[2, 0]])
    assert stock == [1] and package.calls == [] and not warnings_of(caplog)


def test_cuda_tensors_run_the_kernels_and_log_nothing(on_cuda, monkeypatch, caplog):
    package = _install(monkeypatch, FakePackage())
    stock = []
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    kernels.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: stock.append(1))
    kernels.store_mla_rows(*_mla_args(), packed_fp8=True, stock=lambda: stock.append(1))
    kernels.store_index_rows(torch.zeros(2, 64 * 132, dtype=torch.uint8), None, torch.arange(3),
                             torch.zeros(3, 128), stock=lambda: stock.append(1))
    assert kernels.pack_pages(torch.zeros(3, 2, dtype=torch.int64), torch.tensor([1])) == "kernel-result"
    assert kernels.remap_locs(torch.arange(3), torch.zeros(4, dtype=torch.int32), 64) == "kernel-result"
    assert kernels.build_page_inverse(torch.tensor([1]), torch.tensor([1]), 4) == "kernel-result"
    assert package.calls == ["store_mla_rows", "store_mla_rows_fp8", "store_index_rows", "pack_pages",
                             "remap_locs", "build_page_inverse"]
    assert stock == [] and not [r for r in caplog.records if r.name == LOGGER]


def test_a_failing_kernel_warns_once_then_falls_back_silently(on_cuda, monkeypatch, caplog):
    package = _install(monkeypatch, FakePackage(broken={"store_mla_rows"}))
    stock = []
    for _ in range(3):
        kernels.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: stock.append(1))
    assert stock == [1, 1, 1]
    assert package.calls == ["store_mla_rows"], "a kernel that raised is not tried again"
    (warning,) = warnings_of(caplog)
    assert "store_mla_rows" in warning.getMessage() and "exploded" in warning.getMessage()
    # the other kernels keep running
    kernels.store_mla_rows(*_mla_args(), packed_fp8=True, stock=lambda: stock.append(1))
    assert package.calls[-1] == "store_mla_rows_fp8" and stock == [1, 1, 1]


def test_a_failing_kernel_result_comes_from_the_fallback(on_cuda, monkeypatch, caplog):
    _install(monkeypatch, FakePackage(broken={"pack_pages", "remap_locs"}))
    pages = torch.arange(20, dtype=torch.int64).view(5, 4)
    assert torch.equal(kernels.pack_pages(pages, torch.tensor([4, 1])), pages[[4, 1]])
    inverse = torch.tensor([0, 3, 0], dtype=torch.int32)
    assert kernels.remap_locs(torch.tensor([64 + 5, -1]), inverse, 64).tolist() == [3 * 64 + 5, -1]
    assert len(warnings_of(caplog)) == 2


def test_debug_mode_runs_the_checked_path(on_cuda, monkeypatch, caplog):
    package = _install(monkeypatch, FakePackage())
    monkeypatch.setenv(DEBUG_ENV, "1")
    stock = []
    kernels.store_index_rows(torch.zeros(2, 64 * 132, dtype=torch.uint8), torch.tensor([0]), torch.tensor([64]),
                             torch.zeros(1, 128), stock=lambda: stock.append(1))
    assert stock == [1] and package.calls == [] and not warnings_of(caplog)


def test_missing_package_warns_once_on_cuda_and_falls_back(on_cuda, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, kernels.PACKAGE, None)  # import raises ImportError
    stock = []
    for _ in range(2):
        kernels.store_mla_rows(*_mla_args(), packed_fp8=True, stock=lambda: stock.append(1))
        pages = torch.arange(12, dtype=torch.int64).view(4, 3)
        assert torch.equal(kernels.pack_pages(pages, torch.tensor([3, 3])), pages[[3, 3]])
        seq_pages, dense_page = torch.tensor([4, 2]), torch.tensor([1, 2])
        inverse = kernels.build_page_inverse(seq_pages, dense_page, 6)
        assert inverse.dtype == torch.int32 and inverse.tolist() == [0, 0, 2, 0, 1, 0]
        metadata = SimpleNamespace(max_rank_len=[2, 2], per_rank_actual_token=[2, 1],
                                   reverse_split_len=[1, 1, 1, 0], cp_reverse_index=[0, 2, 3, 1])
        gathered = torch.tensor([[10], [13], [11], [99]])
        assert kernels.rerange_in_seq(gathered, metadata).flatten().tolist() == [10, 11, 13]
    assert stock == [1, 1]
    (warning,) = warnings_of(caplog)
    assert "not importable" in warning.getMessage()


def test_missing_package_on_cpu_is_not_worth_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, kernels.PACKAGE, None)
    kernels.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: None)
    kernels.remap_locs(torch.arange(3), torch.zeros(1, dtype=torch.int32), 64)
    assert not warnings_of(caplog)


def test_empty_stores_do_nothing(on_cuda, monkeypatch):
    package = _install(monkeypatch, FakePackage())
    empty = torch.zeros(0, dtype=torch.int64)
    buffer, _, _, k_nope, k_rope = _mla_args()
    kernels.store_mla_rows(buffer, empty, empty, k_nope, k_rope, packed_fp8=False, stock=pytest.fail)
    kernels.store_index_rows(torch.zeros(1, 64 * 132, dtype=torch.uint8), empty, empty, torch.zeros(0, 128),
                             stock=pytest.fail)
    assert package.calls == []


def test_rerange_builds_its_segment_table_once_per_metadata(on_cuda, monkeypatch):
    import sglang_cp_shared_kv_kernel as real

    built = []

    class Package(FakePackage):
        in_seq_segments = staticmethod(lambda *lists: built.append(lists) or real.in_seq_segments(*lists))
        segment_table = staticmethod(real.segment_table)

        def rerange_rows(self, gathered, table, longest, total, out=None):
            return real.rerange_in_seq_reference(gathered, *built[-1])

    _install(monkeypatch, Package())
    metadata = SimpleNamespace(max_rank_len=[3, 3], per_rank_actual_token=[3, 2],
                               reverse_split_len=[2, 1, 1, 1], cp_reverse_index=[0, 2, 3, 1])
    gathered = torch.arange(6).view(6, 1)
    first = kernels.rerange_in_seq(gathered, metadata)
    second = kernels.rerange_in_seq(gathered, metadata)
    assert torch.equal(first, second) and len(built) == 1
    metadata.per_rank_actual_token = [3, 3]  # a changed plan is noticed
    metadata.reverse_split_len = [2, 1, 2, 1]
    kernels.rerange_in_seq(gathered, metadata)
    assert len(built) == 2
