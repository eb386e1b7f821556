"""Every knob of the plugin, in one place.

* the CLI flag ``--enable-nsa-prefill-cp-shared-kv`` (``ServerArgs`` attribute
  ``enable_nsa_prefill_cp_shared_kv``) turns the feature on; nothing else does. On the
  prefill server it shards the KV (:func:`shares_kv`); on the decode server of the same
  deployment it turns on that server's guards (:func:`guards_decode`:
  :mod:`.decode.admission`);
* ``SGLANG_DEBUG_CP_SHARED_KV=1`` turns on CUDA-syncing invariant checks and the
  debug-level logs; off by default and off for performance measurement;
* ``SGLANG_CP_SHARED_KV_TRANSFER_BATCH_DESCRIPTORS`` tunes the PD transfer batch size;
* ``SGLANG_CP_SHARED_KV_PREFETCH=1`` gathers each layer's MLA history one layer ahead
  (phase 8; off by default until it is measured on multi-GPU NCCL);
* ``SGLANG_CP_SHARED_KV_NVTX=1`` marks the plugin's work with NVTX ranges (Nsight Systems)
  and times each stage (``observability/stage_timer.py``; ``SGLANG_CP_SHARED_KV_TIMING_DIR`` names where
  each rank writes the figures);
* ``SGLANG_CP_SHARED_KV_FAILED_ROOM_HOLD_S`` bounds how long a decode server holds a failed
  room's pages for the prefill ranks' drained notices (0.5.12.post1; default 30);
* ``SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD`` is for end-to-end tests only.
"""

from __future__ import annotations

import os

FLAG = "--enable-nsa-prefill-cp-shared-kv"
FLAG_DEST = "enable_nsa_prefill_cp_shared_kv"
#: The same flag in SGLang 0.5.23's words (NSA became DSA there, and ``--enable-prefill-cp``
#: turns prefill CP on): what a 0.5.23 user looks for. Only registered on that release.
FLAG_ALIAS = "--enable-prefill-cp-shared-kv"
FLAG_HELP = (
    "Shard the persistent NSA KV cache (MLA latent + indexer K) page-interleaved across the "
    "prefill context-parallel group, so N CP ranks expose N times the KV capacity. Needs "
    "--enable-nsa-prefill-context-parallel --nsa-prefill-cp-mode in-seq-split, "
    "--disaggregation-mode prefill with the mooncake backend, and "
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1 on prefill and decode."
)

DEBUG_ENV = "SGLANG_DEBUG_CP_SHARED_KV"

#: Gather layer L+1's MLA history while layer L computes (:mod:`forward.prefetch`). Read at
#: startup (the prefetch communicator is created with the pool) and per batch.
PREFETCH_ENV = "SGLANG_CP_SHARED_KV_PREFETCH"

#: NVTX ranges around the plugin's work (:mod:`nvtx`); off: no range is pushed at all.
NVTX_ENV = "SGLANG_CP_SHARED_KV_NVTX"

#: Test-only: accept ``--disaggregation-mode null`` (one server answering prefill-only
#: requests, ``max_new_tokens=1``) so end-to-end checks can compare prompt logprobs
#: with and without the flag. A decode step on such a server fails loudly.
TESTING_ALLOW_NON_PD_ENV = "SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD"

#: Mooncake descriptors per PD transfer batch (``transfer/pages.py``): the default, capped by
#: ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` when that is set lower, keeps every batch
#: under what the TCP lane admits to a peer at once (queued + pending entries, 1,024 + 1,024
#: by default).
TRANSFER_BATCH_DESCRIPTORS_ENV = "SGLANG_CP_SHARED_KV_TRANSFER_BATCH_DESCRIPTORS"
DEFAULT_TRANSFER_BATCH_DESCRIPTORS = 1024

#: Decode (SGLang 0.5.12.post1): the longest a failed room's pages and metadata slot stay held
#: for the prefill ranks' drained notices (:mod:`.decode.failed_room_holds`).
#: NOTE: 30 s is SGLang 0.5.23's own bound for the same hold (its decode waits that long for
#: each prefill rank's abort acknowledgement), far above a rank's queued writes on a live link.
FAILED_ROOM_HOLD_ENV = "SGLANG_CP_SHARED_KV_FAILED_ROOM_HOLD_S"
DEFAULT_FAILED_ROOM_HOLD_S = 30.0


def is_enabled(server_args) -> bool:
    """Whether ``server_args`` carries the flag, on a server of either role (False for a
    stock ``ServerArgs``)."""
    return bool(getattr(server_args, FLAG_DEST, False))


def guards_decode(server_args) -> bool:
    """The flag on a decode server (``--disaggregation-mode decode``): it shards nothing; it
    checks its environment at startup and refuses at once a request it can never hold."""
    return is_enabled(server_args) and getattr(server_args, "disaggregation_mode", None) == "decode"


def shares_kv(server_args) -> bool:
    """The flag on any other server (a PD prefill; validation refuses the rest): its CP
    ranks shard the KV, build the shared pool, hook the forward path and send shards."""
    return is_enabled(server_args) and not guards_decode(server_args)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def debug_enabled() -> bool:
    return _env_true(DEBUG_ENV)


def prefetch_enabled() -> bool:
    return _env_true(PREFETCH_ENV)


def nvtx_enabled() -> bool:
    return _env_true(NVTX_ENV)


def failed_room_hold_s() -> float:
    """:data:`FAILED_ROOM_HOLD_ENV` in seconds (default :data:`DEFAULT_FAILED_ROOM_HOLD_S`);
    raises ValueError, naming the variable and the fix, for anything but a positive number."""
    text = os.environ.get(FAILED_ROOM_HOLD_ENV, "").strip()
    if not text:
        return DEFAULT_FAILED_ROOM_HOLD_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{FAILED_ROOM_HOLD_ENV}={text!r}: the hold of a failed room's pages must be a positive "
                         f"number of seconds; unset it for the default {DEFAULT_FAILED_ROOM_HOLD_S:g}.")
    return value


def testing_non_pd_allowed() -> bool:
    return _env_true(TESTING_ALLOW_NON_PD_ENV)


def is_testing_without_pd(disaggregation_mode: str) -> bool:
    """A prefill-only test server: no PD (``--disaggregation-mode null``), allowed by the
    testing switch. Every other mode but ``prefill`` is refused with the flag on."""
    return disaggregation_mode == "null" and testing_non_pd_allowed()


def warn_if_testing_without_pd(disaggregation_mode: str, logger) -> None:
    """The WARNING an accepted server without PD logs at startup (both releases)."""
    if disaggregation_mode == "null":
        logger.warning("%s: %s=1 lets this server run without PD for prefill-only testing "
                       "(max_new_tokens=1); any decode step will fail. Never use it in production.",
                       FLAG, TESTING_ALLOW_NON_PD_ENV)
