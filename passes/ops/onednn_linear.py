"""`compilecore.onednn_mm(x, w)`: `x @ w.T` through oneDNN with the weight reordered once
into oneDNN's blocked layout (CPU, 16-bit weights).

`torch.mm` on a bf16 CPU tensor reorders the weight on every call: at the batch sizes of
batched decode (2-64 rows) that reorder costs more than the product. Reordered once and
kept, the same oneDNN product streams the weight at close to memory bandwidth
(benchmarks/NOTES.md, section 23). The reordered copy lives in a table keyed by the
weight tensor itself and is made again when the weight's storage or version changes
(a reload, an in-place copy); it is freed with the weight.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# The batch size oneDNN lays the weight out for: measured as fast as a per-size layout
# from 2 to 2048 rows (section 23), so one copy serves every batch.
PACK_BATCH_HINT = 2048
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """The 16-bit dtypes oneDNN runs natively on this CPU (bf16 needs AVX512-BF16 or AMX,
    fp16 AVX512-FP16 or AVX-NE-CONVERT); empty without oneDNN."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")):
        return ()
    checks = ((torch.bfloat16, "_is_mkldnn_bf16_supported"),
              (torch.float16, "_is_mkldnn_fp16_supported"))  # fmt: skip
    return tuple(d for d, name in checks if hasattr(mkldnn, name) and getattr(mkldnn, name)())


def available() -> bool:
    return bool(supported_dtypes())


def _version(w: torch.Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor: no version counter, never modified in place
        return 0


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    key = (w.data_ptr(), _version(w))
    entry = _PACKED.get(w)
    if entry is None or entry[0] != key:
        with torch.no_grad():
            entry = (key, torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT))
        _PACKED[w] = entry
    return entry[1]


@torch.library.custom_op("compilecore::onednn_mm", mutates_args=())
def onednn_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x if x.is_contiguous() else x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), None, "none", [], "")


@onednn_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])
