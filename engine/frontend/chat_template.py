"""Chat templates: the model's Jinja template rendered as transformers renders it, sandboxed.

A template may refuse a conversation (its ``raise_exception``: a role it does not know, an
order of roles it does not allow, or any error while rendering what a request sent); that is
the client's mistake, :class:`ChatTemplateRefused` (a ``ValueError``), as vLLM turns every
rendering error into a 400. A template that tries to escape the sandbox raises jinja2's
``SecurityError`` unchanged: the server's fault when the template is the model's, the
caller's to report when a request sent it.
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


def check_template_source(source: str) -> None:
    """Compile ``source`` (a template a request sent) to find its syntax errors early.

    Raises:
        ChatTemplateRefused: ``source`` is not a valid Jinja template.
    """
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateRefused(f"the chat template does not parse: {exc}") from exc


# transformers' marker of where the continued message ends: appended to its content, found in
# the rendered text, and cut away with everything after it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
    continue_final_message: bool = False,
) -> str:
    """``source`` rendered with ``messages``, ``add_generation_prompt`` and ``variables``.

    ``continue_final_message``: the text ends right after the last message's content (no
    end-of-turn after it), so that the model continues that message instead of starting a new
    one; transformers' rule, whitespace handling included.

    Raises:
        ChatTemplateRefused: the template rejected the conversation, could not render it, or
            dropped the final message that ``continue_final_message`` continues.
    """
    chat = [dict(m) for m in messages]
    final = ""
    if continue_final_message:
        final = _tag_final_message(source, chat)
    try:
        template = _compile_template(source)
        text = template.render(
            messages=chat, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.SecurityError:
        raise  # the template itself is hostile: see the module's docstring
    except jinja2.TemplateError as exc:
        raise ChatTemplateRefused(f"the chat template refused the conversation: {exc}") from exc
    except Exception as exc:  # a TypeError etc. on what the request sent: its fault too
        raise ChatTemplateRefused(f"the chat template failed on this request: {exc!r}") from exc
    if not continue_final_message:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateRefused(
            "continue_final_message: the final message does not appear in the text the chat "
            "template renders (the template changes or drops it)"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:  # the template kept the spacing
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the content: trim what precedes the tag


def _tag_final_message(source: str, chat: list[dict[str, Any]]) -> str:
    """Mark the end of ``chat``'s last message's content (in place); returns the content."""
    if not chat:
        raise ChatTemplateRefused("continue_final_message needs a message to continue")
    final = chat[-1].get("content")
    if not isinstance(final, str):
        raise ChatTemplateRefused("continue_final_message: the final message has no content")
    if "content" not in source:
        raise ChatTemplateRefused(
            "continue_final_message: the chat template does not render messages' content"
        )
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final
