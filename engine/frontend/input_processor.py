"""Prompts and sampling parameters -> validated ``EngineCoreRequest``s."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import msgspec

from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import (
    DEFAULT_MAX_LOGPROBS,
    EngineCoreRequest,
    SamplingParams,
    validate_prompt,
    validate_prompt_length,
)
from corefleet.engine.token_controls import tokenize_bad_words, validate_token_controls

# A prompt is text, or a mapping with "prompt_token_ids" (and optionally "prompt").
PromptType: TypeAlias = str | Mapping[str, object]


class ContextLengthExceeded(ValueError):
    """A prompt that leaves no room in the context for what the request asks to generate.

    ``code`` is OpenAI's for this refusal; the HTTP API reports it in the error body, so a
    client can tell it from a malformed request (only the tokenizer can tell it apart).
    """

    code = "context_length_exceeded"


class EmptyPrompt(ValueError):
    """A prompt without a token: text made only of characters the tokenizer drops."""

    code = "empty_prompt"


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    """Tokenizes and validates, so that nothing invalid ever reaches an engine."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs  # the ranks' --max-logprobs, -1 resolved

    def check_text_length(self, text: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit in the context.

        Tokenizing takes about a second per 2 MB: a prompt whose length alone proves it too
        long is refused at once. The bound has a factor 2 of slack for tokenizers whose
        normalizer shortens text before splitting it; the exact check follows tokenization.
        """
        most_tokens = self.max_model_len - 1
        if len(text) > 2 * self.tokenizer.max_token_chars * most_tokens:
            raise ContextLengthExceeded(
                f"the prompt has {len(text)} characters, far more than the model's maximum "
                f"context length (max_model_len) of {self.max_model_len} tokens can hold"
            )

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            self.check_text_length(prompt)
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            text = prompt.get("prompt")
            return ProcessedPrompt(text if isinstance(text, str) else None, list(ids))
        raise ValueError(
            f"a prompt must be a string or a mapping with 'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per sample (``n`` of them), ids ``{i}_{request_id}`` when n > 1.
        ``cache_salt``: the prompt shares cached KV blocks only with requests of the same salt."""
        params = all_vocab_logprobs(params, self.vocab_size)
        params.validate(self.vocab_size, self.max_logprobs)
        params = self._tokenize_bad_words(params)
        try:
            validate_prompt_length(len(prompt.prompt_token_ids), self.max_model_len)
        except ValueError as exc:
            kind = ContextLengthExceeded if prompt.prompt_token_ids else EmptyPrompt
            raise kind(str(exc)) from None
        validate_prompt(prompt.prompt_token_ids, self.max_model_len, self.vocab_size)
        params = self._resolve_max_tokens(len(prompt.prompt_token_ids), params)
        now = time.time()
        if params.n == 1:
            return [
                EngineCoreRequest(
                    request_id, prompt.prompt_token_ids, params, now, priority, cache_salt
                )
            ]
        requests = []
        for i in range(params.n):
            # Each sample gets its own seed so that seeded n>1 requests are not n copies.
            # Wrapped: seeds stay 64-bit signed integers even next to the top one.
            seed = None if params.seed is None else _wrap_int64(params.seed + i)
            child = msgspec.structs.replace(params, n=1, seed=seed)
            requests.append(
                EngineCoreRequest(
                    f"{i}_{request_id}", prompt.prompt_token_ids, child, now, priority, cache_salt
                )
            )
        return requests

    def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its (validated, so bounded) ``bad_words`` tokenized for the engine,
        which bans them by token; ValueError if a word's tokens fall outside the vocabulary."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        sequences = tokenize_bad_words(
            params.bad_words, lambda word: self.tokenizer.encode(word, add_special_tokens=False)
        )
        params = msgspec.structs.replace(params, bad_words_token_ids=sequences)
        validate_token_controls(params, self.vocab_size)
        return params

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_tokens=None`` resolved to the room the (validated, so not too
        long) prompt leaves; ContextLengthExceeded when an explicit ``max_tokens``, or
        ``min_tokens``, does not fit."""
        room = self.max_model_len - num_prompt
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise ContextLengthExceeded(
                    f"min_tokens={params.min_tokens} does not fit: the prompt has {num_prompt} "
                    f"tokens and max_model_len is {self.max_model_len}, so at most {room} "
                    "tokens can be generated"
                )
            return msgspec.structs.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise ContextLengthExceeded(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {num_prompt} "
                f"tokens and max_model_len is {self.max_model_len}, so at most {room} "
                "tokens can be generated"
            )
        return params


def all_vocab_logprobs(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``params`` with vLLM's ``-1`` (logprobs or prompt_logprobs of the whole vocabulary)
    as the vocabulary's size."""
    if params.logprobs != -1 and params.prompt_logprobs != -1:
        return params
    return msgspec.structs.replace(
        params,
        logprobs=vocab_size if params.logprobs == -1 else params.logprobs,
        prompt_logprobs=vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs,
    )


def _wrap_int64(value: int) -> int:
    """``value`` wrapped into the signed 64-bit range (two's complement)."""
    return (value + 2**63) % 2**64 - 2**63
