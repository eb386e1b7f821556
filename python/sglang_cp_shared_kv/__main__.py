"""``python -m sglang_cp_shared_kv selfcheck|plan ...``.

* ``selfcheck``: the whole shared-KV path on this machine (N prefill CP ranks, the real
  Mooncake engine on loopback, a decode), compared byte for byte with a replicated run;
  exit status 0 when every check passes, 1 when one fails.
* ``plan``: the capacity planner.

Exit status 2 on bad input (one ``error:`` line on stderr naming the argument).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import List, Optional

from sglang_cp_shared_kv.pool.kv_geometry import BUNDLED_MODELS, KV_CACHE_DTYPES, ModelConfigError, NsaModelShape
from sglang_cp_shared_kv.pool.planner import format_plan, plan_capacity
from sglang_cp_shared_kv.selfcheck.options import SelfcheckOptions as SelfcheckDefaults

PROG = "python -m sglang_cp_shared_kv"


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints the whole usage
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog=PROG, description="CP shared KV tools for SGLang NSA prefill.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrorParser)
    check = commands.add_parser(
        "selfcheck",
        help="run the whole shared-KV path here (CP ranks, Mooncake loopback, decode) and compare it "
             "byte for byte with a replicated run",
        description="Run a prefill CP group of N processes through the plugin's real code on one chunked "
                    "request with a radix-cache prefix, send every rank's shard over the real Mooncake "
                    "engine on 127.0.0.1 to a decode pool, and compare kernel inputs, attention outputs "
                    "and decode's bytes with a replicated (flag-off) run. Exit 0: PASS, 1: FAIL.")
    defaults = SelfcheckDefaults
    check.add_argument("--cp-size", type=_int, default=defaults.cp_size, help="CP ranks N (2-8)")
    check.add_argument("--chunk-size", type=_int, default=defaults.chunk_size,
                       help="tokens per prefill chunk after the prefix, the last chunk the rest (SGLang's "
                            "--chunked-prefill-size); a chunk of a multiple of 2N x 64 tokens is stored where "
                            "it was computed, others are gathered by SGLang")
    check.add_argument("--context-len", type=_int, default=defaults.context_len, help="request tokens")
    check.add_argument("--prefix-len", type=_int, default=defaults.prefix_len,
                       help="tokens the request shares with a cached one (a multiple of 64)")
    check.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, help=" | ".join(KV_CACHE_DTYPES))
    check.add_argument("--device", default=defaults.device, help="cpu | cuda (ranks share the GPUs present)")
    check.add_argument("--inject", default=None,
                       help="skip-write | corrupt-shard | drop-batch: break one thing on rank 1 to see a check fail")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    plan = commands.add_parser(
        "plan",
        help="per-rank physical and group logical KV capacity under --enable-nsa-prefill-cp-shared-kv",
        description="Plan KV capacity of a prefill CP group with shared (sharded) KV.",
    )
    plan.add_argument("--model-config", required=True,
                      help=f"{' | '.join(BUNDLED_MODELS)} | PATH/config.json")
    plan.add_argument("--cp-size", required=True, type=_positive_int, help="attention CP size N")
    plan.add_argument("--kv-cache-dtype", required=True, choices=KV_CACHE_DTYPES)
    size = plan.add_mutually_exclusive_group(required=True)
    size.add_argument("--kv-tokens-per-rank", type=_positive_int,
                      help="physical KV tokens per rank (SGLang's profiled max_total_num_tokens)")
    size.add_argument("--kv-gb-per-rank", type=_positive_float,
                      help="KV memory per rank in GB (2**30 bytes), MLA + index buffers")
    plan.add_argument("--context-len", type=_positive_int,
                      help="request length for the scratch and PD figures (default: the model's max context)")
    host = plan.add_mutually_exclusive_group()
    host.add_argument("--hicache-ratio", type=_positive_float,
                      help="with --enable-hierarchical-cache: host pool per rank = this x the rank's device pool")
    host.add_argument("--hicache-size", type=_positive_float,
                      help="with --enable-hierarchical-cache: the MLA host pool per rank in GB (10**9 bytes, SGLang's)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def selfcheck(args, parser) -> int:
    from sglang_cp_shared_kv.selfcheck.options import SelfcheckArgumentError, SelfcheckOptions

    try:
        options = SelfcheckOptions(cp_size=args.cp_size, chunk_size=args.chunk_size, context_len=args.context_len,
                                   prefix_len=args.prefix_len, kv_cache_dtype=args.kv_cache_dtype,
                                   device=args.device, inject=args.inject)
    except SelfcheckArgumentError as exc:
        parser.exit(2, f"{PROG} selfcheck: error: {exc}\n")
    from sglang_cp_shared_kv.releases import installed as releases

    release = releases.INSTALLED
    if release is None:
        parser.exit(2, f"{PROG} selfcheck: error: it drives the classes of sglang "
                       f"{' or '.join(r.version for r in releases.SUPPORTED)}, and the installed sglang is "
                       f"{releases.INSTALLED_VERSION or 'not found'}; run it in the environment of "
                       f"scripts/bootstrap.sh {' (or '.join(r.bootstrap_target for r in releases.SUPPORTED)})\n")
    if not release.gpu_verified and options.device == "cuda":
        # NOTE: such a release's torch is on no GPU image this project has run on (0.5.23: torch 2.14.1)
        parser.exit(2, f"{PROG} selfcheck: error: --device cuda on sglang {release.version} has not been built: no "
                       f"GPU image with its torch has run it; use --device cpu here, or --device cuda in the "
                       f"sglang {releases.RECOMMENDED.version} environment\n")
    if importlib.util.find_spec("mooncake") is None:
        target = release.bootstrap_target
        parser.exit(2, f"{PROG} selfcheck: error: the Mooncake transfer engine is not installed; on a CPU machine "
                       f"run scripts/bootstrap.sh {target} (mooncake-transfer-engine-non-cuda, needs libibverbs1), "
                       "with CUDA 13 pip install mooncake-transfer-engine-cuda13\n")
    # NOTE: imported here, not at the top: the planner must start without torch or SGLang.
    from sglang_cp_shared_kv.selfcheck.report import format_report
    from sglang_cp_shared_kv.selfcheck.run import run_selfcheck

    report = run_selfcheck(options, quiet=args.json)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["verdict"] == "PASS" else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "selfcheck":
        return selfcheck(args, parser)
    try:
        shape = NsaModelShape.load(args.model_config)
        context_len = args.context_len or shape.max_context_len or None
        plan = plan_capacity(
            shape, args.cp_size, args.kv_cache_dtype,
            kv_tokens_per_rank=args.kv_tokens_per_rank,
            kv_gb_per_rank=args.kv_gb_per_rank,
            context_len=context_len,
            hicache_ratio=args.hicache_ratio,
            hicache_size_gb=args.hicache_size,
        )
    except (ModelConfigError, ValueError) as exc:
        parser.exit(2, f"{PROG} plan: error: {exc}\n")
    try:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    except BrokenPipeError:  # e.g. `... | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
