"""The ``--enable-nsa-prefill-cp-shared-kv`` flag on SGLang's ``ServerArgs`` and its validation.

The flag is not a dataclass field of ``ServerArgs`` (we do not fork it); it is an
instance attribute, carried by five hooks:

* ``ServerArgs.__init__`` AROUND: accepts ``enable_nsa_prefill_cp_shared_kv=`` like any
  other server arg (``sglang.Engine(..., enable_nsa_prefill_cp_shared_kv=True)``), or the
  value ``from_cli_args`` is parsing;
* ``ServerArgs.add_cli_args`` AFTER: adds the CLI flag (``--help``, ``--config`` YAML);
* ``ServerArgs.from_cli_args`` AROUND: hands the parsed value to ``__init__`` (so
  ``__post_init__`` sees it) and sets it on the instance;
* ``ServerArgs._set_default_nsa_backends`` AROUND: with the flag, fp8 KV and in-seq-split
  CP, the NSA backends SGLang would default to ``flashmla_kv`` (which crashes there in
  stock SGLang 0.5.12) become ``flashmla_sparse``, logged;
* ``ServerArgs.check_server_args`` AFTER: validates, after SGLang's own checks, in the
  main process. The scheduler processes re-validate before building the pool
  (:mod:`sglang_cp_shared_kv.pool.capacity`).

The attribute survives pickling into the scheduler processes (``ServerArgs`` has no
``__slots__`` and no custom ``__getstate__``).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
from typing import Any, List, Optional

import torch

from sglang_cp_shared_kv import hook_check, kernels
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed, v0512
from sglang_cp_shared_kv.settings.config import (
    FLAG,
    FLAG_DEST,
    FLAG_HELP,
    failed_room_hold_s,
    guards_decode,
    is_enabled,
    is_testing_without_pd,
    shares_kv,
    warn_if_testing_without_pd,
)
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE

logger = logging.getLogger(__name__)

_ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
# NSA prefill implementations whose KV reads go through the pool's get_key_buffer and
# the backend's page tables (trtllm keeps its own layout; aiter is ROCm).
SUPPORTED_NSA_PREFILL_BACKENDS = ("flashmla_sparse", "flashmla_kv", "flashmla_auto", "fa3", "tilelang")
_STAGING_ENV = "SGLANG_DISAGG_STAGING_BUFFER"
# NOTE: stock SGLang 0.5.12.post1 picks flashmla_kv for fp8_e4m3 KV on Hopper; with
# in-seq-split CP2 it fails at the first prefill ("RuntimeError: num_splits must have shape
# (b+1)", flag off too), while flashmla_sparse for both serves it (two H200s, 2026-11-30).
# Why: the backend builds FlashMLA's scheduler metadata for every token of the chunk, the
# in-seq split leaves the rank about chunk / N query rows (only the round-robin split cuts
# the metadata down); scripts/repro_flashmla_kv_in_seq_split.py shows it on one H200.
# flashmla_auto resolves to flashmla_kv for fp8 KV on Hopper, so it fails the same way.
FP8_IN_SEQ_SPLIT_CRASHING_BACKEND = "flashmla_kv"
FP8_IN_SEQ_SPLIT_CRASHING_PREFILL_BACKENDS = ("flashmla_kv", "flashmla_auto")
FP8_IN_SEQ_SPLIT_BACKEND = "flashmla_sparse"
_NSA_BACKEND_SIDES = ("prefill", "decode")
#: The flag value ``from_cli_args`` is building a ``ServerArgs`` for (its ``cls(**fields)``
#: passes dataclass fields only, and ``__post_init__`` already needs the flag).
_CLI_FLAG_VALUE: "contextvars.ContextVar[bool]" = contextvars.ContextVar("cp_shared_kv_cli_flag", default=False)


class CpSharedKVConfigError(ValueError):
    """The server configuration cannot run with ``--enable-nsa-prefill-cp-shared-kv``."""


# ----------------------------------------------------------------------------- hooks
def init_accepting_flag(original, self, *args, **kwargs):
    """AROUND ``ServerArgs.__init__``: accept the flag as a keyword argument."""
    setattr(self, FLAG_DEST, bool(kwargs.pop(FLAG_DEST, _CLI_FLAG_VALUE.get())))
    return original(self, *args, **kwargs)


def add_flag_to_parser(result, parser, *args, **kwargs):
    """AFTER ``ServerArgs.add_cli_args``: the flag, which never takes a stock option's
    abbreviation (:func:`stock_options_keep_their_abbreviations`)."""
    parser.add_argument(FLAG, dest=FLAG_DEST, action="store_true", help=FLAG_HELP)
    stock_options_keep_their_abbreviations(parser, FLAG)
    return result


class _RefuseOnUnsupportedBase(argparse.Action):
    """The flag on an SGLang release without a hook table: naming it stops the parse."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{FLAG}: {installed.unsupported_base_problem(installed.INSTALLED_VERSION)}")


def add_refusing_flag_to_parser(result, parser, *args, **kwargs):
    """AFTER ``ServerArgs.add_cli_args`` on an SGLang release the plugin has no table for
    (``plugin.hooks_for``: ``releases.installed``): the flag exists, so that naming it says why it cannot run
    instead of "unrecognized arguments" or -- where SGLang drops unknown options -- a server
    that starts without it; left out, nothing changes."""
    parser.add_argument(FLAG, dest=FLAG_DEST, action=_RefuseOnUnsupportedBase, nargs=0, default=False,
                        help=f"{FLAG_HELP} Not available with the installed SGLang: "
                             f"{installed.unsupported_base_problem(installed.INSTALLED_VERSION)}.")
    stock_options_keep_their_abbreviations(parser, FLAG)
    return result


def stock_options_keep_their_abbreviations(parser, option: str) -> None:
    """An abbreviation that matches a stock option and ``option`` resolves to the stock one.

    NOTE: SGLang's parser allows abbreviations (argparse's default), and the flag extends
    the prefix of ``--enable-nsa-prefill-context-parallel``: without this, the stock
    command line ``--enable-nsa-prefill`` would fail as ambiguous once the plugin is
    installed, flag off too. argparse has no per-option switch, so this narrows the
    parser's own prefix matcher (``_get_option_tuples``, CPython 3.8-3.13; the action is
    each match's first element). Abbreviations of the flag alone still work.
    """
    find = getattr(parser, "_get_option_tuples", None)
    if find is None:  # a future argparse: exact spellings still parse
        logger.debug("CP shared KV: argparse has no _get_option_tuples; abbreviations unchanged")
        return

    def option_tuples(option_string):
        matches = find(option_string)
        stock = [match for match in matches if option not in match[0].option_strings]
        return stock or matches

    parser._get_option_tuples = option_tuples


def from_cli_args_with_flag(original, cls, args, *rest, **kwargs):
    """AROUND ``ServerArgs.from_cli_args``: ``from_cli_args`` keeps dataclass fields only."""
    value = bool(getattr(args, FLAG_DEST, False))
    token = _CLI_FLAG_VALUE.set(value)
    try:
        server_args = original(cls, args, *rest, **kwargs)
    finally:
        _CLI_FLAG_VALUE.reset(token)
    setattr(server_args, FLAG_DEST, value)
    return server_args


def nsa_backends_for_in_seq_split(original, self, kv_cache_dtype, *args, **kwargs):
    """AROUND ``ServerArgs._set_default_nsa_backends``: under the flag, with fp8 KV and
    in-seq-split CP, an NSA backend the user left unset and SGLang defaults to
    ``flashmla_kv`` becomes ``flashmla_sparse`` (one WARNING; SGLang just logged its pick).
    Flag off, or a backend the user chose: SGLang's choice stands (validation refuses a
    chosen ``flashmla_kv`` with the fix)."""
    user_set = {side: getattr(self, f"nsa_{side}_backend", None) is not None for side in _NSA_BACKEND_SIDES}
    result = original(self, kv_cache_dtype, *args, **kwargs)
    if not (shares_kv(self) and kv_cache_dtype == "fp8_e4m3" and self.enable_nsa_prefill_context_parallel
            and self.nsa_prefill_cp_mode == "in-seq-split"):
        return result
    changed = []
    for side in _NSA_BACKEND_SIDES:
        attr = f"nsa_{side}_backend"
        if not user_set[side] and getattr(self, attr) == FP8_IN_SEQ_SPLIT_CRASHING_BACKEND:
            setattr(self, attr, FP8_IN_SEQ_SPLIT_BACKEND)
            changed.append(f"--nsa-{side}-backend {FP8_IN_SEQ_SPLIT_BACKEND}")
    if changed:
        logger.warning("%s: fp8_e4m3 KV with in-seq-split CP: using %s instead of SGLang's default %s "
                       "(which fails there in SGLang %s: \"num_splits must have shape (b+1)\"); set the "
                       "backends explicitly to silence this.", FLAG, " ".join(changed),
                       FP8_IN_SEQ_SPLIT_CRASHING_BACKEND, v0512.RELEASE.version)
    return result


def validate_after_stock_checks(result, server_args, *args, **kwargs):
    """AFTER ``ServerArgs.check_server_args`` (main process)."""
    if not is_enabled(server_args):
        return result
    hook_check.require_hooks_applied("main process")
    validate(server_args)
    if guards_decode(server_args):
        logger.info("%s: decode server of a shared-KV deployment: it refuses at once a request it can "
                    "never hold (docs/deploy.md, 'Sizing decode').", FLAG)
        return result
    warn_if_testing_without_pd(server_args.disaggregation_mode, logger)
    logger.info("%s: configuration accepted (attention CP size %d).", FLAG, server_args.attn_cp_size)
    return result


# ------------------------------------------------------------------------ validation
def _env_flag(name: str) -> bool:
    return bool(getattr(sg.envs, name).get())


def configuration_problems(server_args, *, hf_config: Any = None, use_mla: Optional[bool] = None) -> List[str]:
    """Every reason ``server_args`` cannot run with the flag, each naming the setting and the fix.

    ``hf_config``/``use_mla`` default to what ``server_args`` resolves; a scheduler
    process passes its model runner's values.
    """
    if hf_config is None:
        hf_config = server_args.get_model_config().hf_config
    if use_mla is None:
        use_mla = server_args.use_mla_backend()

    problems: List[str] = []

    def refuse(setting: str, why_and_fix: str) -> None:
        problems.append(f"{setting}: {why_and_fix}")

    if server_args.device != "cuda" or getattr(torch.version, "hip", None):
        refuse(f"--device {server_args.device}" + (" (ROCm)" if torch.version.hip else ""),
               "shared KV runs on CUDA GPUs only for now; run the prefill server on NVIDIA GPUs "
               "or drop the flag.")
    if not _nsa_model_problem(server_args, hf_config, refuse) and not use_mla:
        refuse(f"--model-path {server_args.model_path}",
               "the model does not run with the MLA attention backend; shared KV needs the MLA "
               "latent cache. Use --attention-backend nsa (the default for NSA models).")
    if not server_args.enable_nsa_prefill_context_parallel:
        refuse("--enable-nsa-prefill-context-parallel is off",
               "shared KV shards the KV across the prefill CP group; add "
               "--enable-nsa-prefill-context-parallel.")
    if server_args.nsa_prefill_cp_mode != "in-seq-split":
        refuse(f"--nsa-prefill-cp-mode {server_args.nsa_prefill_cp_mode}",
               "only the in-seq-split mode has a shared-KV materialize and transfer contract; "
               "set --nsa-prefill-cp-mode in-seq-split.")
    if server_args.attn_cp_size <= 1 and server_args.enable_nsa_prefill_context_parallel:  # else: the line above
        refuse(f"attention CP size {server_args.attn_cp_size}",
               "there is nothing to shard with one CP rank; with "
               "--enable-nsa-prefill-context-parallel the CP size is --tp-size / --dp-size, so "
               "use --tp-size 2 or more.")
    cp_size_problem(server_args, refuse)
    if server_args.page_size != PAGE_SIZE:
        refuse(f"--page-size {server_args.page_size}",
               f"the page-interleaved layout and the NSA index buffer use {PAGE_SIZE}-token "
               f"pages; set --page-size {PAGE_SIZE}.")
    prefill_backend = getattr(server_args, "nsa_prefill_backend", None)
    if prefill_backend is not None and prefill_backend not in SUPPORTED_NSA_PREFILL_BACKENDS:
        refuse(f"--nsa-prefill-backend {prefill_backend}",
               "its KV reads bypass the dense view shared KV materializes; use one of "
               f"{', '.join(SUPPORTED_NSA_PREFILL_BACKENDS)} (the Hopper defaults are supported).")
    if server_args.kv_cache_dtype == "fp8_e4m3" and server_args.nsa_prefill_cp_mode == "in-seq-split":
        crashing = {"prefill": FP8_IN_SEQ_SPLIT_CRASHING_PREFILL_BACKENDS,
                    "decode": (FP8_IN_SEQ_SPLIT_CRASHING_BACKEND,)}
        chosen = [f"--nsa-{side}-backend {backend}" for side in _NSA_BACKEND_SIDES
                  if (backend := getattr(server_args, f"nsa_{side}_backend", None)) in crashing[side]]
        if chosen:
            refuse(" ".join(chosen) + " with --kv-cache-dtype fp8_e4m3",
                   f"SGLang {v0512.RELEASE.version} fails on it with in-seq-split CP (\"num_splits must have shape (b+1)\"; "
                   "flashmla_auto picks flashmla_kv for fp8 KV on Hopper); "
                   f"set --nsa-prefill-backend {FP8_IN_SEQ_SPLIT_BACKEND} --nsa-decode-backend "
                   f"{FP8_IN_SEQ_SPLIT_BACKEND}, or leave both unset and the plugin picks them.")
    testing_without_pd = is_testing_without_pd(server_args.disaggregation_mode)
    if server_args.disaggregation_mode != "prefill" and not testing_without_pd:
        refuse(f"--disaggregation-mode {server_args.disaggregation_mode}",
               "each CP rank holds only its stripe of the KV, so it cannot decode locally; run "
               "this server with --disaggregation-mode prefill and a separate (non-CP) decode server "
               "(with the flag there too: docs/deploy.md).")
    if not testing_without_pd:
        pd_problems(server_args, refuse, other="decode")
    prefill_feature_problems(server_args, refuse)
    return problems


def cp_size_problem(server_args, refuse) -> None:
    """Refuse an in-seq-split CP layout the installed release's stock SGLang cannot serve
    (``Release.served_cp_sizes``): its attention CP size (``--tp-size / --dp-size``) or its
    ``--tp-size`` (the DeepEP width)."""
    release = installed.INSTALLED
    sizes = release.served_cp_sizes if release is not None else None
    cp_size, tp_size = server_args.attn_cp_size, server_args.tp_size
    if sizes is None or not (server_args.enable_nsa_prefill_context_parallel
                             and server_args.nsa_prefill_cp_mode == "in-seq-split" and cp_size > 1) \
            or {cp_size, tp_size} <= set(sizes):
        return
    *first, last = (str(n) for n in sizes)
    served, choose = (f"{', '.join(first)} {word} {last}" for word in ("and", "or"))
    dp = f" --dp-size {server_args.dp_size}" if server_args.dp_size > 1 else ""
    refuse(f"--tp-size {tp_size}{dp} (attention CP size {cp_size})",
           f"SGLang {release.version}'s in-seq-split NSA prefill CP serves CP sizes {served} only, flag off too: "
           f"{release.unserved_cp_size_cause}; "
           f"use --tp-size {choose} (the attention CP size, --tp-size / --dp-size, must be one of them too).")


#: the HiCache host layouts and copy backends the sharded host tier serves (each copies rows
#: or pages by index, which the tier narrows to the rank's own and maps to physical ones)
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
HICACHE_IO_BACKENDS = ("kernel", "direct")
#: the host memory mode the sharded host tier serves (host memory as a cache tier, L2)
HICACHE_HOST_MEMORY_MODE = "cache"


def hicache_problems(server_args, refuse) -> None:
    """What the sharded HiCache (:mod:`sglang_cp_shared_kv.hicache`) does not serve: another
    release's HiCache, a storage tier (L3), another host layout or copy backend."""
    release = installed.INSTALLED
    if release is None or not release.serves_hicache:
        serving = " or ".join(f"sglang=={r.version}" for r in installed.SUPPORTED if r.serves_hicache)
        version = release.version if release is not None else "this SGLang"
        refuse("--enable-hierarchical-cache",
               f"the sharded HiCache host tier is not built for SGLang {version}'s HiCache yet; remove "
               f"--enable-hierarchical-cache, or serve with {serving}.")
        return
    # NOTE: a later release's option (absent before it: host memory is then always a cache)
    host_memory_mode = getattr(server_args, "hicache_host_memory_mode", HICACHE_HOST_MEMORY_MODE)
    if host_memory_mode != HICACHE_HOST_MEMORY_MODE:
        refuse(f"--hicache-host-memory-mode {host_memory_mode}",
               "the sharded host tier keeps each rank's own pages in its host memory (a cache); buffer_only "
               "stages every storage copy in host pages each operation allocates for itself, which the tier "
               f"does not place in the rank's lanes: remove --hicache-host-memory-mode ({HICACHE_HOST_MEMORY_MODE} "
               "is the default).")
    if server_args.hicache_storage_backend:
        storage_problems(server_args, refuse)
    if server_args.hicache_mem_layout not in HICACHE_MEM_LAYOUTS:
        refuse(f"--hicache-mem-layout {server_args.hicache_mem_layout}",
               f"the sharded host tier serves the layouts {', '.join(HICACHE_MEM_LAYOUTS)}; choose one of them.")
    if server_args.hicache_io_backend not in HICACHE_IO_BACKENDS:
        refuse(f"--hicache-io-backend {server_args.hicache_io_backend}",
               f"the sharded host tier serves the copy backends {', '.join(HICACHE_IO_BACKENDS)}; choose one of them.")


#: the HiCache storage backends (L3) the sharded tier serves (hicache/storage.py)
HICACHE_STORAGE_BACKENDS = ("mooncake",)
#: the releases whose HiCache storage tier (L3) the flag shards (``Release.serves_hicache_storage``)
HICACHE_STORAGE_RELEASES = tuple(r for r in installed.SUPPORTED if r.serves_hicache_storage)


def storage_problems(server_args, refuse) -> None:
    """What the sharded storage tier (L3) does not serve: another release's storage tier;
    another backend; a key tag."""
    backend = server_args.hicache_storage_backend
    release = installed.INSTALLED
    if release not in HICACHE_STORAGE_RELEASES:
        serving = " or ".join(f"sglang=={r.version}" for r in HICACHE_STORAGE_RELEASES)
        refuse(f"--hicache-storage-backend {backend}",
               f"the sharded HiCache storage tier (L3) is not built for SGLang {release.version} yet (its host "
               "memory tier, L2, is); remove --hicache-storage-backend (and its extra config) to keep HiCache in "
               f"host memory, or serve with {serving} for L3.")
        return
    if backend not in HICACHE_STORAGE_BACKENDS:
        refuse(f"--hicache-storage-backend {backend}",
               f"the sharded HiCache storage tier serves {', '.join(HICACHE_STORAGE_BACKENDS)} (each rank stores "
               f"and fetches its own pages); use --hicache-storage-backend {HICACHE_STORAGE_BACKENDS[0]}, or remove "
               "--hicache-storage-backend (host memory, L2, is served with any backend).")
    extra = server_args.hicache_storage_backend_extra_config
    try:
        extra = json.loads(extra) if isinstance(extra, str) and extra.strip().startswith("{") else {}
    except ValueError:
        extra = {}  # (SGLang reports a malformed value itself)
    if release.storage_tag_applied_twice and isinstance(extra, dict) and extra.get("extra_backend_tag") is not None:
        refuse(f"--hicache-storage-backend-extra-config extra_backend_tag={extra['extra_backend_tag']!r}",
               f"SGLang {release.version} applies the tag twice when it asks whether an NSA page exists, "
               "so no prefetch would ever hit; under the flag the keys already name the CP group's size (<hash>@cp<N>): remove "
               "extra_backend_tag, or give each deployment its own Mooncake master.")


def prefill_feature_problems(server_args, refuse) -> None:
    """The features a shared-KV prefill refuses whatever the SGLang release (each names its
    fix; the option names are the same in 0.5.12.post1 and 0.5.23)."""
    if _env_flag(_STAGING_ENV):
        refuse(f"{_STAGING_ENV}=1", f"the PD staging buffer is not supported with shared KV; unset {_STAGING_ENV}.")
    if server_args.enable_hierarchical_cache:
        hicache_problems(server_args, refuse)
    if server_args.enable_hisparse:
        refuse("--enable-hisparse", "HiSparse has its own pool layout; not supported with shared KV yet. "
               "Remove --enable-hisparse.")
    if server_args.speculative_algorithm is not None:
        refuse(f"--speculative-algorithm {server_args.speculative_algorithm}",
               "speculative decoding / NextN (MTP) on the prefill server reads the raw index "
               "buffer by logical location; not supported with shared KV yet. Remove the "
               "speculative-decoding options from the prefill server.")
    if server_args.enable_return_routed_experts:
        refuse("--enable-return-routed-experts",
               "its capture buffer is sized by the (N times larger) logical token capacity; not "
               "supported with shared KV yet. Remove the option.")
    if server_args.enable_return_indexer_topk:
        refuse("--enable-return-indexer-topk",
               "its capture buffer is sized by the (N times larger) logical token capacity; not "
               "supported with shared KV yet. Remove the option.")
    if server_args.enable_two_batch_overlap:
        refuse("--enable-two-batch-overlap",
               "it splits a prefill forward into two micro-batches, each with its own attention "
               "metadata, while shared KV builds one dense view per forward; not supported with "
               "shared KV yet. Remove --enable-two-batch-overlap from the prefill server.")
    if runs_flashinfer_autotune(server_args):
        # NOTE: 0.5.23's resolution declares the autotune off under the flag
        # (server_args_v0523.flashinfer_autotune_off); 0.5.12.post1 has no such step
        refuse(f"--moe-runner-backend {server_args.moe_runner_backend} with FlashInfer autotune",
               "its warmup runs a decode-shaped dummy forward, which a shared-KV prefill rank does not run; "
               "add --disable-flashinfer-autotune to the prefill server.")
    ray_problem(server_args, refuse, "every CP rank would run stock, replicated KV while this process "
                 "reports shared KV on", "prefill")
    if server_args.prefill_only_disable_kv_cache:
        refuse("--prefill-only-disable-kv-cache",
               "shared KV needs the paged KV cache; remove --prefill-only-disable-kv-cache.")
    try:
        kernels.kernel_package()
    except kernels.KernelPackageMissing as exc:
        refuse("the plugin installation", f"{exc}.")


# NOTE: the MoE runners SGLang 0.5.12.post1 autotunes at startup
# (ModelRunner._should_run_flashinfer_autotune; flashinfer_cutlass and flashinfer_trtllm_routed
# are left out there, and flashinfer_cutedsl with DeepEP all-to-all bypasses the runner)
FLASHINFER_AUTOTUNED_MOE_RUNNERS = ("flashinfer_trtllm", "flashinfer_mxfp4", "flashinfer_cutedsl")


def runs_flashinfer_autotune(server_args) -> bool:
    """Whether SGLang 0.5.12.post1 runs FlashInfer's autotune (a decode-shaped dummy forward)
    on this server's Hopper or newer GPUs."""
    backend = str(server_args.moe_runner_backend)
    return (not server_args.disable_flashinfer_autotune and backend in FLASHINFER_AUTOTUNED_MOE_RUNNERS
            and not (backend == "flashinfer_cutedsl" and str(server_args.moe_a2a_backend) == "deepep"))


def decode_configuration_problems(server_args, *, hf_config: Any = None) -> List[str]:
    """Every reason a decode server cannot take the flag (it marks the decode of a
    shared-KV deployment: :mod:`..decode_admission`), each naming the setting and the fix."""
    if hf_config is None:
        hf_config = server_args.get_model_config().hf_config
    problems: List[str] = []

    def refuse(setting: str, why_and_fix: str) -> None:
        problems.append(f"{setting}: {why_and_fix}")

    _nsa_model_problem(server_args, hf_config, refuse)
    pd_problems(server_args, refuse, other="prefill")
    if server_args.enable_hisparse:
        refuse("--enable-hisparse", "HiSparse admits decode requests by its own logical pool, which the "
               "flag's admission bound does not model; not supported with the flag yet. Remove "
               "--enable-hisparse from the decode server.")
    ray_problem(server_args, refuse, "a request this decode can never hold would wait at the head of its "
                 "queue while this process reports the guard on", "decode")
    if not installed.INSTALLED.deferred_decode_release:  # (the hold of a failed room's pages: 0.5.12.post1's)
        try:
            failed_room_hold_s()
        except ValueError as exc:  # (its message names the variable and the fix)
            problems.append(str(exc))
    return problems


def _nsa_model_problem(server_args, hf_config, refuse) -> bool:
    """Refuse a model that is not NSA (True when refused)."""
    if sg.is_deepseek_nsa(hf_config):
        return False
    architectures = getattr(hf_config, "architectures", None) or ["?"]
    refuse(f"--model-path {server_args.model_path} ({architectures[0]})",
           "shared KV shards the NSA indexer and MLA caches of DeepSeek-V3.2 / GLM-5 style "
           "models; this model is not NSA. Drop the flag for this model.")
    return True


def pd_problems(server_args, refuse, *, other: str) -> None:
    """The PD transfer both servers of a deployment need (``other``: the other server's role)."""
    if server_args.disaggregation_transfer_backend != "mooncake":
        refuse(f"--disaggregation-transfer-backend {server_args.disaggregation_transfer_backend}",
               "the per-rank shard transfer is implemented for Mooncake only; set "
               "--disaggregation-transfer-backend mooncake.")
    if not _env_flag(_ALL_CP_RANKS_ENV):
        refuse(f"{_ALL_CP_RANKS_ENV} is not set",
               "every CP rank must send its own pages; export "
               f"{_ALL_CP_RANKS_ENV}=1 on this server and on the {other} server (so decode "
               "waits for a response from every prefill CP rank).")


def ray_problem(server_args, refuse, consequence: str, role: str) -> None:
    if getattr(server_args, "use_ray", False):
        refuse("--use-ray",
               f"SGLang's Ray scheduler actors do not load plugins (ray/scheduler_actor.py), so "
               f"{consequence}; launch the {role} server without --use-ray.")


def validate(server_args, *, hf_config: Any = None, use_mla: Optional[bool] = None) -> None:
    """Raise :class:`CpSharedKVConfigError` listing every problem, or return (the checks of
    the server's role: a decode server's, or a shared-KV prefill's)."""
    if guards_decode(server_args):
        problems = decode_configuration_problems(server_args, hf_config=hf_config)
    else:
        problems = configuration_problems(server_args, hf_config=hf_config, use_mla=use_mla)
    if problems:
        raise CpSharedKVConfigError(
            f"{FLAG} cannot start with this configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
