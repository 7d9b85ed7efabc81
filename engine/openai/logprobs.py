"""The engine's per-token logprobs in OpenAI's two response formats.

As vLLM: a completion's ``top_logprobs`` holds the sampled token first and then the top-N
(so ``logprobs: 0`` still names the sampled token), a chat token's ``top_logprobs`` only the
top-N; ``text_offset`` counts the characters of the tokens before it, so it never decreases
even where a multi-byte character spans several tokens (each decoding to a replacement
character until the last). With ``return_tokens_as_token_ids`` every token reads
``"token_id:<id>"``, which survives tokens that are not valid UTF-8 on their own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from corefleet.engine.frontend.outputs import TokenLogprob
from corefleet.engine.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from corefleet.engine.openai.response_models import MIN_LOGPROB

Row = dict[int, TokenLogprob]  # token id -> logprob: the sampled token and the top-N


def _top(row: Row, k: int) -> list[tuple[int, TokenLogprob]]:
    ranked = [(t, e) for t, e in row.items() if e.rank is not None and e.rank <= k]
    return sorted(ranked, key=lambda item: item[1].rank or 0)


def finite(logprob: float) -> float:
    """``logprob`` with -inf (and NaN) as OpenAI's -9999.0: JSON has no -inf. The lists built
    here are appended to, which skips the response model's own clamping."""
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def token_text(token_id: int, entry: TokenLogprob, as_ids: bool) -> str:
    """How a token is named in a response: its text, or ``token_id:<id>``."""
    return f"token_id:{token_id}" if as_ids else entry.decoded_token


def chat_logprobs(
    token_ids: Sequence[int], rows: Sequence[Row], top_k: int, as_ids: bool = False
) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""
    content = []
    for token_id, row in zip(token_ids, rows, strict=False):
        sampled = row[token_id]
        text = token_text(token_id, sampled, as_ids)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=sampled.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(alt := token_text(t, e, as_ids)),
                        logprob=e.logprob,
                        bytes=list(alt.encode()),
                    )
                    for t, e in _top(row, top_k)
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    rows: Sequence[Row],
    top_k: int,
    text_offset: int,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """Legacy completions logprobs; ``text_offset`` is the first token's offset (see
    :func:`next_text_offset` to continue a choice's list across deltas)."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, row in zip(token_ids, rows, strict=False):
        sampled = row[token_id]
        text = token_text(token_id, sampled, as_ids)
        result.tokens.append(text)
        result.token_logprobs.append(finite(sampled.logprob))
        top = {text: finite(sampled.logprob)}  # the sampled token first, as vLLM
        for t, entry in _top(row, top_k):  # best first: alternatives that decode alike keep it
            top.setdefault(token_text(t, entry, as_ids), finite(entry.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def next_text_offset(logprobs: CompletionLogprobs | None, start: int = 0) -> int:
    """The ``text_offset`` of the token after ``logprobs``' last (``start`` if it has none)."""
    if logprobs is None or not logprobs.tokens:
        return start
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
