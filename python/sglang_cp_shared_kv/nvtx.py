"""NVTX ranges around the plugin's work, so Nsight Systems shows its cost beside SGLang's own
ranges. Off by default; ``SGLANG_CP_SHARED_KV_NVTX=1`` turns them on. Off, :func:`marked`
returns a shared no-op context: no range is pushed, no CUDA call is made.

Ranges (all named ``cp_shared_kv:<what>``): ``batch_state``, ``owner_write``,
``materialize:pack+gather`` (a history gather), ``materialize:current`` (a current-region
gather: local writes, a full view), ``materialize:chunk``, ``prefetch:issue``,
``prefetch:wait``, ``pd:batch``. A range given the rank's :class:`..stage_timer.StageTimer` is also timed
(device time per stage, read inside the server; see that module).
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


@contextmanager
def _pushed_and_timed(name: str, timer) -> Iterator[None]:
    with _pushed(name), timer.span(name):
        yield


def marked(name: str, timer=None) -> ContextManager[None]:
    """An NVTX range named ``cp_shared_kv:<name>`` while enabled (timed as ``name`` by
    ``timer`` when one is given), else nothing at all."""
    if not nvtx_enabled():
        return _OFF
    return _pushed(name) if timer is None else _pushed_and_timed(name, timer)
