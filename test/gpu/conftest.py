"""GPU tests: marked ``gpu`` and skipped where no CUDA device is present.

On the lent GPU machine the checkout's ``python/`` and ``sgl-kernel/python/`` are on
PYTHONPATH (``scripts/gpu_session.sh``); elsewhere the editable install provides them."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
