"""Pass switches (user-facing) and the facts about the model that patterns need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# On by default only where a benchmark showed the fused op is not slower than Inductor's own
# fusion on that device (benchmarks/pass_ablation.py; docs/kernel-choices.md, The layer region).
# On CPU the mission's fusions and the batch-1 product make the fast path: each fused op has a C
# kernel that a CPU graph replays in one parallel region with the products.
DEVICE_DEFAULTS = {
    "cpu": {
        "fuse_add_rms_norm": True,
        "fuse_qkv_rope": True,
        "fuse_silu_and_mul": True,
        "fuse_allreduce_rms_norm": False,
        "quantized_linear": True,
        "decompose_dequantize": True,
        "native_linear": True,
        "gemv_to_reduction": True,
        "packed_linear": True,
        "splitk_gemv": False,
    },
    "cuda": {
        "fuse_add_rms_norm": False,
        "fuse_qkv_rope": False,
        "fuse_silu_and_mul": False,
        "fuse_allreduce_rms_norm": False,
        "quantized_linear": False,
        "decompose_dequantize": True,
        "native_linear": False,
        "gemv_to_reduction": False,
        "packed_linear": False,
        "splitk_gemv": False,
    },
}

# Passes whose ops run our own C kernels on CPU: on there by default only where the
# kernels build, and off by default with `native_kernels=False` (Inductor's code alone).
CPU_NATIVE_PASSES = frozenset(
    {
        "fuse_add_rms_norm",
        "fuse_qkv_rope",
        "fuse_silu_and_mul",
        "quantized_linear",
        "native_linear",
        "packed_linear",
    }  # fmt: skip
)


# Passes that choose a product's kernel by its row count (or emit our C kernels, whose
# choices do): all off in batch-invariant mode.
ROW_COUNT_PASSES = CPU_NATIVE_PASSES | {"gemv_to_reduction", "splitk_gemv"}


@dataclass
class PassConfig:
    fuse_add_rms_norm: bool | None = None  # None: the device's default
    fuse_qkv_rope: bool | None = None
    fuse_allreduce_rms_norm: bool | None = None
    fuse_silu_and_mul: bool | None = None
    # Products with block-quantized weights as `compilecore.q4_linear` / `q8_linear`: our C loop
    # on the blocks on CPU; on CUDA a Triton kernel, off there by default: an H200 ran it at
    # 0.53-0.74x Inductor's dequantization + cuBLAS (docs/kernel-choices.md, Quantized products
    # on CUDA).
    quantized_linear: bool | None = None
    # Q8_0's products quantize the activations to int8 per run of 32, as llama.cpp does for its
    # own: 1.5x the exact bf16 products over 6 rows and more, 1.01-1.22x at 1-2 rows (3-5 stay
    # exact), on AVX512-VNNI; so do the K-quants' row products (Q4_K 1-7 rows, 1.45x raw; Q6_K
    # 1-5: docs/kernel-choices.md, Int8 activations); with AMX, q8's products of 128 rows and
    # more multiply a copy rounded to bf16 in oneDNN's tiles (docs/kernel-choices.md, Strips).
    # False: every product exact. CPU only.
    int8_activations: bool = True
    # Dequantization ops left as the reference's plain ops, for Inductor to fuse.
    decompose_dequantize: bool | None = None
    # Batch-1 products as `compilecore.linear` (our C loop; CPU, bf16, AVX-512).
    native_linear: bool | None = None
    # Small static-M GEMMs as vectorized reductions (pieces compiled for compile_sizes).
    gemv_to_reduction: bool | None = None
    # Other CPU GEMMs with 16-bit weights on a weight packed once (`compilecore.packed_mm`).
    packed_linear: bool | None = None
    # Small static-M products as split-K partials (a Triton kernel on CUDA) summed by their
    # consumer (passes/splitk_gemv.py). Off by default: untimed on a device.
    splitk_gemv: bool | None = None
    # Run each piece's graph before and after every pass on random inputs and compare.
    verify: bool = False
    # False: no pass emits an op that runs our own C kernels by default on CPU (Inductor's
    # generated code only), the compiler's own number beside the native one.
    native_kernels: bool = True
    # Batch-invariant mode (`compilation_config={"batch_invariant": True}`): every product
    # one op whose rows do not depend on the batch (passes/batch_invariant.py), every pass
    # that picks a kernel by the row count off.
    batch_invariant: bool = False

    @classmethod
    def from_any(cls, value: PassConfig | dict | None) -> PassConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"compilation_config.passes has unknown fields: {sorted(unknown)}")
        return cls(**value)

    def int8_x(self, device_type: str) -> bool:
        """Whether q8 products get `int8_x=True` (the pass's and the quantized LM head's)."""
        return device_type == "cpu" and self.int8_activations

    def resolved(
        self, device_type: str, built: frozenset[str] = CPU_NATIVE_PASSES
    ) -> dict[str, bool]:
        """Each switch on or off; `built`: the passes of `CPU_NATIVE_PASSES` whose C kernels
        build (and are vectorized) on this CPU (`passes.manager.native_passes_built`)."""
        defaults = dict(DEVICE_DEFAULTS.get(device_type, DEVICE_DEFAULTS["cpu"]))
        if device_type == "cpu":
            off = CPU_NATIVE_PASSES - (built if self.native_kernels else frozenset())
            defaults |= dict.fromkeys(off, False)
        switches = {
            name: default if getattr(self, name) is None else bool(getattr(self, name))
            for name, default in defaults.items()
        }
        if self.batch_invariant:  # the quantized products keep one path for every row count
            keep = {"quantized_linear"} if device_type == "cpu" else set()
            switches |= dict.fromkeys(ROW_COUNT_PASSES - keep, False)
        return switches | {"verify": self.verify, "batch_invariant": self.batch_invariant}


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int  # per rank
    num_kv_heads: int
    head_dim: int


@dataclass
class PassContext:
    """What the compile backend knows about the model, for the patterns."""

    device_type: str = "cpu"
    attention_shapes: list[AttentionShape] = field(default_factory=list)
    tp_size: int = 1
    tp_group_name: str | None = None
    dump_dir: str | None = None  # graphs before/after each pass go here when set

    def key(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("dump_dir")
        return d
