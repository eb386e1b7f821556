"""The flag on SGLang 0.5.23: its settings layer.

0.5.23 renamed NSA to DSA (``--dsa-prefill-backend``), turns prefill CP on with
``--enable-prefill-cp --cp-strategy interleave|zigzag``, and its ``ServerArgs`` is a
msgspec record: ``__init__`` is msgspec's (a hook on it is applied and never runs; an
unknown keyword is a ``TypeError``) and its values are resolved by named steps
(``arg_groups/pipeline.py``) that plugins wrap with ``register_resolution_hook``. Five
hooks (``plugin._hooks_v0523``):

* ``ServerArgs.add_cli_args`` AFTER: the flag under both names, ``FLAG`` and the DSA-era
  :data:`~.config.FLAG_ALIAS`;
* ``ServerArgs.from_cli_args`` AROUND: 0.5.23 builds the record from its fields only, so
  the flag rides on it as a non-field attribute (``ServerArgs.__reduce__`` keeps
  ``__dict__``: the scheduler processes see it). ``sglang.Engine(...)`` cannot take it as
  a keyword on 0.5.23 (msgspec refuses unknown ones): launch the server from the CLI;
* resolution step ``apply_prefill_cp_cuda_graph_default``: 0.5.23 turns the breakable
  prefill CUDA graph on for interleave DSA CP; the plugin's per-layer collectives and
  page-table translation run outside a graph, so with the flag the graph is declared
  off, with one WARNING -- a graph the user chose explicitly is refused instead;
* resolution step ``handle_kv_cache_sharding``: ``--enable-kv-cache-sharding`` beside the
  flag is refused there, naming both (SGLang's step would refuse most such configurations
  in its own terms, or accept one and shard twice);
* ``ServerArgs.check_server_args`` AFTER (main process, after resolution): every
  problem, in 0.5.23's option names, refused together; a configuration without one
  starts, with one WARNING that the 0.5.23 path has been proven on CPU rigs with SGLang's
  real classes and not yet on a GPU (:data:`NOT_GPU_VERIFIED`).
"""

from __future__ import annotations

import logging
from typing import List

import torch

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import v0523
from sglang_cp_shared_kv.releases.installed import RECOMMENDED
from sglang_cp_shared_kv.settings.config import (
    FLAG, FLAG_ALIAS, FLAG_DEST, FLAG_HELP, guards_decode, is_enabled, is_testing_without_pd,
    warn_if_testing_without_pd,
)
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE
from sglang_cp_shared_kv.settings.server_args import (
    SUPPORTED_NSA_PREFILL_BACKENDS,
    CpSharedKVConfigError,
    pd_problems,
    prefill_feature_problems,
    ray_problem,
    stock_options_keep_their_abbreviations,
)

logger = logging.getLogger(__name__)

#: The CP strategy the port shards under (docs/design.md: 0.5.23's zigzag has no DSA
#: index-key gather and returns no latent, so DSA prefill CP there means interleave).
CP_STRATEGY = v0523.RELEASE.cp_strategy
#: The same prefill backends under their DSA-era option (trtllm keeps its own fp8 layout
#: and gathers it itself there too: ``all_gather_dsa_trtllm_fp8_kv``).
SUPPORTED_DSA_PREFILL_BACKENDS = SUPPORTED_NSA_PREFILL_BACKENDS
#: Said once at startup on 0.5.23 (docs/design.md, "The CP strategy on 0.5.23"). NOTE: the
#: lent GPUs' image has torch 2.11, 0.5.23 needs torch 2.14.1: no 0.5.23 path has run on a GPU.
NOT_GPU_VERIFIED = (
    f"{FLAG} on sglang {v0523.RELEASE.version}: the forward and the PD transfer are bit-exact against a "
    "replicated pool in the CPU rigs on this release's real classes, but have not run on a GPU yet; "
    f"sglang=={RECOMMENDED.version} is the GPU-verified base (docs/design.md, 'The CP strategy on "
    f"{v0523.RELEASE.version}').")

KV_SHARDING_CONFLICT = ("--enable-kv-cache-sharding: SGLang's own KV sharding and this plugin's shard the same "
                        "cache two ways; use one: drop --enable-kv-cache-sharding (it needs trtllm, fp8 and "
                        "Blackwell) or the flag.")


# ----------------------------------------------------------------------------- hooks
def add_flag_and_alias_to_parser(result, parser, *args, **kwargs):
    """AFTER ``ServerArgs.add_cli_args``: one option, two spellings."""
    parser.add_argument(FLAG, FLAG_ALIAS, dest=FLAG_DEST, action="store_true",
                        help=f"{FLAG_HELP} On SGLang {v0523.RELEASE.version}: "
                             "--enable-prefill-cp --cp-strategy interleave.")
    stock_options_keep_their_abbreviations(parser, FLAG)
    stock_options_keep_their_abbreviations(parser, FLAG_ALIAS)
    return result


def from_cli_args_carrying_flag(original, cls, args, *rest, **kwargs):
    """AROUND ``ServerArgs.from_cli_args``: the record keeps its fields only."""
    server_args = original(cls, args, *rest, **kwargs)
    setattr(server_args, FLAG_DEST, bool(getattr(args, FLAG_DEST, False)))
    return server_args


def prefill_cuda_graph_off(server_args, previous):
    """Resolution step ``apply_prefill_cp_cuda_graph_default``, wrapped: what SGLang would run
    on a prefill rank outside a request and the shared pool cannot take is turned off -- the
    prefill CUDA graph (said with a WARNING: it is on by default) and FlashInfer's autotune."""
    previous(server_args)
    if not is_enabled(server_args) or guards_decode(server_args):
        return
    flashinfer_autotune_off(server_args)
    graphs = sg.cuda_graph_config
    config = sg.resolving_view(server_args).cuda_graph_config
    if config.prefill.backend == graphs.Backend.DISABLED or _prefill_graph_chosen(server_args):
        return  # nothing to turn off, or the user's choice: validation refuses it
    logger.warning("%s: prefill CUDA graph %r turned off: shared KV's per-layer collectives and page-table "
                   "translation run outside a graph (set --disable-prefill-cuda-graph to silence this).",
                   FLAG, config.prefill.backend)
    sg.declare_resolution(server_args, "cp_shared_kv.prefill_cuda_graph_off",
                          cuda_graph_config=graphs.with_phase(config, graphs.Phase.PREFILL,
                                                              backend=graphs.Backend.DISABLED))


def flashinfer_autotune_off(server_args) -> None:
    """FlashInfer's autotune (with a flashinfer MoE runner or GEMM) warms up through a
    decode-shaped dummy forward on physical page 0, which a shared-KV prefill rank refuses
    (only prefill runs there); SGLang skips it for its own KV sharding the same way
    (``should_run_flashinfer_autotune``). Declared off, one INFO line."""
    if not sg.resolving_view(server_args).disable_flashinfer_autotune:
        logger.info("%s: FlashInfer autotune off: its warmup runs a decode-shaped dummy forward, which a shared-KV "
                    "prefill rank does not run (kernels keep their default configurations).", FLAG)
        sg.declare_resolution(server_args, "cp_shared_kv.flashinfer_autotune_off", disable_flashinfer_autotune=True)


def refuse_kv_sharding_beside_the_flag(server_args, previous):
    """Resolution step ``handle_kv_cache_sharding``, wrapped: both asked for, ours says so
    (before SGLang's step refuses the configuration in its own terms, or accepts it)."""
    if is_enabled(server_args) and sg.resolving_view(server_args).enable_kv_cache_sharding:
        raise CpSharedKVConfigError(f"{FLAG} cannot start with this configuration:\n  - {KV_SHARDING_CONFLICT}")
    previous(server_args)


def validate_after_stock_checks(result, server_args, *args, **kwargs):
    """AFTER ``ServerArgs.check_server_args`` (main process, after resolution)."""
    if is_enabled(server_args):
        hook_check.require_hooks_applied("main process")
        refuse_problems(configuration_problems(server_args))
        warn_if_testing_without_pd(sg.resolved_view(server_args).disaggregation_mode, logger)
        logger.warning(NOT_GPU_VERIFIED)
    return result


# ------------------------------------------------------------------------ validation
def _prefill_graph_chosen(server_args) -> bool:
    graphs = sg.cuda_graph_config
    return (graphs.Phase.PREFILL, "backend") in (getattr(server_args, "_cuda_graph_config_locked", None) or ())


def refuse_problems(problems: List[str]) -> None:
    if problems:
        raise CpSharedKVConfigError(f"{FLAG} cannot start with this configuration:\n"
                                    + "\n".join(f"  - {p}" for p in problems))


def validate_in_scheduler(server_args) -> None:
    """A scheduler process's check of the settings (before its pools are built): the main
    process checked them too, but a scheduler process can be started otherwise (an Engine)."""
    refuse_problems(configuration_problems(server_args))


def configuration_problems(server_args) -> List[str]:
    """Every reason ``server_args`` (resolved) cannot run with the flag, each naming the
    setting and the fix in 0.5.23's option names."""
    cfg = sg.resolved_view(server_args)
    problems: List[str] = []

    def refuse(setting: str, why_and_fix: str) -> None:
        problems.append(f"{setting}: {why_and_fix}")

    hf_config = sg.model_config_of(server_args).hf_config
    if not sg.is_deepseek_dsa(hf_config):
        architectures = getattr(hf_config, "architectures", None) or ["?"]
        refuse(f"--model-path {cfg.model_path} ({architectures[0]})",
               "shared KV shards the DSA indexer and MLA caches of DeepSeek-V3.2 / GLM-5 style models; "
               "this model is not DSA. Drop the flag for this model.")
    pd_problems(cfg, refuse, other="prefill" if guards_decode(server_args) else "decode")
    if guards_decode(server_args):
        if cfg.enable_hisparse:
            refuse("--enable-hisparse", "HiSparse admits decode requests by its own logical pool "
                   "(max_token_pool_size), which the flag's admission bound does not model; not supported with "
                   "the flag yet. Remove --enable-hisparse from the decode server.")
        ray_problem(cfg, refuse, "a request this decode can never hold would wait at the head of its queue "
                    "while this process reports the guard on", "decode")
        return problems
    if cfg.device != "cuda" or getattr(torch.version, "hip", None):
        refuse(f"--device {cfg.device}", "shared KV runs on CUDA GPUs only; run the prefill server on NVIDIA "
               "GPUs or drop the flag.")
    if not cfg.enable_prefill_cp:
        refuse("--enable-prefill-cp is off", "shared KV shards the KV across the prefill CP group; add "
               f"--enable-prefill-cp --cp-strategy {CP_STRATEGY}.")
    elif cfg.cp_strategy != CP_STRATEGY:
        refuse(f"--cp-strategy {cfg.cp_strategy}",
               f"in SGLang {v0523.RELEASE.version} DSA prefill CP is the interleave strategy (zigzag has no "
               f"DSA index-key gather there); set --cp-strategy {CP_STRATEGY}.")
    elif (cfg.attn_cp_size or 1) <= 1:
        refuse(f"attention CP size {cfg.attn_cp_size}", "there is nothing to shard with one CP rank; use "
               "--tp-size 2 or more with --enable-prefill-cp.")
    if cfg.page_size != PAGE_SIZE:
        refuse(f"--page-size {cfg.page_size}", f"the layout and the DSA index buffer use {PAGE_SIZE}-token "
               f"pages; set --page-size {PAGE_SIZE}.")
    if cfg.dsa_prefill_backend is not None and cfg.dsa_prefill_backend not in SUPPORTED_DSA_PREFILL_BACKENDS:
        refuse(f"--dsa-prefill-backend {cfg.dsa_prefill_backend}",
               f"its KV reads bypass the pool's page tables; use one of {', '.join(SUPPORTED_DSA_PREFILL_BACKENDS)}.")
    if cfg.dsa_decode_backend == "trtllm":
        refuse("--dsa-decode-backend trtllm", "on a prefill server it still shapes the prefill: with fp8 KV SGLang "
               "then fuses RoPE for trtllm into the attention and skips interleave's gather of the chunk "
               "(_fuse_rope_for_trtllm_mla), which the shards would store unrotated; this server runs no decode: "
               "leave --dsa-decode-backend unset here or use one of "
               f"{', '.join(SUPPORTED_DSA_PREFILL_BACKENDS)}.")
    if cfg.enable_kv_cache_sharding:  # NOTE: refused in resolution already; kept for a record checked again
        problems.append(KV_SHARDING_CONFLICT)
    if cfg.enable_dsa_cache_layer_split:
        refuse("--enable-dsa-cache-layer-split", "it splits whole layers across the CP ranks, the plugin splits "
               "pages; remove --enable-dsa-cache-layer-split.")
    chosen_graph = cfg.cuda_graph_config.prefill.backend
    if _prefill_graph_chosen(server_args) and chosen_graph != sg.cuda_graph_config.Backend.DISABLED:
        refuse(f"--cuda-graph-backend-prefill {chosen_graph}",
               "shared KV's per-layer collectives and page-table translation run outside a graph; add "
               "--disable-prefill-cuda-graph.")
    testing_without_pd = is_testing_without_pd(cfg.disaggregation_mode)
    if cfg.disaggregation_mode != "prefill" and not testing_without_pd:
        refuse(f"--disaggregation-mode {cfg.disaggregation_mode}",
               "each CP rank holds only its stripe of the KV; run this server with --disaggregation-mode "
               "prefill and a separate (non-CP) decode server with the flag.")
    elif cfg.disaggregation_mode == "prefill" and cfg.disaggregation_enable_kv_checksum:
        refuse("--disaggregation-enable-kv-checksum",
               "SGLang's checksum reads a request's logical page ids from this rank's physical shard (out of "
               "bounds on the GPU) and every CP rank writes its own digest to decode's one slot (every request "
               "fails as a mismatch); turn it off: remove it from this server and from the decode server.")
    prefill_feature_problems(cfg, refuse)
    return problems
