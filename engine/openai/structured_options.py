"""How the server compiles constrained outputs: vLLM's ``--structured-outputs-config``.

One option is read, ``disable_additional_properties``. vLLM's default backend (xgrammar)
compiles a JSON schema in strict mode (an object allows only the properties it declares);
corefleet compiles with llguidance, which allows undeclared properties unless the schema says
``additionalProperties: false``. So the option is on by default here, giving the answers of
vLLM's default (``schema_rewrite.close_objects``); ``false`` follows the letter of JSON Schema.
A request overrides it with ``structured_outputs.disable_additional_properties``. The other
keys of vLLM's ``StructuredOutputsConfig`` choose among vLLM's own backends and are refused.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

_FLAG = "--structured-outputs-config"
_KEYS = ("disable_additional_properties",)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The server's defaults for constrained outputs (vLLM's ``StructuredOutputsConfig``)."""

    # True: an object schema that declares properties allows no others unless it says so.
    disable_additional_properties: bool = True


def parse_structured_outputs_config(text: str) -> StructuredOutputsConfig:
    """The config of the flag's JSON object, as vLLM writes it.

    Raises:
        ValueError: not a JSON object, an unknown key, or a value of the wrong type.
    """
    try:
        value: Any = json.loads(text)
    except ValueError:
        raise ValueError(f"{_FLAG}: expected a JSON object, got {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{_FLAG}: expected a JSON object, got {text[:80]!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"{_FLAG}: unknown keys {unknown}; corefleet compiles every grammar with "
            f"llguidance and reads only {list(_KEYS)}"
        )
    disable = value.get("disable_additional_properties", True)
    if not isinstance(disable, bool):
        raise ValueError(f"{_FLAG}: disable_additional_properties must be true or false")
    return StructuredOutputsConfig(disable_additional_properties=disable)


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    """The ``--structured-outputs-config`` flag, in its own argument group."""
    g = parser.add_argument_group("structured outputs (see docs/coordinator.md)")
    g.add_argument(
        _FLAG,
        default=None,
        metavar="JSON",
        help="vLLM's StructuredOutputsConfig, e.g. '{\"disable_additional_properties\": "
        "false}'. disable_additional_properties (default true, as vLLM's default xgrammar "
        "backend): a JSON schema's objects allow only the properties they declare unless "
        "they say additionalProperties; false follows JSON Schema's letter (any other key "
        "allowed). A request overrides it in structured_outputs",
    )


def structured_outputs_config_from_args(args: argparse.Namespace) -> StructuredOutputsConfig:
    """The config of parsed :func:`add_structured_output_args` flags (ValueError if bad)."""
    text = getattr(args, "structured_outputs_config", None)
    return StructuredOutputsConfig() if text is None else parse_structured_outputs_config(text)
