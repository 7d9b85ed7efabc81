"""How the server answers ``tools``: whether the model may choose (``tool_choice: "auto"``) and
which parser reads its tool calls out of the text. vLLM's flags, with vLLM's rules.

``required`` and a named function need neither flag: their output is constrained by a schema
built from the tools, so it always parses. ``auto`` lets the model's chat template decide;
its text is read by ``--tool-call-parser`` (``tool_parsers.py``), which must be given with
``--enable-auto-tool-choice``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from corefleet.engine.openai.tool_parsers import PARSER_NAMES


@dataclass(frozen=True)
class ToolOptions:
    """``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r}: choose one of "
                f"{', '.join(PARSER_NAMES)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def auto_parser(self) -> str | None:
        """The parser of ``tool_choice: "auto"`` answers; None when auto is not enabled."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """The tool-calling flags of :class:`ToolOptions`, as one argument group."""
    g = parser.add_argument_group("tool calling (see docs/coordinator.md)")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide whether to call a tool (tool_choice "auto", the default '
        "when a request has tools); needs --tool-call-parser. Without it such a request gets "
        'a 400; "required" and a named function work either way',
    )
    g.add_argument(
        "--tool-call-parser",
        choices=PARSER_NAMES,
        default=None,
        help="how tool calls are read from the model's text: hermes (<tool_call> JSON "
        "</tool_call>: Qwen2.5, Hermes, SmolLM2) or llama3_json (Llama 3.1/3.2 JSON)",
    )


def tool_options_from_args(args: argparse.Namespace) -> ToolOptions:
    """The :class:`ToolOptions` of parsed :func:`add_tool_args` flags (ValueError if bad)."""
    return ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser)
