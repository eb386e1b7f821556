"""The selfcheck's settings, each checked against its allowed range (pure; no torch, no SGLang).

A bad value raises :class:`SelfcheckArgumentError` with one line naming the argument and
the allowed range; the CLI prints that line and exits 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp_shared_kv.pool.kv_geometry import KV_CACHE_DTYPES, PAGE_SIZE

INJECTIONS = ("skip-write", "corrupt-shard", "drop-batch")
DEVICES = ("cpu", "cuda")
MAX_CP_SIZE = 8
#: The harness model's context (``max_seq_len`` of its request table).
MAX_CONTEXT_LEN = 4096


class SelfcheckArgumentError(ValueError):
    """A selfcheck setting outside its allowed range (the message names it and the range)."""


@dataclass(frozen=True)
class SelfcheckOptions:
    """One selfcheck run. Defaults finish in about a minute on a 2-core CPU machine."""

    cp_size: int = 2
    #: tokens per prefill chunk after the prefix, the last chunk the rest (SGLang's
    #: --chunked-prefill-size, scaled down: 512 = 2N x 64 rows for N = 2 and 4, which the
    #: ranks store where they computed them; the last, shorter chunk SGLang gathers)
    chunk_size: int = 512
    context_len: int = 1536
    prefix_len: int = 448
    kv_cache_dtype: str = "bf16"
    device: str = "cpu"
    inject: Optional[str] = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        def refuse(argument: str, allowed: str, got) -> None:
            raise SelfcheckArgumentError(f"{argument} must be {allowed}, got {got!r}")

        if not 2 <= self.cp_size <= MAX_CP_SIZE:
            refuse("--cp-size", f"an integer from 2 to {MAX_CP_SIZE}", self.cp_size)
        if not 1 <= self.context_len <= MAX_CONTEXT_LEN:
            refuse("--context-len", f"an integer from 1 to {MAX_CONTEXT_LEN}", self.context_len)
        if not (0 <= self.prefix_len < self.context_len and self.prefix_len % PAGE_SIZE == 0):
            refuse("--prefix-len", f"a multiple of {PAGE_SIZE} (the radix cache shares whole pages) from 0 "
                   f"to below --context-len {self.context_len}", self.prefix_len)
        if not 1 <= self.chunk_size <= MAX_CONTEXT_LEN:
            refuse("--chunk-size", f"an integer from 1 to {MAX_CONTEXT_LEN}", self.chunk_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            refuse("--kv-cache-dtype", f"one of {', '.join(KV_CACHE_DTYPES)}", self.kv_cache_dtype)
        if self.device not in DEVICES:
            refuse("--device", f"one of {', '.join(DEVICES)}", self.device)
        if self.inject is not None and self.inject not in INJECTIONS:
            refuse("--inject", f"one of {', '.join(INJECTIONS)}", self.inject)

    @property
    def chunk_ends(self) -> list:
        """Where each chunk after the prefix ends (sequence positions), as SGLang's chunked
        prefill cuts it: every ``chunk_size`` tokens, the last chunk the rest."""
        return list(range(self.prefix_len + self.chunk_size, self.context_len, self.chunk_size)) + [self.context_len]

    @property
    def chunks(self) -> int:
        return len(self.chunk_ends)
