"""How far ahead the batch-1 products' loops prefetch their weights: a policy per CPU
vendor, measured (docs/kernel-choices.md, Prefetch)."""

from __future__ import annotations

import functools

WEIGHT_PREFETCH = 4096  # bytes ahead (3-8 KB read alike on the Xeon)


@functools.cache
def weight_prefetch_bytes() -> int:
    """How far ahead the batch-1 products' loops prefetch their weights (`CC_PREFETCH`):
    `WEIGHT_PREFETCH` on Intel CPUs, where those loops read at ~0.8x a plain sum without it and
    at the sum's speed with it; none elsewhere (on AMD's Zen 4 the same prefetch read slower).
    docs/kernel-choices.md, Prefetch."""
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read(4096)
    except OSError:
        return 0
    return WEIGHT_PREFETCH if "GenuineIntel" in head else 0
