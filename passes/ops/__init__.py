"""Fused custom ops that the passes emit (namespace `compilecore`).

Each op has a fake implementation (for tracing), a torch reference implementation (the
oracle, and the path where no kernel applies), a C kernel for CPU (`layer_kernels.cpp`,
declared with `passes.native_calls.declare_entry`) and, for the mission's fusions, a Triton
kernel (used for CUDA tensors)."""

from passes.ops import linear, quantized, silu_and_mul  # noqa: F401 - registers the ops
from passes.ops.add_rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref
from passes.ops.allreduce_rms_norm import fused_allreduce_add_rms_norm
from passes.ops.qkv_rope import fused_qkv_rope, fused_qkv_rope_ref

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "fused_allreduce_add_rms_norm",
    "fused_qkv_rope",
    "fused_qkv_rope_ref",
]
