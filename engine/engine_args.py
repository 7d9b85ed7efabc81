"""Command-line engine arguments (vLLM's flag names) <-> EngineConfig.

Nothing here lists the arguments: the flags, the keyword arguments and the argv of a rank
process are all derived from :data:`corefleet.engine.config.ENGINE_ARGS`, the table built from
the config dataclasses' ``engine_arg(...)`` declarations. A new config field is a new flag.
"""

from __future__ import annotations

import argparse
from typing import Any

from corefleet.engine.config import ENGINE_ARGS, EngineArg, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags shared by every command that runs an engine, one per table row.

    Each flag's destination is its keyword (``--scheduling-policy`` -> ``scheduling_policy``),
    so :func:`engine_kwargs_from_args` reads them back by the same name.
    """
    group = parser.add_argument_group("engine")
    for arg in ENGINE_ARGS:
        if arg.kind is bool:
            group.add_argument(
                arg.flag,
                dest=arg.keyword,
                action=argparse.BooleanOptionalAction,
                default=arg.default,
                help=arg.help,
            )
        else:
            group.add_argument(
                arg.flag,
                dest=arg.keyword,
                type=arg.kind,
                choices=arg.choices,
                default=arg.default,
                help=arg.help,
            )


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Flat engine keyword arguments (as ``LLM(**kwargs)`` takes them) from parsed flags."""
    return {arg.keyword: getattr(args, arg.keyword) for arg in ENGINE_ARGS}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; invalid values raise ValueError naming the argument."""
    return EngineConfig.from_kwargs(**engine_kwargs_from_args(args))


def engine_argv_from_config(config: EngineConfig) -> list[str]:
    """The flags that rebuild ``config`` in another process (``corefleet engine-core``).

    The inverse of :func:`engine_config_from_args`; a test checks the round trip. Every
    argument is passed, defaults included, so the rank does not depend on its own defaults.
    """
    argv: list[str] = []
    for arg in ENGINE_ARGS:
        argv += _flag_tokens(arg, arg.value_in(config))
    return argv


def _flag_tokens(arg: EngineArg, value: object) -> list[str]:
    if value is None:
        return []  # only optional arguments may be None, and their default is None
    if arg.kind is bool:
        return [arg.flag if value else "--no-" + arg.flag.removeprefix("--")]
    # repr: a float's shortest exact spelling, so 1/3 comes back as the same float.
    text = repr(value) if arg.kind is float else str(value)
    if text.startswith("-"):
        return [f"{arg.flag}={text}"]  # else argparse could take a path like "-m" for a flag
    return [arg.flag, text]
