"""``python -m sglang_cp_shared_kv plan ...``: the capacity planner.

Exit status 0 on success, 2 on bad input (one ``error:`` line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from sglang_cp_shared_kv.kv_geometry import BUNDLED_MODELS, KV_CACHE_DTYPES, ModelConfigError, NsaModelShape
from sglang_cp_shared_kv.planner import format_plan, plan_capacity

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


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog=PROG, description="CP shared KV tools for SGLang NSA prefill.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrorParser)
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
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        shape = NsaModelShape.load(args.model_config)
        context_len = args.context_len or shape.max_context_len or None
        plan = plan_capacity(
            shape, args.cp_size, args.kv_cache_dtype,
            kv_tokens_per_rank=args.kv_tokens_per_rank,
            kv_gb_per_rank=args.kv_gb_per_rank,
            context_len=context_len,
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
