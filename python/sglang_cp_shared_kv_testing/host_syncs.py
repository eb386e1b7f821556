"""Where the plugin makes the host wait for the GPU, counted in the CP harness.

A host synchronisation on CUDA stops the CPU until the GPU has finished everything queued
before it; the kernels after it are then launched onto an idle GPU, one launch latency at a
time, until the CPU is ahead again. In a prefill forward of tens of layers that cost repeats
per layer if a hook synchronises per layer, so the design allows one per forward (the page
map's sizes, read in the batch's first layer, ``forward.dense_layout``) and none after it.

:class:`HostSyncCounter` makes that checkable on CPU, where nothing synchronises but the
same calls are made: while :meth:`HostSyncCounter.counting` is active it wraps the torch
entry points that synchronise on CUDA --

* a value read on the host: ``Tensor.item``, ``.tolist``, ``bool()`` / ``int()`` /
  ``float()`` / ``operator.index()`` of a tensor, ``torch.equal``, ``Tensor.cpu``;
* an output whose size depends on the data: ``nonzero``, ``unique``, ``bincount``,
  ``masked_select``, ``repeat_interleave`` without ``output_size``, indexing with a
  boolean mask --

and counts a call when its direct Python caller is a module of the plugin package (the rigs live in their own).
SGLang's own synchronisations are not counted: they happen with the flag off too. Calls are
filed by the phase the rig reports (:meth:`at_layer`): ``forward start`` (before the first
layer), ``layer 0``, ``later layers``, ``after`` (the rig's own checks).
"""

from __future__ import annotations

import collections
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

import torch

from sglang_cp_shared_kv.scoped import attributes_set

# NOTE: with the separator, so that the rigs' sibling package (sglang_cp_shared_kv_testing)
# does not match the plugin's name as a prefix
_PLUGIN_DIR = str(Path(__file__).resolve().parents[1] / "sglang_cp_shared_kv") + os.sep

#: Tensor methods that read a value on the host or size their output by the data
_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero",
                   "unique", "bincount", "masked_select")
#: torch functions of the same kinds
_TORCH_FUNCTIONS = ("equal", "nonzero", "unique", "bincount", "masked_select")


def _is_bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter:
    """Counts the plugin's host synchronisations by phase and call site (module docstring)."""

    def __init__(self) -> None:
        self.phase = "after"
        self.calls: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def at_layer(self, layer_id: Optional[int], *, forward_start: bool = False) -> None:
        """The rig's report: a forward starts (``forward_start``), layer ``layer_id`` starts,
        or (``None``) the forward's layers are done."""
        if forward_start:
            self.phase = "forward start"
        elif layer_id is None:
            self.phase = "after"
        else:
            self.phase = "layer 0" if layer_id == 0 else "later layers"

    def _count(self, what: str) -> None:
        caller = sys._getframe(2)  # 0: _count, 1: the wrapper, 2: whoever called the torch entry point
        path = caller.f_code.co_filename
        if path.startswith(_PLUGIN_DIR):
            site = f"{Path(path).relative_to(_PLUGIN_DIR)}:{caller.f_lineno} {what}"
            self.calls[self.phase][site] += 1

    def _wrapped(self, what: str, real, *, when=None):
        def wrapper(*args, **kwargs):
            if when is None or when(args, kwargs):
                self._count(what)
            return real(*args, **kwargs)
        return wrapper

    @contextmanager
    def counting(self) -> Iterator["HostSyncCounter"]:
        tensor = {name: self._wrapped(f"Tensor.{name}", getattr(torch.Tensor, name)) for name in _TENSOR_METHODS}
        tensor["repeat_interleave"] = self._wrapped(
            "Tensor.repeat_interleave", torch.Tensor.repeat_interleave,
            when=lambda args, kwargs: kwargs.get("output_size") is None)
        tensor["__getitem__"] = self._wrapped("boolean-mask indexing", torch.Tensor.__getitem__,
                                              when=lambda args, kwargs: _is_bool_mask(args[1]))
        functions = {name: self._wrapped(f"torch.{name}", getattr(torch, name)) for name in _TORCH_FUNCTIONS}
        functions["repeat_interleave"] = self._wrapped(
            "torch.repeat_interleave", torch.repeat_interleave,
            when=lambda args, kwargs: kwargs.get("output_size") is None)
        with attributes_set(torch.Tensor, **tensor), attributes_set(torch, **functions):
            yield self

    def report(self) -> Dict[str, Dict[str, int]]:
        """``{phase: {call site: calls}}`` of the calls counted so far."""
        return {phase: dict(sites) for phase, sites in self.calls.items() if sites}


__all__ = ["HostSyncCounter"]
