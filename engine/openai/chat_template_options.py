"""vLLM's server-side chat-template flags: ``--chat-template``,
``--chat-template-content-format`` and ``--default-chat-template-kwargs``.

- ``--chat-template`` replaces the model's template for every request that takes ``messages``
  (chat completions, Responses, ``/tokenize``'s chat form, the pooling chat forms) and is what
  ``/tokenizer_info`` shows. The value is read as vLLM's ``load_chat_template`` reads it: a file
  that can be opened is read; otherwise a value holding Jinja's markers (``{``, ``}`` or a
  newline) is the template itself, its backslash escapes (``\\n``) decoded; anything else is a
  path that does not exist, an error. It is loaded and compiled once, at start-up: a template
  that does not parse stops the server before it serves anything.
- ``--chat-template-content-format``: how a message's content reaches the template. Messages
  here hold text only, given as one string (vLLM's ``string``; ``auto`` resolves to it).
  vLLM's ``openai`` (content as a list of parts) is refused at start-up.
- ``--default-chat-template-kwargs``: a JSON object of template variables merged under each
  request's ``chat_template_kwargs`` (vLLM's ``merge_kwargs``: the request wins, except where
  its value is null or ``"auto"``).

The options travel to ``serve --api-server-count`` children as JSON (``api_servers.py``): the
template's text, not its path, so every process renders the same template.
"""

from __future__ import annotations

import argparse
import codecs
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corefleet.engine.frontend.chat_template import ChatTemplateRefused, check_template_source
from corefleet.engine.frontend.tokenizer import RESERVED_TEMPLATE_KWARGS

# A server template is chosen by the operator, but a wrong path (model weights) must not be
# read into memory: the largest real templates are tens of KB.
MAX_SERVER_TEMPLATE_BYTES = 1 << 20
MAX_DEFAULT_KWARGS_CHARS = 64 * 1024  # the flag's JSON text
MAX_DEFAULT_KWARGS = 64  # top-level names, as a request's chat_template_kwargs
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's choices; "openai" is refused
JINJA_MARKERS = "{}\n"  # vLLM's test for "this is a template, not a path"


@dataclass(frozen=True)
class ChatTemplateOptions:
    """The server's chat-template options; ValueError naming the flag when one is bad."""

    chat_template: str | None = None  # the template's text (None: the model's)
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            if len(self.chat_template.encode("utf-8")) > MAX_SERVER_TEMPLATE_BYTES:
                raise ValueError(
                    f"--chat-template: the template is longer than {MAX_SERVER_TEMPLATE_BYTES} "
                    "bytes"
                )
            try:
                check_template_source(self.chat_template)
            except ChatTemplateRefused as exc:
                raise ValueError(f"--chat-template: {exc}") from None
        fmt = self.chat_template_content_format
        if fmt not in CONTENT_FORMATS:
            raise ValueError(
                f"--chat-template-content-format {fmt[:64]!r} must be one of {CONTENT_FORMATS}"
            )
        if fmt == "openai":
            raise ValueError(
                "--chat-template-content-format openai is not supported: messages reach the "
                "template with their content as one string (string, which auto resolves to)"
            )
        check_default_kwargs(self.default_chat_template_kwargs)


def check_default_kwargs(kwargs: Any) -> None:
    """Raises ValueError (naming the flag) unless ``kwargs`` is a bounded object of variables
    a request's ``chat_template_kwargs`` could set too."""
    flag = "--default-chat-template-kwargs"
    if not isinstance(kwargs, dict):
        raise ValueError(f"{flag} must be a JSON object, not {type(kwargs).__name__}")
    if len(kwargs) > MAX_DEFAULT_KWARGS:
        raise ValueError(f"{flag} has {len(kwargs)} names; at most {MAX_DEFAULT_KWARGS}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"{flag}: {reserved[0]!r} cannot be set there (the conversation, the tools and the "
            "template are the request's own)"
        )


def parse_default_kwargs(text: str | None) -> dict[str, Any]:
    """The ``--default-chat-template-kwargs`` value as an object (ValueError if it is not)."""
    if text is None:
        return {}
    flag = "--default-chat-template-kwargs"
    if len(text) > MAX_DEFAULT_KWARGS_CHARS:
        raise ValueError(f"{flag} is longer than {MAX_DEFAULT_KWARGS_CHARS} characters")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    check_default_kwargs(value)
    return dict(value)


def load_chat_template(value: str) -> str:
    """The template ``--chat-template value`` names: a file's text, or ``value`` itself when
    it cannot be opened and holds Jinja's markers (vLLM's rule). ValueError otherwise."""
    flag = "--chat-template"
    try:
        with open(value, "rb") as handle:
            data = handle.read(MAX_SERVER_TEMPLATE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        if not any(c in value for c in JINJA_MARKERS):
            raise ValueError(
                f"{flag} {value[:256]!r} looks like a file path, but it cannot be opened: {exc}"
            ) from None
        return _unescaped(value)
    if len(data) > MAX_SERVER_TEMPLATE_BYTES:
        raise ValueError(f"{flag} {value!r}: the file is larger than {MAX_SERVER_TEMPLATE_BYTES}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {value!r} is not UTF-8 text: {exc}") from None


def _unescaped(value: str) -> str:
    # vLLM decodes an inline template's backslash escapes ("\n" typed in a shell) with
    # unicode_escape; going through latin-1 with backslashreplace keeps other non-ASCII text
    # as it was typed instead of reading its UTF-8 bytes as latin-1.
    try:
        return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--chat-template: a bad backslash escape in the template: {exc}"
        ) from None


def add_chat_template_args(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`ChatTemplateOptions`, as one argument group."""
    g = parser.add_argument_group("chat templates (vLLM's flags)")
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template replacing the model's for every request: a file, or the "
        "template itself (a value with {, } or a newline that is not a file); checked at "
        "start-up",
    )
    g.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="how message content reaches the template: auto and string give it as one "
        "string; openai (a list of parts) is not supported",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="template variables for every request, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override them",
    )


def chat_template_options_from_args(args: argparse.Namespace) -> ChatTemplateOptions:
    """The :class:`ChatTemplateOptions` of parsed :func:`add_chat_template_args` flags (the
    template file read here); ValueError naming the flag when one is bad."""
    template = args.chat_template
    return ChatTemplateOptions(
        chat_template=None if template is None else load_chat_template(template),
        chat_template_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=parse_default_kwargs(args.default_chat_template_kwargs),
    )


def merge_template_kwargs(
    defaults: Mapping[str, Any] | None, requested: Mapping[str, Any]
) -> dict[str, Any]:
    """``requested`` (a request's template variables) over the server's ``defaults``: vLLM's
    ``merge_kwargs``, where a request value of null or ``"auto"`` leaves the default."""
    if not defaults:
        return dict(requested)
    kept = {k: v for k, v in requested.items() if v is not None and not _is_auto(v)}
    return dict(defaults) | kept


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"
