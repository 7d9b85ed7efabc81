"""Render ``docs/cli.md`` from the commands' own ``--help`` texts.

The page holds ``corefleet --help``, ``corefleet <command> --help`` for every command that
``corefleet.engine.cli.build_parser()`` defines (discovered, not listed here), and
``corefleet-operator --help`` (``corefleet.operator.cli.build_parser()``), each in a fenced block.

The rendering does not depend on the terminal or, as far as argparse allows, on the Python
version: every parser gets a formatter with a fixed width (``COLUMNS`` is ignored), option
invocations are spelled one way (``-n NAMESPACE, --namespace NAMESPACE``), boolean ``--x/--no-x``
flags never repeat their default, and colour (Python 3.14) is off. ``tests/deploy/test_cli_docs.py``
fails when the page differs from a fresh rendering.

Usage::

    .venv/bin/python tools/gen_cli_docs.py            # rewrite docs/cli.md
    .venv/bin/python tools/gen_cli_docs.py --check    # exit 1 (with a diff) if it is stale
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_PATH = REPO / "docs" / "cli.md"
WIDTH = 100
REGENERATE = ".venv/bin/python tools/gen_cli_docs.py"
_BOOL_DEFAULT_SUFFIX = " (default: %(default)s)"


class _StableFormatter(argparse.HelpFormatter):
    """Fixed width and one spelling of option invocations, whatever the terminal or Python."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=WIDTH)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            (metavar,) = self._metavar_formatter(
                action, self._get_default_metavar_for_positional(action)
            )(1)
            return metavar
        if action.nargs == 0:
            return ", ".join(action.option_strings)
        args = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{option} {args}" for option in action.option_strings)


def _stable_formatter_class(original: object) -> type[argparse.HelpFormatter]:
    """``original`` (e.g. a Raw* formatter) with the stable width and invocations mixed in."""
    if not (isinstance(original, type) and issubclass(original, argparse.HelpFormatter)):
        return _StableFormatter  # a factory function: fall back to the plain layout
    if issubclass(original, _StableFormatter):
        return original
    return type(f"Stable{original.__name__}", (_StableFormatter, original), {})


def _subparsers(
    parser: argparse.ArgumentParser,
) -> Iterator[argparse._SubParsersAction[argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield action


def _stabilize(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` and every parser under it render the same everywhere (in place)."""
    parser.formatter_class = _stable_formatter_class(parser.formatter_class)
    if hasattr(parser, "color"):  # Python >= 3.14 colours help on a terminal
        parser.color = False
    for action in parser._actions:
        # Python 3.10 and early 3.11 releases append the default to a --x/--no-x flag's help;
        # later ones do not (nor does `corefleet --help` on CI's Python): drop it everywhere.
        if isinstance(action, argparse.BooleanOptionalAction) and action.help:
            action.help = action.help.removesuffix(_BOOL_DEFAULT_SUFFIX)
    for sub in _subparsers(parser):
        for _, child in _commands(sub):
            _stabilize(child)


def _commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> list[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of each command in definition order; aliases (same parser) left out."""
    seen: set[int] = set()
    out = []
    for name, child in sub.choices.items():
        if id(child) not in seen:
            seen.add(id(child))
            out.append((name, child))
    return out


def _command_summaries(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> dict[str, str]:
    return {choice.dest: choice.help or "" for choice in sub._choices_actions}


def _walk(
    parser: argparse.ArgumentParser, summary: str = ""
) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """``parser`` then every (sub)command under it, depth first, in definition order."""
    yield parser, summary
    for sub in _subparsers(parser):
        summaries = _command_summaries(sub)
        for name, child in _commands(sub):
            yield from _walk(child, summaries.get(name, ""))


def _help_text(parser: argparse.ArgumentParser) -> str:
    lines = parser.format_help().rstrip("\n").splitlines()
    return "\n".join(line.rstrip() for line in lines)


def _anchor(title: str) -> str:
    """GitHub's heading anchor for a plain command name."""
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _parsers() -> list[argparse.ArgumentParser]:
    from corefleet.engine.cli import build_parser as corefleet_parser
    from corefleet.operator.cli import build_parser as operator_parser

    parsers = [corefleet_parser(), operator_parser()]
    for parser in parsers:
        _stabilize(parser)
    return parsers


def render() -> str:
    """The whole of ``docs/cli.md``."""
    corefleet, operator = _parsers()
    sections = [*_walk(corefleet), *_walk(operator)]
    out = [
        f"<!-- Generated by tools/gen_cli_docs.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "# Command-line reference",
        "",
        "> This page is generated from the commands' own `--help` output. Do not edit it by hand;",
        f"> after changing a flag, regenerate it with `{REGENERATE}`.",
        "> `tests/deploy/test_cli_docs.py` fails while it is out of date.",
        "",
        "Two console scripts come with the `corefleet` distribution: `corefleet` (the engine,",
        "`pip install 'corefleet[engine]'`) and `corefleet-operator` (the Kubernetes operator,",
        "`pip install 'corefleet[operator]'`).",
        "",
        "Commands:",
        "",
    ]
    for parser, summary in sections:
        suffix = f": {summary}" if summary else ""
        out.append(f"- [`{parser.prog}`](#{_anchor(parser.prog)}){suffix}")
    for parser, summary in sections:
        out += ["", f"## {parser.prog}", ""]
        if summary:
            out += [summary[0].upper() + summary[1:] + ".", ""]
        out += ["```text", _help_text(parser), "```"]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the page, or with ``--check`` report whether it is current (exit 1 if not)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--output", type=Path, default=DOC_PATH, help="default: docs/cli.md")
    args = parser.parse_args(argv)
    text = render()
    path: Path = args.output
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"{path} (committed)",
            tofile=f"{path} (from --help now)",
        )
        sys.stdout.writelines(diff)
        print(f"\n{path} is out of date; regenerate it with: {REGENERATE}", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
