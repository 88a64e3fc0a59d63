"""The engine: scheduler, paged KV cache, sampler, attention backends, the `LLM` API
and the CLI. `from runtime import LLM, SamplingParams`."""

from runtime.llm import LLM
from runtime.outputs import CompletionOutput, Logprob, RequestOutput
from runtime.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "RequestOutputKind",
           "SamplingParams"]  # fmt: skip
