"""The post-grad pass manager that the compile backend installs for every piece.

It is an Inductor `CustomGraphPass`: Inductor calls it on each piece's post-grad FX graph
(as `post_grad_custom_pre_pass`, before Inductor's own patterns fold the residual add into
its GEMMs), and its `uuid()` is part of Inductor's cache key, so a change of passes or of
their configuration never reuses a stale compiled artifact. Order: no-op elimination, the
enabled fusions (all-reduce first), clean-up.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from passes.base import GraphPass
from passes.cleanup import CleanupPass
from passes.config import CPU_NATIVE_PASSES, PassConfig, PassContext
from passes.noop_elimination import NoOpEliminationPass
from passes.verifier import has_collectives, verify_pass

logger = logging.getLogger("compilecore.passes")


def op_name(target) -> str:
    """`aten.add` for torch.ops.aten.add.Tensor, `compilecore.fused_add_rms_norm`, ..."""
    packet = getattr(target, "_overloadpacket", target)
    name = getattr(packet, "_qualified_op_name", None)
    if name:
        return name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def op_histogram(graph: fx.Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            name = op_name(node.target)
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def build_passes(
    switches: dict[str, bool],
    context: PassContext,
    custom: Sequence[GraphPass] = (),
    config: PassConfig | None = None,
) -> list[GraphPass]:
    passes: list[GraphPass] = [NoOpEliminationPass()]

    def dtypes(name: str) -> tuple[torch.dtype, ...] | None:
        # On CPU a fusion left at its default fires only where its op's C kernel runs
        # (bf16): elsewhere the op is an opaque reference call a CPU graph cannot record.
        default = config is None or getattr(config, name) is None
        return (torch.bfloat16,) if context.device_type == "cpu" and default else None

    if switches["fuse_allreduce_rms_norm"] and context.tp_size > 1 and context.tp_group_name:
        from passes.fuse_allreduce_rms_norm import AllReduceRMSNormFusionPass

        passes.append(AllReduceRMSNormFusionPass(context.tp_group_name))
    if switches["fuse_add_rms_norm"]:
        from passes.fuse_add_rms_norm import AddRMSNormFusionPass

        passes.append(AddRMSNormFusionPass(dtypes=dtypes("fuse_add_rms_norm")))
    if switches["fuse_qkv_rope"] and context.attention_shapes:
        from passes.fuse_qkv_rope import QKVRoPEFusionPass

        passes.append(QKVRoPEFusionPass(context.attention_shapes, dtypes("fuse_qkv_rope")))
    if switches["fuse_silu_and_mul"]:
        from passes.fuse_silu_and_mul import SiluAndMulFusionPass

        passes.append(SiluAndMulFusionPass(dtypes=dtypes("fuse_silu_and_mul")))
    # Quantized products first: the passes below would take a dequantized weight for a
    # plain one.
    if switches["quantized_linear"] and context.device_type in ("cpu", "cuda"):
        from passes.quantized_linear import QuantizedLinearPass

        int8_x = (config or PassConfig()).int8_x(context.device_type)
        passes.append(QuantizedLinearPass(int8_x, invariant=switches["batch_invariant"]))
    if switches["decompose_dequantize"]:
        from passes.decompose_dequantize import DecomposeDequantizePass

        passes.append(DecomposeDequantizePass())
    # Before gemv_to_reduction, which takes the batch-1 products it leaves.
    if switches["native_linear"] and context.device_type == "cpu":
        from passes.native_linear import NativeLinearPass

        passes.append(NativeLinearPass())
    if switches["gemv_to_reduction"]:
        from passes.gemv_to_reduction import GemvToReductionPass

        passes.append(GemvToReductionPass())
    if switches["splitk_gemv"]:
        from passes.splitk_gemv import SplitKGemvPass

        passes.append(SplitKGemvPass())
    if switches["batch_invariant"]:
        from passes.batch_invariant import BatchInvariantPass

        passes.append(BatchInvariantPass())
    # Last of the built-ins: fusion patterns above still see plain mm.
    if switches["packed_linear"] and context.device_type == "cpu":
        from passes.ops.packed_linear import available
        from passes.packed_linear import PackedLinearPass

        if available():
            passes.append(PackedLinearPass())
    # User passes see the built-in fusions' ops and leave the clean-up to the manager.
    passes.extend(custom)
    passes.append(CleanupPass())
    return passes


@functools.cache
def native_passes_built() -> frozenset[str]:
    """The CPU passes whose C kernels build and are vectorized here: all of them with
    AVX-512 (`layer_kernels`); with AVX2 + FMA only the quantized products
    (`quant_kernels.cpp`'s fp32 row products) and bf16's batched products on a widened
    copy (`packed_linear.widens`), the rest left to Inductor."""
    from passes.ops import layer_kernels, packed_linear, quantized

    if layer_kernels.available():
        return CPU_NATIVE_PASSES
    built = {"quantized_linear"} if quantized.kernel_path() != "portable" else set()
    return frozenset(built | ({"packed_linear"} if packed_linear.available() else set()))


class PostGradPassManager(CustomGraphPass):
    def __init__(
        self,
        config: PassConfig | None = None,
        context: PassContext | None = None,
        passes: list[GraphPass] | None = None,
        custom_passes: Sequence[GraphPass] = (),
    ):
        self.config = config or PassConfig()
        self.context = context or PassContext()
        self.switches = self.config.resolved(self.context.device_type, native_passes_built())
        if passes is None:
            passes = build_passes(self.switches, self.context, custom_passes, self.config)
        self.passes = passes
        self.current_piece = "graph"  # set by the backend before each piece's compile
        self.example_inputs: Sequence[Any] | None = None  # that piece's inputs (verifier)
        # piece -> pass name -> sites matched (pieces whose passes ran; for a piece Inductor's
        # cache answered, the backend adds the report saved when they ran)
        self.match_counts: dict[str, dict[str, int]] = {}
        # piece -> {"before": op histogram, "after": op histogram} around all passes
        self.histograms: dict[str, dict[str, dict[str, int]]] = {}

    def __call__(self, graph: fx.Graph) -> None:
        counts = self.match_counts.setdefault(self.current_piece, {})
        histogram = {"before": op_histogram(graph)}
        verify = self.config.verify and not has_collectives(graph)
        if self.config.verify and not verify:
            logger.info("%s holds collectives: not verified", self.current_piece)
        for step, graph_pass in enumerate(self.passes):
            before = copy.deepcopy(graph) if verify or self.context.dump_dir else None
            matched = int(graph_pass(graph) or 0)
            counts[graph_pass.name] = counts.get(graph_pass.name, 0) + matched
            logger.debug("%s: pass %s matched %d", self.current_piece, graph_pass.name, matched)
            if self.context.dump_dir:
                self._dump(step, graph_pass.name, before, graph, matched)
            if verify and matched:
                verify_pass(graph_pass.name, before, graph, self.current_piece, self.example_inputs)
        histogram["after"] = op_histogram(graph)
        self.histograms[self.current_piece] = histogram

    def _dump(self, step: int, name: str, before: fx.Graph, after: fx.Graph, matched: int) -> None:
        folder = Path(self.context.dump_dir) / self.current_piece
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "order.txt", "w" if step == 0 else "a") as f:
            f.write(f"{name} {matched}\n")
        if not matched:  # the report says it matched 0; a pair of equal files says nothing
            return
        # Named by pass, not by position, so dumps with other passes on still pair up.
        # verbose: each value's dtype and shape; the `# File:` lines are the source lines.
        for label, graph in (("before", before), ("after", after)):
            (folder / f"{name}.{label}.py").write_text(graph.python_code("self", verbose=True).src)

    def uuid(self) -> str:
        parts = [
            inspect.getsource(PostGradPassManager),
            json.dumps(self.switches, sort_keys=True),
            json.dumps(self.context.key(), sort_keys=True, default=str),
            *(p.uuid() for p in self.passes),
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
