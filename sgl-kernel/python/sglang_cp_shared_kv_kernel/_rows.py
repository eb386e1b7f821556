"""The row a store program reads: ``rows[i]`` (owned rows of a chunk) or ``i`` itself."""

import triton
import triton.language as tl


@triton.jit
def source_rows(rows_ptr, i, live, HAS_ROWS: tl.constexpr):
    if HAS_ROWS:
        src = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64)
    else:
        src = i.to(tl.int64)
    return src
