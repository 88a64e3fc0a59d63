"""The Triton kernels of the fused ops (`add_rms_norm.py`, `qkv_rope.py`; see there for
what they compute), at module level: imported only where Triton is used. A kernel defined
inside a function reads `tl` from its closure, which Triton 3.6's interpreter does not
patch (`tl.sum` then fails as a call "outside of the scope of a kernel")."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    dtype = out_ptr.dtype.element_ty
    # fp32 arithmetic, rounded to the input dtype wherever the unfused graph rounds
    # (the add, the normalized value, the weight product): same results, and the
    # interpreter has no 16-bit float arithmetic.
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(dtype)
    tl.store(new_res_ptr + offs, s, mask=mask)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / n_cols
    normed = (sf * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (w * normed).to(dtype), mask=mask)


@triton.jit
def qkv_rope_kernel(
    qkv_ptr,
    pos_ptr,
    cache_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    qkv_stride,
    cache_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads, then v heads
    half = HEAD // 2
    cols = tl.arange(0, HALF_BLOCK)
    mask = cols < half
    src = qkv_ptr + token * qkv_stride + head * HEAD
    dtype = q_ptr.dtype.element_ty
    # fp32 arithmetic rounded like the unfused ops (each product, then the sum).
    x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + cols, mask=mask, other=0.0).to(tl.float32)
    if head < NUM_HEADS + NUM_KV:
        pos = tl.load(pos_ptr + token)
        cos = tl.load(cache_ptr + pos * cache_stride + cols, mask=mask, other=0.0)
        sin = tl.load(cache_ptr + pos * cache_stride + half + cols, mask=mask, other=0.0)
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
        a = (x1 * cos).to(dtype).to(tl.float32)
        b = (x2 * sin).to(dtype).to(tl.float32)
        c = (x2 * cos).to(dtype).to(tl.float32)
        d = (x1 * sin).to(dtype).to(tl.float32)
        o1 = a - b
        o2 = c + d
        if head < NUM_HEADS:
            dst = q_ptr + token * NUM_HEADS * HEAD + head * HEAD
        else:
            dst = k_ptr + token * NUM_KV * HEAD + (head - NUM_HEADS) * HEAD
    else:
        o1, o2 = x1, x2
        dst = v_ptr + token * NUM_KV * HEAD + (head - NUM_HEADS - NUM_KV) * HEAD
    tl.store(dst + cols, o1.to(dtype), mask=mask)
    tl.store(dst + half + cols, o2.to(dtype), mask=mask)
