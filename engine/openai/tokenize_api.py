"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

They run on the coordinator's own tokenizer (the ranks are not asked), with the generation
endpoints' rules: a ``model`` other than the served one is a 404, bad input a 400 naming the
field, and a long text is tokenized (or a long id list decoded) in a worker thread so that it
never stalls the event loop. A prompt is tokenized whatever its length (as vLLM's: the answer
carries ``max_model_len`` for the client to compare); the body limit bounds it. The chat form
renders the conversation exactly as ``/v1/chat/completions`` does, so ``count`` is that
request's ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.openai.chat_render import check_chat_template_fields, render_chat_tokens
from corefleet.engine.openai.errors import TOKEN_OUT_OF_VOCABULARY, RequestError, parse_request
from corefleet.engine.openai.protocol import _template_message  # the chat endpoint's own
from corefleet.engine.openai.replies import Reply, error_reply, json_reply
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from corefleet.engine.openai.tool_request import NO_TOOLS, ToolPlan

# Texts up to this many characters (id lists up to this many ids) are handled on the event
# loop: a hand-off to a worker thread costs more than they do.
INLINE_CHARS = 2048
INLINE_IDS = 2048

T = TypeVar("T")


class TokenizeApi:
    """The tokenizer routes over ``state``'s tokenizer; each takes a body, answers a Reply."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def tokenize(self, raw: bytes) -> Reply:
        """``POST /tokenize``: ``messages`` selects the chat form, else the prompt form."""
        try:
            body = _tokenize_request(raw)
            self.state.check_model(body.model)
            max_model_len = self.state.engine_info().max_model_len  # 503 while no rank
            if isinstance(body, TokenizeChatRequest):
                trusted = self.state.options.trust_request_chat_template
                check_chat_template_fields(body, trusted)
                chars = sum(len(m.text()) for m in body.messages)
                chars += sum(len(str(t.function.parameters or "")) for t in body.tools or ())
                ids = await _off_loop(chars > INLINE_CHARS, self._chat_ids, body)
            else:
                ids = await _off_loop(len(body.prompt) > INLINE_CHARS, self._prompt_ids, body)
        except RequestError as err:
            return error_reply(err)
        backend = self.state.tokenizer.backend
        strs = [backend.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        answer = TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs
        )
        return json_reply(answer.model_dump())

    async def detokenize(self, raw: bytes) -> Reply:
        """``POST /detokenize``: the text of ``tokens``, special tokens kept (as vLLM's)."""
        tokenizer = self.state.tokenizer
        try:
            body = parse_request(DetokenizeRequest, raw)
            self.state.check_model(body.model)
            vocab = tokenizer.vocab_size
            bad = next((t for t in body.tokens if t >= vocab), None)
            if bad is not None:
                raise RequestError(
                    f"tokens: the token id {bad} is out of the vocabulary (ids are below {vocab})",
                    param="tokens",
                    code=TOKEN_OUT_OF_VOCABULARY,
                )
        except RequestError as err:
            return error_reply(err)
        text = await _off_loop(len(body.tokens) > INLINE_IDS, _decode, tokenizer, body.tokens)
        return json_reply(DetokenizeResponse(prompt=text).model_dump())

    def tokenizer_info(self) -> dict[str, Any]:
        """``GET /tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``)."""
        return tokenizer_info(self.state.tokenizer, self.state.model_root)

    def _prompt_ids(self, body: TokenizeCompletionRequest) -> list[int]:
        add = body.add_special_tokens is not False  # null: the default, true
        return self.state.tokenizer.encode(body.prompt, add_special_tokens=add)

    def _chat_ids(self, body: TokenizeChatRequest) -> list[int]:
        """The conversation's tokens as ``/v1/chat/completions`` renders them (the same
        function), the tools shown as with ``tool_choice`` auto, the default."""
        messages = [_template_message(m) for m in body.messages]
        plan = ToolPlan("auto", tuple(body.tools)) if body.tools else NO_TOOLS
        try:
            defaults = self.state.options.chat.default_chat_template_kwargs
            return render_chat_tokens(self.state.tokenizer, messages, body, plan, defaults)[1]
        except ValueError as exc:  # ChatTemplateRefused (its code), or no template at all
            code = getattr(exc, "code", None)
            raise RequestError(str(exc), param="messages", code=code) from None


def _tokenize_request(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as the chat form when it has ``messages``, else as the prompt form."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "messages" in data:
        return parse_request(TokenizeChatRequest, data)
    return parse_request(TokenizeCompletionRequest, data)


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


async def _off_loop(heavy: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``heavy``."""
    if heavy:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


# -- /tokenizer_info ------------------------------------------------------------------------

# Keys that name the tokenizer's files on the server: meaningless to a client (vLLM drops them).
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")


def tokenizer_info(tokenizer: Tokenizer, model_root: str) -> dict[str, Any]:
    """The tokenizer's configuration as vLLM's ``/tokenizer_info`` gives it: the model's
    ``tokenizer_config.json`` (special tokens as their text, file paths dropped), the special
    tokens the server uses, ``tokenizer_class`` and the chat template the server renders with.
    A GGUF model has no such file: its special tokens and template are read from the model."""
    config = _read_config(model_root)
    for key in _FILE_KEYS:
        config.pop(key, None)
    info: dict[str, Any] = {key: _as_text(value) for key, value in config.items()}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(tokenizer, name)
        if value is not None:
            info[name] = value
    # The class transformers would load; a bare tokenizer.json loads as PreTrainedTokenizerFast.
    info["tokenizer_class"] = str(config.get("tokenizer_class") or "PreTrainedTokenizerFast")
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _read_config(model_root: str) -> dict[str, Any]:
    path = Path(model_root) / "tokenizer_config.json" if model_root else None
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_text(value: Any) -> Any:
    """Special tokens written as AddedToken objects (``{"content": ...}``) as their text, as
    vLLM's answer has them (transformers' AddedToken serialised by its content)."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and (
            "special" in value or value.get("__type") == "AddedToken"
        ):
            return value["content"]
        return {k: _as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_text(v) for v in value]
    return value
