"""Chat templates: the model's Jinja template rendered as transformers renders it, sandboxed.

A template may refuse a conversation (its ``raise_exception``: a role it does not know, an
order of roles it does not allow); that is the client's mistake, :class:`ChatTemplateRefused`
(a ``ValueError``). A template that tries to escape the sandbox is the server's fault and
raises jinja2's ``SecurityError`` unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox


class ChatTemplateRefused(ValueError):
    """The model's chat template rejected a conversation (or could not render it)."""

    code = "chat_template_refused"  # the HTTP API's error code for it


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render the body unchanged.

    transformers uses the tag to build assistant-token masks for training; for inference it
    only has to parse.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares it this way

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &, '), which would corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Sandboxed and immutable: templates come with downloaded models and must not reach
    # Python internals or mutate the caller's messages. trim_blocks/lstrip_blocks match
    # transformers, so the same template renders the same text.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads from its caller (``messages``, ``tools``...): whether a
    template renders ``tools`` at all is known before any request."""
    env = _compile_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """``source`` rendered with ``messages``, ``add_generation_prompt`` and ``variables``.

    Raises:
        ChatTemplateRefused: the template rejected the conversation or could not render it.
    """
    template = _compile_template(source)
    try:
        return template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.SecurityError:
        raise  # the template itself is hostile: a fault of the server, not of the request
    except jinja2.TemplateError as exc:
        raise ChatTemplateRefused(f"the chat template refused the conversation: {exc}") from exc
