"""GPU tests: marked ``gpu`` and skipped where no CUDA device is present.

The kernel package is importable from the checkout too (the lent GPU machine runs
without the editable install)."""

import sys
from pathlib import Path

import pytest
import torch

try:
    import sglang_cp_shared_kv_kernel  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel" / "python"))


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
