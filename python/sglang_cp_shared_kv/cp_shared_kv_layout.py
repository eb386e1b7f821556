"""Logical <-> physical KV page mapping for CP shared KV (pure; no SGLang import).

The scheduler, radix cache, ``req_to_token`` and the allocator work in *logical*
token locations, identical on every CP rank. Only KV-buffer access and the PD
transfer translate them to *physical* locations in one rank's pool.

Invariants (page size P, CP size N, logical page p, 1-based usable pages):

* page 0 is the dummy/padding page: owner -1 (``NO_OWNER``), physical page 0;
* ``owner(p) = (p - 1) mod N``                       (page-interleaved ownership)
* ``physical(p) = (p - 1) div N + 1``                (page index inside the owner's pool)
* ``physical_loc = physical(page(loc)) * P + loc mod P``
* the inverse: physical page q >= 1 of rank r holds logical page ``(q - 1) * N + r + 1``;
* capacity: ``logical_tokens = (physical_tokens div P) * N * P``.

Every function comes in a torch form (device tensors, no host sync unless
``validate=True``) and a numpy form (``*_np``, used by the PD transfer path, which
works on numpy page lists). The same arithmetic serves both: each helper takes the
array namespace (``torch`` or ``numpy``) it operates in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

NO_OWNER = -1
DUMMY_PAGE = 0
SHARD_POLICY = "page_interleaved"


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def logical_tokens_for(physical_tokens: int, page_size: int, cp_size: int) -> int:
    """Logical capacity a CP group exposes over per-rank pools of ``physical_tokens``."""
    _require_positive_int("page_size", page_size)
    _require_positive_int("cp_size", cp_size)
    if isinstance(physical_tokens, bool) or physical_tokens < 0:
        raise ValueError(f"physical_tokens must be >= 0, got {physical_tokens}")
    return (int(physical_tokens) // page_size) * cp_size * page_size


def physical_tokens_for(logical_tokens: int, page_size: int, cp_size: int) -> int:
    """Per-rank physical pool size behind a logical capacity (exact inverse of
    :func:`logical_tokens_for` on the values it produces)."""
    _require_positive_int("page_size", page_size)
    _require_positive_int("cp_size", cp_size)
    if logical_tokens < 0 or logical_tokens % (page_size * cp_size) != 0:
        raise ValueError(
            f"logical_tokens={logical_tokens} is not a multiple of page_size*cp_size="
            f"{page_size * cp_size}; it cannot come from a page-interleaved split"
        )
    return logical_tokens // cp_size


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


@dataclass(frozen=True)
class CpSharedKVLayout:
    """Page-interleaved ownership of logical KV pages across ``cp_size`` ranks,
    seen from rank ``cp_rank``."""

    page_size: int
    cp_size: int
    cp_rank: int

    def __post_init__(self) -> None:
        _require_positive_int("page_size", self.page_size)
        _require_positive_int("cp_size", self.cp_size)
        if isinstance(self.cp_rank, bool) or not isinstance(self.cp_rank, (int, np.integer)):
            raise ValueError(f"cp_rank must be an int, got {self.cp_rank!r}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"cp_rank must be in [0, cp_size={self.cp_size}), got {self.cp_rank}"
            )

    # ------------------------------------------------------------------ capacity
    def logical_tokens(self, physical_tokens: int) -> int:
        return logical_tokens_for(physical_tokens, self.page_size, self.cp_size)

    def physical_tokens(self, logical_tokens: int) -> int:
        return physical_tokens_for(logical_tokens, self.page_size, self.cp_size)

    # ------------------------------------------------------------ shared arithmetic
    def _check_non_negative(self, values: Any, what: str) -> None:
        count = values.numel() if _is_torch(values) else values.size
        if count == 0:
            return
        smallest = int(values.min())
        if smallest < 0:
            raise ValueError(f"{what} must be >= 0, got a value of {smallest}")

    def _owner(self, pages: Any, xp: Any) -> Any:
        return xp.where(pages == DUMMY_PAGE, NO_OWNER, (pages - 1) % self.cp_size)

    def _physical_page(self, pages: Any) -> Any:
        # Floor division maps the dummy page 0 to (0 - 1) // N + 1 == 0.
        return (pages - 1) // self.cp_size + 1

    def _logical_page(self, physical_pages: Any, rank: int, xp: Any) -> Any:
        logical = (physical_pages - 1) * self.cp_size + rank + 1
        return xp.where(physical_pages == DUMMY_PAGE, DUMMY_PAGE, logical)

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.cp_rank
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, cp_size={self.cp_size}), got {rank}")
        return rank

    # --------------------------------------------------------------- torch pages
    def owner_for_logical_pages(self, pages, *, validate: bool = True):
        """Owning CP rank of each logical page (``NO_OWNER`` for page 0)."""
        import torch

        if validate:
            self._check_non_negative(pages, "logical pages")
        return self._owner(pages, torch)

    def owned_pages_mask(self, pages, *, validate: bool = True):
        """True where this rank owns the logical page (never for page 0)."""
        return self.owner_for_logical_pages(pages, validate=validate) == self.cp_rank

    def logical_pages_to_physical(self, pages, *, validate: bool = True):
        """Physical page of each logical page inside its owner's pool (0 -> 0)."""
        if validate:
            self._check_non_negative(pages, "logical pages")
        return self._physical_page(pages)

    def physical_pages_to_logical(self, physical_pages, rank: int | None = None, *, validate: bool = True):
        """Inverse map: logical page held at ``physical_pages`` of ``rank`` (default: this rank)."""
        import torch

        if validate:
            self._check_non_negative(physical_pages, "physical pages")
        return self._logical_page(physical_pages, self._rank(rank), torch)

    # ---------------------------------------------------------------- torch locs
    def owned_by_this_rank(self, locs, *, validate: bool = True):
        """True where this rank owns the token location (never in page 0)."""
        if validate:
            self._check_non_negative(locs, "token locations")
        return self.owned_pages_mask(locs // self.page_size, validate=False)

    def logical_locs_to_physical(self, locs, *, validate: bool = True):
        """Physical token location of each logical location inside its owner's pool."""
        if validate:
            self._check_non_negative(locs, "token locations")
        pages = locs // self.page_size
        return self._physical_page(pages) * self.page_size + locs % self.page_size

    # --------------------------------------------------------------- numpy pages
    def owner_for_logical_pages_np(self, pages) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64)
        self._check_non_negative(pages, "logical pages")
        return self._owner(pages, np)

    def owned_pages_mask_np(self, pages) -> np.ndarray:
        return self.owner_for_logical_pages_np(pages) == self.cp_rank

    def logical_pages_to_physical_np(self, pages) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64)
        self._check_non_negative(pages, "logical pages")
        return self._physical_page(pages)

    def physical_pages_to_logical_np(self, physical_pages, rank: int | None = None) -> np.ndarray:
        physical_pages = np.asarray(physical_pages, dtype=np.int64)
        self._check_non_negative(physical_pages, "physical pages")
        return self._logical_page(physical_pages, self._rank(rank), np)

    def filter_owned_pages_np(self, logical_pages, request_page_positions) -> Tuple[np.ndarray, np.ndarray]:
        """Keep the pages this rank owns.

        Returns ``(physical_pages, positions)``: this rank's physical page for each
        owned logical page, and the request-absolute page position it came from
        (taken from ``request_page_positions``, aligned with ``logical_pages``).
        """
        logical_pages = np.asarray(logical_pages, dtype=np.int64)
        positions = np.asarray(request_page_positions, dtype=np.int64)
        if logical_pages.shape != positions.shape or logical_pages.ndim != 1:
            raise ValueError(
                "logical_pages and request_page_positions must be 1-D and of equal length, "
                f"got shapes {logical_pages.shape} and {positions.shape}"
            )
        self._check_non_negative(positions, "request page positions")
        owned = self.owned_pages_mask_np(logical_pages)
        return self._physical_page(logical_pages[owned]), positions[owned]


def owner_counts(owners, cp_size: int, placed=None):
    """Pages per owner rank of the int64 tensor ``owners`` (``placed``: only those entries),
    without a host synchronisation (NOTE: ``torch.bincount`` on CUDA reads its input's
    maximum on the host to size its output, even with ``minlength``)."""
    counts = owners.new_zeros(cp_size)
    ones = owners.new_ones(owners.shape) if placed is None else placed.to(owners.dtype)
    return counts.scatter_add_(0, owners, ones)
