"""What an SGLang release is to the plugin: one frozen record per release (:mod:`.v0512`,
:mod:`.v0523`), validated when it is made."""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

#: name -> (module, attribute); attribute None: the module itself, dotted: an attribute of an
#: attribute (an enum member)
SymbolTable = Mapping[str, Tuple[str, Optional[str]]]

#: The prefill CP strategies a release can shard under: SGLang 0.5.12.post1's in-seq split
#: (each rank keeps two zigzag segments of a chunk) and 0.5.23's interleave (tokens dealt out
#: round robin).
CP_STRATEGIES = ("in-seq-split", "interleave")

#: The symbols every release has where they are, meaning the same.
COMMON_SYMBOLS: SymbolTable = {
    "envs": ("sglang.srt.environ", "envs"),
    # --- PD transfer (Mooncake)
    "KVPoll": ("sglang.srt.disaggregation.base.conn", "KVPoll"),
    "StateType": ("sglang.srt.disaggregation.base.conn", "StateType"),
    "DisaggregationMode": ("sglang.srt.disaggregation.utils", "DisaggregationMode"),
    "FAKE_BOOTSTRAP_HOST": ("sglang.srt.disaggregation.utils", "FAKE_BOOTSTRAP_HOST"),
    "MooncakeKVManager": ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVManager"),
    "NetworkAddress": ("sglang.srt.utils.network", "NetworkAddress"),
    # --- the decode server (its admission queue)
    "prepare_abort": ("sglang.srt.disaggregation.utils", "prepare_abort"),
    # --- HiCache's storage tier (L3): an existence query's result (a raising query's miss)
    "PoolTransferResult": ("sglang.srt.mem_cache.hicache_storage", "PoolTransferResult"),
    # --- the plugin framework
    "HookRegistry": ("sglang.srt.plugins.hook_registry", "HookRegistry"),
    "HookType": ("sglang.srt.plugins.hook_registry", "HookType"),
}


def installed_sglang_version() -> Optional[str]:
    """The version of the installed ``sglang`` distribution (None: not installed)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True, eq=False)  # NOTE: one object per release, compared and hashed by identity
class Release:
    """One SGLang release the plugin serves."""

    #: the ``sglang`` distribution's version, exactly
    version: str
    #: the suffix of this release's own modules and tests: ``v``, the major and minor
    #: numbers and the patch number in two digits ("0.5.12.post1" -> "v0512", "0.5.3" -> "v0503")
    name: str
    #: every SGLang symbol the plugin reads on this release (``sglang_api``)
    symbols: SymbolTable
    #: the prefill CP strategy the flag shards under (:data:`CP_STRATEGIES`)
    cp_strategy: str
    #: the attention CP sizes stock SGLang serves under that strategy (None: any); the flag
    #: refuses the others at startup
    served_cp_sizes: Optional[Tuple[int, ...]]
    #: why stock SGLang does not serve the other sizes (the refusal says it)
    unserved_cp_size_cause: Optional[str]
    #: whether real servers of this release have run the flag on a GPU (startup warns if not;
    #: the selfcheck refuses ``--device cuda``)
    gpu_verified: bool
    #: the module of SGLang's sparse-attention backend (the selfcheck preloads it in its
    #: forkserver, so each rank process starts without importing it again)
    attention_backend_module: str
    #: ``scripts/bootstrap.sh``'s target for this release's test environment
    bootstrap_target: str
    #: where decode says it runs HiSparse: a flag of its registration ("registration", once
    #: per decode) or device pages of each room ("room")
    hisparse_signal: str
    #: whether the flag serves SGLang's HiCache (``--enable-hierarchical-cache``) on this release,
    #: each rank's host pool holding its own pages (``sglang_cp_shared_kv.hicache``)
    serves_hicache: bool = False
    #: whether the flag serves HiCache's storage tier (``--hicache-storage-backend``, L3) on this
    #: release, each rank storing and fetching its own pages (``sglang_cp_shared_kv.hicache.storage``)
    serves_hicache_storage: bool = False
    #: whether this release's Mooncake backend applies ``extra_backend_tag`` twice when it asks
    #: whether a DSA page exists (so no prefetch would hit: the flag refuses the tag)
    storage_tag_applied_twice: bool = False
    #: whether SGLang's senders share its cached decode status sockets across threads under a
    #: per-endpoint lock (``_send_multipart_locked``), which the flag's cause message takes too
    #: (ZMQ sockets are not thread-safe: an unlocked send interleaves frames with an abort ACK)
    status_sends_locked: bool = False
    #: whether decode frees a failed room's pages only once every prefill rank acknowledged that
    #: its writes drained, an acknowledgement SGLang withholds from a rank whose write failed
    #: (``_poison_unsettled_send``): an aux write the flag withholds, nothing of it submitted,
    #: then reports success and the room's failure record fails the room
    deferred_decode_release: bool = False

    def __post_init__(self) -> None:
        numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", self.version)
        expected = f"v{int(numbers[1])}{int(numbers[2])}{int(numbers[3]):02d}" if numbers else None
        problems = []
        if self.name != expected:
            problems.append(f"name {self.name!r} (expected {expected!r} for version {self.version!r})")
        if self.cp_strategy not in CP_STRATEGIES:
            problems.append(f"cp_strategy {self.cp_strategy!r} (one of {CP_STRATEGIES})")
        if self.served_cp_sizes is not None and (
                list(self.served_cp_sizes) != sorted(set(self.served_cp_sizes)) or min(self.served_cp_sizes) < 2):
            problems.append(f"served_cp_sizes {self.served_cp_sizes} (increasing, each at least 2)")
        if (self.served_cp_sizes is None) != (self.unserved_cp_size_cause is None):
            problems.append("unserved_cp_size_cause goes with served_cp_sizes (both set or neither)")
        if self.hisparse_signal not in ("registration", "room"):
            problems.append(f"hisparse_signal {self.hisparse_signal!r} ('registration' or 'room')")
        missing = sorted(set(COMMON_SYMBOLS) - set(self.symbols))
        if missing:
            problems.append(f"symbols lack the common {missing}")
        if problems:
            raise ValueError(f"release {self.version}: " + "; ".join(problems))
