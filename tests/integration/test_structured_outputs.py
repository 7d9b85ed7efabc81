"""Structured outputs on the embedded SmolLM2: every constrained answer parses and validates."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from corefleet.engine import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

_STR = {"type": "string", "maxLength": 24}
_INT = {"type": "integer", "minimum": 0, "maximum": 99}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A strict object (no other keys), as OpenAI's strict json_schema mode requires."""
    required = list(props) if required is None else required
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


# Twenty shapes: nesting, bounded arrays, enums, const, anyOf/oneOf, patterns, optional keys,
# numbers with ranges, nullable types, arrays of arrays and of objects, a top-level array. Every
# string and array is bounded, so an answer that follows its grammar must end: only a number's
# digits are not (a greedy 135M model once wrote a latitude's decimals until max_tokens).
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    _obj({"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),
    _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    _obj({"v": {"anyOf": [_INT, _STR]}}),
    {"type": "array", "items": _obj({"x": _INT, "y": _INT}), "minItems": 1, "maxItems": 3},
    _obj({"title": _STR, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    _obj({"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 24}}),
    _obj({"city": _STR, "country": {"type": "string", "enum": ["FR", "DE", "IT", "ES"]}}),
    _obj({"items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 4}}),
    _obj({"user": _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})}),
    _obj({"status": {"const": "done"}, "count": _INT}),
    _obj(
        {
            "m": {
                "type": "array",
                "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    _obj({"kind": {"oneOf": [{"const": "cat"}, {"const": "dog"}]}, "legs": _INT}),
    _obj({"first": _STR, "last": _STR, "middle": _STR}, ["first", "last"]),
    _obj(
        {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "cur": {"enum": ["EUR", "USD"]},
        }
    ),
    _obj({"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": _INT}),
    _obj({"point": _obj({"lat": {"type": "integer", "minimum": -90, "maximum": 90}})}),
    _obj({"steps": {"type": "array", "items": _obj({"n": _INT, "text": _STR}), "maxItems": 2}}),
]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(multiprocess=False, dtype="float32", kv_cache_memory=256 << 20)
    yield engine
    engine.shutdown()


def _chat_prompt(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def _greedy(max_tokens: int, **structured: Any) -> SamplingParams:
    constraint = StructuredOutputsParams(**structured) if structured else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint)


def test_twenty_schemas_in_one_batch_all_validate(llm: LLM) -> None:
    prompts = [_chat_prompt(llm, f"Answer in JSON: {json.dumps(s)}") for s in SCHEMAS]
    params = [_greedy(256, json=json.dumps(s)) for s in SCHEMAS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        answer = output.outputs[0]
        assert answer.finish_reason == "stop", (schema, answer.text)
        jsonschema.validate(json.loads(answer.text), schema)


def test_regex_choice_grammar_and_any_json_object(llm: LLM) -> None:
    prompt = _chat_prompt(llm, "What is the capital of France? Reply briefly.")
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": "[A-Z][a-z]{2,10}, [0-9]{4}"}, re.compile(r"[A-Z][a-z]{2,10}, [0-9]{4}")),
        ({"choice": ["Paris", "London", "Berlin"]}, {"Paris", "London", "Berlin"}),
        ({"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}, None),
        ({"json_object": True}, dict),
    ]
    outputs = llm.generate(
        [prompt] * len(cases), [_greedy(48, **c) for c, _ in cases], use_tqdm=False
    )
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    assert cases[0][1].fullmatch(texts[0])
    assert texts[1] in cases[1][1]
    assert texts[2] in ("The answer is yes.", "The answer is no.")
    assert isinstance(json.loads(texts[3]), dict)


def test_a_structural_tag_constrains_only_what_follows_its_trigger(llm: LLM) -> None:
    # Free text in which every <function=forecast> block must follow the schema: the greedy
    # model, unconstrained, copies the prompt's pattern with days=2, outside the schema.
    schema = _obj({"city": _STR, "days": {"type": "integer", "minimum": 6, "maximum": 7}})
    structure = {"begin": "<function=forecast>", "schema": schema, "end": "</function>"}
    tag = {"type": "structural_tag", "structures": [structure], "triggers": ["<function="]}
    prompt = (
        'Forecast requests:\n<function=forecast>{"city": "Rome", "days": 3}</function>\n'
        '<function=forecast>{"city": "Oslo", "days": 5}</function>\n'
    )
    free, tagged = llm.generate(
        [prompt, prompt], [_greedy(80), _greedy(80, structural_tag=json.dumps(tag))], use_tqdm=False
    )
    blocks = re.compile(r"<function=forecast>(.*?)</function>")

    def valid(text: str) -> list[bool]:
        found = []
        for block in blocks.findall(text):
            try:
                jsonschema.validate(json.loads(block), schema)
                found.append(True)
            except (ValueError, jsonschema.ValidationError):
                found.append(False)
        return found

    assert valid(tagged.outputs[0].text) and all(valid(tagged.outputs[0].text))
    assert not all(valid(free.outputs[0].text))


def test_free_requests_in_a_mixed_batch_equal_an_unconstrained_run(llm: LLM) -> None:
    free = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    alone = llm.generate(free, _greedy(24), use_tqdm=False)
    constrained = [_chat_prompt(llm, "Give a JSON object."), _chat_prompt(llm, "Yes or no?")]
    mixed = llm.generate(
        [constrained[0], free[0], constrained[1], free[1], free[2]],
        [
            _greedy(64, json=json.dumps(SCHEMAS[0])),
            _greedy(24),
            _greedy(8, choice=["yes", "no"]),
            _greedy(24),
            _greedy(24),
        ],
        use_tqdm=False,
    )
    free_mixed = [mixed[1], mixed[3], mixed[4]]
    for a, b in zip(alone, free_mixed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert mixed[2].outputs[0].text in ("yes", "no")


def test_a_grammar_longer_than_max_tokens_ends_with_length(llm: LLM) -> None:
    output = llm.generate("Count:", _greedy(5, regex="(ab){40}"), use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length"
    assert len(output.token_ids) == 5 and "abab".startswith(output.text[:4])


def test_a_grammar_the_engine_cannot_compile_fails_alone(llm: LLM) -> None:
    # The API checks grammars before queueing; a client of the engine itself need not have.
    outputs = llm.generate(
        ["Hi", "The capital of France is"],
        [_greedy(8, regex="(unclosed"), _greedy(8)],
        use_tqdm=False,
    )
    failed, served = outputs[0].outputs[0], outputs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert served.finish_reason == "length" and len(served.token_ids) == 8
    # The engine serves on, and a valid grammar after the failure works.
    again = llm.generate("Yes or no?", _greedy(4, choice=["yes", "no"]), use_tqdm=False)
    assert again[0].outputs[0].text in ("yes", "no")
