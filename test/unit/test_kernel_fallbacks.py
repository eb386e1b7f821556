"""sglang_cp_shared_kv.kernels: when the Triton kernel runs, when its reference (or, for the
stores, SGLang's own store) does, and what gets logged (one warning per failing kernel,
nothing on success). A kernel that raised runs its reference on this rank until the CP
group agrees (``failed_here``), then on every rank (``failed``: test_rank_agreement.py)."""

import logging
import sys
from types import SimpleNamespace

import pytest
import torch

import sglang_cp_shared_kv_kernel as real_package
from sglang_cp_shared_kv import kernels
from sglang_cp_shared_kv.settings.config import DEBUG_ENV
from sglang_cp_shared_kv.kernels import KernelDispatch, KernelPackageMissing

LOGGER = "sglang_cp_shared_kv.kernels"


@pytest.fixture(autouse=True)
def debug_off(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)


class FakePackage:
    """Records kernel calls (``broken`` names kernels that raise); the references are the
    real package's, so a fallback computes the real result."""

    def __init__(self, broken=()):
        self.calls = []
        self.broken = set(broken)

    def __getattr__(self, name):
        if name.endswith("_reference"):
            return getattr(real_package, name)

        def kernel(*args, **kwargs):
            self.calls.append(name)
            if name in self.broken:
                raise RuntimeError(f"{name} exploded")
            return "kernel-result"
        return kernel


def _install(monkeypatch, package, on_cuda=False):
    """A dispatch whose kernel package is ``package``; ``on_cuda``: dispatch as if the
    tensors lived on a CUDA device."""
    monkeypatch.setattr(kernels, "kernel_package", lambda: package)
    if on_cuda:
        monkeypatch.setattr(kernels, "_all_on_cuda", lambda tensors: True)
    return KernelDispatch()


def _mla_args(n=4):
    latent = torch.randn(n, 576).bfloat16()
    return (torch.zeros(8, 1, 576, dtype=torch.bfloat16), torch.arange(n), torch.arange(n) + 2,
            latent[:, :512], latent[:, 512:])


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_cpu_tensors_take_the_fallback_silently(monkeypatch, caplog):
    package = FakePackage()
    dispatch = _install(monkeypatch, package)
    stock = []
    dispatch.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: stock.append(1))
    pages = torch.arange(12, dtype=torch.int64).view(4, 3)
    assert torch.equal(dispatch.pack_pages(pages, torch.tensor([2, 0])), pages[[2, 0]])
    assert stock == [1] and package.calls == [] and not warnings_of(caplog)


def test_cuda_tensors_run_the_kernels_and_log_nothing(monkeypatch, caplog):
    package = FakePackage()
    dispatch = _install(monkeypatch, package, on_cuda=True)
    stock = []
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    dispatch.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: stock.append(1))
    dispatch.store_mla_rows(*_mla_args(), packed_fp8=True, stock=lambda: stock.append(1))
    dispatch.store_index_rows(torch.zeros(2, 64 * 132, dtype=torch.uint8), None, torch.arange(3),
                              torch.zeros(3, 128), stock=lambda: stock.append(1))
    assert dispatch.pack_pages(torch.zeros(3, 2, dtype=torch.int64), torch.tensor([1])) == "kernel-result"
    assert dispatch.remap_locs(torch.arange(3), torch.zeros(4, dtype=torch.int32), 64) == "kernel-result"
    assert dispatch.build_page_inverse(torch.tensor([1]), torch.tensor([1]), 4) == "kernel-result"
    rows = torch.zeros(4, 1, 576, dtype=torch.bfloat16)
    dispatch.copy_mla_rows(rows, torch.tensor([1]), rows, torch.tensor([2]))
    index = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    dispatch.copy_index_rows(index, torch.tensor([1]), index, torch.tensor([70]))
    assert package.calls == ["store_mla_rows", "store_mla_rows_fp8", "store_index_rows", "pack_pages",
                             "remap_locs", "build_page_inverse", "copy_mla_rows", "copy_index_rows"]
    assert stock == [] and not [r for r in caplog.records if r.name == LOGGER]


def test_a_failing_kernel_warns_once_then_falls_back_silently(monkeypatch, caplog):
    package = FakePackage(broken={"store_mla_rows"})
    dispatch = _install(monkeypatch, package, on_cuda=True)
    stock = []
    for _ in range(3):
        dispatch.store_mla_rows(*_mla_args(), packed_fp8=False, stock=lambda: stock.append(1))
    assert stock == [1, 1, 1]
    assert package.calls == ["store_mla_rows"], "a kernel that raised is not tried again"
    (warning,) = warnings_of(caplog)
    assert "store_mla_rows" in warning.getMessage() and "exploded" in warning.getMessage()
    # this rank's failure, with its cause, waits for the group's agreement point
    assert dispatch.failed_here == {"store_mla_rows": "RuntimeError: store_mla_rows exploded"}
    assert dispatch.failed == set()
    # the other kernels keep running
    dispatch.store_mla_rows(*_mla_args(), packed_fp8=True, stock=lambda: stock.append(1))
    assert package.calls[-1] == "store_mla_rows_fp8" and stock == [1, 1, 1]


def test_a_failing_kernel_result_comes_from_its_reference(monkeypatch, caplog):
    dispatch = _install(monkeypatch, FakePackage(broken={"pack_pages", "remap_locs"}), on_cuda=True)
    pages = torch.arange(20, dtype=torch.int64).view(5, 4)
    assert torch.equal(dispatch.pack_pages(pages, torch.tensor([4, 1])), pages[[4, 1]])
    inverse = torch.tensor([0, 3, 0], dtype=torch.int32)
    assert dispatch.remap_locs(torch.tensor([64 + 5, -1]), inverse, 64).tolist() == [3 * 64 + 5, -1]
    assert len(warnings_of(caplog)) == 2


def test_failures_belong_to_one_dispatch(monkeypatch, caplog):
    """Two engines (or test configurations) in one process keep their own fallback sets."""
    package = FakePackage(broken={"pack_pages"})
    first = _install(monkeypatch, package, on_cuda=True)
    second = KernelDispatch()
    pages = torch.arange(20, dtype=torch.int64).view(5, 4)
    first.pack_pages(pages, torch.tensor([1]))
    assert set(first.failed_here) == {"pack_pages"} and second.failed_here == {}
    package.broken.clear()
    assert second.pack_pages(pages, torch.tensor([1])) == "kernel-result"
    assert torch.equal(first.pack_pages(pages, torch.tensor([1])), pages[[1]])  # still on its reference


def test_debug_mode_runs_the_checked_path(monkeypatch, caplog):
    package = FakePackage()
    dispatch = _install(monkeypatch, package, on_cuda=True)
    monkeypatch.setenv(DEBUG_ENV, "1")
    stock = []
    dispatch.store_index_rows(torch.zeros(2, 64 * 132, dtype=torch.uint8), torch.tensor([0]), torch.tensor([64]),
                              torch.zeros(1, 128), stock=lambda: stock.append(1))
    assert stock == [1] and package.calls == [] and not warnings_of(caplog)


def test_the_references_are_the_kernel_packages_own():
    """The fallbacks are the package's ``*_reference`` functions (no second copy here)."""
    dispatch = KernelDispatch()
    pages = torch.arange(12, dtype=torch.int64).view(4, 3)
    assert torch.equal(dispatch.pack_pages(pages, torch.tensor([3, 3])), pages[[3, 3]])
    seq_pages, dense_page = torch.tensor([4, 2]), torch.tensor([1, 2])
    inverse = dispatch.build_page_inverse(seq_pages, dense_page, 6)
    assert inverse.dtype == torch.int32 and inverse.tolist() == [0, 0, 2, 0, 1, 0]
    metadata = SimpleNamespace(max_rank_len=[2, 2], per_rank_actual_token=[2, 1],
                               reverse_split_len=[1, 1, 1, 0], cp_reverse_index=[0, 2, 3, 1])
    gathered = torch.tensor([[10], [13], [11], [99]])
    assert dispatch.rerange_in_seq(gathered, metadata).flatten().tolist() == [10, 11, 13]
    import inspect

    source = inspect.getsource(kernels)
    for reference in ("pack_pages_reference", "build_page_inverse_reference", "remap_locs_reference",
                      "rerange_in_seq_reference", "copy_mla_rows_reference", "copy_index_rows_reference"):
        assert f"package.{reference}(" in source
    assert "index_select" not in source and "torch.cat" not in source and "index_copy_" not in source


def test_a_missing_package_is_an_error_naming_the_fix(monkeypatch):
    """The references ship in the kernel package, so without it there is no fallback:
    the dispatch says so (and startup refuses the flag, test_validation.py)."""
    monkeypatch.setitem(sys.modules, kernels.PACKAGE, None)  # import raises ImportError
    with pytest.raises(KernelPackageMissing, match="reinstall the plugin"):
        KernelDispatch().remap_locs(torch.arange(3), torch.zeros(1, dtype=torch.int32), 64)


def test_empty_stores_do_nothing(monkeypatch):
    package = FakePackage()
    dispatch = _install(monkeypatch, package, on_cuda=True)
    empty = torch.zeros(0, dtype=torch.int64)
    buffer, _, _, k_nope, k_rope = _mla_args()
    dispatch.store_mla_rows(buffer, empty, empty, k_nope, k_rope, packed_fp8=False, stock=pytest.fail)
    dispatch.store_index_rows(torch.zeros(1, 64 * 132, dtype=torch.uint8), empty, empty, torch.zeros(0, 128),
                              stock=pytest.fail)
    assert package.calls == []


def test_rerange_builds_its_segment_table_once_per_metadata(monkeypatch):
    built = []

    class Package(FakePackage):
        in_seq_segments = staticmethod(lambda *lists: built.append(lists) or real_package.in_seq_segments(*lists))
        segment_table = staticmethod(real_package.segment_table)

        def rerange_rows(self, gathered, table, longest, total, out=None):
            return real_package.rerange_in_seq_reference(gathered, *built[-1])

    dispatch = _install(monkeypatch, Package(), on_cuda=True)
    metadata = SimpleNamespace(max_rank_len=[3, 3], per_rank_actual_token=[3, 2],
                               reverse_split_len=[2, 1, 1, 1], cp_reverse_index=[0, 2, 3, 1])
    gathered = torch.arange(6).view(6, 1)
    first = dispatch.rerange_in_seq(gathered, metadata)
    second = dispatch.rerange_in_seq(gathered, metadata)
    assert torch.equal(first, second) and len(built) == 1
    metadata.per_rank_actual_token = [3, 3]  # a changed plan is noticed
    metadata.reverse_split_len = [2, 1, 2, 1]
    dispatch.rerange_in_seq(gathered, metadata)
    assert len(built) == 2


def test_a_kernel_the_group_gave_up_on_is_not_tried(monkeypatch):
    """After the group's decision (``fall_back``) the kernel runs nowhere, even where it would
    not raise, and the decision survives the next agreement point (``failed_here`` cleared)."""
    package = FakePackage()
    dispatch = _install(monkeypatch, package, on_cuda=True)
    dispatch.fall_back("pack_pages")
    dispatch.failed_here.clear()
    pages = torch.arange(20, dtype=torch.int64).view(5, 4)
    assert torch.equal(dispatch.pack_pages(pages, torch.tensor([3])), pages[[3]])
    assert package.calls == []
    with pytest.raises(ValueError, match="unknown kernel"):
        dispatch.fall_back("no_such_kernel")


def test_every_kernel_the_dispatch_runs_is_named_in_kernel_names():
    """The agreement point falls back by the names of KERNEL_NAMES: every name ``_run``
    records must be there (read from the dispatch's own source)."""
    import inspect
    import re

    source = inspect.getsource(KernelDispatch)
    recorded = set(re.findall(r'self\._run\("(\w+)"', source))
    recorded |= set(re.findall(r'"(store_mla_rows(?:_fp8)?)"', source))
    assert recorded and recorded <= set(kernels.KERNEL_NAMES)
    assert len(set(kernels.KERNEL_NAMES)) == len(kernels.KERNEL_NAMES)
