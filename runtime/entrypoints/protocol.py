"""The OpenAI API's request bodies (the fields compilecore serves, with vLLM's extras) and
how they become `SamplingParams`. A field this server does not serve (OpenAI's `suffix`,
`functions`, `audio`, ..., or a misspelt one) is a 400 naming it, not ignored in silence;
a field with a bad value is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.entrypoints.tool_calls import template_message
from runtime.sampling_params import SamplingParams
from runtime.structured_output import from_request


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    # No field is dropped in silence: one this server does not serve is a 400 naming it
    # (OpenAI's bookkeeping fields below are accepted; they change no output).
    model_config = ConfigDict(extra="forbid")
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    # OpenAI's spec allows null for n, stream and the penalties: null is the default.
    model: str | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (runtime/structured_output.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(
        self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        """Unset fields take the model's defaults (generation_config.json), as in vLLM."""

        def pick(name: str) -> Any:
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return SamplingParams(
            n=1 if self.n is None else self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            best_of=self.best_of,
            structured_outputs=from_request(
                self.response_format,
                self.structured_outputs,
                {
                    "json": self.guided_json,
                    "regex": self.guided_regex,
                    "choice": self.guided_choice,
                    "grammar": self.guided_grammar,
                },
            ),  # fmt: skip
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt and its logprobs alone
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""
    # An assistant's tool calls, and a tool result's call id and function name: they reach
    # the chat template (a tool-calling round trip needs them).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> dict[str, Any]:
        """The message as the chat template takes it (ValueError for a content part whose
        text is not a string)."""
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            texts = [part.get("text", "") for part in content if part.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("a text content part's text must be a string")
            content = "".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return template_message(message)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: one call at most


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
