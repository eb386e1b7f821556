"""What the rig builds around SGLang's Mooncake classes, shared by prefill and decode.

Owns the plugin's transfer hooks (:func:`apply_transfer_hooks`, the installed release's
table), the one stand-in for SGLang's model-parallel state (:func:`attention_identity`),
the server args and ``KVArgs`` a ``MooncakeKVManager`` is built from (:func:`server_args`,
:func:`kv_args`, :func:`metadata_buffers`), and the deadline-bounded waits
(:func:`wait_for`, :func:`poll_until`); what differs per SGLang release is
:mod:`.releases`'. SGLang is imported inside the functions.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from sglang_cp_shared_kv_testing.pd.releases import release


def apply_transfer_hooks() -> None:
    """Register and apply the plugin's PD transfer hooks (the installed release's table)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_shared_kv import plugin
    from sglang_cp_shared_kv.releases.installed import INSTALLED
    from sglang_cp_shared_kv.hook_check import missing_hooks, register_hooks
    from sglang_cp_shared_kv.transfer import hooks, hooks_v0523 as hooks_dsa

    table = plugin.hooks_for(INSTALLED)
    specs = [s for s in table if s.hook.__module__ in (hooks.__name__, hooks_dsa.__name__)]
    register_hooks(specs)
    HookRegistry.apply_hooks()
    problems = missing_hooks(specs)
    if problems:
        raise RuntimeError("transfer hooks not applied: " + "; ".join(problems))


def attention_identity(cp_rank: int, cp_size: int, bootstrap_port: int = 0):
    """What SGLang's connection layer reads of one rank's parallel state while its manager is
    built (there is no torch.distributed world here); per release (:mod:`.releases`)."""
    return release().identity(cp_rank, cp_size, bootstrap_port)


def server_args(bootstrap_port: int, shared: bool, kv_cache_dtype: str):
    """The ``ServerArgs`` fields a Mooncake manager reads, with the plugin's flag."""
    from sglang_cp_shared_kv.settings.config import FLAG_DEST

    return SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port, dist_init_addr=None,
                           enable_dp_attention=False, dp_size=1, pp_size=1, nnodes=1,
                           kv_cache_dtype=kv_cache_dtype, load_balance_method="follow_bootstrap_room",
                           enable_hisparse=False, chunked_prefill_size=8192, enable_metrics=False,
                           disaggregation_ib_device=None, enable_pd_role_switch=False, **{FLAG_DEST: shared})


def kv_args(pool, metadata_buffers):
    """``KVArgs`` for ``pool`` and ``metadata_buffers``, as SGLang's scheduler fills them."""
    return release().kv_args(pool, metadata_buffers)


def metadata_buffers(slots: int):
    """SGLang's aux ``MetadataBuffers`` with ``slots`` request slots."""
    return release().metadata_buffers(slots)


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
