"""What one shared-KV forward carries from hook to hook, in one object.

:func:`.steps.begin_forward` creates a :class:`ForwardInFlight` for a batch that shares KV
and hangs it on the pool as ``pool.in_flight`` (the pool's one per-forward attribute: SGLang
hands the hooks the pool, not the forward); :func:`.steps.end_forward` drops it, also when
the forward failed. Nothing of it outlives its forward, so a failed forward cannot leak a
view, a prefetched gather or a local-writes decision into the next one.

The pool reads two fields and nothing else (it imports nothing from ``forward/``):
``mla_view`` and ``index_view``, the ``(layer_id, dense)`` scratch SGLang's kernels read
through ``get_key_buffer`` and the index readers while a layer attends.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from sglang_cp_shared_kv.forward.agreement import ForwardAgreement
from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.scoped import attributes_set

#: (layer_id, dense scratch) of one layer
LayerView = Tuple[int, torch.Tensor]


@dataclass(eq=False)
class ForwardInFlight:
    """The state of one shared-KV forward between its hooks (module docstring)."""

    batch_state: CpSharedBatchState
    agreement: ForwardAgreement
    #: the layer's dense MLA view, read by SGLang's attention (``pool.get_key_buffer``)
    mla_view: Optional[LayerView] = None
    #: the layer's dense index K/scale view, read by SGLang's indexer
    index_view: Optional[LayerView] = None
    #: the next layer's MLA history being gathered (a :class:`.materialize.MlaHistory`)
    # NOTE: typed Any here and below: materialize and local_writes_v0512 read this object,
    # and the package's import graph (which counts TYPE_CHECKING imports) stays acyclic
    prefetched: Any = None
    #: (the batch's CP metadata, its :class:`.local_writes_v0512.LocalWrites`), decided at
    #: its first layer (0.5.12.post1's in-seq split; None before and on 0.5.23)
    local_writes: Optional[Tuple[Any, Any]] = None
    #: within ``Indexer._get_q_k_bf16`` of a local-writes forward: SGLang's in-seq
    #: all-gather returns this rank's rows as they are
    gathers_kept_local: bool = False

    # ------------------------------------------------------------------ views
    def set_mla_view(self, layer_id: int, dense: torch.Tensor) -> None:
        self.mla_view = (layer_id, dense)

    def set_index_view(self, layer_id: int, dense: torch.Tensor) -> None:
        self.index_view = (layer_id, dense)

    def clear_views(self) -> None:
        self.mla_view = None
        self.index_view = None

    @contextmanager
    def gathers_in_seq_kept_local(self):
        """Within the block, SGLang's in-seq all-gather returns this rank's rows as they
        are (the index key of a local-writes forward, :mod:`.local_writes_v0512`)."""
        with attributes_set(self, gathers_kept_local=True):
            yield

    # --------------------------------------------------------------- prefetch
    def put_prefetched(self, history) -> None:
        """Keep the next layer's MLA history until it is taken."""
        self.prefetched = history

    def take_prefetched(self, layer_id: int):
        """The MLA history prefetched for ``layer_id`` (None if there is none for it). One
        prefetched for another layer (the layers ran out of order) is recorded for the
        forward's agreement point and taken all the same: its gather was issued on every
        rank, so taking it keeps this rank's collectives in step with the group's."""
        history, self.prefetched = self.prefetched, None
        if history is not None and history.layer_id != layer_id:
            self.agreement.record(
                "prefetch_layer", f"layer {layer_id} found layer {history.layer_id}'s prefetched history; the "
                "layers ran out of order", layer_id)
        return history
