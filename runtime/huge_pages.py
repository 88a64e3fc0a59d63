"""CPU weights in transparent huge pages.

Batch-1 decode streams every weight once per token. With 4 KiB pages that is ~66,000 pages a
step, each a TLB miss and a page walk in the middle of a stream; in 2 MiB pages it is ~130.
Linux gives anonymous memory huge pages only where asked (`madvise` mode, the common default),
so the parameters are copied once into one 2 MiB-aligned arena advised with MADV_HUGEPAGE before
the model is compiled (docs/kernel-choices.md, Huge pages).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from passes.huge_pages import HUGE_PAGE, huge_page_buffer

logger = logging.getLogger("compilecore")


def pack_parameters(module: nn.Module) -> int:
    """Move every CPU parameter of `module` into one huge-page arena (same values, same
    Parameter objects); returns the bytes moved, 0 where the kernel refuses the advice."""
    params = [p for p in dict.fromkeys(module.parameters()) if p.device.type == "cpu"]
    params = [p for p in params if p.is_contiguous() and p.numel()]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // 64) * 64  # 64-byte aligned rows
    if total < HUGE_PAGE:
        return 0
    arena, advised = huge_page_buffer(total)
    if not advised:
        logger.info("madvise(MADV_HUGEPAGE) refused: weights stay in normal pages")
        return 0
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            nbytes = p.numel() * p.element_size()
            view = arena[offset : offset + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)  # the first touch: the kernel backs it with huge pages
            p.data = view
    return total
