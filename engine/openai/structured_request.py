"""The API's ways to ask for a constrained output, mapped to one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object and its older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``
fields. At most one may be set, except next to ``tool_choice`` required or named: the tools'
constraint then replaces the others (as vLLM's tool parser replaces the request's structured
outputs, so that the calls come back), after their shape was checked. A JSON schema's objects
allow only the properties they declare (``disable_additional_properties``, on by default: see
``structured_options``), which the params carry to the ranks (``grammars.to_llguidance``
rewrites the schema; the option is part of their compile cache's key).

The grammar is checked by :func:`check_constraint` (no tokenizer; about a millisecond for a
typical schema, up to ~200 ms for the largest GBNF grammar), which the API runs off the event
loop for a long grammar, as it tokenizes a long prompt: a malformed schema, regex or grammar is
a 400 naming the field before anything is queued. The rank compiles it again against the
model's tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from corefleet.engine.messages import StructuredOutputsParams
from corefleet.engine.openai import limits
from corefleet.engine.openai.errors import CONSTRAINT_CONFLICT, INVALID_GRAMMAR, RequestError
from corefleet.engine.openai.structured_options import StructuredOutputsConfig
from corefleet.engine.structured_output.grammars import check_grammar

GUIDED_FIELDS = {  # vLLM's older fields, and the kind each one sets
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
# vLLM's options of structured_outputs that only tune its own backends: accepted, no effect.
_BACKEND_OPTIONS = {"disable_fallback", "disable_any_whitespace", "whitespace_pattern"}
_STRICT_OPTION = "disable_additional_properties"  # honoured: see structured_options
_DEFAULT_CONFIG = StructuredOutputsConfig()


def structured_params(
    response_format: dict[str, Any] | None,
    structured_outputs: Any,
    guided: dict[str, Any],
    free_end: dict[str, Any],
    tools: StructuredOutputsParams | None = None,
    config: StructuredOutputsConfig = _DEFAULT_CONFIG,
) -> StructuredOutputsParams | None:
    """The request's one constraint, its shape checked (its grammar is checked by
    :func:`check_constraint`); None when it asks for none.

    ``guided`` holds the ``guided_*`` fields the request set (not null); ``free_end`` its
    ``ignore_eos`` and ``min_tokens``, which a grammar refuses: it ends by allowing only EOS.
    ``tools``: the constraint of ``tool_choice`` required or named (``tool_request``), which
    replaces any other. ``config``: the server's ``--structured-outputs-config``.

    Raises:
        RequestError: 400 naming the field: several constraints, an unknown format, a grammar
            that is too long.
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    from_format = _from_response_format(response_format)
    if from_format is not None:
        found.append(("response_format", from_format))
    strict = config.disable_additional_properties
    if structured_outputs is not None:
        own, strict = _from_structured_outputs(structured_outputs, strict)
        if own is not None:
            found.append(("structured_outputs", own))
        elif from_format is None and not guided and tools is None:
            raise RequestError(
                f"structured_outputs: set exactly one of {sorted(_STRUCTURED_KEYS)}",
                param="structured_outputs",
            )
    for field, value in guided.items():
        found.append((field, _params(field, GUIDED_FIELDS[field], value)))
    if tools is not None:
        found = [("tool_choice", tools)]  # vLLM: the tools' schema overrides the others
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise RequestError(
            f"set at most one way to constrain the output, got {names}",
            param=found[1][0],
            code=CONSTRAINT_CONFLICT,
        )
    field, params = found[0]
    for name, value in free_end.items():
        if value:
            raise RequestError(
                f"{name} cannot be combined with {field}: a constrained output ends at the "
                "grammar's end, with EOS",
                param=name,
                code=CONSTRAINT_CONFLICT,
            )
    return _closed(params, strict)


def _closed(params: StructuredOutputsParams, strict: bool) -> StructuredOutputsParams:
    """``params`` carrying ``disable_additional_properties`` when it is a JSON schema (the rank
    and :func:`check_constraint` compile it so); any other kind as it is."""
    if params.json is None:
        return params
    return StructuredOutputsParams(json=params.json, disable_additional_properties=strict)


def constraint_chars(params: StructuredOutputsParams | None) -> int:
    """The characters of grammar text a request carries (0 without a constraint)."""
    return 0 if params is None else len(params.kind()[1])


def check_constraint(params: StructuredOutputsParams | None, body: Any) -> None:
    """Raise a 400 naming ``body``'s field when the constraint's grammar does not compile.

    Raises:
        RequestError: the schema, regex or grammar is malformed or cannot be compiled.
    """
    if params is None:
        return
    try:
        check_grammar(params)
    except ValueError as exc:
        field = _constraint_field(body)
        raise RequestError(f"{field}: {exc}", param=field, code=INVALID_GRAMMAR) from None


def json_constraint(field: str, schema: dict[str, Any]) -> StructuredOutputsParams:
    """A JSON-schema constraint built by the server from ``field`` (the tools), its size
    checked as a client's schema would be."""
    return _params(field, "json", schema)


def _constraint_field(body: Any) -> str:
    """The request field that carries the constraint (structured_params keeps only one)."""
    choice = getattr(body, "tool_choice", None)
    if getattr(body, "tools", None) and choice is not None and choice not in ("none", "auto"):
        return "tools"  # required or named: the tools' schemas replaced any other constraint
    own = getattr(body, "structured_outputs", None)
    if isinstance(own, dict) and any(own.get(k) not in (None, False) for k in _STRUCTURED_KEYS):
        return "structured_outputs"
    for field in GUIDED_FIELDS:
        if getattr(body, field, None) is not None:
            return field
    if _from_response_format(getattr(body, "response_format", None)) is not None:
        return "response_format"
    return "tools"  # tool_choice required or named: the tools' schemas


def _from_response_format(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestError(
                "response_format: json_schema must be an object with a 'schema' object",
                param="response_format",
            )
        # OpenAI's json_schema without a schema allows any JSON (as vLLM does).
        return _params("response_format", "json", spec.get("schema", {}))
    raise RequestError(
        f"response_format: type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _from_structured_outputs(
    value: Any, strict: bool
) -> tuple[StructuredOutputsParams | None, bool]:
    """The constraint of vLLM's ``structured_outputs`` object (None: it only sets options, for
    the constraint of another field) and whether JSON objects are closed (``strict``, the
    server's default, unless it sets ``disable_additional_properties``)."""
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be an object", param=field)
    unknown = set(value) - _STRUCTURED_KEYS - _BACKEND_OPTIONS - {_STRICT_OPTION}
    if unknown:
        raise RequestError(f"{field}: unknown keys {sorted(unknown)}", param=field)
    option = value.get(_STRICT_OPTION)
    if option is not None and not isinstance(option, bool):
        raise RequestError(f"{field}: {_STRICT_OPTION} must be a boolean", param=field)
    strict = strict if option is None else option
    set_keys = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if not set_keys:
        return None, strict
    if len(set_keys) != 1:
        raise RequestError(
            f"{field}: set exactly one of {sorted(_STRUCTURED_KEYS)}, got {sorted(set_keys)}",
            param=field,
        )
    key = set_keys[0]
    if key == "json_object":
        return StructuredOutputsParams(json_object=True), strict
    return _params(field, key, value[key]), strict


def _params(field: str, kind: str, value: Any) -> StructuredOutputsParams:
    """``StructuredOutputsParams`` with ``kind`` set from a request value, shape-checked."""
    if kind in ("json", "structural_tag") and isinstance(value, dict):
        try:
            text = json.dumps(value)
        except RecursionError:
            raise RequestError(f"{field}: nested too deeply", param=field) from None
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(f"{field}: choice must be a non-empty list of strings", param=field)
        text = json.dumps(value)
    elif isinstance(value, str):
        text = value
    else:
        raise RequestError(f"{field}: {kind} must be a string", param=field)
    if len(text) > limits.MAX_GRAMMAR_CHARS:
        raise RequestError(
            f"{field}: the {kind} has {len(text)} characters, more than the "
            f"{limits.MAX_GRAMMAR_CHARS} allowed",
            param=field,
            code=INVALID_GRAMMAR,
        )
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(text))
    if kind == "json":
        return StructuredOutputsParams(json=text)
    if kind == "regex":
        return StructuredOutputsParams(regex=text)
    if kind == "grammar":
        return StructuredOutputsParams(grammar=text)
    return StructuredOutputsParams(structural_tag=text)
