"""The engine's per-token logprobs in OpenAI's two response formats."""

from __future__ import annotations

from collections.abc import Sequence

from corefleet.engine.frontend.outputs import TokenLogprob
from corefleet.engine.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

Row = dict[int, TokenLogprob]  # token id -> logprob: the sampled token and the top-N


def _top(row: Row, k: int) -> list[TokenLogprob]:
    ranked = [entry for entry in row.values() if entry.rank is not None and entry.rank <= k]
    return sorted(ranked, key=lambda entry: entry.rank or 0)


def chat_logprobs(token_ids: Sequence[int], rows: Sequence[Row], top_k: int) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""
    content = []
    for token_id, row in zip(token_ids, rows, strict=False):
        sampled = row[token_id]
        content.append(
            ChatTokenLogprob(
                token=sampled.decoded_token,
                logprob=sampled.logprob,
                bytes=list(sampled.decoded_token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=e.decoded_token,
                        logprob=e.logprob,
                        bytes=list(e.decoded_token.encode()),
                    )
                    for e in _top(row, top_k)
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int], rows: Sequence[Row], top_k: int, text_offset: int
) -> CompletionLogprobs:
    """Legacy completions logprobs; ``text_offset`` is where these tokens start in the text."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, row in zip(token_ids, rows, strict=False):
        sampled = row[token_id]
        result.tokens.append(sampled.decoded_token)
        result.token_logprobs.append(sampled.logprob)
        top: dict[str, float] = {}
        for entry in _top(row, top_k):  # best first: alternatives that decode alike keep it
            top.setdefault(entry.decoded_token, entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(sampled.decoded_token)
    return result
