"""Pass switches (user-facing) and the facts about the model that patterns need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# On by default only where a benchmark showed the fused op is not slower than Inductor's
# own fusion on that device (benchmarks/pass_ablation.py). On CPU the fused ops run their
# torch reference as an opaque call, which Inductor's generated C++ loops beat.
DEVICE_DEFAULTS = {
    "cpu": {
        "fuse_add_rms_norm": False,
        "fuse_qkv_rope": False,
        "fuse_allreduce_rms_norm": False,
        "fuse_decode_layer": True,
        "gemv_to_reduction": True,
        "packed_linear": True,
    },
    "cuda": {
        "fuse_add_rms_norm": False,
        "fuse_qkv_rope": False,
        "fuse_allreduce_rms_norm": False,
        "fuse_decode_layer": False,
        "gemv_to_reduction": False,
        "packed_linear": False,
    },
}


@dataclass
class PassConfig:
    fuse_add_rms_norm: bool | None = None  # None: the device's default
    fuse_qkv_rope: bool | None = None
    fuse_allreduce_rms_norm: bool | None = None
    # A decoder layer's one-token piece as one op of our C loops (CPU, bf16, AVX-512).
    fuse_decode_layer: bool | None = None
    # Small static-M GEMMs as vectorized reductions (pieces compiled for compile_sizes).
    gemv_to_reduction: bool | None = None
    # Other CPU GEMMs with 16-bit weights on a weight packed once (`compilecore.packed_mm`).
    packed_linear: bool | None = None
    # Run each piece's graph before and after every pass on random inputs and compare.
    verify: bool = False

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

    def resolved(self, device_type: str) -> dict[str, bool]:
        defaults = DEVICE_DEFAULTS.get(device_type, DEVICE_DEFAULTS["cpu"])
        return {
            name: default if getattr(self, name) is None else bool(getattr(self, name))
            for name, default in defaults.items()
        } | {"verify": self.verify}


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
