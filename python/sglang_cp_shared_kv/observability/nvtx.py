"""NVTX ranges around the plugin's work, so Nsight Systems shows its cost beside SGLang's own
ranges. Off by default; ``SGLANG_CP_SHARED_KV_NVTX=1`` turns them on. Off, :func:`marked`
returns a shared no-op context: no range is pushed, no CUDA call is made.

Ranges (all named ``cp_shared_kv:<what>``), leaves unless said otherwise:

* ``batch_state``: the forward's batch state (page map, dense page tables);
* ``materialize:<kind>:view``, ``...:pack``, ``...:gather``, ``...:current`` with ``<kind>``
  ``index`` or ``mla``: allocating the dense view; packing this rank's owned history pages
  (none when they are one run of its shard); the history all-gather; the pack and
  all-gather of a current region (local writes, a full view), which no prefetch can hide
  (:class:`.forward.materialize.GatherStages`);
* ``materialize:chunk``: the chunk's MLA rows stored into the view;
* ``owner_write``: this rank's owned rows into its shard;
* ``prefetch:issue``: a container around the next layer's asynchronous MLA history
  (its ``materialize:mla:view``, ``...:pack`` and ``...:gather`` inside it);
* ``prefetch:wait``: the compute stream waiting for a prefetched history;
* ``pd:batch``: one batch of a PD transfer (not timed).

A range given the rank's :class:`..stage_timer.StageTimer` is also timed (device time per
stage, read inside the server; see that module). NOTE: for an asynchronous (prefetch)
gather, ``materialize:mla:gather`` spans only its launch on the compute stream; the part
of it the compute stream is exposed to is ``prefetch:wait``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

from sglang_cp_shared_kv.settings.config import nvtx_enabled

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
