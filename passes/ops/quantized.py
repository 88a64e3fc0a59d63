"""Block-quantized weights: the two formats, their dequantization (the reference every
quantized product is checked against), and the products that read them directly.

Formats (planar, one tensor per field, so that a tensor-parallel slice of output rows is a
slice of each field, and a slice of input columns one of whole groups):

- q4: `w` uint8 [N, K/2], in each run of 32 values byte j holds value j (low nibble) and
  value j + 16 (high nibble), GGUF's order; `scales`, `mins` fp16 (or fp32) [N, K/g];
  value = scale * q + min. GGUF Q4_1 as stored; Q4_0 is min = -8 scale; int4 groups;
  Q4_K with its scales and mins as stored (compact): uint8 [N, G + G/2], per row the G
  6-bit sub-block scales (mins) then G/8 fp32 super-block scales (-mins); scale = super x
  sub, exact in fp32 (`expand_compact`). Q5_K as Q4_K with q in [0, 31], its values
  kept in 5 bits: `w` uint8 [N, 5K/8] (`pack_q5`; passes/ops/quant_layout.py).
- q8: `w` int8 [N, K], `scales` fp16 (or fp32) [N, K/g]; value = scale * q. GGUF Q8_0
  (g = 32), int8 per output channel (g = K); Q6_K (g = 16, q - 32) with its scales as
  stored (compact): int8 [N, G + G/4], per row the G int8 sub-block scales then G/16
  fp32 super-block scales, and its values kept in 6 bits: `w` uint8 [N, 3K/4]
  (`pack_q6`). IQ4_NL / IQ4_XS: `w` uint8 [N, K/2], 4-bit indices into a table of 16
  integers in q4's nibble order (`iq4_values`), fp32 `scales` [N, K/32].

Ops (namespace `compilecore`): `dequantize_q4`, `dequantize_q8` (what a quantized linear
layer traces as: `mm(x, dequantize(...)^T)`, visible in every dump), and `q4_linear`,
`q8_linear`: the product read straight from the blocks (`quant_kernels.cpp` on CPU, a
Triton kernel on CUDA: `triton_quant.py`), which
`passes/quantized_linear.py` puts in place of that pair for a few static rows. Where
no pass fires, `passes/decompose_dequantize.py` hands Inductor the reference's plain ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F

from passes import native, native_calls
from passes.native_calls import NativeCall
from passes.ops.invariant_mm import LONG_ROWS, invariant_mm
from passes.ops.packed_linear import bf16_gemm_is_native, fp32_linear, has_amx
from passes.ops.quant_layout import (  # noqa: F401 - the layouts, re-exported
    GROUPS_PER_SUPER,
    groups_of,
    iq4_values,
    is_compact,
    is_iq4,
    is_q5,
    pack_q5,
    pack_q6,
    q4_columns,
    unpack_q5,
    unpack_q6,
)
from passes.ops.scratch import row_slices, scratch
from passes.ops.triton_utils import HAS_TRITON

RUN = 32  # values per nibble run of q4 (the group size is a multiple of it)
# Rows up to which the products read the blocks directly (exact, bound by reading the
# weight); more rows are compute-bound and dequantize once (this file's kernel) into a
# dense GEMM. With bf16 x the dense path rounds each q4 value to bf16 (Q4_1's perplexity:
# unchanged, docs/kernel-choices.md, Int8 activations). Q8_0's values have up to 19 bits, and
# rounding them moved 43% of a product's outputs off the exact one's rounding, so q8's dense
# path multiplies [x | x] by a split [hi | lo] copy (16 bits, twice the GEMM's work). Where the
# kernel multiplies the blocks' integers in bf16 (AVX512-BF16, `BF16_ROWS`), its strips of 16
# weight rows (8 rows of x and more) beat the dense path for q4 up to 64 rows (1.09x there,
# 0.86x at 128) and for q8 at every row count measured, 64-2048 (1.44-1.97x):
# docs/kernel-choices.md, Strips. Never below 16, the CPU graphs' largest batch, whose replays
# take team calls only.
MAX_KERNEL_ROWS = MappingProxyType({4: 32, 8: 128})
BF16_ROWS = MappingProxyType({4: 64, 8: None})  # None: no limit
# With AMX, oneDNN's bf16 tiles on the copy rounded to bf16 (`dense_from_blocks`) beat q8's
# strips on int8 activations from 128 rows: 1.1-1.4x there, 2.4-3.1x at 512, 0.7-0.94x at 64
# (benchmarks/ab_dense_copy.py). Exact products keep the strips: `int8_activations=False`
# means exact on every CPU (the split copy, 1.6-2.2x faster, is 16 bits of Q8_0's 19).
AMX_DENSE_ROWS = 128
# Without AMX, Q4_K's int8 strips (VNNI, 16 weight rows) beat the dense copy from 128 rows
# on the 1.7B's shapes (1.10-1.28x at 128-512, a tie at 64) and its exact strips 1.2-1.6x
# at 8-512 (benchmarks/ab_quant_raw.py): with int8 activations it keeps the kernel at
# every row count there.
# The fp32 path (AVX2 + FMA): q8's row products lose to MKL's fp32 GEMM on the dequantized
# weight from 32-64 rows (1536x576: 0.68x at 64 rows, 0.57x at 128), q4's break even at 64.
FP32_ROWS = MappingProxyType({4: 32, 8: 32})
# The K-quants', IQ4's and Q8_0's row products on int8 activations there (`int8_pairs`;
# many rows in strips of 16 decoded weight rows) take every row count: against that GEMM
# on the 1.7B's shapes (2 threads) Q4_K 2.25x / 1.75x / 1.21x at 64 / 128 / 512 rows, Q8_0
# 2.49x / 1.64x / 1.18x, Q6_K 1.33x / 1.06x / 0.92x at 64 / 128 / 256, IQ4 0.97x at 512
# alone; in the model, where the dense copy's scratch and x's conversion count too, a
# 512-token prefill with Q6_K, IQ4 and Q8_0 on them past 128 rows ran 1.06x (Q4_K_M
# file), 1.18x (Q8_0) and 1.34x (IQ4_XS) their dense copies (docs/quantization.md).
PAIRS_ROWS = MappingProxyType({4: None, 8: None})  # None: no limit


def expand_compact(field: torch.Tensor) -> torch.Tensor:
    """Scales (or mins) as stored: fp32 [..., G], each a super-block's fp32 scale times a
    sub-block's byte (exact). Q4_K's: uint8 [..., G + G/2], 6-bit bytes, 8 groups a
    super-block; Q6_K's: int8 [..., G + G/4], 16 groups a super-block."""
    g, per = groups_of(field), GROUPS_PER_SUPER[field.dtype]
    sub = field[..., :g].float().unflatten(-1, (g // per, per))
    sup = field[..., g:].contiguous().view(torch.float32).unsqueeze(-1)
    return (sub * sup).flatten(-2)


def dequantize_q4_ref(
    w: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """q4 blocks [..., K/2] (Q5_K's [..., 5K/8]) -> values [..., K] in `dtype`, computed
    in fp32."""
    lead, k = w.shape[:-1], q4_columns(w, scales)
    if is_q5(w, scales):
        q = unpack_q5(w)
    else:
        runs = w.reshape(*lead, k // RUN, 1, RUN // 2)
        # Low nibbles then high ones, as one broadcast shift (Inductor fuses it; a stack of
        # two halves would be a concatenation it materializes).
        shifts = (torch.arange(2, dtype=torch.uint8, device=w.device) * 4).unsqueeze(-1)
        q = (runs >> shifts) & 15
    if is_compact(scales):
        scales, mins = expand_compact(scales), expand_compact(mins)
    q = q.reshape(*lead, scales.shape[-1], -1)
    values = q.float() * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return values.reshape(*lead, k).to(dtype)


def q4_int8_x(scales: torch.Tensor, int8_x: bool) -> bool:
    """Whether a q4 product with these scales takes int8 activations where `int8_x` allows
    them: the K-quants' (compact) only, as llama.cpp multiplies Q4_K; Q4_0 / Q4_1 stay exact
    (int8 cost the shipped Q4_1 model 1.2% perplexity, docs/kernel-choices.md)."""
    return bool(int8_x) and is_compact(scales)


def q8_columns(w: torch.Tensor, scales: torch.Tensor) -> int:
    """The values a row of q8 blocks holds (Q6_K's 6-bit rows: 4 for 3 bytes; IQ4's
    indices: 2 a byte)."""
    if w.dtype != torch.uint8:
        return w.shape[-1]
    return 2 * w.shape[-1] if is_iq4(w, scales) else w.shape[-1] // 3 * 4


def dequantize_q8_ref(w: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q8 blocks [..., K] (Q6_K's 6-bit [..., 3K/4], IQ4's indices [..., K/2]) -> values
    [..., K] in `dtype`, computed in fp32."""
    lead, k = w.shape[:-1], q8_columns(w, scales)
    if is_iq4(w, scales):  # q4's nibble order, each nibble an index into the table
        shifts = (torch.arange(2, dtype=torch.uint8, device=w.device) * 4).unsqueeze(-1)
        w = iq4_values((w.reshape(*lead, k // RUN, 1, RUN // 2) >> shifts) & 15)
    elif w.dtype == torch.uint8:
        w = unpack_q6(w)
    if is_compact(scales):
        scales = expand_compact(scales)
    q = w.reshape(*lead, scales.shape[-1], -1)
    return (q.float() * scales.float().unsqueeze(-1)).reshape(*lead, k).to(dtype)


def dequantized_dtype(match: object) -> torch.dtype | None:
    """The dtype a pattern match's dequantize op produces (the pattern matcher ignores
    dtype arguments when matching, so patterns registered per dtype check it)."""
    ops = (torch.ops.compilecore.dequantize_q4.default, torch.ops.compilecore.dequantize_q8.default)
    for node in getattr(match, "nodes", ()):
        if node.target in ops:
            return node.args[-1]
    return None


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    # Every argument travels as an int64 (pointers too); a region's team size last.
    return native.load_op_kernel(
        Path(__file__).with_name("quant_kernels.cpp"), "quant_kernels_available", (),
        ("q4_linear_team(i64 x11)", "q4_linear_region(i64 x12)", "q8_linear_team(i64 x10)",
         "q8_linear_region(i64 x11)", "quant_kernels_path(i64 x4) -> i64",
         "quant_kernels_int8_rows() -> i64", "quant_kernels_invariant_rows() -> i64",
         "quant_kernels_amx_tiles() -> i64", "quant_kernels_int8_pairs() -> i64",
         "dequantize_q4_region(i64 x9)",
         "dequantize_q8_region(i64 x8)"),
    )  # fmt: skip


# Scale dtypes the kernel reads (uint8: Q4_K's compact scales; int8: Q6_K's), and their
# flag bits.
_SCALE_DTYPES = {True: (torch.float16, torch.float32, torch.uint8),
                 False: (torch.float16, torch.float32, torch.int8)}  # fmt: skip


def _kernel_reads(w: torch.Tensor, scales: torch.Tensor, q4: bool) -> bool:
    """Whether the kernel reads these values: q4's uint8; q8's int8, Q6_K's 6-bit uint8
    rows beside their compact scales, or IQ4's indices."""
    if q4:
        return w.dtype == torch.uint8
    return w.dtype == torch.int8 or (
        w.dtype == torch.uint8 and (scales.dtype == torch.int8 or is_iq4(w, scales))
    )


def _scale_flags(scales: torch.Tensor, w: torch.Tensor, q4: bool) -> int:
    """Flag bits 2 (fp32 scales), 4 (compact), 6 (values in other bits than the format's
    own: q8's in 6, Q6_K's; q4's in 5, Q5_K's) and 8 (q8's values are IQ4's indices)."""
    iq4 = not q4 and is_iq4(w, scales)
    packed = is_q5(w, scales) if q4 else w.dtype == torch.uint8 and not iq4
    flags = 4 * int(scales.dtype == torch.float32) | 16 * int(is_compact(scales))
    return flags | 64 * packed | 256 * iq4


def _dequantize_native(
    w: torch.Tensor, fields: tuple[torch.Tensor, ...], dtype: torch.dtype, split: bool = False,
    into_scratch: bool = False,
) -> torch.Tensor | None:  # fmt: skip
    """The kernel's dequantization of 2-D blocks on CPU into bf16 or fp32 (the same values
    as the reference, ~10x faster), or None where it does not apply. `split` (bf16): rows
    [hi | lo] of 2K, hi + lo the value to 16 bits. `into_scratch`: written into this
    thread's scratch (passes/ops/scratch.py), valid until its next use."""
    q4 = len(fields) == 2
    k = q4_columns(w, fields[0]) if q4 else q8_columns(w, fields[0])
    if (
        w.dim() != 2
        or dtype not in (torch.float32, torch.bfloat16)
        or k % RUN
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in (w, *fields))
        or any(t.dtype not in _SCALE_DTYPES[q4] for t in fields)
        or len({t.dtype for t in fields}) != 1
        or not _kernel_reads(w, fields[0], q4)
        or (lib := _kernel()) is None
    ):
        return None
    n, groups = w.shape[0], groups_of(fields[0])
    split = split and dtype == torch.bfloat16
    shape = (n, 2 * k if split else k)
    out = scratch(shape, dtype) if into_scratch else torch.empty(shape, dtype=dtype)
    flags = int(dtype == torch.bfloat16) | 8 * split | _scale_flags(fields[0], w, q4)
    args = (w, *fields, out, flags, n, k, k // groups, torch.get_num_threads())
    region = lib.dequantize_q4_region if q4 else lib.dequantize_q8_region
    region(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))
    return out


def dequantize_q4(w, scales, mins, dtype):
    out = _dequantize_native(w, (scales, mins), dtype)
    return dequantize_q4_ref(w, scales, mins, dtype) if out is None else out


def dequantize_q8(w, scales, dtype):
    out = _dequantize_native(w, (scales,), dtype)
    return dequantize_q8_ref(w, scales, dtype) if out is None else out


@functools.cache
def kernel_path() -> str:
    """How the kernel takes bf16 activations here: "bf16" (exact: AVX512-BF16), "int8"
    (AVX512-VNNI: quantized per run of 32 where the call allows int8 activations, else
    converted to fp32), "fp32" (converted: AVX-512, or AVX2 + FMA) or "portable"."""
    lib = _kernel()
    level = 0 if lib is None else int(lib.quant_kernels_vectorized())
    return ("portable", "fp32", "int8", "bf16")[level]


@functools.cache
def int8_strips() -> bool:
    """Whether `q8_linear(..., int8_x=True)` quantizes activations here (AVX512-BF16 and
    AVX512-VNNI: Q8_0's products, its strips from 6 rows and its row products for 1-2
    rows; 3-5 rows and the rows past a whole number of strips stay exact)."""
    lib = _kernel()
    return lib is not None and bool(lib.quant_kernels_int8_strips())


# Batch-invariant mode (`invariant=True`): up to this many rows the exact row products,
# above it the strips; each path gives a row the same bits at any row count and offset,
# and the scheduler keeps short queries (decodes, verifications) and long chunks in
# separate steps (runtime/scheduler.py). The kernels' INVARIANT_ROWS (quant/formats.h).
INVARIANT_ROWS = 16


def kernel_invariant_rows() -> int | None:
    """The kernels' own INVARIANT_ROWS (None where they do not build): must equal ours."""
    lib = _kernel()
    return None if lib is None else int(lib.quant_kernels_invariant_rows())


@functools.cache
def int8_rows() -> int:
    """Rows up to which `q8_linear(..., int8_x=True)` quantizes bf16 activations in Q8_0's
    row products (1-2 with AVX512-BF16 and AVX512-VNNI, or with AVX2: there 1.3x the
    exact product's speed on the default model's head, benchmarks/ab_quant_raw.py); 0
    where they stay exact."""
    lib = _kernel()
    return 0 if lib is None else int(lib.quant_kernels_int8_rows())


def int8_pairs() -> bool:
    """Whether the K-quants' (Q4_K, Q5_K, Q6_K), IQ4's and Q8_0's row products quantize
    activations where `int8_x` allows them at every row count they take, AVX2's way (no
    AVX-512: quant/rows_avx2_int8.h; K a multiple of 64)."""
    lib = _kernel()
    return lib is not None and bool(lib.quant_kernels_int8_pairs())


@functools.cache
def amx_tiles() -> bool:
    """Whether exact products of 3-64 bf16 rows take AMX tiles here (quant/tiles_amx.h:
    Q4_0, Q4_1, Q4_K, Q5_K, Q8_0, Q6_K from 6 rows; 16 weight rows at a time): exact as
    the row products, the fp32 sums in another order, so not in batch-invariant mode."""
    lib = _kernel()
    return lib is not None and bool(lib.quant_kernels_amx_tiles())


@functools.cache
def _bf16_path(bits: int, k: int, group: int) -> bool:
    """Whether the kernel takes bf16 activations on its exact bf16 path for this shape."""
    lib = _kernel()
    return lib is not None and lib.quant_kernels_path(int(bits == 4), k, group, 0) == 1


def _invariant_dense(x: torch.Tensor, bits: int, scales: torch.Tensor) -> bool:
    """Batch-invariant mode's long steps take a dense GEMM where the default does at many
    rows (q4 on bf16 x, `BF16_ROWS`; q8's strips win at every row count there)."""
    return (
        x.shape[0] > INVARIANT_ROWS
        and BF16_ROWS[bits] is not None
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and bf16_gemm_is_native()
        and _bf16_path(bits, x.shape[-1], x.shape[-1] // groups_of(scales))
    )


def _few_enough_rows(
    x: torch.Tensor, w: torch.Tensor, fields: tuple, group: int, int8_x: bool
) -> bool:
    bits = 4 if len(fields) == 2 else 8
    exact = x.dtype == torch.bfloat16 and _bf16_path(bits, x.shape[-1], group)
    limit = BF16_ROWS[bits] if exact else MAX_KERNEL_ROWS[bits]
    if exact and bits == 8 and int8_x and has_amx():  # exact products keep the strips
        limit = AMX_DENSE_ROWS - 1
    # Q4_K's and Q5_K's int8 strips beat the dense copy at every row count (1.10-1.48x at
    # 128-512 rows, docs/kernel-choices.md, Int8 activations)
    k_quant = bits == 4 and group == RUN and is_compact(fields[0])
    if exact and k_quant and int8_x and int8_strips() and not has_amx():
        limit = None
    if kernel_path() == "fp32":
        # int8 x on q4 is the K-quants' (`q4_int8_x`); on q8 Q8_0's and IQ4's (groups of
        # 32) and Q6_K's (16, packed in bytes)
        q6_k = group == 16 and w.dtype == torch.uint8
        pairs = int8_x and (bits == 4 or group == 32 or q6_k) and int8_pairs()
        limit = PAIRS_ROWS[bits] if pairs and x.shape[-1] % 64 == 0 else FP32_ROWS[bits]
    return limit is None or x.shape[0] <= limit


def _product_call(
    name: str, x: torch.Tensor, w: torch.Tensor, fields: tuple, bias: torch.Tensor | None,
    y: torch.Tensor, int8_x: bool = False, invariant: bool = False,
) -> NativeCall | None:  # fmt: skip
    """The kernel's call for y = x @ dequantize(w, *fields)^T (+ bias), or None where it
    does not apply (a GPU, another dtype, a strided input, many rows, no compiler).
    `invariant` (batch-invariant mode): the row products at every row count, exact."""
    groups, bits = groups_of(fields[0]), 4 if len(fields) == 2 else 8
    tensors = (x, w, *fields, y) + (() if bias is None else (bias,))
    floats = (torch.float32, torch.bfloat16)
    if (
        x.dim() != 2
        or x.shape[-1] % groups
        or not (invariant or _few_enough_rows(x, w, fields, x.shape[-1] // groups, bool(int8_x)))
        or x.dtype not in floats
        or y.dtype not in floats
        or (bias is not None and bias.dtype != x.dtype)
        or any(f.dtype not in _SCALE_DTYPES[bits == 4] for f in fields)
        or len({f.dtype for f in fields}) != 1
        or not _kernel_reads(w, fields[0], bits == 4)
        or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
        or (lib := _kernel()) is None
    ):
        return None
    m, k = x.shape
    n = w.shape[0]
    flags = int(x.dtype == torch.bfloat16) | 2 * int(y.dtype == torch.bfloat16)
    flags |= _scale_flags(fields[0], w, bits == 4) | 32 * int(bool(int8_x) and not invariant)
    flags |= 128 * int(bool(invariant))
    args = (x, flags, w, *fields, 0 if bias is None else bias, y, m, n, k, k // groups)
    team, region = getattr(lib, f"{name}_team"), getattr(lib, f"{name}_region")
    return NativeCall(
        native_calls.function_address(team), args, f"compilecore.{name}", torch.get_num_threads(),
        region,
    )  # fmt: skip


def _q4_call(args: tuple, out: torch.Tensor) -> NativeCall | None:
    x, w, scales, mins, bias, _, int8_x, invariant = (*args, None, None, False, False)[:8]
    return _product_call("q4_linear", x, w, (scales, mins), bias, out, int8_x, invariant)


def _q8_call(args: tuple, out: torch.Tensor) -> NativeCall | None:
    x, w, scales, bias, _, int8_x, invariant = (*args, None, None, False, False)[:7]
    return _product_call("q8_linear", x, w, (scales,), bias, out, int8_x, invariant)


def _product_ref(x, weight, bias, out_dtype):
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(out_dtype)


def q4_linear_ref(x, w, scales, mins, bias=None, out_dtype=None, int8_x=False, invariant=False):
    """y [M, N] = x @ dequantize_q4(w, scales, mins)^T (+ bias), in `out_dtype` (x's);
    exact (`int8_x` allows the kernel an approximation; never the reference)."""
    dtype = torch.promote_types(x.dtype, out_dtype or x.dtype)
    return _product_ref(x, dequantize_q4_ref(w, scales, mins, dtype), bias, out_dtype)


def q8_linear_ref(x, w, scales, bias=None, out_dtype=None, int8_x=False, invariant=False):
    """The exact product (`int8_x` allows the kernel an approximation; never the reference)."""
    dtype = torch.promote_types(x.dtype, out_dtype or x.dtype)
    return _product_ref(x, dequantize_q8_ref(w, scales, dtype), bias, out_dtype)


def _dense_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a dense product beyond the kernel's rows dequantizes into and multiplies in."""
    dtype = torch.promote_types(x.dtype, out_dtype or x.dtype)
    if dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_gemm_is_native():
        return torch.float32
    return dtype


def _dense_product(x, weight, bias, out_dtype):
    """x @ weight^T (+ bias) in weight's dtype, the result in `out_dtype` (x's)."""
    out_dtype = out_dtype or x.dtype
    if weight.dtype != x.dtype:
        x, bias = x.to(weight.dtype), None if bias is None else bias.to(weight.dtype)
    return _product_ref(x, weight, bias, out_dtype)


def q4_linear(x, w, scales, mins, bias=None, out_dtype=None, int8_x=False, invariant=False):
    """y [M, N] = x @ dequantize_q4(w, scales, mins)^T (+ bias). `int8_x`: with bf16 x, on
    CPUs with AVX512-BF16 and AVX512-VNNI, the row products (below the strips' 8 rows) and
    Q4_K's strips may quantize x to int8 per run of 32, as llama.cpp multiplies its K-quants
    (the pass asks for it for Q4_K's: docs/kernel-choices.md, Int8 activations), within the
    same bound as Q8_0's (tests/test_quantized.py).
    `invariant` (batch-invariant mode): a row's bits never depend on the other rows: the
    exact row products up to INVARIANT_ROWS rows, above it (a long prefill chunk's step,
    where bf16 GEMMs are native) the dense copy's GEMM one tile of LONG_ROWS a call
    (`invariant_mm`), as the default takes it past 64 rows."""
    if invariant and _invariant_dense(x, 4, scales):
        weight = dequantize_q4(w, scales, mins, torch.bfloat16)
        y = invariant_mm(x, weight.t(), LONG_ROWS)
        return y if bias is None else y + bias
    y = x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)
    call = _q4_call((x, w, scales, mins, bias, out_dtype, int8_x, invariant), y)
    if call is None:  # many rows (a prefill): a dense copy, then the dense product
        dtype = _dense_dtype(x, out_dtype)
        y = dense_from_blocks(x, w, (scales, mins), bias, out_dtype, dtype)
        if y is None:
            y = _dense_product(x, dequantize_q4(w, scales, mins, dtype), bias, out_dtype)
        return y
    call.run()
    return y


def q8_linear(x, w, scales, bias=None, out_dtype=None, int8_x=False, invariant=False):
    """y [M, N] = x @ dequantize_q8(w, scales)^T (+ bias). `int8_x`: for Q8_0 (bf16 x,
    groups of 32, AVX512-BF16 and AVX512-VNNI) x may be quantized to int8 per run of 32 as
    llama.cpp does: its strips (6 rows and more) 1.5x the exact products' speed, its row
    products for 1-2 rows 1.01-1.22x (docs/kernel-choices.md), within ~1% of the largest output
    (tests/test_quantized.py bounds it); 3-5 rows (where the integer row product was slower) and
    the rows past a whole number of strips (a strip: 16 weight rows) stay exact. Q6_K's 6-bit
    values take it in their row products (1-5 rows) and strips (docs/kernel-choices.md).
    `invariant`: as `q4_linear`'s."""
    y = x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)
    call = _q8_call((x, w, scales, bias, out_dtype, int8_x, invariant), y)
    if call is None:
        return q8_dense_product(x, w, scales, bias, out_dtype, int8_x)
    call.run()
    return y


def q8_dense_product(x, w, scales, bias=None, out_dtype=None, int8_x=False):
    """Beyond the kernel's rows: a dense GEMM on a dequantized copy; bf16 multiplies
    [x | x] by the split [hi | lo] copy (Q8_0's values do not fit bf16: 19 bits), or with
    `int8_x` on AMX (from AMX_DENSE_ROWS) by the copy rounded to bf16 (the approximation
    `int8_x` allows, whose error is below int8 activations': tests/test_quantized.py bounds
    both); fp32 where the CPU has no bf16 GEMM (`bf16_gemm_is_native`)."""
    dtype = _dense_dtype(x, out_dtype)
    if x.dim() == 2:
        split = dtype == torch.bfloat16 and not (int8_x and has_amx())
        y = dense_from_blocks(x, w, (scales,), bias, out_dtype, dtype, split)
        if y is not None:
            return y
    return _dense_product(x, dequantize_q8(w, scales, dtype), bias, out_dtype)


def dense_from_blocks(x, w, fields, bias, out_dtype, dtype, split=False):
    """x @ dequantize(w, *fields)^T (+ bias), the weight dequantized into `dtype` in this
    thread's scratch a slice of rows at a time, each slice one library GEMM (`split`: [x | x]
    times the [hi | lo] copy); None where the native dequantization does not apply."""
    if x.dim() != 2:
        return None
    q4 = len(fields) == 2
    k = q4_columns(w, fields[0]) if q4 else q8_columns(w, fields[0])
    width = 2 * k if split else k
    slices = row_slices(w.shape[0], width * dtype.itemsize)
    out_dtype = out_dtype or x.dtype
    x = (torch.cat([x, x], 1) if split else x).to(dtype)  # once, not a slice at a time
    bias = None if bias is None else bias.to(dtype)
    fp32 = dtype == torch.float32  # CPUs without a bf16 GEMM: `fp32_linear`
    if len(slices) > 1 or fp32:
        y = x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype)
    for a, b in slices:
        part = _dequantize_native(w[a:b], tuple(f[a:b] for f in fields), dtype, split, True)
        if part is None:
            return None
        part_bias = None if bias is None else bias[a:b]
        if fp32:
            fp32_linear(x, part, part_bias, y[:, a:b])
            continue
        out = _product_ref(x, part, part_bias, out_dtype)
        if len(slices) == 1:
            return out
        y[:, a:b] = out
    return y


def q4_linear_cuda(x, w, scales, mins, bias=None, out_dtype=None, int8_x=False, invariant=False):
    from passes.ops.triton_quant import INVARIANT_TILE, quant_linear_triton

    tile = INVARIANT_TILE if invariant else None
    return quant_linear_triton(x, w, (scales, mins), bias, out_dtype, tile)


def q8_linear_cuda(x, w, scales, bias=None, out_dtype=None, int8_x=False, invariant=False):
    from passes.ops.triton_quant import INVARIANT_TILE, quant_linear_triton

    tile = INVARIANT_TILE if invariant else None
    return quant_linear_triton(x, w, (scales,), bias, out_dtype, tile)


def _fake_q4(x, w, scales, mins, bias=None, out_dtype=None, int8_x=False, invariant=False):
    return x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)


def _fake_q8(x, w, scales, bias=None, out_dtype=None, int8_x=False, invariant=False):
    return x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype)


def _fake_dequantize_q4(w, scales, mins, dtype):
    return w.new_empty(*w.shape[:-1], q4_columns(w, scales), dtype=dtype)


def _fake_dequantize_q8(w, scales, dtype):
    return w.new_empty(*w.shape[:-1], q8_columns(w, scales), dtype=dtype)


# Through `torch.library.Library` (no Python wrapper per call; docs/kernel-choices.md, Library
# registration).
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("dequantize_q4(Tensor w, Tensor scales, Tensor mins, ScalarType dtype) -> Tensor")
_LIB.define("dequantize_q8(Tensor w, Tensor scales, ScalarType dtype) -> Tensor")
_LIB.define(
    "q4_linear(Tensor x, Tensor w, Tensor scales, Tensor mins, Tensor? bias=None, "
    "ScalarType? out_dtype=None, bool int8_x=False, bool invariant=False) -> Tensor"
)
_LIB.define(
    "q8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias=None, "
    "ScalarType? out_dtype=None, bool int8_x=False, bool invariant=False) -> Tensor"
)
_LIB.impl("dequantize_q4", dequantize_q4, "CPU")
_LIB.impl("dequantize_q8", dequantize_q8, "CPU")
_LIB.impl("dequantize_q4", dequantize_q4_ref, "CUDA")
_LIB.impl("dequantize_q8", dequantize_q8_ref, "CUDA")
_LIB.impl("q4_linear", q4_linear, "CPU")
_LIB.impl("q8_linear", q8_linear, "CPU")
# On a GPU the blocks are read by a Triton kernel (passes/ops/triton_quant.py).
_LIB.impl("q4_linear", q4_linear_cuda if HAS_TRITON else q4_linear_ref, "CUDA")
_LIB.impl("q8_linear", q8_linear_cuda if HAS_TRITON else q8_linear_ref, "CUDA")
torch.library.register_fake("compilecore::dequantize_q4", _fake_dequantize_q4, lib=_LIB)
torch.library.register_fake("compilecore::dequantize_q8", _fake_dequantize_q8, lib=_LIB)
torch.library.register_fake("compilecore::q4_linear", _fake_q4, lib=_LIB)
torch.library.register_fake("compilecore::q8_linear", _fake_q8, lib=_LIB)
native_calls.declare_entry("compilecore::q4_linear", _q4_call)
native_calls.declare_entry("compilecore::q8_linear", _q8_call)
