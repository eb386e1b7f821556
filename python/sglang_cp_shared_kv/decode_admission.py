"""The decode server of a shared-KV deployment refuses at once a request it can never hold.

Why: stock SGLang 0.5.12.post1's decode admits its queue in order
(``DecodePreallocQueue.pop_preallocated``) and stops at the first request its pool cannot
take now. Its one refusal (``_check_if_req_exceed_kv_capacity``, HTTP 400) is a prompt
longer than the pool. A request with a prompt of P tokens and ``max_new_tokens`` M is
taken only when its pool's free and evictable tokens cover both

    P + num_reserved_decode_tokens        and        P + min(M, CLIP) - retractable

(CLIP: ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``; retractable: the tokens the running
requests hold, which are not free either), so in every state of the pool it needs::

    tokens_needed = P + max(num_reserved_decode_tokens, min(M, CLIP))  <=  pool tokens

A request above that is never taken: it waits at the head of the queue for good -- no
timeout runs before decode has preallocated (the waiting timeout starts at
``send_metadata``) -- and every request behind it waits with it. With the flag the prefill
admits N times one rank's pool, so a decode sized like one prefill GPU meets such prompts.

With ``--enable-nsa-prefill-cp-shared-kv`` on the decode server (:mod:`.decode_server`)
such a request fails at once, like SGLang's own refusal (HTTP 400, ``finish_reason`` abort),
with a message naming the sizes and the fix; everything else is SGLang's. Without the flag
on decode the server is stock. The planner sizes decode with the same bound.

Pure: no SGLang, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp_shared_kv.config import FLAG

#: SGLang 0.5.12.post1's ``--num-reserved-decode-tokens`` default
DEFAULT_RESERVED_DECODE_TOKENS = 512


@dataclass(frozen=True)
class DecodeAdmission:
    """What one decode server can ever admit (module docstring)::

        tokens_needed(P, M) = P + max(reserved_decode_tokens, min(M, clip_max_new_tokens))

    and a request is admissible only if ``tokens_needed <= pool_tokens``."""

    pool_tokens: int
    reserved_decode_tokens: int
    clip_max_new_tokens: int

    def tokens_needed(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return prompt_tokens + max(self.reserved_decode_tokens, min(max_new_tokens, self.clip_max_new_tokens))

    def longest_context(self) -> int:
        """The longest ``--context-length`` whose every request this decode holds: the
        tokenizer keeps P + M below it, so P <= C - 1 and min(M, clip) < C (the inverse
        of :func:`decode_pool_tokens_for_context`)."""
        return self.pool_tokens - self.reserved_decode_tokens + 1

    def refusal(self, prompt_tokens: int, max_new_tokens: int) -> Optional[str]:
        """Why a request can never be admitted here, naming the fix; None when it can be."""
        needed = self.tokens_needed(prompt_tokens, max_new_tokens)
        if needed <= self.pool_tokens:
            return None
        headroom = max(self.reserved_decode_tokens, min(max_new_tokens, self.clip_max_new_tokens))
        return (f"{FLAG}: this decode server can never hold the request: its {prompt_tokens}-token prompt "
                f"and {headroom} tokens of decode headroom (the larger of --num-reserved-decode-tokens "
                f"{self.reserved_decode_tokens} and max_new_tokens {max_new_tokens}) need {needed} KV tokens; "
                f"the decode pool holds {self.pool_tokens}. Stock SGLang would keep it waiting at the head of "
                f"decode's queue, and every request behind it. Fix: give decode a pool of at least {needed} "
                f"tokens (--mem-fraction-static / --max-total-tokens), or give prefill and decode a "
                f"--context-length of at most {self.longest_context()} (docs/deploy.md, 'Sizing decode').")


def decode_pool_tokens_for_context(context_len: int,
                                   reserved_decode_tokens: int = DEFAULT_RESERVED_DECODE_TOKENS) -> int:
    """The smallest decode pool that holds every request of a ``--context-length`` of
    ``context_len``: a prompt of C - 1 tokens plus the reserved decode tokens."""
    return context_len - 1 + reserved_decode_tokens


__all__ = ["DEFAULT_RESERVED_DECODE_TOKENS", "DecodeAdmission", "decode_pool_tokens_for_context"]
