"""Small-batch linear layers on CPU: as a multiply and a reduction over K that Inductor
generates as one vectorized loop (see passes/gemv_to_reduction.py), and the LM head's
product as our own C loop (`compilecore.gemv_logits`, `gemv.cpp`) where the CPU has
AVX512-BF16."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from passes import huge_pages, native, native_calls
from passes.native_calls import NativeCall
from passes.ops import derived


def gemv_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for small M."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1).to(x.dtype)


def gemv_logits_reduction(
    x: torch.Tensor, w: torch.Tensor, argmax_only: torch.Tensor | None = None
) -> torch.Tensor:
    """The LM head's small-batch GEMV, logits kept in fp32: the sampler works in fp32
    anyway, and rounding to bf16 first only makes near-ties between tokens exact ties.
    Every row is computed (`argmax_only` is `gemv_logits`' flag, which allows fewer)."""
    return (x.float().unsqueeze(1) * w.float().unsqueeze(0)).sum(-1)


@functools.cache
def _kernel(dot_sizes: tuple[int, ...] = ()) -> ctypes.CDLL | None:
    """`gemv.cpp` built for this CPU (rows unrolled for `dot_sizes`), or None where it has
    no AVX512-BF16."""
    return native.load_op_kernel(
        Path(__file__).with_name("gemv.cpp"), "gemv_available", dot_sizes,
        ("gemv_bf16_f32(ptr, i64, ptr, i64, ptr, i64 x4)", "gemv_unrolled(i64) -> i64",
         "gemv_screen_available() -> i64",
         "gemv_head_bf16(ptr, i64, ptr, i64, ptr, i64 x4, ptr, i64, ptr, i64, ptr)"),
    )  # fmt: skip


# -- the screened head: greedy steps read an int8 copy of the LM head ----------------------
def argmax_only_flag() -> tuple[torch.Tensor, object]:
    """A flag for `gemv_logits`' `argmax_only` (int64 [1], 0 or 1) and a numpy view that
    sets it without a torch call. Whoever builds the step owns one and sets it per step; a
    recorded CPU graph reads it through its address, so a replay follows the current step."""
    flag = torch.zeros(1, dtype=torch.int64, device="cpu")
    return flag, flag.numpy()


def screen_bytes(w: torch.Tensor) -> int | None:
    """Bytes a screened head call reads for w in place of w's own: its int8 copy and the
    per-row data (the few rows computed exactly aside); None while w has no screen."""
    screen = derived.current(w, "head_screen")
    if screen is None:
        return None
    q, meta = screen[0], screen[1]
    return q.numel() * q.element_size() + meta.numel() * meta.element_size()


def _screen(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """w's int8 screen, made once (and again when w changes: passes/ops/derived.py)."""
    return derived.derived(w, "head_screen", _make_screen)


def _make_screen(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The int8 copy of w ([N, K] bf16): rows padded to Kp (a multiple of 64) in huge
    pages, per row (scale, |w - q scale|, |q scale|, sum of q) as fp32, Kp, and the slack
    per unit of |x| that covers fp32 rounding in both products (a float's bits)."""
    (n, k), kp = w.shape, -(-w.shape[1] // 64) * 64
    q, _ = huge_pages.huge_page_buffer(n * kp)
    q = q.view(torch.int8).view(n, kp)
    meta = torch.empty(n, 4)
    for start in range(0, n, 4096):  # fp32 temporaries a few MB at a time
        chunk = w[start : start + 4096].float()
        scale = chunk.abs().amax(1).clamp_min(1e-30) / 127
        qr = (chunk / scale[:, None]).round_().clamp_(-127, 127)
        q[start : start + 4096, :k] = qr.to(torch.int8)
        q[start : start + 4096, k:] = 0
        approx = qr * scale[:, None]
        m = meta[start : start + 4096]
        m[:, 0], m[:, 1] = scale, (chunk - approx).norm(dim=1)
        m[:, 2], m[:, 3] = approx.norm(dim=1), qr.sum(1)
        m[:, 1:3] *= 1 + 1e-5  # the norms' own rounding, upward
    # fp32 error of a K-term dot product is at most ~K * 2**-24 * |x| |w_row|; both
    # loops err, so twice that, and twice again for margin.
    slack = 4 * k * 2**-24 * float(w.float().norm(dim=1).max())
    slack_bits = int(torch.tensor(slack, dtype=torch.float32).view(torch.int32))
    return q, meta, kp, slack_bits & 0xFFFFFFFF


def screen_available() -> bool:
    """Whether greedy batch-1 steps read the head through its int8 screen here (a C
    compiler, AVX512-BF16 and AVX512-VNNI)."""
    lib = _kernel()
    return lib is not None and bool(lib.gemv_screen_available())


def own_kernel_available(dtype: torch.dtype) -> bool:
    """Whether `compilecore.gemv_logits` runs our C loop for weights of this dtype."""
    return dtype == torch.bfloat16 and _kernel() is not None


def _native_call(args: tuple, out: torch.Tensor) -> NativeCall | tuple | None:
    """The C call `gemv_logits` makes for (x, w, argmax_only) into `out`."""
    x, w, argmax_only = (*args, None)[:3]
    if not (x.dtype == w.dtype and own_kernel_available(w.dtype)):
        return None
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        # The op reads a copy it makes per call: a replay would read the one made at capture.
        raise native_calls.Unrecordable("compilecore.gemv_logits on an input with strided columns")
    (m, k), n = x.shape, w.shape[0]
    if not m:
        return ()
    lib = _kernel(native.unrolled_sizes(k)) or _kernel()
    args = (x, x.stride(0), w, w.stride(0), out, m, n, k, torch.get_num_threads())
    fn = lib.gemv_bf16_f32
    if m == 1 and argmax_only is not None and lib.gemv_screen_available():
        q, meta, kp, slack_bits = _screen(w)
        args, fn = (*args, q, kp, meta, slack_bits, argmax_only), lib.gemv_head_bf16
    return NativeCall(native_calls.function_address(fn), args, "compilecore.gemv_logits", 0, fn)


def gemv_logits(
    x: torch.Tensor, w: torch.Tensor, argmax_only: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 logits [M, N] = x [M, K] @ w [N, K]^T for bf16 x and w on CPU, read one
    weight row at a time (each x row re-reads the weight: meant for M = 1).

    Where `argmax_only` (see `argmax_only_flag`) holds 1 when the call runs, the logits
    serve only an argmax: the batch-1 head computes the exact logit only of rows that can
    be the largest and -inf for the rest (`gemv_head_bf16`), so the argmax is the full
    product's and the other values are not."""
    if not (x.dtype == w.dtype and own_kernel_available(w.dtype)):
        raise RuntimeError(
            f"compilecore.gemv_logits needs bf16 x and w on a CPU with AVX512-BF16 (got "
            f"{x.dtype} and {w.dtype}); use passes.ops.gemv.gemv_logits_reduction instead"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    if x.shape[0]:
        _native_call((x, w, argmax_only), y).run()
    return y


def _fake_gemv_logits(
    x: torch.Tensor, w: torch.Tensor, argmax_only: torch.Tensor | None = None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


# Through `torch.library.Library`, not the `custom_op` decorator, whose Python wrapper costs ~8
# us a call (docs/kernel-choices.md, Library registration).
_LIB = torch.library.Library("compilecore", "FRAGMENT")
_LIB.define("gemv_logits(Tensor x, Tensor w, Tensor? argmax_only=None) -> Tensor")
_LIB.impl("gemv_logits", gemv_logits, "CPU")
torch.library.register_fake("compilecore::gemv_logits", _fake_gemv_logits, lib=_LIB)
native_calls.declare_entry("compilecore::gemv_logits", _native_call)
