"""Structured outputs (runtime/structured_output.py, xgrammar): every output of a
constrained request parses and validates, greedy and sampled, n > 1, batched with
unconstrained requests whose tokens stay exactly as without them; a spec that does not
compile is refused before anything is queued. The model is a random tiny Llama: only the
grammar makes its output valid, and JSON is asked without free whitespace (a random model
pads with it until max_tokens)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime import LLM, SamplingParams
from runtime.structured_output import StructuredOutputsParams

PROMPTS = ["The quick brown fox", "Compilers are", "héllo 🙂 wörld"]


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}  # fmt: skip


ENUM, FLAG = {"enum": ["x", "y", "z"]}, {"type": "boolean"}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
CODE = {"type": "string", "pattern": "^[A-C][0-9]$"}
SCHEMAS = [
    _obj({"a": ENUM, "b": FLAG}),
    _obj({"n": SMALL}),
    _obj({"tags": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 3}}),
    _obj({"inner": _obj({"ok": FLAG})}),
    _obj({"code": CODE}),
    _obj({"a": ENUM, "b": FLAG}, required=["a"]),  # an optional field
    _obj({"deep": _obj({"deeper": _obj({"v": SMALL})})}),
    _obj({"pair": {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 2}}),
    _obj({"points": {"type": "array", "items": _obj({"x": SMALL, "y": SMALL}), "maxItems": 2}}),
    _obj({"kind": {"const": "circle"}, "r": SMALL}),
    _obj({"v": {"anyOf": [SMALL, FLAG]}}),
    _obj({"maybe": {"anyOf": [ENUM, {"type": "null"}]}}),
    _obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "on": FLAG}),
    _obj({"word": {"type": "string", "pattern": "^[a-z]{1,3}$"}}),
    _obj({"grid": {"type": "array", "items": {"type": "array", "items": FLAG, "maxItems": 2},
                   "maxItems": 2}}),
    _obj({"a": ENUM, "b": ENUM, "c": ENUM, "d": FLAG}),
    _obj({"status": {"enum": ["ok", "error", "pending"]}, "code": SMALL}),
    {"type": "array", "items": ENUM, "minItems": 1, "maxItems": 3},  # not an object at top
    _obj({"user": _obj({"name": {"enum": ["ann", "bob"]}, "age": SMALL,
                        "roles": {"type": "array", "items": ENUM, "maxItems": 2}})}),
    _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}, required=[]),
]  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), enforce_eager=True)


def _outputs(llm: LLM, structured, temperature: float, n: int = 1, prompts=PROMPTS) -> list:
    params = SamplingParams(temperature=temperature, seed=3, n=n, max_tokens=60,
                            structured_outputs=structured)  # fmt: skip
    return [o for r in llm.generate(prompts, params, use_tqdm=False) for o in r.outputs]


@pytest.mark.parametrize("temperature, n", [(0.0, 1), (1.0, 2)])
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(llm, schema, temperature, n):
    spec = {"json": SCHEMAS[schema], "disable_any_whitespace": True}
    for out in _outputs(llm, spec, temperature, n):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMAS[schema])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_json_object(llm, temperature):
    for out in _outputs(llm, {"regex": "[a-c]{3}-[0-9]{2}"}, temperature):
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", out.text), out.text
    choices = ["yes", "no", "maybe"]
    for out in _outputs(llm, StructuredOutputsParams(choice=choices), temperature, n=2):
        assert out.text in choices
    spec = {"json_object": True, "disable_any_whitespace": True}
    for out in _outputs(llm, spec, temperature):  # an object, not any JSON value
        assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)


def test_an_ebnf_grammar_and_the_older_guided_decoding_name(llm):
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                            guided_decoding={"grammar": grammar})  # fmt: skip
    assert params.structured_outputs.grammar == grammar and params.guided_decoding is None
    for r in llm.generate(PROMPTS, params, use_tqdm=False):
        out = r.outputs[0]
        assert out.finish_reason == "length" or re.fullmatch(r"\([0-9](\+[0-9])*\)", out.text)


def test_unconstrained_rows_of_the_same_batch_keep_their_tokens(llm):
    """A constrained request masks its own row on a copy: the greedy and seeded rows
    beside it give exactly the tokens they give alone."""
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)]  # fmt: skip
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], plain, use_tqdm=False)]
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs={"regex": "[0-9]{5}"})  # fmt: skip
    mixed = llm.generate(PROMPTS[:2] + [PROMPTS[2]], plain + [constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert re.fullmatch("[0-9]{5}", mixed[2].outputs[0].text)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"regex": "(unclosed"}, "regex does not compile"),
        ({"json": {"type": "no-such-type"}}, "json does not compile"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"choice": []}, "non-empty strings"),
        ({"json": "{not json"}, "is not JSON"),
    ],
)
def test_a_spec_that_does_not_compile_is_refused_before_queueing(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
