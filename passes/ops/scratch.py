"""One reused buffer a thread for the dense copies a quantized product makes beyond its
kernel's rows (a prefill): the weight dequantized, multiplied, then dead.

Why reused: a fresh copy of a large weight is a fresh mapping whose pages fault in on every
call. On the AMX Xeon a 16384 x 2048 Q8_0 weight's product at 64 rows took 35 ms with a
new 67 MB copy and 12.7 ms with the copy in a buffer already touched
(`benchmarks/ab_dense_copy.py`). A weight larger than `SCRATCH_BYTES` is copied and
multiplied a slice of rows at a time (`row_slices`), so the buffer stays bounded.
"""

from __future__ import annotations

import threading

import torch

from passes import huge_pages

SCRATCH_BYTES = 64 << 20

_local = threading.local()


def scratch(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of `shape` in this thread's buffer, valid until the thread's
    next call; the buffer grows (in huge pages where Linux gives them) and is never freed."""
    nbytes = shape[0] * shape[1] * dtype.itemsize
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = huge_pages.huge_page_buffer(max(nbytes, 2 << 20))[0]
        _local.buffer = buffer
    return buffer[:nbytes].view(dtype).view(shape)


def row_slices(n: int, row_bytes: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of at most SCRATCH_BYTES each (whole 16-row tiles)."""
    rows = max(16, SCRATCH_BYTES // max(row_bytes, 1) // 16 * 16)
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]
