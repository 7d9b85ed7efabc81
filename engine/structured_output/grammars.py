"""From a request's ``StructuredOutputsParams`` to an llguidance grammar, and its checks.

Chosen by measurement (``benchmarks/grammar_backends.py``): llguidance compiles a JSON schema in
about 1 ms (xgrammar in about 4, with a worst case of 25) and needs no other package; xgrammar
fills a mask faster, but both are far below a forward pass. This module needs no tokenizer and
no torch, so the coordinator uses it to refuse a bad grammar with a 400 before anything is
queued; the engine compiles the same text against its tokenizer (``manager``).

A JSON schema is compiled closed by default (``disable_additional_properties``, see
``schema_rewrite.close_objects``): the option is part of the grammar's key, so the engine's
cache never hands a request the grammar of the other setting.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

from corefleet.engine.messages import StructuredOutputsParams
from corefleet.engine.structured_output.schema_rewrite import close_objects

# llguidance converts GBNF to Lark in Python, in time that grows with the square of the rules
# (~200 ms at 10 KB, 2.3 s at 42 KB): a GBNF grammar is bounded tighter than a Lark one.
MAX_GBNF_CHARS = 8 * 1024
# Whitespace between JSON tokens is the model's choice (as xgrammar's any_whitespace), so a
# model that indents its JSON is not pushed off its own distribution; but at most 32 characters
# in a row, so that a small model cannot fill max_tokens with newlines (a known failure mode of
# unbounded whitespace, which vLLM answers with disable_any_whitespace).
_JSON_OPTIONS: dict[str, object] = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}",
}


GrammarKey = tuple[str, str, bool]  # (kind, text, disable_additional_properties)


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The cache key of a request's grammar: ``(kind, text, closed)``, where ``closed`` is
    ``disable_additional_properties`` (default True); ``ValueError`` if malformed."""
    kind, text = params.kind()
    return kind, text, params.disable_additional_properties is not False


def to_llguidance(kind: str, text: str, closed: bool = True) -> str:
    """The llguidance grammar for ``(kind, text)``; ``ValueError`` naming the field if the
    text cannot even be read (an invalid schema is found by :func:`check_grammar`).
    ``closed``: a JSON schema's objects allow only their declared properties unless they say
    otherwise (``close_objects``)."""
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            if closed:
                schema = close_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"},
                defaults=_JSON_OPTIONS,  # type: ignore[arg-type]
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            lark = "start: " + " | ".join(json.dumps(c) for c in choices)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind == "grammar":
            if not is_lark_syntax(text) and len(text) > MAX_GBNF_CHARS:
                raise ValueError(
                    f"a GBNF grammar may have at most {MAX_GBNF_CHARS} characters (this one has "
                    f"{len(text)}); write a longer one in Lark syntax"
                )
            return llguidance.LLMatcher.grammar_from_lark(_to_lark(text))
        if kind == "structural_tag":
            return _structural_tag(json.loads(text))
    except (
        ValueError,
        TypeError,
        KeyError,
        AssertionError,
        RecursionError,
    ) as exc:
        raise ValueError(f"invalid {field}: {exc}") from exc
    raise ValueError(f"unknown structured output kind {kind!r}")


def _to_lark(text: str) -> str:
    """Lark syntax as is, GBNF converted; ``ValueError`` for a grammar the converter refuses
    (it raises a bare ``Exception`` for malformed input, e.g. "No 'root' rule found")."""
    try:
        return any_to_lark(text)
    except Exception as exc:
        raise ValueError(str(exc)) from exc


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` naming the field when the grammar is malformed or cannot compile.

    Runs without a tokenizer (a syntax and schema check, about a millisecond), so a frontend
    refuses the request before it is queued.
    """
    kind, text, closed = grammar_key(params)
    grammar = to_llguidance(kind, text, closed)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid structured_outputs.{kind}: {messages[0] if messages else ''}")


def _structural_tag(spec: dict[str, Any]) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}``): free text in which each structure, once its trigger appears, follows its
    schema up to its end."""
    triggers: list[str] = spec["triggers"]
    tags = []
    for structure in spec["structures"]:
        begin = structure["begin"]
        matching = [t for t in triggers if t and begin.startswith(t)]
        if not matching:
            raise ValueError(f"no trigger in {triggers!r} starts the structure begin {begin!r}")
        trigger = matching[0]
        tags.append(
            llguidance.StructTag(
                trigger=trigger,
                begin=begin,
                grammar=structure.get("schema", {}),
                end=structure["end"],
            )
        )
    return llguidance.StructTag.to_grammar(tags)
