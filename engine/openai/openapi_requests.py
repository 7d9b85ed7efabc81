"""The generation requests' rules in the OpenAPI document: the served ranks' bounds (``n`` ×
prompts, the context, the vocabulary, ``--max-logprobs``, the scheduling policy) and the
cross-field rules, patched into the schemas pydantic writes for the request models."""

from __future__ import annotations

import math
from typing import Any

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.chat_render import chat_template_rules
from corefleet.engine.openai.openapi_admin import Schema
from corefleet.engine.openai.openapi_structured import structured_output_rules
from corefleet.engine.openai.token_request import token_control_schemas

NULL: Schema = {"type": "null"}
_MAX_N_RANGES = 6


def _int(prop: Schema, **bounds: int) -> None:
    """Add ``bounds`` to the integer branch of ``prop`` (``X`` or ``anyOf: [X, null]``)."""
    for branch in [prop, *prop.get("anyOf", [])]:
        if branch.get("type") == "integer":
            branch.update(bounds)


def _only(values: list[Any], why: str, **schema: Any) -> Schema:
    """A parameter the server refuses but for these values (``schema`` or an ``enum``)."""
    accepted = [schema] if schema else []
    return {"anyOf": [*accepted, *({"const": v} for v in values)], "description": why}


def _absent_or_null(field: str) -> Schema:
    return {"properties": {field: NULL}}


def _one(field: str) -> Schema:
    """``field`` absent, null or 1."""
    return {"properties": {field: {"enum": [1, None]}}}


def _is(field: str, value: Any) -> Schema:
    return {"required": [field], "properties": {field: {"const": value}}}


def sampling_rules(
    schema: Schema,
    model_name: str,
    max_n: int,
    max_model_len: int | None,
    vocab: int | None,
    max_logprobs: int | None = None,
    priority_scheduling: bool = False,
) -> None:
    """The bounds and rules both generation endpoints share, patched into ``schema``."""
    props = schema["properties"]
    if not priority_scheduling:
        props["priority"] = _only([0, None], "any value only under --scheduling-policy priority")
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        if max_logprobs is not None and vocab is not None and name in props:
            # -1 (the whole vocabulary) only where --max-logprobs allows that many.
            _int(props[name], minimum=-1 if vocab <= max_logprobs else 0, maximum=max_logprobs)
    props["model"] = {"enum": [model_name, None], "default": None, "title": "Model"}
    _int(props["n"], maximum=max_n)
    for branch in props["stop_token_ids"]["anyOf"]:
        if vocab is not None and "items" in branch:
            _int(branch["items"], maximum=vocab - 1)
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if max_model_len is not None and name in props:
            _int(props[name], maximum=max_model_len - 1)  # a prompt has at least one token
    # -1: as many as the context holds; 0 is not a length.
    kept: Schema = {"type": "integer", "minimum": 1}
    if max_model_len is not None:
        kept["maximum"] = max_model_len - 1
    props["truncate_prompt_tokens"] = {
        "anyOf": [{"const": -1}, kept, NULL],
        "default": None,
        "title": "Truncate Prompt Tokens",
    }
    props["stream_options"]["description"] = "only with stream: true"
    schema["allOf"] = [{"anyOf": [_absent_or_null("stream_options"), _is("stream", True)]}]
    props["prompt_logprobs"]["description"] = "not with stream: true (0 or null then)"
    schema["allOf"] += token_control_schemas(props, vocab, chat="messages" in props)
    structured_output_rules(schema)


def _n_ranges(max_n: int) -> list[tuple[int, int, int]]:
    """(first n, last n, most prompts) over n = 2..max_n: exact (n × prompts <= max_n) while
    there are few distinct bounds, else _MAX_N_RANGES geometric ranges, each with the bound of
    its largest n (stricter than the server for the others: schemathesis gives up on an
    ``anyOf`` of more than about ten branches here)."""
    exact, n = [], 2
    while n <= max_n:
        last = max_n // (max_n // n)
        exact.append((n, last, max_n // n))
        n = last + 1
    if len(exact) <= _MAX_N_RANGES:
        return exact
    ranges, first = [], 2
    for i in range(1, _MAX_N_RANGES + 1):
        last = min(max_n, math.ceil(max_n ** (i / _MAX_N_RANGES)))
        if last >= first:
            ranges.append((first, last, max_n // last))
            first = last + 1
    return ranges


def completion_rules(
    schema: Schema, max_n: int, max_model_len: int | None, vocab: int | None
) -> None:
    """``POST /v1/completions``: the prompt's forms and bounds, n × prompts, what is refused."""
    props, rules = schema["properties"], schema["allOf"]
    token = {"type": "integer", "minimum": 0} | ({} if vocab is None else {"maximum": vocab - 1})
    ids: Schema = {"type": "array", "items": token, "minItems": 1}
    if max_model_len is not None:
        ids["maxItems"] = max_model_len - 1
    text = {"type": "string", "minLength": 1}
    many = [{"type": "array", "items": x, "minItems": 1, "maxItems": max_n} for x in (text, ids)]
    props["prompt"] = {
        "title": "Prompt",
        "description": f"text or token ids, or a list of either; n × prompts is at most {max_n}",
        "anyOf": [text, ids, *many],
    }
    # n × prompts <= max_n: one prompt, or n = 1, or n in a range with a bound on the prompts.
    one_prompt = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]}
    cases: list[Schema] = [{"properties": {"prompt": one_prompt}}, _one("n")]
    for first, last, most in _n_ranges(max_n):
        n_range = {"type": "integer", "minimum": first, "maximum": last}
        prompts = {"type": "array", "maxItems": most}
        cases.append({"required": ["n"], "properties": {"n": n_range, "prompt": prompts}})
    rules.append({"anyOf": cases})
    props["max_tokens"]["description"] = "0 only with echo: true (the prompt alone)"
    props["suffix"] = _only(["", None], "not supported: only an empty string or null")
    # The server takes best_of = n, but n > 1 would take a branch per n (and best_of is legacy).
    props["best_of"] = _only([1, None], "only equal to n (this document: 1, with n = 1)")
    rules.append({"anyOf": [_absent_or_null("best_of"), _one("n")]})
    default = p.CompletionRequest.model_fields["max_tokens"].default
    min_tokens = {"properties": {"min_tokens": {"maximum": default}}}
    rules.append({"anyOf": [{"required": ["max_tokens"]}, min_tokens]})


def chat_rules(schema: Schema, messages: Schema) -> None:
    """``POST /v1/chat/completions``: top_logprobs only with logprobs; content optional only for
    an assistant turn."""
    props = schema["properties"]
    props["top_logprobs"]["description"] = "only with logprobs: true"
    schema["allOf"].append({"anyOf": [_absent_or_null("top_logprobs"), _is("logprobs", True)]})
    # Only an assistant turn may lack content.
    content = {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}}
    messages["allOf"] = [{"anyOf": [_is("role", "assistant"), content]}]
    chat_template_rules(schema)
