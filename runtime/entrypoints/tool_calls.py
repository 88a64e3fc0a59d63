"""Tool calling for `/v1/chat/completions`, as vLLM's server does it.

- `tool_choice` `"required"` or a named function: the output is forced through the
  structured-output grammar, so any model gives a valid call. Named: the function's
  parameters schema, the output being its arguments. Required: a JSON array of at least
  one `{"name": ..., "parameters": ...}` object, one schema per tool.
- `"auto"` (with `--enable-auto-tool-choice --tool-call-parser hermes`): the model writes
  calls as Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (what Hermes, Qwen and SmolLM-style templates ask for); they are parsed out of its text.
- `"none"`, or no tools: plain text.

Responses carry OpenAI's `tool_calls` (`id`, `type: function`, `function.name`,
`function.arguments` as JSON text) and `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from typing import Any

PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _functions(tools: list[dict]) -> dict[str, dict]:
    """name -> function of each tool; a ValueError names what is malformed."""
    out = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ValueError("tools must be [{'type': 'function', 'function': {...}}, ...]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("each tool's function needs a name")
        out[fn["name"]] = fn
    return out


def resolve_choice(tools: list[dict] | None, tool_choice: Any, auto_parser: str | None) -> Any:
    """The tool choice a request gets: None (plain text), "auto", "required" or a name.
    OpenAI's default with tools is "auto", which needs a parser (vLLM: a 400 without one)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = _functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if auto_parser else "none"
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        if auto_parser is None:
            raise ValueError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser"
            )
        return "auto"
    if tool_choice == "required":
        return "required"
    named = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = named.get("name") if isinstance(named, dict) else None
    if name not in functions:
        raise ValueError(f"tool_choice names no tool of this request: {tool_choice!r}")
    return name


def forced_schema(tools: list[dict], choice: Any, parallel: bool = True) -> dict | None:
    """The JSON schema the output is held to for a required or named choice, else None;
    `parallel=False` (OpenAI's `parallel_tool_calls`): one call at most."""
    if choice in (None, "auto"):
        return None
    functions = _functions(tools)
    params = {n: fn.get("parameters") or {"type": "object"} for n, fn in functions.items()}
    if choice != "required":
        return params[choice]
    calls = [
        {"type": "object", "properties": {"name": {"const": n}, "parameters": p},
         "required": ["name", "parameters"], "additionalProperties": False}
        for n, p in params.items()
    ]  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def tool_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}  # fmt: skip


def parse(text: str, choice: Any) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output under `choice`."""
    if choice is None:
        return text, []
    if choice == "auto":
        calls = []
        for block in _HERMES.findall(text):
            try:
                call = json.loads(block)
                calls.append(tool_call(call["name"], call.get("arguments", {})))
            except (ValueError, KeyError, TypeError):
                return text, []  # not a call after all: the text as it is
        content = _HERMES.sub("", text).strip() or None
        return (content, calls) if calls else (text, [])
    try:
        value = json.loads(text)
    except ValueError:  # cut by max_tokens before the grammar completed
        return text, []
    if choice == "required":
        return None, [tool_call(c["name"], c["parameters"]) for c in value]
    return None, [tool_call(choice, value)]


def template_message(message: dict) -> dict:
    """A message as chat templates expect it: an assistant's tool calls with their
    arguments as objects (OpenAI sends them as JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                fn["arguments"] = json.loads(fn["arguments"])
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}
