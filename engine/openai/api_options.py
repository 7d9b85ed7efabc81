"""vLLM's flags that shape the API's answers rather than the engine's work: how tokens are named
in logprobs and whether usage is always reported. Each one sets a default a request may
override (``return_tokens_as_token_ids``) or forces a field on (``include_usage``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from corefleet.engine.openai.chat_template_options import (
    ChatTemplateOptions,
    add_chat_template_args,
    chat_template_options_from_args,
)


@dataclass(frozen=True)
class ApiOptions:
    """``--return-tokens-as-token-ids`` and ``--enable-force-include-usage``."""

    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    # A request's own chat_template is code this server runs: refused (400) unless trusted.
    trust_request_chat_template: bool = False
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served.
    enable_prompt_tokens_details: bool = False
    # --chat-template, --chat-template-content-format, --default-chat-template-kwargs
    chat: ChatTemplateOptions = field(default_factory=ChatTemplateOptions)


DEFAULT_API_OPTIONS = ApiOptions()


def add_api_args(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`ApiOptions`, as one argument group."""
    g = parser.add_argument_group("API answers (vLLM's flags)")
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='name tokens in logprobs as "token_id:<id>" unless a request sets '
        "return_tokens_as_token_ids itself (tokens that are not valid UTF-8 alone stay exact)",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed answer ends with a usage chunk and every chunk carries usage so "
        "far, as if each request set stream_options include_usage and continuous_usage_stats",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in chat requests (rendered in the same sandbox as the "
        "model's); without it such a request gets a 400, as in vLLM",
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix "
        "cache served (left out when none), as in vLLM",
    )
    add_chat_template_args(parser)


def api_options_from_args(args: argparse.Namespace) -> ApiOptions:
    """The :class:`ApiOptions` of parsed :func:`add_api_args` flags."""
    return ApiOptions(
        args.return_tokens_as_token_ids,
        args.enable_force_include_usage,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        chat=chat_template_options_from_args(args),
    )
