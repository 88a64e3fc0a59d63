"""Buffers in transparent huge pages: weights and the copies made from them are streamed
every step, and from 2 MiB pages they read faster (docs/kernel-choices.md, Huge pages).
`runtime/huge_pages.py` moves a model's parameters into them."""

from __future__ import annotations

import ctypes
from typing import Any

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def madvise_huge(address: int, length: int) -> bool:
    """Ask Linux to back [address, address + length) with transparent huge pages (which it
    does on first touch in the common `madvise` mode); False where it refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(address, length, MADV_HUGEPAGE) == 0


def huge_page_buffer(nbytes: int) -> tuple[Any, bool]:
    """An untouched uint8 tensor of `nbytes` starting on a 2 MiB boundary and advised
    MADV_HUGEPAGE (Linux backs it with huge pages on first touch), and whether the advice
    was taken (normal pages otherwise)."""
    import torch

    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages, all inside `raw`
    raw = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)  # untouched: no pages yet
    start = -raw.data_ptr() % HUGE_PAGE
    advised = madvise_huge(raw.data_ptr() + start, length)
    return raw[start : start + nbytes], advised
