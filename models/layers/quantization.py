"""Weight quantization of linear layers and embeddings: which layers hold block-quantized
weights (`QuantizationConfig`, vLLM's `quant_config`), in which format (`QuantFormat`),
and how a layer holds, loads and dequantizes them.

A quantized layer keeps its weight as the format's fields (`qweight`, `scales`, `mins`:
passes/ops/quantized.py describes them), each row-sliced for tensor parallelism like the
weight it replaces. Its forward reads `dequantize(...)` into the same `F.linear` as an
unquantized layer: the traced graph shows `mm(x, dequantize(fields)^T)`, and the compiler
decides how that runs (`passes/quantized_linear.py`, `passes/decompose_dequantize.py`).

Two sources: a GGUF file's blocks (models/gguf.py: kept as stored), or a float
checkpoint quantized when loaded (`quantization="int8"` per output channel,
`"int4"` in groups of 32 or 128 with a scale and a minimum each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from passes.ops import quantized  # noqa: F401 - registers the dequantize ops
from passes.ops.quantized import GROUPS_PER_SUPER, q4_int8_x, unpack_q6


@dataclass(frozen=True)
class QuantFormat:
    # 4 (q4: scale and min per group), 8 (q8: scale per group), 6 (q8's values kept in
    # 6 bits: Q6_K's, passes/ops/quant_layout.py `pack_q6`) or 5 (q4's in 5 bits: Q5_K's,
    # `pack_q5`)
    bits: int
    group: int  # values per scale; 0: one scale per row (per output channel)
    # The K-quants' scales as stored (passes/ops/quantized.py: `expand_compact`): uint8 for
    # Q4_K's scales and mins, int8 for Q6_K's; fp32 where a super-block scale times a
    # sub-block one is held multiplied out (exact in fp32 only).
    scale_dtype: torch.dtype = torch.float16
    # 4-bit indices into IQ4_NL's 16 values (IQ4_NL's, IQ4_XS's; bits 4, groups of 32,
    # fp32 scales): q8's ops, values looked up (passes/ops/quant_layout.py `iq4_values`)
    table: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"block formats have 4, 5, 6 or 8 bits, not {self.bits}")
        if self.scale_dtype == torch.uint8 and not self.has_mins:
            raise ValueError("compact uint8 scales are Q4_K's and Q5_K's: 4 or 5 bits only")
        if self.scale_dtype == torch.int8 and self.has_mins:
            raise ValueError("compact int8 scales are Q6_K's: 6 or 8 bits only")
        if self.bits == 5 and (self.scale_dtype != torch.uint8 or self.group != 32):
            raise ValueError("5-bit values are Q5_K's: groups of 32, compact uint8 scales")
        if self.bits == 6 and (self.scale_dtype != torch.int8 or self.group != 16):
            raise ValueError("6-bit values are Q6_K's: groups of 16, compact int8 scales")
        if self.table and (self.bits, self.group, self.scale_dtype) != (4, 32, torch.float32):
            raise ValueError("IQ4's table indices take 4 bits, groups of 32, fp32 scales")

    @property
    def has_mins(self) -> bool:
        """q4's fields (a min per group; Q5_K's too), which the q4 ops read."""
        return self.bits in (4, 5) and not self.table

    @property
    def compact(self) -> bool:
        return self.scale_dtype in GROUPS_PER_SUPER

    def group_size(self, cols: int) -> int:
        return self.group or cols

    def fields(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each field's shape and dtype for a [rows, cols] weight."""
        g = self.group_size(cols)
        step = 32 if self.has_mins or self.table else 16  # the kernel's run of values
        if cols % g or g % step:
            raise ValueError(
                f"a {self.bits}-bit weight of {cols} columns cannot be held in groups of {g} "
                f"(the row must split into whole groups of a multiple of {step})"
            )
        scales = ((rows, cols // g), self.scale_dtype)
        if self.compact:  # G sub-block bytes, then one fp32 super-block scale per `per`
            groups, per = cols // g, GROUPS_PER_SUPER[self.scale_dtype]
            if groups % per:
                raise ValueError(f"K-quant rows of {cols} columns are not whole super-blocks "
                                 f"of {per * g}")  # fmt: skip
            scales = ((rows, groups + groups // per * 4), self.scale_dtype)
        if self.bits == 8:
            return {"qweight": ((rows, cols), torch.int8), "scales": scales}
        if self.table:
            return {"qweight": ((rows, cols // 2), torch.uint8), "scales": scales}
        if self.bits == 6:  # whole super-blocks (above): whole chunks of 128
            return {"qweight": ((rows, cols // 4 * 3), torch.uint8), "scales": scales}
        if self.bits == 5:
            return {"qweight": ((rows, cols // 8 * 5), torch.uint8), "scales": scales,
                    "mins": scales}  # fmt: skip
        return {"qweight": ((rows, cols // 2), torch.uint8), "scales": scales, "mins": scales}

    def names(self) -> tuple[str, ...]:
        return ("qweight", "scales", "mins") if self.has_mins else ("qweight", "scales")

    def dequantize(self, fields: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The values of `fields` (in `names()` order) in `dtype`."""
        ops = torch.ops.compilecore
        if self.has_mins:
            return ops.dequantize_q4(*fields, dtype)
        return ops.dequantize_q8(*fields, dtype)

    def product(self, x: torch.Tensor, fields: Sequence[torch.Tensor],
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                int8_x: bool = False, invariant: bool = False) -> torch.Tensor:  # fmt: skip
        """x @ values^T (+ bias) read straight from the blocks (the LM head's product,
        which runs outside compiled code); `int8_x`, `invariant`: the ops' arguments of
        those names."""
        ops = torch.ops.compilecore
        if self.has_mins:  # as the pass gives them (`q4_int8_x`)
            int8_x = q4_int8_x(fields[1], int8_x)
            return ops.q4_linear(x, *fields, bias, out_dtype, int8_x, invariant)
        return ops.q8_linear(x, *fields, bias, out_dtype, int8_x, invariant)


def quant_fields(module: nn.Module, fmt: QuantFormat | None = None, suffix: str = ""
                 ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """A quantized module's fields, in its format's `names()` order (`fmt` and `suffix`:
    one part's, of a fused module held per part)."""
    fmt = fmt or module.quant_format
    return tuple(getattr(module, name + suffix) for name in fmt.names())


def formats_held(module: nn.Module) -> list[tuple[QuantFormat, str]]:
    """A module's block formats with its fields' name suffix: its own (`quant_format`,
    no suffix) and each part's of a fused module held per part (`_{shard id}`)."""
    fmt = getattr(module, "quant_format", None)
    held = [] if fmt is None else [(fmt, "")]
    parts = getattr(module, "part_formats", None) or ()
    return held + [(part, f"_{sid}") for (sid, _), part in parts]


def unpack_6bit_values(model: nn.Module, device_type: str | None = None) -> int:
    """Q6_K's values, kept in 6 bits for the CPU's row products (`pack_q6`), unpacked
    once to int8 [N, K] where the weights live elsewhere (`device_type`: the parameters'
    own by default). Every other path reads int8 q8 values as they read Q8_0's; on CUDA
    the Triton product unpacked a full copy on every call before (a 49152 x 2048 head:
    ~2.3 GB of temporaries a step). Returns how many fields were unpacked."""
    count = 0
    for module in model.modules():
        for fmt, suffix in formats_held(module):
            param = getattr(module, "qweight" + suffix)
            where = device_type or param.device.type
            if fmt.bits == 6 and param.dtype == torch.uint8 and where != "cpu":
                param.data = unpack_q6(param.data)  # a tied head shares this parameter
                count += 1
    return count


@dataclass
class QuantizationConfig:
    """`name`: vLLM's `quantization` value. `formats`: layer prefix -> its format, for a
    checkpoint stored quantized (GGUF); `parts`: fused layer prefix -> each part's format,
    in shard order, where the parts are stored in different formats (Q4_K_M's Q4_K q and
    k with a Q6_K v); `default`: the format of every linear layer that `formats` does not
    name, for a float checkpoint quantized when loaded."""

    name: str
    default: QuantFormat | None = None
    formats: dict[str, QuantFormat] = field(default_factory=dict)
    parts: dict[str, tuple[QuantFormat, ...]] = field(default_factory=dict)

    @property
    def quantize_at_load(self) -> bool:
        return self.default is not None

    def format_for(self, prefix: str) -> QuantFormat | None:
        return self.formats.get(prefix, self.default)


# quantization= on a float checkpoint -> the linear layers' format.
AT_LOAD = {
    "int8": QuantFormat(8, 0),  # per output channel
    "int4": QuantFormat(4, 32),
    "int4_g128": QuantFormat(4, 128),
}


def quantization_config(name: str | None) -> QuantizationConfig | None:
    """The config for `LLM(quantization=name)` on a float checkpoint."""
    if name is None:
        return None
    if name in AT_LOAD:
        return QuantizationConfig(name, AT_LOAD[name])
    raise ValueError(
        f"quantization={name!r} is not supported: use 'int8' (per output channel), 'int4' "
        "(groups of 32, a scale and a minimum each) or 'int4_g128' on a float checkpoint, or "
        "pass a .gguf file as the model (its Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and IQ4 "
        "blocks are kept; other types are dequantized)"
    )


def make_quantized_params(module: nn.Module, fmt: QuantFormat, rows: int, cols: int,
                          loader, suffix: str = "") -> list[nn.Parameter]:  # fmt: skip
    """Register `fmt`'s fields on `module` as parameters (named with `suffix`), each
    loaded by `loader`."""
    params = []
    for name, (shape, dtype) in fmt.fields(rows, cols).items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = loader
        module.register_parameter(name + suffix, param)
        params.append(param)
    return params


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """A float weight [rows, cols] in `fmt`'s fields (round to nearest; the scales are
    fp16, and the values are quantized against the rounded scales)."""
    rows, cols = weight.shape
    g = fmt.group_size(cols)
    w = weight.float().reshape(rows, cols // g, g)
    if fmt.bits == 8:
        scales = (w.abs().amax(-1) / 127).half()
        s = scales.float().unsqueeze(-1)
        q = torch.where(s > 0, w / s, 0).round().clamp(-127, 127).to(torch.int8)
        return {"qweight": q.reshape(rows, cols), "scales": scales}
    low, high = w.amin(-1), w.amax(-1)
    scales, mins = ((high - low) / 15).half(), low.half()
    s, m = scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)
    q = torch.where(s > 0, (w - m) / s, 0).round().clamp(0, 15).to(torch.uint8)
    runs = q.reshape(rows, cols // 32, 2, 16)  # GGUF's order: j and j + 16 share a byte
    packed = runs[:, :, 0] | (runs[:, :, 1] << 4)
    return {"qweight": packed.reshape(rows, cols // 2), "scales": scales, "mins": mins}
