"""Pieces of the CUDA-graph wrapper that do not need a device."""

from __future__ import annotations

import torch


def test_weak_ref_tensor_aliases_without_owning():
    """What CUDA-graph entries keep of their outputs (checked on CPU memory: the helper
    is device-agnostic)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    from compilecore.cuda_graph import weak_ref_tensors

    t = torch.arange(24.0).reshape(4, 6)[:, 1:4]  # a strided view
    weak = weak_ref_tensors((t, [t * 0]))[0]
    assert weak.data_ptr() == t.data_ptr() and weak.stride() == t.stride()
    t.add_(1)
    assert torch.equal(weak, t)
    base = torch.ones(8)
    ref = StorageWeakRef(base.untyped_storage())
    alias = weak_ref_tensors(base)
    del base
    gc.collect()
    assert ref.expired()  # the alias did not keep the memory
    del alias
