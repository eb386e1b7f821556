"""The decode server of a shared-KV deployment refuses at once a request it can never hold.

Why: stock SGLang 0.5.12.post1's decode admits its queue in order
(``DecodePreallocQueue.pop_preallocated``) and stops at the first request its pool cannot
take now. Its one capacity refusal (``_check_if_req_exceed_kv_capacity``, HTTP 400) is a
prompt longer than the pool. A request with a prompt of P tokens is taken only when its
pool's free and evictable tokens cover both

    P + num_reserved_decode_tokens        and        P + min(max_new_tokens, CLIP) - retractable

(retractable: the tokens the running requests hold, which are not free either), so in
every state of the pool it needs::

    tokens_needed = P + num_reserved_decode_tokens  <=  pool tokens

NOTE: the second term never binds: before decode's queue sees a request, SGLang's
scheduler caps ``max_new_tokens`` at pool - ceil_page(P) - page - 1
(``Scheduler.init_req_max_new_tokens``), so P + max_new_tokens stays below the pool.

A request above the bound is never taken: it waits at the head of the queue for good -- no
timeout runs before decode has preallocated (the waiting timeout starts at
``send_metadata``) -- and every request behind it waits with it. With the flag the prefill
admits N times one rank's pool, so a decode sized like one prefill GPU meets such prompts.

With ``--enable-nsa-prefill-cp-shared-kv`` on the decode server (:mod:`.decode.server`)
such a request fails at once, like SGLang's own refusal (HTTP 400, ``finish_reason`` abort),
with a message naming the sizes and the fix; everything else is SGLang's. Without the flag
on decode the server is stock. The planner sizes decode with the same bound.

Pure: no SGLang, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE

#: SGLang 0.5.12.post1's ``--num-reserved-decode-tokens`` default
DEFAULT_RESERVED_DECODE_TOKENS = 512


def decode_pool_tokens_for_context(context_len: int, reserved_decode_tokens: int = DEFAULT_RESERVED_DECODE_TOKENS,
                                   page_size: int = PAGE_SIZE) -> int:
    """The smallest decode pool that holds every request of a ``--context-length`` of
    ``context_len`` (a prompt of C - 1 tokens plus the reserved decode tokens), in whole
    pages: SGLang rounds ``--max-total-tokens`` down to a page."""
    return -(-(context_len - 1 + reserved_decode_tokens) // page_size) * page_size


@dataclass(frozen=True)
class DecodeAdmission:
    """What one decode server can ever admit (module docstring)::

        tokens_needed(P) = P + reserved_decode_tokens  <=  pool_tokens"""

    pool_tokens: int
    reserved_decode_tokens: int

    def tokens_needed(self, prompt_tokens: int) -> int:
        return prompt_tokens + self.reserved_decode_tokens

    def longest_context(self) -> int:
        """The longest ``--context-length`` whose every request this decode holds: the
        tokenizer keeps a prompt below it, P <= C - 1 (the inverse of
        :func:`decode_pool_tokens_for_context` for a whole-page pool)."""
        return self.pool_tokens - self.reserved_decode_tokens + 1

    def refusal(self, prompt_tokens: int) -> Optional[str]:
        """Why a request can never be admitted here, naming the fix; None when it can be."""
        needed = self.tokens_needed(prompt_tokens)
        if needed <= self.pool_tokens:
            return None
        return (f"{FLAG}: this decode server can never hold the request: its {prompt_tokens}-token prompt "
                f"and the {self.reserved_decode_tokens} tokens decode reserves for it "
                f"(--num-reserved-decode-tokens) need {needed} KV tokens; the decode pool holds "
                f"{self.pool_tokens}. Stock SGLang would keep it waiting at the head of decode's queue, and "
                f"every request behind it. Fix: give decode a pool of at least "
                f"{-(-needed // PAGE_SIZE) * PAGE_SIZE} tokens (--mem-fraction-static / --max-total-tokens), "
                f"or give prefill and decode a --context-length of at most {self.longest_context()} "
                f"(docs/deploy.md, 'Sizing decode').")


__all__ = ["DEFAULT_RESERVED_DECODE_TOKENS", "DecodeAdmission", "decode_pool_tokens_for_context"]
