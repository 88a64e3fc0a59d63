from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from compilecore.parallel_state import tensor_model_parallel_all_gather
from models.layers.quantization import quant_fields
from models.layers.vocab_embedding import ParallelLMHead
from passes.ops import gemv


class LogitsProcessor(nn.Module):
    """Hidden states -> logits over the whole vocabulary (gathered across TP ranks).

    The runtime may give it kernels (runtime/lm_head.py; the model file never chooses one):
    `small_batch_gemv` for a single row, which reads the (large) LM head weight at close
    to memory bandwidth and returns fp32 logits, and `linear` for more rows, a kernel on a
    weight packed once. Without them: `F.linear`. A quantized head runs its own product
    on the blocks, with int8 activations for q8 where the runtime sets
    `int8_activations`, unless the runtime gives it `quantized_product` (the compiler's
    own, where our kernels do not run)."""

    # One row: a reduction over several rows re-reads the weight per row (batch-4 decode 120 ->
    # 137 tok/s with F.linear instead, docs/kernel-choices.md, Static-size code).
    SMALL_BATCH = 1

    def __init__(
        self,
        vocab_size: int,
        scale: float = 1.0,
        small_batch_gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        self.vocab_size, self.scale = vocab_size, scale
        self.small_batch_gemv = small_batch_gemv
        self.linear = linear
        # A quantized head's q8 product may take int8 activations (the runtime's choice).
        self.int8_activations = False
        # (x, format, fields, bias) -> fp32 logits, in place of the format's own product.
        self.quantized_product: Callable | None = None
        # Whether this model's next logits serve only an argmax (greedy rows without
        # logprobs): the model runner sets it per step, and the batch-1 head takes it as an
        # argument. One per model: two engines stepping at once never share it.
        self.argmax_only, self._argmax_only_view = gemv.argmax_only_flag()

    def set_argmax_only(self, flag: bool) -> None:
        self._argmax_only_view[0] = flag

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        # Not with a bias: a greedy step's batch-1 head may compute only the rows that can
        # win before the bias is added (passes/ops/gemv.py), and a bias can make another win.
        small = hidden_states.shape[0] <= self.SMALL_BATCH and lm_head.bias is None
        fmt = lm_head.quant_format
        if fmt is not None and self.quantized_product is not None:
            logits = self.quantized_product(hidden_states, fmt, quant_fields(lm_head), lm_head.bias)
        elif fmt is not None:  # fp32 logits, as the kernels below give
            logits = fmt.product(hidden_states, quant_fields(lm_head), lm_head.bias,
                                 torch.float32, self.int8_activations)  # fmt: skip
        elif self.small_batch_gemv is not None and small:
            logits = self._small_batch(lm_head, hidden_states)
        elif self.linear is not None and lm_head.bias is None:
            logits = self.linear(hidden_states, lm_head.weight)
        else:
            logits = F.linear(hidden_states, lm_head.weight, lm_head.bias)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def _small_batch(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        """The head over the rows this rank really holds, padded to its share after: a
        padding row's logit (0) would raise a screened head's cut-off above real rows whose
        logits are all negative."""
        real = max(0, lm_head.vocab_end - lm_head.vocab_start)
        logits = self.small_batch_gemv(hidden_states, lm_head.weight[:real], self.argmax_only)
        pad = lm_head.num_embeddings_per_partition - real
        return F.pad(logits, (0, pad), value=float("-inf")) if pad else logits
