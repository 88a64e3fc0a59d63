"""Quantized weights: the block formats against gguf-py (llama.cpp's own reference
quantizer and dequantizer), the products that read blocks against the dequantized
reference, the passes that rewrite `mm(x, dequantize(...)^T)`, GGUF files and int8/int4
at load against HF transformers on the same dequantized weights."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from hypothesis import example, given
from hypothesis import strategies as st

from compilecore import testing
from compilecore.testing import count_ops
from models import gguf
from models.layers.quantization import (
    AT_LOAD,
    QuantFormat,
    quantization_config,
    quantize,
    unpack_6bit_values,
)
from models.loader import load_hf_config
from passes.config import CPU_NATIVE_PASSES, PassConfig
from passes.decompose_dequantize import DecomposeDequantizePass
from passes.manager import native_passes_built
from passes.ops import packed_linear, quantized
from passes.quantized_linear import QuantizedLinearPass
from tests.gguf_files import Q
from tests.gguf_files import quantize as gguf_quantize
from tests.helpers import TOKENIZER_VOCAB, hf_logits, load_ours, packed_logits

ops = torch.ops.compilecore


def _scales(g, shape, top, k_quant=False):
    """fp16 scales, or a K-quant's fp32 ones: an fp16 times a 6-bit integer (exact)."""
    base = (torch.rand(shape, generator=g) * top).half()
    if not k_quant:
        return base
    return (base / 63).half().float() * torch.randint(1, 64, shape, generator=g).float()


def _compact(g, n, groups, top, sign):
    """Q4_K's scales (or mins) as stored: 6-bit sub-block scales, fp32 (fp16-exact)
    super-block scales of sign `sign`."""
    sub = torch.randint(0, 64, (n, groups), dtype=torch.uint8, generator=g)
    sup = sign * (torch.rand(n, groups // 8, generator=g) * top / 63).half().float()
    return torch.cat([sub, sup.view(torch.uint8)], 1)


def _q4_fields(g, n, k, group=32, k_quant=False, five=False):
    """q4 fields; `k_quant`: Q4_K's compact scales and mins (k a multiple of 256); `five`:
    Q5_K's, values in [0, 31] packed in 5 bits as GGUF files load them."""
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    if five:
        w = quantized.pack_q5(torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g))
    if k_quant or five:
        return w, _compact(g, n, k // group, 0.05, 1), _compact(g, n, k // group, 0.4, -1)
    return w, _scales(g, (n, k // group), 0.05), -_scales(g, (n, k // group), 0.4)


def _values(scales):
    """A scales or mins field's values, compact ones expanded."""
    return quantized.expand_compact(scales) if quantized.is_compact(scales) else scales


def _compact6(g, n, groups, top):
    """Q6_K's scales as stored: int8 sub-block scales (either sign), then fp32 (fp16-exact)
    super-block scales, one per 16 groups."""
    sub = torch.randint(-128, 128, (n, groups), dtype=torch.int8, generator=g)
    sup = (torch.rand(n, groups // 16, generator=g) * top / 127).half().float()
    return torch.cat([sub, sup.view(torch.int8)], 1)


def _q8_fields(g, n, k, group=32, k_quant=False, packed=True):
    """q8 fields; `k_quant`: Q6_K's (values within 6 bits, compact scales, groups of 16:
    k a multiple of 256), the values packed in 6 bits as GGUF files load them, or
    (`packed=False`) one int8 each."""
    if k_quant:
        w = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
        return quantized.pack_q6(w) if packed else w, _compact6(g, n, k // 16, 0.04)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return w, _scales(g, (n, k // group), 0.01)


def _iq4_fields(g, n, k):
    """IQ4's: 4-bit table indices in q4's order, fp32 scales a run of 32 (an fp16 times an
    integer in [-32, 31], as IQ4_XS's; exact in fp32)."""
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    sub = torch.randint(-32, 32, (n, k // 32), generator=g).float()
    return w, (torch.rand(n, k // 32, generator=g) * 0.01).half().float() * sub


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
)
def test_gguf_blocks_dequantize_as_gguf_py_does(qtype):
    """Our fields of a GGUF tensor dequantize to exactly gguf-py's values (the K-quants'
    blocks from our test quantizer: gguf-py reads them, it cannot write them)."""
    w = np.random.default_rng(0).normal(size=(6, 512)).astype(np.float32)
    blocks = gguf_quantize(w, qtype)
    fields = gguf._blocks(torch.from_numpy(blocks), qtype)
    if qtype in (Q.Q8_0, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS):
        got = quantized.dequantize_q8_ref(fields["qweight"], fields["scales"], torch.float32)
    else:
        args = (fields["qweight"], fields["scales"], fields["mins"])
        got = quantized.dequantize_q4_ref(*args, torch.float32)
    assert torch.equal(got, torch.from_numpy(quants.dequantize(blocks, qtype)))


@testing.settings(max_examples=25)
@given(
    rows=st.sampled_from([1, 2, 3, 4, 5, 7, 16, 17, 33, 130]), n=st.integers(1, 40),
    runs=st.integers(1, 6),
    bits=st.sampled_from([4, 5, 8]), per_channel=st.booleans(), bias=st.booleans(),
    k_quant=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_fp32_products_equal_the_dequantized_reference(rows, n, runs, bits, per_channel, bias,
                                                       k_quant, seed):  # fmt: skip
    """fp32 activations stay in fp32: the product read from blocks equals the fp32
    reference up to summation order, for any row count (the kernel's up to 32 or 128, the
    reference's beyond), tails and a whole-row group. bits 5: Q5_K's (each row
    dequantized in the kernel: its row products read 5 bits on the bf16 path only)."""
    g = torch.Generator().manual_seed(seed)
    k_quant, five = k_quant or bits == 5, bits == 5
    bits = 4 if five else bits
    k = 256 * runs if k_quant else 32 * runs  # the K-quants: whole super-blocks
    group = k if per_channel and bits == 8 else 16 if k_quant and bits == 8 else 32  # Q6_K: 16
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    if bits == 4:
        fields = _q4_fields(g, n, k, k_quant=k_quant, five=five)
        got = ops.q4_linear(x, *fields, b)
        want = F.linear(x.double(), quantized.dequantize_q4_ref(*fields, torch.float64),
                        None if b is None else b.double())  # fmt: skip
    else:
        fields = _q8_fields(g, n, k, group, k_quant)
        got = ops.q8_linear(x, *fields, b)
        want = F.linear(x.double(), quantized.dequantize_q8_ref(*fields, torch.float64),
                        None if b is None else b.double())  # fmt: skip
    scale = (x.double().abs() @ quantized.dequantize_q8_ref(fields[0], fields[1], torch.float64)
             .abs().T).max().item() if bits == 8 else want.abs().max().item()  # fmt: skip
    assert (got.double() - want).abs().max().item() <= 1e-5 * max(scale, 1.0)


@testing.settings(max_examples=30)
@given(n=st.integers(1, 40), runs=st.integers(1, 6), bits=st.sampled_from([4, 5, 8]),
       per_channel=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       k_quant=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_the_kernels_dequantization_equals_the_reference_bit_for_bit(
    n, runs, bits, per_channel, dtype, k_quant, seed
):
    """The CPU op (what a prefill's products and an eager embedding read) is the kernel's
    dequantization; it must give the reference's values exactly, in fp32 and in bf16
    (bits 5: Q5_K's)."""
    g = torch.Generator().manual_seed(seed)
    k_quant, five = k_quant or bits == 5, bits == 5
    bits = 4 if five else bits
    k = 256 * runs if k_quant else 32 * runs  # the K-quants: whole super-blocks
    if bits == 4:
        fields = _q4_fields(g, n, k, k_quant=k_quant, five=five)
        got = ops.dequantize_q4(*fields, dtype)
        want = quantized.dequantize_q4_ref(*fields, dtype)
    else:
        fields = _q8_fields(g, n, k, k if per_channel else 16 if k_quant else 32, k_quant)
        got = ops.dequantize_q8(*fields, dtype)
        want = quantized.dequantize_q8_ref(*fields, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@testing.settings(max_examples=25)
@given(rows=st.sampled_from([1, 2, 3, 4, 5, 6, 9, 16, 17, 33, 130]), n=st.integers(1, 40),
       runs=st.integers(1, 9), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_iq4_products_and_dequantization_equal_the_reference(rows, n, runs, dtype, seed):
    """IQ4_NL / IQ4_XS's table indices: the kernel's dequantization gives the reference's
    values exactly, and its exact products (bf16's looked up in place, the strips and
    every other path on rows unpacked to int8) equal the fp64 product up to fp32 sums, at
    any row count, odd runs included (a last pair; a lone run takes the unpacked path).
    Their strips on int8 activations: `test_strips_write_bias_bf16_and_tail_rows`."""
    g = torch.Generator().manual_seed(seed)
    k = 32 * runs
    fields = _iq4_fields(g, n, k)
    for out in (torch.float32, torch.bfloat16):
        want = quantized.dequantize_q8_ref(*fields, out)
        assert torch.equal(ops.dequantize_q8(*fields, out), want)
    x = torch.randn(rows, k, generator=g).to(dtype)
    values = quantized.dequantize_q8_ref(*fields, torch.float64)
    got = ops.q8_linear(x, *fields, None, torch.float32).double()
    want = x.double() @ values.T
    assert bool(((got - want).abs() <= (x.double().abs() @ values.abs().T) * 1e-5 + 1e-6).all())


@testing.settings(max_examples=20)
@given(rows=st.integers(1, 16), n=st.integers(1, 40), runs=st.sampled_from([2, 4, 18]),
       fmt=st.sampled_from(["q4", "q4_k", "q5_k", "q4_g128", "q8", "q6_k", "q6_k_int8",
                            "int8"]),
       outliers=st.booleans(), int8_x=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
@example(rows=8, n=32, runs=4, fmt="q6_k", outliers=True, int8_x=True, seed=0)  # strips
def test_bf16_products_stay_within_their_path_bound(rows, n, runs, fmt, outliers, int8_x, seed):
    """bf16 activations: on AVX512-BF16 the product is exact but for fp32 sums and the
    output's bf16 rounding; on the integer path (AVX512-VNNI without it) each run of 32
    activations is quantized to int8 against its largest magnitude / 127, as llama.cpp
    does, which adds up to sum over runs of (max |x| in the run / 254) * sum |w| over the
    run. q4's bf16 path takes its +128 offset off per group (below), which cancels:
    outliers (a channel ~1000x the rest, as real models have) show that term; q8's
    multiplies the integers themselves and has none, but Q6_K's 6-bit values take a +160
    off per group of 16 the same way. q8 groups: Q8_0's 32, Q6_K's 16 (its values in 6
    bits, or one int8 each) and int8's whole row; q4 groups of 32 and of 128 (int4_g128).
    `int8_x` (q8's argument): Q8_0's strips (6 rows and more, 16 weight rows) quantize
    activations the same way on CPUs with both AVX512-BF16 and AVX512-VNNI, and so do its
    row products for 1-2 rows and Q6_K's (6 bits) for 1-5 and, where AMX has no tiles for
    them, its strips from 6, under the same bound; with AVX2 alone Q8_0's and Q6_K's at
    every count."""
    g = torch.Generator().manual_seed(seed)
    whole = 256 * max(1, runs // 4)  # the K-quants' super-blocks
    k = {"q4_g128": 128 * max(1, runs // 4), "q4_k": whole, "q5_k": whole}.get(fmt, 32 * runs)
    k = whole if fmt.startswith("q6_k") else k
    runs = k // 32
    x = torch.randn(rows, k, generator=g)
    if outliers:  # a channel ~1000x the rest, as real models' activations have
        x[:, 5::37] *= 1000
    x = x.bfloat16()
    if fmt.startswith(("q4", "q5")):  # q5_k: Q5_K's, as exact as q4's
        fields = _q4_fields(g, n, k, 128 if fmt == "q4_g128" else 32, fmt == "q4_k",
                            fmt == "q5_k")  # fmt: skip
        got = ops.q4_linear(x, *fields, None, torch.float32)
        w = quantized.dequantize_q4_ref(*fields, torch.float64)
    else:
        group = {"q8": 32, "q6_k": 16, "q6_k_int8": 16, "int8": k}[fmt]
        fields = _q8_fields(g, n, k, group, fmt.startswith("q6_k"), fmt == "q6_k")
        got = ops.q8_linear(x, *fields, None, torch.float32, int8_x)
        w = quantized.dequantize_q8_ref(*fields, torch.float64)
    xd = x.double()
    want = xd @ w.T
    sums = xd.abs() @ w.abs().T  # what fp32 sums can lose, relative
    bound = sums * 1e-5 + 1e-6
    path = quantized.kernel_path()
    # (an upper bound for Q8_0's 3-5 rows; Q6_K's 6 rows and more take the exact strips
    # where there are 16 weight rows for one)
    int8_x = int8_x and (
        quantized.int8_strips()
        and (fmt == "q8" or fmt == "q6_k" and (rows < 6 or n < 16 or not quantized.amx_tiles()))
        or fmt == "q8"
        and rows <= quantized.int8_rows()  # AVX2's row products
        or fmt in ("q8", "q6_k")
        and quantized.int8_pairs()
    )
    if (path == "int8" and fmt in ("q4", "q4_k", "q8")) or int8_x:  # else fp32 or bf16
        run_max = xd.abs().reshape(rows, runs, 32).amax(-1)  # [rows, runs]
        run_w = w.abs().reshape(n, runs, 32).sum(-1)  # [n, runs]
        bound = bound + (run_max / 254) @ run_w.T * 1.001
    if path == "bf16" and fmt.startswith(("q4", "q5")):
        # The offsets come off per group, (m - 128 d) X, so fp32 sums hold terms
        # ~(256 d + |m|) sum|x| that cancel.
        group_abs = xd.abs().reshape(rows, quantized.groups_of(fields[1]), -1).sum(-1)
        terms = _values(fields[1]).double().abs() * 256 + _values(fields[2]).double().abs()
        bound = bound + group_abs @ terms.T * 2**-20
    if path == "bf16" and fmt == "q6_k":  # terms ~(192 + 160) d sum|x| per group of 16
        group_abs = xd.abs().reshape(rows, k // 16, 16).sum(-1)
        bound = bound + group_abs @ _values(fields[1]).double().abs().T * 352 * 2**-20
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.skipif(not quantized.amx_tiles(), reason="needs AMX tiles")
@testing.settings(max_examples=30)
@given(rows=st.integers(3, 64), n=st.sampled_from([16, 48, 64]), runs=st.sampled_from([2, 4, 18]),
       fmt=st.sampled_from(["q4", "q4_k", "q4_k_int8_x", "q5_k", "q5_k_int8_x", "q8",
                            "q8_int8_x", "q6_k", "q6_k_int8_x", "iq4", "iq4_int8_x"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(),
       outliers=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_products_on_amx_tiles_stay_exact(rows, n, runs, fmt, dtype, bias, outliers, seed):
    """On AMX, q4's (Q4_0, Q4_1, Q4_K), Q5_K's, Q8_0's and Q6_K's products of 3-64 bf16
    rows (16 weight rows a tile, pairs of runs, the tail rows of x zero in their tile) are
    exact but for fp32 sums, as the row products are: q4's +128 offset of the bf16 form
    comes off per run (terms ~(256 d + |m|) sum|x| that cancel), the bias is added in fp32
    and the output rounded once. Q4_K's compact scales (K whole super-blocks) as Q4_1's
    fp16 ones; with int8 activations allowed it takes the tiles (exact) above its integer
    row products, from 6 rows, as Q5_K's 5-bit rows (each nibble's fifth bit adds 16 to
    its bf16 form); Q6_K's 6-bit rows (groups of 16: a tile of half a run each, -160 d per
    group) from 6 rows, where the strips were; Q8_0 between its integer row products and
    its int8 strips, 3-5 rows; IQ4 (its table values looked up as bf16) at every count,
    where int8 activations are allowed too."""
    if fmt == "q8_int8_x":
        rows = 3 + rows % 3
    if fmt.startswith("q6_k") or fmt in ("q4_k_int8_x", "q5_k_int8_x"):
        rows = 6 + rows % 59
    g = torch.Generator().manual_seed(seed)
    k = 256 * (1 + runs % 2) if fmt.startswith(("q4_k", "q5_k", "q6_k")) else 32 * runs
    runs = k // 32
    x = torch.randn(rows, k, generator=g)
    if outliers:
        x[:, 5::37] *= 1000
    x = x.bfloat16()
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    xd = x.double()
    if fmt.startswith(("q4", "q5")):
        fields = _q4_fields(g, n, k, k_quant=fmt != "q4", five=fmt.startswith("q5"))
        got = ops.q4_linear(x, *fields, b, dtype, fmt.endswith("int8_x"))
        w = quantized.dequantize_q4_ref(*fields, torch.float64)
        terms = _values(fields[1]).double().abs() * 256 + _values(fields[2]).double().abs()
        offsets = xd.abs().reshape(rows, runs, 32).sum(-1) @ terms.T * 2**-20
    elif fmt.startswith("q6_k"):  # 6-bit rows, groups of 16: terms ~(192 + 160) d sum|x|
        fields = _q8_fields(g, n, k, 16, True, True)
        got = ops.q8_linear(x, *fields, b, dtype, fmt == "q6_k_int8_x")
        w = quantized.dequantize_q8_ref(*fields, torch.float64)
        group_abs = xd.abs().reshape(rows, k // 16, 16).sum(-1)
        offsets = group_abs @ _values(fields[1]).double().abs().T * 352 * 2**-20
    else:
        fields = _iq4_fields(g, n, k) if fmt.startswith("iq4") else _q8_fields(g, n, k)
        got = ops.q8_linear(x, *fields, b, dtype, fmt.endswith("int8_x"))
        w = quantized.dequantize_q8_ref(*fields, torch.float64)
        offsets = 0
    assert got.shape == (rows, n) and got.dtype == dtype
    want = xd @ w.T + (b.double() if bias else 0)
    bound = (xd.abs() @ w.abs().T) * 1e-5 + 1e-6 + offsets
    if dtype == torch.bfloat16:
        bound = bound + want.abs() * 2**-8
    assert bool(((got.double() - want).abs() <= bound).all())


STRIP_FORMATS = ["q8", "q8_int8_x", "q6_k", "q6_k_int8", "int8", "q4", "q4_k", "q5_k", "q4_g128"]


@pytest.mark.parametrize("fmt", [*STRIP_FORMATS, "iq4", "iq4_int8_x"])
@pytest.mark.parametrize("rows", [21, 4, 1])
def test_strips_write_bias_bf16_and_tail_rows(fmt, rows):
    """Enough rows for the strips of 16 weight rows (40 = two strips and 8 rows left to
    the row product) with a bias and bf16 outputs: each output within fp32 sums of the
    reference plus its own bf16 rounding, bias added once, q4's mins through the sums of
    x. `q8_int8_x`: Q8_0's strips on int8 activations (where the CPU has them: the strip
    rows differ from the exact product, within the quantization's bound; the tail rows
    are exact). Fewer rows: the row products alone (one row: q8's loops of their own),
    exact but for `q8_int8_x`'s at 1-2 rows, which quantize x the same way. `iq4_int8_x`:
    IQ4's strips likewise, and its row products where no strips run (every row of x below
    6; the tail rows beside strips stay exact); the +128 its bytes carry cancels through
    x's sums as quantized, so Q8_0's bound holds. With AVX2 alone both quantize x at every
    row count."""
    g = torch.Generator().manual_seed(len(fmt))
    n, k = 40, 256
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    if fmt.startswith(("q4", "q5")):
        fields = _q4_fields(g, n, k, 128 if fmt == "q4_g128" else 32, fmt == "q4_k",
                            fmt == "q5_k")  # fmt: skip
        got = ops.q4_linear(x, *fields, bias, torch.bfloat16).double()
        values = quantized.dequantize_q4_ref(*fields, torch.float64)
    else:
        group = {"q6_k": 16, "q6_k_int8": 16, "int8": k}.get(fmt, 32)
        fields = _q8_fields(g, n, k, group, fmt.startswith("q6_k"), fmt == "q6_k")
        fields = _iq4_fields(g, n, k) if fmt.startswith("iq4") else fields
        got = ops.q8_linear(x, *fields, bias, torch.bfloat16, fmt.endswith("int8_x")).double()
        values = quantized.dequantize_q8_ref(*fields, torch.float64)
    want = x.double() @ values.T + bias.double()
    bound = (x.double().abs() @ values.abs().T) * 1e-5 + want.abs() * 2**-8 + 1e-6
    int8_rows = fmt == "q8_int8_x" and (
        quantized.int8_strips()
        and rows not in (3, 4, 5)
        or rows <= quantized.int8_rows()
        or quantized.int8_pairs()
    )
    int8_rows = int8_rows or fmt == "iq4_int8_x" and quantized.int8_strips()
    every_row = rows < 6 or fmt.endswith("int8_x") and quantized.int8_pairs()
    int8_rows = int8_rows or fmt == "iq4_int8_x" and quantized.int8_pairs()
    if int8_rows:
        approximated = slice(0, n) if every_row else slice(0, 32)  # every row, or strips
        exact = bool(((got - want).abs() <= bound).all(0)[approximated.stop :].all())
        run_max = x.double().abs().reshape(rows, k // 32, 32).amax(-1)
        run_w = values.abs().reshape(n, k // 32, 32).sum(-1)
        quantization = (run_max / 254) @ run_w.T * 1.001
        assert exact and not bool(((got - want).abs() <= bound)[:, approximated].all())
        bound = bound + quantization
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q4", "q6_k"])
@pytest.mark.parametrize("rows", [1, 3, 5, 7, 8, 17, 130])
def test_k_quant_int8_activations_stay_within_their_bound(fmt, rows):
    """`int8_x` on q4 (which the pass gives Q4_K's products) and on Q6_K's 6-bit values:
    on CPUs with AVX512-BF16 and AVX512-VNNI the row products (below the strips: 8 rows
    for q4, 6 for q8) and, without AMX tiles, the strips (16 weight rows; the 8 rows past
    them stay exact: Q4_K's from 8 rows, Q6_K's from 6) quantize each run of 32
    activations to int8 against max |x| / 127,
    which moves an output by at most sum over runs of (max |x| in the run / 254) * sum
    |d q| over the run (q4's mins and Q6_K's offset multiply x's exact sums); a last pair
    of runs (K % 128 = 64) included. Q5_K's 5-bit rows take int8 strips from 16 rows
    where AMX has no tiles (its rows unpacked to bytes per strip), else their row products
    take it at every row count. With AVX2 alone (`int8_pairs`) the K-quants' row products
    take it at every row count. Elsewhere the argument changes nothing."""
    g = torch.Generator().manual_seed(rows)
    n, k = 40, 576 if fmt == "q4" else 512
    x = torch.randn(rows, k, generator=g)
    x[:, 5::37] *= 1000  # outliers, as real models' activations have
    x = x.bfloat16()
    if fmt == "q6_k":
        fields = _q8_fields(g, n, k, 16, True)
        product = functools.partial(ops.q8_linear, x, *fields, None, torch.float32)
        values = steps = quantized.dequantize_q8_ref(*fields, torch.float64)
    else:
        fields = _q4_fields(g, n, k, 32, fmt == "q4_k", fmt == "q5_k")
        product = functools.partial(ops.q4_linear, x, *fields, None, torch.float32)
        values = quantized.dequantize_q4_ref(*fields, torch.float64)
        steps = values - _values(fields[2]).double().repeat_interleave(32, 1)  # d q, no min
    exact, got = product(), product(True)
    strips = {"q6_k": 6, "q5_k": None if quantized.amx_tiles() else 16}.get(fmt, 8)
    tiles = quantized.amx_tiles() and rows <= 64  # exact, where AMX has them
    # Q4_K's and Q5_K's int8 strips, where AMX has no tiles for them (else a dense copy)
    k_strips = fmt in ("q4_k", "q5_k") and not quantized.amx_tiles()
    dense = rows > quantized.BF16_ROWS[4] and fmt != "q6_k" and not k_strips  # exact x
    int8_strips = k_strips or fmt == "q6_k" and not tiles
    quantizes = quantized.int8_strips() and not dense and (
        strips is None or rows < strips or int8_strips
    )
    if not (quantizes or quantized.int8_pairs() and fmt != "q4"):
        assert torch.equal(got, exact)
        return
    want = x.double() @ values.T
    run_max = x.double().abs().reshape(rows, k // 32, 32).amax(-1)
    run_w = steps.abs().reshape(n, k // 32, 32).sum(-1)
    bound = (x.double().abs() @ values.abs().T) * 1e-5 + (run_max / 254) @ run_w.T * 1.001
    if fmt == "q6_k":  # the +32 offset's fp32 terms, as the bf16 path's +160
        group_abs = x.double().abs().reshape(rows, k // 16, 16).sum(-1)
        bound = bound + group_abs @ _values(fields[1]).double().abs().T * 96 * 2**-20
    assert not torch.equal(got, exact)
    assert bool(((got.double() - want).abs() <= bound).all())
    # x already int8-exact (integers, 127 in every run): the same product as the exact one
    xi = torch.randint(-127, 128, (rows, k), generator=g).float()
    xi[:, ::32] = 127
    product = functools.partial(product.func, xi.bfloat16(), *product.args[1:])
    exact, got = product(), product(True)
    sums = xi.double().abs() @ values.abs().T
    assert bool(((got.double() - exact.double()).abs() <= sums * 1e-6 + 1e-6).all())


def test_the_pass_gives_int8_activations_to_k_quants_only():
    """With `int8_activations` the pass's q4 products take `int8_x` where the fields are
    Q4_K's (compact), not Q4_0 / Q4_1's, which stay exact as the shipped model's do."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g).bfloat16()
    for k_quant in (True, False):
        fn = _linear(_q4_fields(g, 48, 256, 32, k_quant), 4, torch.bfloat16)
        backend = testing.check_pass(QuantizedLinearPass(int8_x=True), fn, x, dynamic=False,
                                     rtol=0.05)  # fmt: skip
        nodes = [n for n in backend.graph_after.nodes if n.target == ops.q4_linear.default]
        assert len(nodes) == 1
        assert (nodes[0].args[6] if len(nodes[0].args) > 6 else False) == k_quant


@pytest.mark.parametrize("fmt", ["q8", "q6_k", "q4", "q4_k", "q5_k", "iq4"])
@pytest.mark.parametrize("rows", [1, 21])
@pytest.mark.parametrize("int8_x", [False, True])
def test_products_are_the_same_whichever_thread_takes_a_row(fmt, rows, int8_x):
    """The products hand out their rows (and strips) by OpenMP's guided schedule, so which
    thread computes a row changes from call to call and with the team's size: one thread,
    three (odd shares of 1000 rows) and repeated calls give the same bits, with int8
    activations allowed too."""
    g = torch.Generator().manual_seed(rows)
    n, k = 1000, 256
    x = torch.randn(rows, k, generator=g).bfloat16()
    if fmt.startswith(("q4", "q5")):
        fields = _q4_fields(g, n, k, 32, fmt == "q4_k", fmt == "q5_k")
        product = functools.partial(ops.q4_linear, x, *fields, None, torch.float32, int8_x)
    else:
        fields = _q8_fields(g, n, k, 16 if fmt == "q6_k" else 32, fmt == "q6_k")
        fields = _iq4_fields(g, n, k) if fmt == "iq4" else fields
        product = functools.partial(ops.q8_linear, x, *fields, None, torch.float32, int8_x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = product()
        torch.set_num_threads(3)
        outputs = [product() for _ in range(4)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got, want) for got in outputs)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e-35])
def test_q8_products_carry_non_finite_and_tiny_activations(bad):
    """An inf, a nan or a run of magnitudes near the float range's bottom in a row of x:
    outputs are non-finite exactly where the reference's are, the others within fp32 sums
    of the reference, tiny products
    included, and the other rows untouched."""
    g = torch.Generator().manual_seed(3)
    w, scales = _q8_fields(g, 24, 128)
    x = torch.randn(3, 128, generator=g).bfloat16()
    x[1, 40] = bad
    if bad == 1e-35:
        x[1, 32:64] = torch.full((32,), bad).bfloat16()
    got = ops.q8_linear(x, w, scales, None, torch.float32).double()
    want = x.double() @ quantized.dequantize_q8_ref(w, scales, torch.float64).T
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    sums = x.double().abs() @ quantized.dequantize_q8_ref(w, scales, torch.float64).abs().T
    assert bool(((got - want).abs()[finite] <= (sums * 1e-5 + 1e-30)[finite]).all())


@pytest.mark.parametrize("k_quant", [False, True])
def test_q8_dense_rows_keep_the_values_bits(k_quant):
    """Beyond the kernel's rows (`MAX_KERNEL_ROWS` where the kernel has no bf16 path,
    `AMX_DENSE_ROWS` on AMX) an exact bf16 q8 product is one bf16 GEMM over [x | x] and the
    split [hi | lo] copy (fp32 where the CPU has no bf16 GEMM): the values to 16 bits, so
    the bf16 output is the exact product's rounding but where the exact sum lies within
    ~2^-16 of a rounding boundary. Rounding the values to bf16 instead misses ~43% of the
    outputs."""
    g = torch.Generator().manual_seed(1)
    rows = quantized.MAX_KERNEL_ROWS[8] + 31
    k = 512 if k_quant else 576  # Q6_K: whole super-blocks
    fields = _q8_fields(g, 96, k, 16 if k_quant else 32, k_quant)
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = quantized.q8_dense_product(x, *fields)
    w = quantized.dequantize_q8_ref(*fields, torch.float64)
    want = x.double() @ w.T
    exact = want.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got != exact).double().mean() < 0.02
    bound = exact.double().abs() * 2**-7 + (x.double().abs() @ w.abs().T) * 2**-15
    assert bool(((got.double() - want).abs() <= bound).all())


_DENSE_FORMATS = ["q4", "q4_k", "q5_k", "q8", "q6_k", "iq4"]


def _dense_fields(g, fmt, n, k):
    if fmt.startswith(("q4", "q5")):
        return _q4_fields(g, n, k, 32, fmt == "q4_k", fmt == "q5_k")
    return _iq4_fields(g, n, k) if fmt == "iq4" else _q8_fields(g, n, k, 32, fmt == "q6_k")


@testing.settings(max_examples=30)
@given(fmt=st.sampled_from(_DENSE_FORMATS), n=st.integers(1, 80), rows=st.integers(1, 24),
       k=st.sampled_from([256, 512]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       split=st.booleans(), slice_rows=st.sampled_from([16, 32, 48, 1 << 20]))  # fmt: skip
def test_dense_copies_multiply_the_dequantized_weight_slice_by_slice(
    fmt, n, rows, k, dtype, split, slice_rows
):
    """A product past the kernel's rows dequantizes the weight into the thread's scratch a
    slice of rows at a time (passes/ops/scratch.py), one GEMM a slice: against the exact
    product of the copy's values (each value rounded to bf16, or to 16 bits when split),
    every format, slices of 16-48 rows and one slice, bias added once per output."""
    from passes.ops import scratch

    g = torch.Generator().manual_seed(n * 7 + rows)
    fields = _dense_fields(g, fmt, n, k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    split = split and dtype == torch.bfloat16
    width = (2 if split else 1) * k * dtype.itemsize
    saved, scratch.SCRATCH_BYTES = scratch.SCRATCH_BYTES, slice_rows * width
    try:
        got = quantized.dense_from_blocks(x, *fields[:1], fields[1:], bias, None, dtype, split)
    finally:
        scratch.SCRATCH_BYTES = saved
    if got is None:  # no native dequantization here
        assert quantized.kernel_path() == "portable"
        return
    ref = quantized.dequantize_q4_ref if len(fields) == 3 else quantized.dequantize_q8_ref
    values = ref(*fields, torch.float64)
    copy = values if split or dtype == torch.float32 else ref(*fields, dtype).double()
    want = x.double() @ copy.T + bias.double()
    assert got.shape == (rows, n) and got.dtype == dtype
    scale = x.double().abs() @ values.abs().T + bias.double().abs()
    bound = want.abs() * (2**-8 if dtype == torch.bfloat16 else 2**-20) + scale * 2**-15
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.skipif(
    not (packed_linear.has_amx() and quantized.kernel_path() == "bf16"), reason="needs AMX"
)
def test_q8_products_of_many_rows_take_the_dense_copy_on_amx():
    """With AMX, from `AMX_DENSE_ROWS` bf16 rows q8's products on int8 activations leave
    the strips for oneDNN's tiles on the copy rounded to bf16 (benchmarks/ab_dense_copy.py;
    its error bounded above); one row fewer stays on the kernel (the CPU graphs' sizes).
    Exact products stay on the kernel at every row count: `int8_activations=False` means
    exact, and the split copy holds Q8_0's values to 16 bits only."""
    g = torch.Generator().manual_seed(3)
    fields = _q8_fields(g, 64, 576)
    rows = quantized.AMX_DENSE_ROWS
    x = torch.randn(rows, 576, generator=g).bfloat16()
    y = x.new_empty(rows, 64)
    assert quantized._q8_call((x[:-1], *fields, None, None, True), y[:-1]) is not None
    assert quantized._q8_call((x, *fields, None, None, True), y) is None
    got = quantized.q8_linear(x, *fields, None, None, True)
    want = quantized.dense_from_blocks(x, fields[0], fields[1:], None, None, torch.bfloat16)
    assert torch.equal(got, want)
    exact = quantized._q8_call((x, *fields, None, None, False), y)
    assert exact is not None
    exact.run()
    assert torch.equal(quantized.q8_linear(x, *fields, None, None, False), y)
    want = x.double() @ quantized.dequantize_q8_ref(*fields, torch.float64).T
    assert bool(((y.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all())


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86's vector paths")
def test_the_quant_kernels_vectorize_with_avx2_and_fma():
    """The products read the blocks with vectors on AVX2 + FMA CPUs (Zen 1-3, Haswell to
    Ice Lake clients) as on AVX-512 ones, and the `quantized_linear` pass runs them there
    even where the rest of our kernels (AVX-512) do not build; the portable loop, 20-40x
    slower (benchmarks/ab_quant_raw.py), is left for CPUs with neither."""
    flags = _cpu_flags()
    vectorized = "avx512f" in flags or {"avx2", "fma"} <= flags
    assert (quantized.kernel_path() != "portable") == vectorized
    assert ("quantized_linear" in native_passes_built()) == vectorized


@pytest.mark.skipif("avx512_vnni" not in _cpu_flags(), reason="needs AVX512-VNNI")
def test_int8_activations_off_keeps_products_exact_without_avx512_bf16():
    """On AVX512-VNNI CPUs without AVX512-BF16 (Ice Lake, Cascade Lake servers) groups of
    32 took the int8 path whether or not the caller allowed int8 activations: the kernel
    built as for such a CPU must keep a Q8_0 product exact (fp32) without flags bit 5 and
    quantize x with it."""
    from passes import native, prefetch

    flags = native.FLAGS + ["-mno-avx512bf16", f"-DCC_PREFETCH={prefetch.weight_prefetch_bytes()}"]
    source = native.op_source(Path(quantized.__file__).with_name("quant_kernels.cpp"))
    lib = native.load_library(source, "quant_kernels_vnni", native.cache_root() / "tests", flags)
    lib.quant_kernels_path.argtypes = [ctypes.c_int64] * 4
    lib.q8_linear_region.argtypes = [ctypes.c_int64] * 11
    assert lib.quant_kernels_vectorized() == 2  # the integer path, no bf16 one
    assert [lib.quant_kernels_path(0, 64, 32, ok) for ok in (0, 1)] == [0, 2]
    g = torch.Generator().manual_seed(5)
    n, k = 48, 256
    w, scales = _q8_fields(g, n, k, 32)
    x = torch.randn(1, k, generator=g).bfloat16()
    want = x.double() @ quantized.dequantize_q8_ref(w, scales, torch.float64).T
    errors = []
    for int8 in (0, 1):
        y = torch.empty(1, n)
        args = (x, 1 | 32 * int8, w, scales, 0, y, 1, n, k, 32, 1)
        lib.q8_linear_region(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
        errors.append(((y.double() - want).abs().max() / want.abs().max()).item())
    assert errors[0] < 1e-5 < 1e-3 < errors[1]  # exact fp32 sums, then int8 x's rounding


def _invariance_cases():
    g = torch.Generator().manual_seed(11)
    n, k = 48, 512
    return {
        "q4 g32": ("q4", _q4_fields(g, n, k)),
        "Q4_K": ("q4", _q4_fields(g, n, k, 32, k_quant=True)),
        "Q5_K": ("q4", _q4_fields(g, n, k, 32, five=True)),
        "q8 g32": ("q8", _q8_fields(g, n, k, 32)),
        "q8 per channel": ("q8", _q8_fields(g, n, k, k)),
        "Q6_K": ("q8", _q8_fields(g, n, k, k_quant=True)),
        "IQ4_XS": ("q8", _iq4_fields(g, n, k)),
    }


def _rows_that_differ(kind, fields, dtype, invariant):
    """The row counts m (1-32) whose product gives the first m rows other bits than the
    same rows among 48, int8 activations allowed (the default's widest choice of paths)."""
    k = quantized.q8_columns(*fields[:2]) if kind == "q8" else quantized.q4_columns(*fields[:2])
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    op = ops.q4_linear if kind == "q4" else ops.q8_linear
    full = op(x, *fields, None, None, True, invariant)
    return [m for m in range(1, 33) if not torch.equal(op(x[:m], *fields, None, None, True,
                                                             invariant), full[:m])]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", sorted(_invariance_cases()))
def test_invariant_products_give_a_row_its_bits_at_every_row_count(case, dtype):
    """`invariant=True` (batch-invariant mode): no int8 activations; up to INVARIANT_ROWS
    rows the exact row products, above it the strips, each giving a row the same bits at
    any row count and offset (the scheduler keeps the two kinds of rows in separate
    steps); what the worker checks at start on a model's own weights."""
    from models.layers.quantization import QuantFormat
    from runtime.worker import invariant_rows_that_differ

    kind, fields = _invariance_cases()[case]
    assert quantized.kernel_invariant_rows() in (None, quantized.INVARIANT_ROWS)
    k = quantized.q8_columns(*fields[:2]) if kind == "q8" else quantized.q4_columns(*fields[:2])
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    fmt = QuantFormat(4 if kind == "q4" else 8, 32)
    assert invariant_rows_that_differ(fmt, fields, x) == []
    op = ops.q4_linear if kind == "q4" else ops.q8_linear
    full = op(x, *fields, None, None, True, True)
    for start in range(0, 48 - 17, 3):  # the strips at any offset and count
        for m in (17, 20, 25, 31 - start % 8):
            got = op(x[start : start + m], *fields, None, None, True, True)
            assert torch.equal(got, full[start : start + m]), (start, m)


@pytest.mark.skipif(not quantized.int8_pairs(), reason="AVX2's row products (no AVX-512)")
@pytest.mark.parametrize("case", sorted(_invariance_cases()))
def test_avx2_products_give_a_row_its_bits_up_to_the_dense_rows(case):
    """With AVX2 alone the default products (int8 activations allowed) take one path a
    format up to FP32_ROWS rows: q4's exact slots, the pairs (Q8_0's 1-2 rows included:
    they had their own row product), q8 per channel's exact rows; so a row's bits do not
    depend on the rows beside it (a verification's products give what decode's give)."""
    kind, fields = _invariance_cases()[case]
    k = quantized.q8_columns(*fields[:2]) if kind == "q8" else quantized.q4_columns(*fields[:2])
    rows = quantized.FP32_ROWS[4 if kind == "q4" else 8]
    x = torch.randn(rows + 8, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    op = ops.q4_linear if kind == "q4" else ops.q8_linear
    for start in (0, 5):  # fp32 outputs: bf16 would round small differences away
        full = op(x[start : start + rows], *fields, None, torch.float32, True)
        for m in range(1, rows + 1):
            got = op(x[start : start + m], *fields, None, torch.float32, True)
            assert torch.equal(got, full[:m]), (start, m)


def test_the_default_products_depend_on_the_row_count():
    """The control: without `invariant` the paths change with the row count, and some
    row counts give other bits (on any CPU whose kernels build), in bf16 or in fp32 (with
    AVX2 alone the int8 paths of 1-2 rows and of more round to the same bf16 here)."""
    if quantized.kernel_path() == "portable":
        pytest.skip("the portable loop has one path")
    cases = _invariance_cases()
    assert any(
        _rows_that_differ(*cases[c], dtype, invariant=False)
        for c in cases
        for dtype in (torch.bfloat16, torch.float32)
    )


def test_the_pass_switches_follow_the_kernels_that_build():
    """Only the passes whose kernels build are on by default; `native_kernels=False` turns
    every one of them off, the quantized products included."""
    only_products = frozenset({"quantized_linear"})
    on = PassConfig().resolved("cpu", only_products)
    assert on["quantized_linear"]
    assert not any(on[name] for name in CPU_NATIVE_PASSES - only_products)
    assert PassConfig().resolved("cpu", CPU_NATIVE_PASSES)["native_linear"]
    assert not PassConfig(native_kernels=False).resolved("cpu", only_products)["quantized_linear"]
    assert not PassConfig().resolved("cpu", frozenset())["quantized_linear"]
    assert PassConfig(quantized_linear=True).resolved("cpu", frozenset())["quantized_linear"]


@pytest.mark.parametrize("bits", [4, 8])
def test_dense_products_multiply_in_fp32_without_a_bf16_gemm(bits):
    """Beyond the row products (a prefill), bf16 activations on a CPU whose GEMM has no
    bf16 path (AVX2: torch's generic dot loop, ~5x slower than MKL's fp32 GEMM) are
    multiplied in fp32 against fp32 values: the bf16 output is then the exact product's
    rounding but at near-ties, for q4 as for q8; with a bf16 GEMM (AVX-512) the q4 values
    are rounded to bf16 first and q8's split in two (`test_q8_dense_rows_keep_the_values_bits`)."""
    g = torch.Generator().manual_seed(bits)
    rows, n, k = 80, 64, 256
    x = torch.randn(rows, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    if bits == 4:
        fields = _q4_fields(g, n, k)
        got = ops.q4_linear(x, *fields, bias)
        w = quantized.dequantize_q4_ref(*fields, torch.float64)
    else:
        fields = _q8_fields(g, n, k, 32)
        got = ops.q8_linear(x, *fields, bias)
        w = quantized.dequantize_q8_ref(*fields, torch.float64)
    want = x.double() @ w.T + bias.double()
    assert got.dtype == torch.bfloat16
    off = (got != want.to(torch.bfloat16)).double().mean()
    if quantized.bf16_gemm_is_native():
        assert off < 0.5  # bf16 inputs to the GEMM: most outputs still round alike
    else:
        assert quantized._dense_dtype(x, None) == torch.float32
        assert off < 0.02


@pytest.mark.parametrize("name", sorted(AT_LOAD))
def test_quantize_at_load_rounds_to_nearest(name):
    fmt = AT_LOAD[name]
    w = torch.randn(24, 256) * 0.1
    fields = quantize(w, fmt)
    names = fmt.names()
    assert tuple(fields) == names
    got = (quantized.dequantize_q8_ref if fmt.bits == 8 else quantized.dequantize_q4_ref)(
        *fields.values(), torch.float32
    )
    group = fmt.group_size(256)
    step = fields["scales"].float().repeat_interleave(group, dim=1)
    assert bool(((got - w).abs() <= step / 2 * 1.001 + 1e-7).all())


def test_unknown_quantization_is_refused_with_what_is_supported():
    with pytest.raises(ValueError, match="'int8'.*'int4'"):
        quantization_config("fp8")
    with pytest.raises(ValueError, match="groups"):
        QuantFormat(4, 48).fields(4, 96)


def _linear(fields, bits, dtype):
    dequantize = ops.dequantize_q4 if bits == 4 else ops.dequantize_q8

    def fn(x):
        return F.linear(x, dequantize(*fields, dtype))

    return fn


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_pass_takes_static_rows(bits, dtype):
    g = torch.Generator().manual_seed(0)
    fields = _q4_fields(g, 48, 128) if bits == 4 else _q8_fields(g, 48, 128)
    fn = _linear(fields, bits, dtype)
    x = torch.randn(3, 128, generator=g).to(dtype)
    backend = testing.check_pass(QuantizedLinearPass(), fn, x, dynamic=False,
                                 rtol=None if dtype == torch.float32 else 0.05)  # fmt: skip
    product = ops.q4_linear if bits == 4 else ops.q8_linear
    assert backend.matches("quantized_linear") == 1
    assert count_ops(backend.graph_after, product) == 1
    assert count_ops(backend.graph_after, torch.ops.aten.mm) == 0


@pytest.mark.parametrize("bias", [False, True])
def test_fused_parts_in_different_formats_are_multiplied_apart(bias):
    """A QKV whose v is stored in another format (Q4_K_M's Q6_K v beside Q4_K q and k)
    holds each part apart and traces to one `mm` (or `addmm`) a part, each of which the
    pass rewrites; the product equals x times the parts' dequantized rows, in order."""
    from models.layers.linear import QKVParallelLinear
    from models.layers.quantization import QuantizationConfig, quant_fields

    g = torch.Generator().manual_seed(0)
    q4_k, q6_k = QuantFormat(4, 32, torch.uint8), QuantFormat(6, 16, torch.int8)
    config = QuantizationConfig("gguf", parts={"attn.qkv_proj": (q4_k, q4_k, q6_k)})
    layer = QKVParallelLinear(256, 32, 4, 2, bias=bias, quant_config=config,
                              prefix="attn.qkv_proj", params_dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        for sid, rows in (("q", 128), ("k", 64), ("v", 64)):
            fields = (_q8_fields(g, rows, 256, 16, True) if sid == "v"
                      else _q4_fields(g, rows, 256, 32, True))  # fmt: skip
            for name, value in zip(("qweight", "scales", "mins"), fields):
                getattr(layer, f"{name}_{sid}").copy_(value)
        if bias:
            layer.bias.normal_(generator=g)
    weight = torch.cat([fmt.dequantize(quant_fields(layer, fmt, f"_{sid}"), torch.float32)
                        for (sid, _), fmt in layer.part_formats])  # fmt: skip
    x = torch.randn(3, 256, generator=g)
    want = F.linear(x, weight, layer.bias)
    torch.testing.assert_close(layer(x)[0], want, rtol=1e-5, atol=1e-5)
    backend = testing.check_pass(QuantizedLinearPass(), lambda x: layer(x)[0], x, dynamic=False)
    assert backend.matches("quantized_linear") == 3
    assert count_ops(backend.graph_after, ops.q4_linear) == 2
    assert count_ops(backend.graph_after, ops.q8_linear) == 1
    assert count_ops(backend.graph_after, torch.ops.aten.mm) == 0


@pytest.mark.parametrize("q6_k", [False, True])
def test_compact_scales_slice_by_whole_super_blocks_across_ranks(q6_k):
    """A row-parallel rank's columns of compact scales (Q4_K's, Q6_K's): its sub-block
    bytes and its super-blocks' fp32 scales, whose expansion equals the full field's
    columns; a rank whose columns are not whole super-blocks is refused when the layer is
    built."""
    from models.layers.linear import RowParallelLinear
    from models.layers.quantization import QuantizationConfig

    g = torch.Generator().manual_seed(0)
    # 8 rows of 1024 columns in 2 super-blocks: Q4_K's 32 groups of 32, Q6_K's 64 of 16
    fmt = QuantFormat(8, 16, torch.int8) if q6_k else QuantFormat(4, 32, torch.uint8)
    groups = 1024 // fmt.group
    full = _compact6(g, 8, groups, 0.05) if q6_k else _compact(g, 8, groups, 0.05, 1)
    config = QuantizationConfig("gguf", formats={"o": fmt})
    layer = RowParallelLinear(512, 8, bias=False, quant_config=config, prefix="o")
    layer.tp_size = 2
    for rank in (0, 1):
        layer.tp_rank = rank
        layer.weight_loader(layer.scales, full)
        half = groups // 2
        want = quantized.expand_compact(full)[:, half * rank : half * rank + half]
        assert torch.equal(quantized.expand_compact(layer.scales), want)
    with pytest.raises(ValueError, match="whole super-blocks"):
        RowParallelLinear(128, 8, bias=False, quant_config=config, prefix="o")


@pytest.mark.parametrize("rows", [5, 140])
def test_quantized_linear_pass_takes_symbolic_rows(rows):
    """The symbolic token count's code too: the op reads blocks for up to 32-128 rows and
    dequantizes into a dense GEMM beyond (checked against eager at both)."""
    g = torch.Generator().manual_seed(0)
    fn = _linear(_q4_fields(g, 48, 128), 4, torch.float32)
    backend = testing.check_pass(QuantizedLinearPass(), fn, torch.randn(rows, 128, generator=g))
    assert backend.matches("quantized_linear") == 1


def test_decompose_dequantize_hands_inductor_plain_ops():
    """Where no product op takes it (native kernels off, the embedding's lookup), the
    dequantization becomes the reference's aten ops."""
    g = torch.Generator().manual_seed(0)
    fn = _linear(_q4_fields(g, 48, 128), 4, torch.float32)
    backend = testing.check_pass(DecomposeDequantizePass(), fn, torch.randn(5, 128, generator=g))
    assert backend.matches("decompose_dequantize") == 1
    assert count_ops(backend.graph_after, ops.dequantize_q4) == 0
    assert count_ops(backend.graph_after, torch.ops.aten.bitwise_and) == 1


def test_our_gguf_header_reader_reads_what_gguf_py_reads(tiny_gguf, tmp_path):
    """models/gguf_file.py against gguf-py's reader on the same file: every field (arrays
    of strings and numbers included), every tensor's name, type, shape and bytes; a cut
    file is refused by name."""
    from gguf import GGUFReader, GGUFValueType

    from models.gguf_file import GGUFFile

    ours, theirs = GGUFFile(tiny_gguf[0]), GGUFReader(str(tiny_gguf[0]))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.fields) == set(fields)
    for key, field in fields.items():
        got = ours.field(key)
        got = got.items() if field.types[0] == GGUFValueType.ARRAY else got
        want = field.contents()
        assert got == (pytest.approx(want) if isinstance(want, float) else want), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf[0].read_bytes()[:-100])
    with pytest.raises(gguf.GGUFError, match="runs past the end of the file"):
        gguf.quant_config(cut)


def test_gguf_layers_keep_their_blocks(tiny_gguf):
    config = gguf.quant_config(tiny_gguf[0])
    assert config.formats["model.layers.0.self_attn.qkv_proj"] == QuantFormat(4, 32)
    assert config.formats["model.layers.1.mlp.gate_up_proj"] == QuantFormat(4, 32)
    assert config.formats["model.embed_tokens"] == QuantFormat(8, 32)
    q4_1, q8_0 = QuantFormat(4, 32), QuantFormat(8, 32)
    assert config.parts["model.layers.1.self_attn.qkv_proj"] == (q4_1, q4_1, q8_0)
    assert "lm_head" not in config.formats  # Q5_0: floats


def test_gguf_logits_match_hf_on_the_dequantized_weights(tiny_gguf):
    path, oracle = tiny_gguf
    hf_config = load_hf_config(gguf.metadata_dir(path))
    model, engine_config = load_ours(path, quant_config=gguf.quant_config(path),
                                     hf_config=hf_config)  # fmt: skip
    assert model.model.layers[0].self_attn.qkv_proj.qweight.dtype == torch.uint8
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TOKENIZER_VOCAB, (n,), generator=g) for n in (1, 7, 12)]
    got, want = packed_logits(model, engine_config, prompts), hf_logits(oracle, prompts)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_k_quant_layers_keep_their_blocks_and_match_hf(tmp_path, caplog):
    """A Q4_K_M-like mix (Q4_K; Q6_K for the MLP's down projection, the head and one
    layer's v projection; Q5_K for the embedding and one layer's gate and up): Q4_K layers
    hold q4 blocks, Q5_K ones q4 blocks with their values in 5 bits (where our kernels
    read them: AVX512-BF16; else floats) and Q6_K ones q8 blocks in groups of 16 with
    their values in 6 bits, all with their scales as stored; the fused QKV whose parts
    differ holds each part in its own format, and one whose v is Q5_0 (not kept) loads as
    floats. Logits against HF holding gguf-py's dequantization of every block."""
    from tests.gguf_files import write_gguf
    from tests.helpers import llama_config, save_checkpoint

    config = llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=3)  # fmt: skip
    hf = save_checkpoint(tmp_path / "hf", config)
    path = tmp_path / "k.gguf"
    types = {"mlp.down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "layers.1.self_attn.v_proj": Q.Q6_K,
             "layers.2.self_attn.v_proj": Q.Q5_0, "embed_tokens": Q.Q5_K,
             "layers.0.mlp.gate_proj": Q.Q5_K, "layers.0.mlp.up_proj": Q.Q5_K,
             "layers.2.self_attn.o_proj": Q.IQ4_XS}  # fmt: skip
    oracle = write_gguf(path, hf, types, Q.Q4_K)
    quant = gguf.quant_config(path)
    q4_k, q6_k = QuantFormat(4, 32, torch.uint8), QuantFormat(6, 16, torch.int8)
    five = gguf.keeps_q5_k("cpu")
    q5_k = QuantFormat(5, 32, torch.uint8)
    assert (quant.formats.get("model.layers.0.mlp.gate_up_proj") == q5_k) == five
    assert (quant.formats.get("model.embed_tokens") == q5_k) == five
    # Off the CPU the Triton products read no 5-bit rows: Q5_K loads as floats there.
    on_gpu = gguf.quant_config(path, "cuda")
    assert "model.embed_tokens" not in on_gpu.formats and on_gpu.formats["lm_head"] == q6_k
    iq4 = QuantFormat(4, 32, torch.float32, table=True)
    assert quant.formats["model.layers.2.self_attn.o_proj"] == iq4
    assert "model.layers.2.self_attn.o_proj" not in on_gpu.formats
    assert quant.formats["model.layers.0.self_attn.qkv_proj"] == q4_k
    assert quant.formats["model.layers.0.mlp.down_proj"] == q6_k
    assert quant.formats["lm_head"] == q6_k
    assert quant.parts["model.layers.1.self_attn.qkv_proj"] == (q4_k, q4_k, q6_k)
    assert "model.layers.2.self_attn.qkv_proj" not in {*quant.formats, *quant.parts}
    model, engine_config = load_ours(path, quant_config=quant,
                                     hf_config=load_hf_config(gguf.metadata_dir(path)))  # fmt: skip
    assert model.model.layers[0].mlp.down_proj.scales.dtype == torch.int8
    gate_up = model.model.layers[0].mlp.gate_up_proj
    held = gate_up.qweight.shape[1] == 256 // 8 * 5 if five else gate_up.weight.is_floating_point()
    assert held
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.qweight_v.dtype == torch.uint8 and qkv.qweight_v.shape[1] == 256 // 4 * 3
    assert not hasattr(qkv, "weight") and qkv.scales_v.shape[1] == 256 // 16 + 4
    assert model.model.layers[2].self_attn.qkv_proj.weight.dtype.is_floating_point
    assert "1 fused modules (model.layers.2.self_attn.qkv_proj" in caplog.text
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, TOKENIZER_VOCAB, (n,), generator=g) for n in (1, 9)]
    got, want = packed_logits(model, engine_config, prompts), hf_logits(oracle, prompts)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # On a GPU the loader unpacks the 6-bit values once (the Triton product reads int8):
    # the CPU loaded them packed; unpacked, every Q6_K field (3 down projections, the
    # head, one v part) reads the same values.
    assert unpack_6bit_values(model) == 0
    assert unpack_6bit_values(model, device_type="cuda") == 5
    assert qkv.qweight_v.dtype == torch.int8 and qkv.qweight_v.shape == (128, 256)
    assert model.lm_head.qweight.dtype == torch.int8
    assert torch.equal(packed_logits(model, engine_config, prompts), got)
    assert unpack_6bit_values(model, device_type="cuda") == 0


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["q4_1", "q8_0", "k_mix", "q5_k_iq4_xs"])
def test_gguf_compiled_greedy_equals_eager(tiny_gguf, tiny_llama, tokenizer_dir, tmp_path,
                                           layers):  # fmt: skip
    """The engine on a GGUF file, compiled (the quantized products recorded into CPU
    graphs) against eager, both bf16, on the same tokens. Q8_0 layers with 9 prompts: the
    q8 products' strips (8 rows and more) in prefill and in the batch of 16's graph, and
    the tokens against HF fp32 on the file's dequantized weights up to the first near tie;
    compiled with exact products (`int8_activations` off) against eager, and with the
    default's int8 activations in the strips against HF up to the first tie within 0.05.
    `k_mix`: Q4_K with Q6_K v projections (each QKV's parts multiplied apart), in fp32.
    `q5_k_iq4_xs`: Q5_K with Q6_K down projections and head, as llama.cpp's Q5_K_M, and
    IQ4_XS o projections and embedding (its table looked up in Inductor's gather), in
    fp32, then in bf16 (the 5-bit and table row products where AVX512-BF16 builds them)."""
    from runtime import LLM, SamplingParams
    from tests.gguf_files import write_gguf
    from tests.helpers import hf_greedy_checked, llama_config, save_checkpoint

    if layers == "q4_1":
        path = str(tiny_gguf[0])
        prompts = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46], [7]]
    else:
        path = str(tmp_path / "q.gguf")
        if layers == "q8_0":
            oracle = write_gguf(tmp_path / "q.gguf", tiny_llama[1], {}, Q.Q8_0)
        else:
            config = llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2)  # fmt: skip
            hf = save_checkpoint(tmp_path / "hf", config)
            if layers == "k_mix":
                oracle = write_gguf(tmp_path / "q.gguf", hf, {"v_proj": Q.Q6_K}, Q.Q4_K)
            else:
                types = {"down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "o_proj": Q.IQ4_XS,
                         "embed_tokens": Q.IQ4_XS}  # fmt: skip
                oracle = write_gguf(tmp_path / "q.gguf", hf, types, Q.Q5_K)
        prompts = [[5 + i, 17, 33, 2 * i] for i in range(8)] + [[40, 41, 42, 43, 44, 45, 46]]
        # a step of 128 tokens and more: q8's dense copy on AMX (AMX_DENSE_ROWS), its first
        # 11 greedy tokens without a near tie within 0.05
        prompts += [[(7 * i + 5) % 97 + 3 for i in range(120)]] * (layers == "q8_0")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    # The K-quants in fp32: this model's logits (~4) move by more than HF's near-tie margin
    # under bf16 activations, and eager in bf16 rounds their values (fp32 scales); Q5_K's
    # 5-bit row products (bf16 only) then run against HF with the int8 run's margin.
    dtype = "float32" if layers in ("k_mix", "q5_k_iq4_xs") else "auto"
    runs = [(True, False, True, dtype), (False, False, True, dtype)]
    runs += [(False, True, True, dtype), (False, False, False, dtype)] * (layers == "q8_0")
    runs += [(False, False, True, "bfloat16")] * (layers == "q5_k_iq4_xs")
    for eager, int8, native, dtype in runs:  # (enforce_eager, int8_activations, native_kernels)
        passes = {"int8_activations": int8, "native_kernels": native}
        llm = LLM(path, tokenizer=str(tokenizer_dir), enforce_eager=eager, max_model_len=256,
                  dtype=dtype, compilation_config={"passes": passes})  # fmt: skip
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)])  # fmt: skip
        del llm
    # eager against compiled token for token but on the long prompt, which (a near tie at its
    # last token: eager's bf16 weights and the compiled products round apart) is held to HF
    # up to its first near tie below
    short = len(prompts) - (layers == "q8_0")
    assert outs[0][:short] == outs[1][:short]
    if layers != "q4_1":
        wanted = [hf_greedy_checked(oracle, p, 12, 0.02) for p in prompts]
        assert sum(checked for _, checked in wanted) >= 40, "near ties too early"
        for got, (want, checked) in zip(outs[1], wanted):
            assert got[:checked] == want[:checked]
    if layers in ("q8_0", "q5_k_iq4_xs"):
        wanted = [hf_greedy_checked(oracle, p, 12, 0.05) for p in prompts]
        assert sum(checked for _, checked in wanted) >= 25, "near ties too early"
        for got, (want, checked) in zip(outs[2], wanted):
            assert got[:checked] == want[:checked]
    if layers == "q8_0":
        # native_kernels=False: the compiler's products, the (tied Q8_0) head included.
        wanted = [hf_greedy_checked(oracle, p, 12, 0.02) for p in prompts]
        for got, (want, checked) in zip(outs[3], wanted):
            assert got[:checked] == want[:checked]


@pytest.mark.parametrize("name", ["int8", "int4", "Q6_K", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_compilers_quantized_head_calls_no_native_op(tiny_llama, tmp_path, name, rows):
    """Where the quantized products are the compiler's (`native_kernels=False`, or a CPU
    our kernels are not built for), so is the quantized LM head's: one row a compiled
    reduction over the blocks, more the reference dequantization and a GEMM; no
    `compilecore` op runs, and the logits are the reference's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runtime.llm import build_engine_config
    from runtime.lm_head import compiled_quantized_head

    config = build_engine_config(str(tiny_llama[0]), compilation_config={
        "passes": {"native_kernels": False}, "cache_dir": str(tmp_path)})  # fmt: skip
    product = compiled_quantized_head(config)
    g = torch.Generator().manual_seed(rows)
    if name in ("Q6_K", "Q4_K"):  # a GGUF head's K-quant blocks as loaded (compact scales)
        q6 = name == "Q6_K"
        fmt = QuantFormat(6, 16, torch.int8) if q6 else QuantFormat(4, 32, torch.uint8)
        fields = _q8_fields(g, 96, 256, 16, True) if q6 else _q4_fields(g, 96, 256, 32, True)
    else:
        fmt = quantization_config(name).default
        fields = tuple(quantize(torch.randn(96, 256, generator=g), fmt).values())
    x = torch.randn(rows, 256, generator=g)
    dequantize = quantized.dequantize_q4_ref if fmt.bits == 4 else quantized.dequantize_q8_ref
    want = F.linear(x, dequantize(*fields, torch.float32))

    class Ours(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.namespace)
            return func(*args, **(kwargs or {}))

    product(x, fmt, fields, None)  # compiled on first use
    with Ours() as mode:
        got = product(x, fmt, fields, None)
    assert "compilecore" not in mode.seen
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int4", "int4_g128"])
def test_quantization_at_load_matches_hf_on_the_same_rounding(tiny_llama, tmp_path, name):
    """`quantization="int8" | "int4" | "int4_g128"`: our logits equal HF's with every
    linear layer's weight replaced by its quantize-dequantize round trip (groups of 128 on
    a model whose rows are 128 and 256 wide)."""
    import copy

    from tests.helpers import llama_config, save_checkpoint

    folder, hf = tiny_llama
    if name == "int4_g128":
        folder = tmp_path / "wide"
        hf = save_checkpoint(folder, llama_config(hidden_size=128, intermediate_size=256))
    config = quantization_config(name)
    model, engine_config = load_ours(folder, quant_config=config)
    assert model.model.layers[0].mlp.down_proj.quant_format == AT_LOAD[name]
    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        for module_name, module in oracle.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in module_name:
                fields = quantize(module.weight, config.default)
                dequantize = (quantized.dequantize_q8_ref if config.default.bits == 8
                              else quantized.dequantize_q4_ref)  # fmt: skip
                module.weight.copy_(dequantize(*fields.values(), torch.float32))
    prompts = [torch.tensor([3, 9, 27, 81, 243 % TOKENIZER_VOCAB])]
    got, want = packed_logits(model, engine_config, prompts), hf_logits(oracle, prompts)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_llm_refuses_quantization_that_does_not_apply(tiny_gguf, tiny_llama):
    from runtime.llm import build_engine_config

    with pytest.raises(ValueError, match="quantized already"):
        build_engine_config(str(tiny_gguf[0]), quantization="int8")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        build_engine_config(str(tiny_llama[0]), quantization="gguf")
    with pytest.raises(ValueError, match="not supported"):
        build_engine_config(str(tiny_llama[0]), quantization="awq")


def test_quantization_whose_groups_do_not_divide_a_layer_is_refused_up_front(tiny_llama):
    """int4 in groups of 128 on a model whose rows are 64 or 128 wide: a ValueError that
    names the first layer it cannot hold and what to use, before any weight is read."""
    from runtime import LLM

    with pytest.raises(ValueError, match=r"'int4_g128' cannot hold model\.layers\.0\.self_attn"
                                         r"\.qkv_proj .*groups of 128.*'int4'"):  # fmt: skip
        LLM(str(tiny_llama[0]), quantization="int4_g128", max_model_len=64)


_interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (set without CUDA)"
)


def _triton_case(rows, n, runs, bits, fmt, bias, dtype, out_dtype, seed, device="cpu",
                 tile=None):  # fmt: skip
    """(our Triton product, the reference) on one drawn case; fmt: "plain", "k_quant"
    (Q4_K's compact fields / Q6_K's groups of 16) or "per_channel" (q8)."""
    from passes.ops.triton_quant import quant_linear_triton

    g = torch.Generator().manual_seed(seed)
    k_quant = fmt == "k_quant"
    k = 256 * runs if k_quant else 32 * runs
    group = k if fmt == "per_channel" and bits == 8 else 16 if k_quant and bits == 8 else 32
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    if bits == 4:
        w, *fields = _q4_fields(g, n, k, k_quant=k_quant)
        ref = quantized.q4_linear_ref
    else:
        w, *fields = _q8_fields(g, n, k, group, k_quant, packed=False)  # as loaded on CUDA
        ref = quantized.q8_linear_ref
    want = ref(x, w, *fields, b, out_dtype)
    x, w, b = x.to(device), w.to(device), None if b is None else b.to(device)
    fields = [f.to(device) for f in fields]
    got = quant_linear_triton(x, w, tuple(fields), b, out_dtype, tile)
    if device == "cuda" and tile is None:  # the op dispatches CUDA tensors to the kernel
        op = ops.q4_linear if bits == 4 else ops.q8_linear
        assert torch.equal(op(x, w, *fields, b, out_dtype), got)
    return got.cpu(), want


def _assert_close_to_reference(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2  # a bf16 output's own rounding
    scale = max(want.float().abs().max().item(), 1.0)
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


@_interpreted
@testing.settings(max_examples=20)
@given(
    rows=st.sampled_from([1, 2, 5, 16, 17, 40]), n=st.integers(1, 70), runs=st.integers(1, 4),
    bits=st.sampled_from([4, 8]), fmt=st.sampled_from(["plain", "k_quant", "per_channel"]),
    bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fp32_out=st.booleans(), seed=st.integers(0, 2**16),
    tile=st.sampled_from([None, (16, 16, 128, 4), (32, 32, 64, 2), (16, 64, 256, 8),
                         (1, 8, 64, 2, None, 3), (1, 32, 512, 4), (16, 16, 32, 4, None, 2)]),
)  # fmt: skip
def test_triton_products_equal_the_reference(rows, n, runs, bits, fmt, bias, dtype, fp32_out,
                                             seed, tile):  # fmt: skip
    """The CUDA products' Triton kernel (under the interpreter here) against the
    reference: each value rounded as the reference rounds its dequantized copy, fp32
    sums; Q4_K's compact fields expanded in the kernel, Q6_K's groups of 16, whole-row
    groups, tails of rows and columns (and of K, when a step of K passes its end), a
    bias, fp32 outputs from bf16 inputs, launch tiles."""
    from passes.ops.triton_quant import Tile

    out_dtype = torch.float32 if fp32_out else None
    tile = None if tile is None else Tile(*tile)
    got, want = _triton_case(rows, n, runs, bits, fmt, bias, dtype, out_dtype, seed, tile=tile)
    _assert_close_to_reference(got, want)


@_interpreted
def test_triton_products_refuse_6_bit_rows():
    """The CUDA product reads Q6_K's values as int8 (unpacked once at load): handed the
    CPU's 6-bit rows it says so, where it unpacked a full copy on every call before; and
    Q5_K's 5-bit rows and IQ4's indices, which load as floats off the CPU."""
    from passes.ops.triton_quant import quant_linear_triton

    g = torch.Generator().manual_seed(0)
    w, scales = _q8_fields(g, 8, 256, 16, k_quant=True)
    with pytest.raises(ValueError, match="unpack_6bit_values"):
        quant_linear_triton(torch.randn(1, 256), w, (scales,))
    # Q5_K's 5-bit rows and IQ4's table indices likewise: a GPU loads those as floats
    with pytest.raises(ValueError, match="Q5_K's 5-bit rows"):
        w, scales, mins = _q4_fields(g, 8, 256, five=True)
        quant_linear_triton(torch.randn(1, 256), w, (scales, mins))
    with pytest.raises(ValueError, match="IQ4's 4-bit table indices"):
        w, scales = _iq4_fields(g, 8, 256)
        quant_linear_triton(torch.randn(1, 256), w, (scales,))


@_interpreted
def test_triton_products_address_rows_past_2_31_values():
    """Row offsets in int64: x's third row starts 2^32 - 128 values after its first (a
    row stride just under 2^31, so the stride itself is an int32 argument). In int32 the
    offset wrapped to -128 and the row read the zeros before x (the pad below): its
    outputs were 0. The virtual 8 GiB is an untouched mapping: 3 rows of pages are used."""
    from passes.ops.triton_quant import quant_linear_triton

    stride, k, n, pad = 2**31 - 64, 64, 16, 256
    buffer = mmap.mmap(-1, (pad + 2 * stride + k) * 4)
    x = torch.frombuffer(buffer, dtype=torch.float32).as_strided((3, k), (stride, 1), pad)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3, k, generator=g)
    x.copy_(values)
    w, scales = _q8_fields(g, n, k, 32, False)
    want = quantized.q8_linear_ref(values, w, scales)
    _assert_close_to_reference(quant_linear_triton(x, w, (scales,)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, fmt", [(4, "plain"), (4, "k_quant"), (8, "plain"), (8, "k_quant")])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_triton_products_on_cuda(bits, fmt, rows):
    got, want = _triton_case(rows, 4096, 8, bits, fmt, False, torch.bfloat16, None, 0, "cuda")
    _assert_close_to_reference(got, want)


@pytest.mark.gpu
def test_gguf_on_cuda_with_the_triton_products_equals_cpu(tiny_gguf):
    """The tiny GGUF's greedy tokens on CUDA with the quantized-product pass on (its
    Triton kernel inside the graphs) equal CPU's, in fp32. Token ids in and out: the tiny
    file's SentencePiece vocabulary needs `sentencepiece`, which a device machine may lack."""
    from runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    tokens = {}
    for device in ("cpu", "cuda"):
        extra = {"kv_cache_memory": 64 << 20} if device == "cuda" else {}
        llm = LLM(str(tiny_gguf[0]), device=device, dtype="float32", skip_tokenizer_init=True,
                  **extra,
                  compilation_config={"passes": {"quantized_linear": True},
                                      "cudagraph_capture_sizes": [1, 2]})  # fmt: skip
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cuda"] == tokens["cpu"]
