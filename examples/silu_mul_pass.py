"""A user pass: `silu(gate) * up` -> one `examples.silu_and_mul` op.

The Llama MLP computes `silu(x[..., :d]) * x[..., d:]`; after Inductor's decompositions
the post-grad graph holds it as

    g = slice(x, -1, 0, d); u = slice(x, -1, d, 2d)
    y = mul(div(g, add(exp(neg(g)), 1)), u)     # silu decomposed (converts in 16-bit)

and the pass rewrites each site to

    y = examples.silu_and_mul(g, u)

one site per decoder layer. The op is opaque to Inductor, so this is a demonstration of
the API, not a speed-up on CPU (Inductor fuses the unfused form into its own loop); a
GPU kernel behind the op is where such a pass pays.

    from examples.silu_mul_pass import silu_mul_pass
    LLM(model, compilation_config={"custom_passes": [silu_mul_pass()]})
    compilecore generate --custom-pass examples.silu_mul_pass:silu_mul_pass
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from passes import PatternPass


@torch.library.custom_op("examples::silu_and_mul", mutates_args=())
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@silu_and_mul.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


def search(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def replace(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.ops.examples.silu_and_mul(gate, up)


def silu_mul_pass() -> PatternPass:
    """One pattern per dtype: in 16-bit dtypes the decomposed silu carries converts."""
    fused = PatternPass(name="fuse_silu_mul")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        example = [torch.empty(4, 16, dtype=dtype), torch.empty(4, 16, dtype=dtype)]
        fused.add(search, replace, example)
    return fused
