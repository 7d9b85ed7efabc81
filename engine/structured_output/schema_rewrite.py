"""JSON Schema rewrites the server makes before a schema becomes a grammar.

- :func:`close_objects`: vLLM's ``disable_additional_properties``. vLLM's default backend
  (xgrammar) compiles a JSON schema in strict mode, where an object allows only the properties
  it declares; llguidance follows the letter of JSON Schema, where undeclared properties are
  allowed, and a small model fills them with invented keys until ``max_tokens``. Adding
  ``additionalProperties: false`` to every object schema that declares ``properties`` or
  ``patternProperties`` and says nothing of extra ones (as vLLM's guidance backend does with
  that option) gives xgrammar's answer; an explicit ``additionalProperties`` (or
  ``unevaluatedProperties``) is left as written.
- :func:`relocate`: a tool's ``parameters`` moved into a larger schema (``tool_choice:
  "required"`` nests each tool's under ``items.anyOf[i].properties.arguments``). Its
  ``$defs``/``definitions`` are hoisted to the root under names no other tool can produce,
  and every local ``$ref`` is rewritten to where its target now lives.

Both copy: the request's own schema (which the chat template also renders) is never changed.
Only schema positions are walked (``properties``, ``items``, ``anyOf``...), never values such
as ``const``, ``enum`` or ``default``, so a literal that looks like a schema stays as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Keywords whose value is a map of name -> subschema.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
# Keywords whose value is a list of subschemas.
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
# Keywords whose value is one subschema (``items`` may also be a list: draft 4's tuples).
_SCHEMA_ONE = frozenset(
    {
        "items",
        "additionalItems",
        "unevaluatedItems",
        "additionalProperties",
        "unevaluatedProperties",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
_DEF_TABLES = ("$defs", "definitions")


def _transform(schema: Any, visit: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of ``schema`` in which every subschema object went through ``visit``, children
    first. A boolean schema (or anything not an object) is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _transform(sub, visit) for name, sub in value.items()}
        elif (key in _SCHEMA_LISTS or key == "items") and isinstance(value, list):
            out[key] = [_transform(sub, visit) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = _transform(value, visit)
        else:
            out[key] = value
    return visit(out)


def close_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``additionalProperties: false`` wherever an object schema declares
    properties and does not say whether others are allowed (see the module docstring).

    Raises:
        RecursionError: the schema is nested deeper than Python's recursion limit.
    """

    def close(sub: dict[str, Any]) -> dict[str, Any]:
        declares = "properties" in sub or "patternProperties" in sub
        says = "additionalProperties" in sub or "unevaluatedProperties" in sub
        return sub | {"additionalProperties": False} if declares and not says else sub

    result: dict[str, Any] = _transform(schema, close)
    return result


def _escape(token: str) -> str:
    """A JSON Pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def hoisted_name(owner: str, table: str, name: str) -> str:
    """The root ``$defs`` name of ``owner``'s definition ``name`` from ``table``.

    ``owner`` is a function name, which holds neither ``.`` nor ``:`` (OpenAI's pattern), so
    the text up to the first of them is the owner and the separator says the table: two tools,
    or a tool's ``$defs`` and its ``definitions``, never produce the same name.
    """
    return f"{owner}{'.' if table == '$defs' else ':'}{name}"


def relocate(schema: dict[str, Any], owner: str, at: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(schema without its definitions, its definitions under their root names)``, for a
    schema moved to the JSON Pointer ``at`` of a larger document whose ``$defs`` receive the
    definitions. A ``$ref`` into its own ``$defs``/``definitions`` points to the hoisted
    name; any other local ``$ref`` (``#``, ``#/properties/...``) is prefixed with ``at``;
    a ``$ref`` to another document is left alone.

    Raises:
        RecursionError: the schema is nested deeper than Python's recursion limit.
    """

    def rewrite(ref: str) -> str:
        if not ref.startswith("#"):
            return ref  # another document, or an $anchor-less URI: not ours to move
        pointer = ref[1:]
        for table in _DEF_TABLES:
            head = f"/{table}/"
            if pointer.startswith(head):
                token, _, rest = pointer[len(head) :].partition("/")
                name = hoisted_name(owner, table, _unescape(token))
                return f"#/$defs/{_escape(name)}" + (f"/{rest}" if rest else "")
        return f"#{at}{pointer}"

    def visit(sub: dict[str, Any]) -> dict[str, Any]:
        ref = sub.get("$ref")
        return sub | {"$ref": rewrite(ref)} if isinstance(ref, str) else sub

    body = {k: v for k, v in schema.items() if k not in _DEF_TABLES}
    defs: dict[str, Any] = {}
    for table in _DEF_TABLES:
        entries = schema.get(table)
        if isinstance(entries, dict):
            for name, sub in entries.items():
                defs[hoisted_name(owner, table, name)] = _transform(sub, visit)
    moved: dict[str, Any] = _transform(body, visit)
    return moved, defs
