"""What the rig builds around SGLang's Mooncake classes, shared by prefill and decode.

Owns the plugin's transfer hooks (:func:`apply_transfer_hooks`), the one stand-in for
SGLang's model-parallel state (:func:`attention_identity`), the server args and
``KVArgs`` a ``MooncakeKVManager`` is built from (:func:`server_args`, :func:`kv_args`,
:func:`metadata_buffers`), and the deadline-bounded waits (:func:`wait_for`,
:func:`poll_until`). SGLang is imported inside the functions.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace


def apply_transfer_hooks() -> None:
    """Register and apply the plugin's PD transfer hooks (the plugin's own table)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_shared_kv import plugin
    from sglang_cp_shared_kv.hook_check import missing_hooks, register_hooks
    from sglang_cp_shared_kv.transfer import hooks

    specs = [s for s in plugin.HOOKS if s.hook.__module__ == hooks.__name__]
    register_hooks(specs)
    HookRegistry.apply_hooks()
    problems = missing_hooks(specs)
    if problems:
        raise RuntimeError("transfer hooks not applied: " + "; ".join(problems))


@contextmanager
def attention_identity(cp_rank: int, cp_size: int):
    """What SGLang's connection layer reads from the model-parallel state, for one rank
    (there is no torch.distributed world here)."""
    import sglang.srt.disaggregation.common.conn as common

    from sglang_cp_shared_kv.scoped import attributes_set

    values = dict(get_attention_tp_size=lambda: 1, get_attention_tp_rank=lambda: 0,
                  get_attention_cp_size=lambda: cp_size, get_attention_cp_rank=lambda: cp_rank,
                  get_attention_dp_size=lambda: 1, get_attention_dp_rank=lambda: 0,
                  get_pp_group=lambda: SimpleNamespace(rank_in_group=0, world_size=1))
    with attributes_set(common, **values):
        yield


def server_args(bootstrap_port: int, shared: bool, kv_cache_dtype: str):
    """The ``ServerArgs`` fields a Mooncake manager reads, with the plugin's flag."""
    from sglang_cp_shared_kv.config import FLAG_DEST

    return SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port, dist_init_addr=None,
                           enable_dp_attention=False, dp_size=1, pp_size=1, nnodes=1,
                           kv_cache_dtype=kv_cache_dtype, load_balance_method="follow_bootstrap_room",
                           enable_hisparse=False, chunked_prefill_size=8192, enable_metrics=False,
                           disaggregation_ib_device=None, **{FLAG_DEST: shared})


def kv_args(pool, metadata_buffers):
    """``KVArgs`` for ``pool`` and ``metadata_buffers``, as SGLang's scheduler fills them."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.gpu_id = 0, 0, 0, 0
    args.prefill_start_layer = pool.start_layer
    args.prefill_end_layer = getattr(pool, "end_layer", None)
    args.mla_compression_ratios = None
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.page_size = pool.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = metadata_buffers.get_buf_infos()
    args.ib_device = None
    setup_state_kv_args(args, pool, None, pool.layer_num)
    return args


def metadata_buffers(slots: int):
    """SGLang's aux ``MetadataBuffers`` with ``slots`` request slots."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(slots, hidden_size=16, hidden_states_dtype=torch.float32)


def wait_for(predicate, deadline_s: float, what: str, interval: float = 0.005):
    """``predicate()``'s first truthy value; TimeoutError after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline_s:.0f}s waiting for {what}")
        time.sleep(interval)


def poll_until(poll, states, deadline_s: float, what: str, interval: float = 0.005):
    """Poll a sender/receiver until it reports one of ``states`` (KVPoll.Failed is 0)."""
    end = time.monotonic() + deadline_s
    while True:
        state = poll()
        if state in states:
            return state
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline_s:.0f}s waiting for {what} (last state {state})")
        time.sleep(interval)
