"""What every release's shared-KV pool does the same way: physical buffers behind a logical,
N-times-larger address space, read through dense views, written only where this rank owns.

:class:`CpSharedPoolMixin` goes first in the bases of each release's pool class, before
SGLang's own DSA/NSA pool (``pool.CpSharedNSATokenToKVPool`` on 0.5.12.post1,
``pool_dsa.CpSharedDSATokenToKVPool`` on 0.5.23), so its methods replace SGLang's:

* ``size`` is the logical capacity (SGLang bounds-checks page tables against it and every
  page table carries logical locations); the buffers hold ``physical_size`` tokens;
* ``get_key_buffer`` and the index readers serve the layer's *dense view* (the
  materialized scratch the remapped page tables address) and refuse when there is none,
  rather than read physical rows with dense or logical locations;
* index writes go to the buffer :meth:`index_writes_into` names for one store (this rank's
  physical pages, or the dense view);
* what one forward carries between hooks (batch state, dense views, prefetched history,
  local-writes decision) is not the pool's: it is ``in_flight`` (``forward.in_flight``),
  one object set at the batch's start and dropped at its end; the pool reads its two
  views and imports nothing from ``forward/``;
* the shard of a layer is read after HiCache's load-back of that layer, as SGLang's getters
  wait for it (:meth:`physical_kv_buffer`);
* paths that address rows by location (host offload, non-MLA writes) refuse.

What differs per release -- the constructor's arguments, the MLA store's signature and
SGLang's own store into an arbitrary buffer (:meth:`stock_store_mla_rows`) -- is the
release's class. SGLang's index-K kernels are the table's ``index_k_ops`` (the same
``GetKAndS`` / ``SetKAndS`` interface on both releases).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Optional, Tuple

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.scoped import attributes_set


class CpSharedPoolMixin:
    """The release-independent half of a shared-KV pool (module docstring)."""

    bound_context: ClassVar[Optional[CpSharedKVContext]] = None

    @classmethod
    def bound_to(cls, context: CpSharedKVContext) -> type:
        """A subclass whose instances use ``context`` (SGLang constructs the pool itself)."""
        return type(cls.__name__, (cls,), {"bound_context": context, "__module__": cls.__module__})

    def _physical_size_for(self, size: int, page_size: int, context: Optional[CpSharedKVContext],
                           index_buf_size: Optional[int]) -> int:
        """Before SGLang's constructor: bind the context, return the physical token count
        behind ``size`` logical tokens."""
        context = context or self.bound_context
        if context is None:
            raise TypeError(f"{type(self).__name__} needs a CpSharedKVContext (context= or bound_to())")
        layout = context.layout
        if layout.page_size != page_size:
            raise ValueError(f"layout page size {layout.page_size} != pool page size {page_size}")
        if index_buf_size is not None and index_buf_size != size:
            raise ValueError(
                f"index_buf_size={index_buf_size} differs from the pool size {size}; "
                "only HiSparse sets it, and HiSparse is not supported with shared KV"
            )
        self.context = context
        self.physical_size = layout.physical_tokens(size)
        return self.physical_size

    def _expose_logical_size(self, size: int) -> None:
        """After SGLang's constructor: SGLang bounds-checks logical page tables against
        ``size``; the buffers stay physical. Starts with no batch in flight."""
        self.size = size
        self.logical_size = size
        #: the forward in flight (a ``forward.in_flight.ForwardInFlight``; None between forwards)
        self.in_flight: Any = None
        # NOTE: set only inside index_writes_into's block (one store call), never across hooks
        self._index_write_target: Optional[Tuple[int, torch.Tensor]] = None

    @property
    def cp_layout(self):
        """This rank's layout (the context's)."""
        return self.context.layout

    def physical_kv_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_load_back(layer_id)
        return self.kv_buffer[layer_id - self.start_layer]

    def physical_index_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_for_load_back(layer_id)
        return self.index_k_with_scale_buffer[layer_id - self.start_layer]

    def _wait_for_load_back(self, layer_id: int) -> None:
        """The current stream waits for HiCache's load-back of ``layer_id`` into this rank's
        buffers, as SGLang's own getters do (a no-op without a load-back in flight)."""
        counter = getattr(self, "layer_transfer_counter", None)
        if counter is not None:
            counter.wait_until(layer_id - self.start_layer)

    def mla_view(self, layer_id: int) -> torch.Tensor:
        """The dense MLA view of ``layer_id`` the forward in flight materialized."""
        return self._view(None if self.in_flight is None else self.in_flight.mla_view, layer_id, "the MLA KV")

    def index_view(self, layer_id: int, what: str = "the index K and scale") -> torch.Tensor:
        """The dense index K/scale view of ``layer_id`` the forward in flight materialized."""
        return self._view(None if self.in_flight is None else self.in_flight.index_view, layer_id, what)

    @staticmethod
    def _view(view, layer_id: int, what: str) -> torch.Tensor:
        if view is None or view[0] != layer_id:
            raise RuntimeError(
                f"{FLAG}: {what} of layer {layer_id} read without a materialized dense view; "
                "a shared-KV rank cannot read the sequence from its own shard"
            )
        return view[1]

    # ---------------------------------------------------------------- MLA rows
    def stock_store_mla_rows(self, layer, buffer: torch.Tensor, locs: torch.Tensor, k_nope: torch.Tensor,
                             k_rope: torch.Tensor) -> None:
        """SGLang's own MLA store (fp8 quantisation included) of row i at ``locs[i]`` of
        ``buffer``: the bytes a stock pool holds for these rows (the release's class)."""
        raise NotImplementedError

    @property
    def stores_packed_fp8(self) -> bool:
        """Whether SGLang stores the latent as packed fp8 bytes with scales (the release's class)."""
        raise NotImplementedError

    def get_key_buffer(self, layer_id: int):
        dense = self.mla_view(layer_id)
        return dense.view(self.dtype) if self.store_dtype != self.dtype else dense

    def get_value_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    # ------------------------------------------------------------- index rows
    @contextmanager
    def index_writes_into(self, layer_id: int, buffer: torch.Tensor):
        """Within the block, the index stores of ``layer_id`` write into ``buffer``."""
        with attributes_set(self, _index_write_target=(layer_id, buffer)):
            yield

    @property
    def directs_index_writes(self) -> bool:
        """Within :meth:`index_writes_into`: an index store the plugin itself issued."""
        return self._index_write_target is not None

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        target = self._index_write_target
        if target is None or target[0] != layer_id:
            raise RuntimeError(
                f"{FLAG}: the raw index buffer of layer {layer_id} requested outside a shared-KV "
                "index store (decode / speculative paths are not supported on a shared-KV rank)"
            )
        return target[1]

    def set_index_k_scale_buffer(self, layer_id, loc, index_k, index_k_scale) -> None:
        sg.index_k_ops.SetKAndS.execute(
            pool=self, buf=self.get_index_k_with_scale_buffer(layer_id), loc=loc,
            index_k=index_k, index_k_scale=index_k_scale,
        )

    def get_index_k_scale_buffer(self, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len):
        buf = self.index_view(layer_id)
        return sg.index_k_ops.GetKAndS.execute(
            self, buf, page_indices=page_indices, seq_len_tensor=seq_len_tensor,
            seq_len_sum=seq_len_sum, max_seq_len=max_seq_len,
        )

    # ------------------------------------------- paths that would misuse logical locations
    def _refuse(self, what: str):
        raise NotImplementedError(f"{FLAG}: {what} is not supported on a shared-KV prefill rank")

    def get_mla_kv_buffer(self, *args, **kwargs):
        self._refuse("reading MLA rows by location (get_mla_kv_buffer)")

    def set_kv_buffer(self, *args, **kwargs):
        self._refuse("set_kv_buffer (non-MLA writes)")

    def get_cpu_copy(self, *args, **kwargs):
        self._refuse("offloading KV to host by location (retract/offload)")

    def load_cpu_copy(self, *args, **kwargs):
        self._refuse("loading KV from host by location")

    def move_kv_cache(self, *args, **kwargs):
        self._refuse("moving KV rows by location (move_kv_cache)")
