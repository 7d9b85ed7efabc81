"""A conversation rendered into a prompt, with vLLM's chat-template options: the request fields
(:class:`ChatTemplateFields`), their checks (:func:`check_chat_template_fields`) and the one
rendering (:func:`render_chat`) that every endpoint taking ``messages`` shares, so that
``/v1/chat/completions`` and ``/tokenize`` turn the same request into the same tokens.

- ``chat_template``: a Jinja template replacing the model's for this request, rendered in the
  same sandbox. As in vLLM it is refused (400) unless the server runs with
  ``--trust-request-chat-template``: a template is code, and the sandbox bounds what it may
  reach, not how long it runs.
- ``chat_template_kwargs``: more template variables (Qwen3's ``enable_thinking``...). They may
  override the special tokens (``bos_token``...) as in transformers, but not the conversation:
  ``messages``, ``tools`` and transformers' own arguments (``conversation``, ``chat_template``,
  ``tokenize``) get a 400, as they do at vLLM. ``add_generation_prompt`` and
  ``continue_final_message`` there are overridden by the request's own fields, and
  ``documents`` by the request's ``documents`` when it has them (vLLM's ``merge_kwargs``).
- ``add_generation_prompt`` (default true) opens the assistant's turn;
  ``continue_final_message`` (default false) leaves the last message open for the model to
  continue it instead. Both true is a 400 (with transformers, vLLM fails the same request).
- ``add_special_tokens`` (default false: the template writes them) adds the tokenizer's
  BOS/EOS around the rendered text.
- ``documents`` (a list of string maps) reach the template as ``documents``, for RAG templates.
- ``reasoning_effort`` (chat completions only, vLLM's values) reaches the template as
  ``reasoning_effort``, and sets ``enable_thinking`` (false for ``none``, else true) unless
  ``chat_template_kwargs`` names it: vLLM's rule, for templates where thinking is opt-in.

The server's ``--default-chat-template-kwargs`` lie under all of these
(``chat_template_options.merge_template_kwargs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from jinja2.exceptions import SecurityError
from pydantic import BaseModel, ConfigDict, Field

from corefleet.engine.frontend.chat_template import ChatTemplateRefused, check_template_source
from corefleet.engine.frontend.tokenizer import (
    BOTH_PROMPT_FLAGS,
    RESERVED_TEMPLATE_KWARGS,
    Tokenizer,
)
from corefleet.engine.openai.chat_template_options import merge_template_kwargs
from corefleet.engine.openai.errors import CHAT_TEMPLATE_REFUSED, RequestError
from corefleet.engine.openai.tool_request import NO_TOOLS, ToolPlan, template_inputs

if TYPE_CHECKING:  # protocol imports this module: the request type is for annotations only
    from corefleet.engine.openai.protocol import ChatCompletionRequest

# Real templates are a few KB (the largest known, tool-calling ones, about 20 KB): the bound
# keeps compiling one a millisecond-scale task and the compiled-template cache small.
MAX_CHAT_TEMPLATE_CHARS = 64 * 1024
MAX_CHAT_TEMPLATE_KWARGS = 64  # top-level names; a template reads a handful
MAX_DOCUMENTS = 1024
MAX_ROLE_CHARS = 64  # a message's role: the template decides which it knows

# Set by the request's own fields, whatever chat_template_kwargs says (vLLM's merge_kwargs).
_REQUEST_FIELDS = frozenset({"add_generation_prompt", "continue_final_message"})

UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


class ChatTemplateFields(BaseModel):
    """vLLM's chat-template fields of a request that takes ``messages``; null means the
    default. A base of the request models (its config leaves ``extra`` to them)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_DOCUMENTS)
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, max_length=MAX_CHAT_TEMPLATE_KWARGS
    )

    def opens_turn(self) -> bool:
        """``add_generation_prompt`` with its default (true)."""
        return self.add_generation_prompt is not False

    def request_template_kwargs(self) -> dict[str, Any]:
        """The template variables this request sets (before the server's defaults)."""
        return dict(self.chat_template_kwargs or {})


# vLLM's values (OpenAI's, and "max" for DeepSeek V4's templates).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionTemplateFields(ChatTemplateFields):
    """The chat endpoint's template fields: :class:`ChatTemplateFields` and
    ``reasoning_effort``, which only chat templates read."""

    reasoning_effort: ReasoningEffort | None = Field(
        default=None,
        description="reaches the chat template as reasoning_effort, and sets enable_thinking "
        "(false for none) unless chat_template_kwargs sets it",
    )

    def request_template_kwargs(self) -> dict[str, Any]:
        kwargs = super().request_template_kwargs()
        effort = self.reasoning_effort
        if effort is not None:
            # vLLM's rule: templates where thinking is opt-in (enable_thinking false by
            # default) think when an effort is asked, unless the request says otherwise.
            if "enable_thinking" not in kwargs:
                kwargs["enable_thinking"] = effort != "none"
            kwargs["reasoning_effort"] = effort
        return kwargs


def check_chat_template_fields(fields: ChatTemplateFields, trust_request_template: bool) -> None:
    """The checks of ``fields`` that need no rendering (done before a request is admitted).

    Raises:
        RequestError: 400 naming the field: both prompt flags true, a template sent to a server
            that does not trust them, a template that does not parse, a reserved name in
            ``chat_template_kwargs``.
    """
    if fields.continue_final_message and fields.opens_turn():
        raise RequestError(BOTH_PROMPT_FLAGS, param="continue_final_message")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(fields.chat_template_kwargs or ()))
    if reserved:
        raise RequestError(
            f"chat_template_kwargs: {reserved[0]!r} cannot be set there (the conversation, the "
            "tools and the template are the request's own fields)",
            param="chat_template_kwargs",
        )
    if fields.chat_template is None:
        return
    if not trust_request_template:
        raise RequestError(UNTRUSTED_TEMPLATE, param="chat_template", code=CHAT_TEMPLATE_REFUSED)
    try:
        check_template_source(fields.chat_template)
    except ChatTemplateRefused as exc:
        raise RequestError(
            f"chat_template: {exc}", param="chat_template", code=CHAT_TEMPLATE_REFUSED
        ) from None


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    fields: ChatTemplateFields,
    tools: ToolPlan = NO_TOOLS,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages`` (``ChatCompletionRequest.template_messages`` form) under
    ``fields`` (checked by :func:`check_chat_template_fields`), the request's ``tools`` and
    the server's ``defaults`` (``--default-chat-template-kwargs``).

    Raises:
        ValueError: no template (the model has none and the request sent none).
        ChatTemplateRefused: the template refused the conversation or failed on the kwargs.
        RequestError: the request's own template broke out of the sandbox.
    """
    template = fields.chat_template
    effective = template if template is not None else tokenizer.chat_template
    messages, variables = template_inputs(messages, tools, effective)
    merged = merge_template_kwargs(defaults, fields.request_template_kwargs())
    kwargs = {k: v for k, v in merged.items() if k not in _REQUEST_FIELDS}
    documents = kwargs.pop("documents", None)  # the kwargs' documents, unless the request's
    documents = fields.documents if fields.documents is not None else documents
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=fields.opens_turn(),
            continue_final_message=bool(fields.continue_final_message),
            chat_template=template,
            documents=documents,
            **(kwargs | variables),
        )
    except SecurityError as exc:
        if template is None:
            raise  # the model's own template: the server's fault
        raise RequestError(
            f"chat_template: the template tried to leave the sandbox: {exc}",
            param="chat_template",
            code=CHAT_TEMPLATE_REFUSED,
        ) from None


def render_chat_tokens(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    fields: ChatTemplateFields,
    tools: ToolPlan = NO_TOOLS,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """:func:`render_chat`'s text and its token ids (``add_special_tokens`` applied)."""
    text = render_chat(tokenizer, messages, fields, tools, defaults)
    return text, tokenizer.encode(text, add_special_tokens=bool(fields.add_special_tokens))


def chat_template_rules(schema: dict[str, Any]) -> None:
    """The rules of :func:`check_chat_template_fields` that a JSON Schema can state, patched
    into a request's OpenAPI ``schema`` (which has an ``allOf`` list of rules)."""
    props = schema["properties"]
    props["continue_final_message"]["description"] = "only with add_generation_prompt: false"
    not_continued = {"properties": {"continue_final_message": {"enum": [False, None]}}}
    no_new_turn: dict[str, Any] = {"required": ["add_generation_prompt"]}
    no_new_turn["properties"] = {"add_generation_prompt": {"const": False}}
    schema["allOf"].append({"anyOf": [not_continued, no_new_turn]})
    kwargs = props["chat_template_kwargs"]
    kwargs["description"] = "more chat template variables; not " + ", ".join(
        sorted(RESERVED_TEMPLATE_KWARGS)
    )
    kwargs["propertyNames"] = {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}
    props["chat_template"]["description"] = (
        "a Jinja chat template for this request: refused (chat_template_refused) unless the "
        "server runs with --trust-request-chat-template, or when it does not parse"
    )


def response_role(body: ChatCompletionRequest) -> str:
    """The answer's role (vLLM's): the assistant's when a new turn is opened for it, else the
    last message's, which the model goes on writing."""
    return "assistant" if body.opens_turn() else body.messages[-1].role


def echoed_text(body: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the answer: the last message's content when that message has
    the answer's role (vLLM's rule), else nothing."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == response_role(body) else ""
