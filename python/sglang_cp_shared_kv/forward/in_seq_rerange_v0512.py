"""In-seq-split CP all-gather: the gathered zigzag blocks put in sequence order by one
kernel launch instead of SGLang's two rounds of ``split`` / ``cat``.

SGLang's ``cp_all_gather_rerange_output`` (``sglang.srt.layers.utils.cp_utils``) runs
for the MLA latent, the NSA index key and the final hidden state of every in-seq-split
prefill: it pads this rank's rows to the common per-rank length, all-gathers them over
the attention-CP group into one buffer, and re-orders that buffer (drop each rank's
padding, then take the 2N blocks in sequence order). :func:`gather_in_seq_order`
issues that very all-gather and then re-orders the buffer with
:meth:`~sglang_cp_shared_kv.kernels.KernelDispatch.rerange_in_seq` (the Triton kernel of
``sgl-kernel/``, or its reference, the same split/cat, where the kernel cannot run). The
result is SGLang's, bit for bit. The hook itself is in :mod:`.hooks`.

SGLang's function runs unchanged (the hook is inert) unless every one of these holds:

* this process runs with ``--enable-nsa-prefill-cp-shared-kv`` (the forward batch's
  pool is ours), the batch has CP metadata, and the split is in-seq (not round-robin);
* the input is 2-D (SGLang's function only accepts that: it ends with
  ``view(-1, hidden_size)``);
* the kernel can run: the input is on CUDA and debug mode is off (startup has checked
  that the kernel package imports).

Collectives: every CP rank issues the same all-gather in the same order, whichever path
it takes. Both paths call the same group's ``cp_all_gather_into_tensor_async`` once,
with the same stream argument, on a buffer of ``ceil(total_seq_lens / cp_size) * cp_size``
rows allocated in the same symmetric-memory context, from the same padded input -- so a
rank that decided differently from the others (debug mode set on one rank only, say)
still stays in step. The decision itself uses only facts that are the same on
every rank (the flag, the batch's metadata, the input's rank and device, the
environment, the installed packages); a kernel that raised on one rank is not among them:
that rank takes this path too, and ``KernelDispatch.rerange_in_seq`` falls back *after* the
all-gather, on the gathered buffer.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import debug_enabled
from sglang_cp_shared_kv.kernels import KernelDispatch


def kernel_can_run(rows: torch.Tensor) -> bool:
    """Whether the re-range kernel can run on ``rows``' device (the kernel package itself
    is checked at startup). Deliberately leaves out whether it failed before in this
    process (per rank): such a rank still takes the plugin path and falls back after the
    collective."""
    return rows.is_cuda and not debug_enabled()


def takes_plugin_path(rows: torch.Tensor, forward_batch, uses_shared_kv: bool) -> bool:
    """The pre-collective decision (module docstring); rank-identical facts only.
    ``uses_shared_kv``: this forward runs on a shared-KV pool (the flag is on in this
    process; the same answer on every CP rank, which all run the same server arguments)."""
    if not uses_shared_kv or getattr(forward_batch, "attn_cp_metadata", None) is None:
        return False
    if sg.is_nsa_prefill_cp_round_robin_split():
        return False
    return rows.dim() == 2 and kernel_can_run(rows)


def gather_in_seq_order(kernels: KernelDispatch, rows: torch.Tensor, cp_size: int, metadata,
                        stream) -> torch.Tensor:
    """All-gather this rank's ``rows`` over the attention-CP group as SGLang does, then
    return every rank's rows in sequence order (``metadata``: the batch's
    ``ContextParallelMetadata``)."""
    # The group and the allocation helpers are looked up on SGLang's module at call time,
    # so this collective is the one SGLang's function would issue.
    cp_utils = sg.cp_utils
    group = cp_utils.get_attention_cp_group()
    slot = (int(metadata.total_seq_lens) + cp_size - 1) // cp_size  # every rank's padded row count
    missing = slot - rows.shape[0]
    if missing > 0:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, missing))
    with cp_utils.use_symmetric_memory(group, disabled=not cp_utils.is_allocation_symmetric()):
        gathered = torch.empty((slot * cp_size, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    group.cp_all_gather_into_tensor_async(gathered, rows, stream)
    return kernels.rerange_in_seq(gathered, metadata)
