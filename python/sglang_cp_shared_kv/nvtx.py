"""NVTX ranges around the plugin's work, so Nsight Systems shows its cost beside SGLang's own
ranges. Off by default; ``SGLANG_CP_SHARED_KV_NVTX=1`` turns them on. Off, :func:`marked`
returns a shared no-op context: no range is pushed, no CUDA call is made.

Ranges (all named ``cp_shared_kv:<what>``): ``batch_state``, ``owner_write``,
``materialize:pack+gather``, ``materialize:chunk``, ``prefetch:issue``, ``prefetch:wait``,
``pd:batch``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

from sglang_cp_shared_kv.config import nvtx_enabled

_OFF = nullcontext()


@contextmanager
def _pushed(name: str) -> Iterator[None]:
    import torch

    if not torch.cuda.is_available():  # nothing to mark without a GPU
        yield
        return
    torch.cuda.nvtx.range_push(f"cp_shared_kv:{name}")
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def marked(name: str) -> ContextManager[None]:
    """An NVTX range named ``cp_shared_kv:<name>`` while enabled, else nothing at all."""
    return _pushed(name) if nvtx_enabled() else _OFF
