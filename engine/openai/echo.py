"""Completions' ``echo`` and vLLM's ``prompt_logprobs`` in responses.

``echo`` puts each choice's prompt before its completion, as vLLM does: the text starts with the
prompt's text (the decoded ids for a token-id prompt), and with ``logprobs`` the lists start
with the prompt's tokens, whose logprobs the engine computed (``prompt_logprobs`` defaults to
``logprobs``); the first prompt token has none, so its ``token_logprobs`` and ``top_logprobs``
entries are null. ``max_tokens: 0`` runs the engine for one token (an engine request always
samples) and drops it: the answer is the prompt alone. A stream sends the prompt in a choice's
first chunk.

``prompt_logprobs`` (both endpoints) is vLLM's list of one ``{token id: Logprob}`` per prompt
token, the first null: per choice in a completion, once per response in a chat completion.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from corefleet.engine.frontend.outputs import TokenLogprob
from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.logprobs import completion_logprobs, next_text_offset
from corefleet.engine.openai.serving import ChoiceDelta, Generation

PromptRows = list[dict[int, TokenLogprob] | None]


def prompt_logprobs_entries(rows: PromptRows | None) -> p.PromptLogprobs | None:
    """The engine's prompt logprobs as the response's ``prompt_logprobs``."""
    if rows is None:
        return None
    return [
        None
        if row is None
        else {
            token_id: p.Logprob(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token)
            for token_id, e in row.items()
        }
        for row in rows
    ]


class CompletionEcho:
    """What ``echo`` adds to a completion's choices (nothing without it)."""

    def __init__(self, body: p.CompletionRequest, generation: Generation) -> None:
        self.enabled = bool(body.echo)
        self.drop_output = self.enabled and body.max_tokens == 0
        self.generation = generation
        # Choice -> its prompt's logprob rows, kept from its first delta until its logprobs
        # are built (they lead them).
        self._prompt_rows: dict[int, PromptRows] = {}
        self._started: set[int] = set()

    def prompt_text(self, choice: int) -> str:
        return self.generation.prompt_text(choice)

    def deltas(self, deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        """``deltas`` with each choice's prompt text before its first delta's (and in the
        final text); with ``max_tokens: 0``, the engine's one token taken out. Without echo,
        ``deltas`` themselves: no generator layer on every streamed token."""
        return self._echoed(deltas) if self.enabled else deltas

    async def _echoed(self, deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        async for d in deltas:
            if self.drop_output:
                d.text, d.token_ids, d.logprobs = "", [], []
                d.full_text = None if d.full_text is None else ""
            prompt = self.prompt_text(d.index)
            if d.index not in self._started:
                self._started.add(d.index)
                d.text = prompt + d.text
                if d.prompt_logprobs is not None:
                    self._prompt_rows[d.index] = d.prompt_logprobs
            if d.full_text is not None:
                d.full_text = prompt + d.full_text
            yield d

    def logprobs(
        self, d: ChoiceDelta, top_k: int, text_offset: int, as_ids: bool = False
    ) -> p.CompletionLogprobs:
        """The delta's completion logprobs: after echo, a choice's first ones start with its
        prompt's tokens."""
        rows = self._prompt_rows.pop(d.index, None)
        if rows is None:
            return completion_logprobs(d.token_ids, d.logprobs, top_k, text_offset, as_ids)
        ids = self.generation.prompt_token_ids(d.index)
        result = self._first_prompt_token(ids[0], text_offset, as_ids)
        scored = completion_logprobs(
            ids[1:], _rows(rows[1:]), top_k, next_text_offset(result), as_ids
        )
        output = completion_logprobs(
            d.token_ids,
            d.logprobs,
            top_k,
            next_text_offset(scored, next_text_offset(result)),
            as_ids,
        )
        parts = (result, scored, output)
        # Built anew, not extended, so that the model's validators clamp -inf to -9999.0.
        return p.CompletionLogprobs(
            tokens=[t for part in parts for t in part.tokens],
            token_logprobs=[x for part in parts for x in part.token_logprobs],
            top_logprobs=[x for part in parts for x in part.top_logprobs],
            text_offset=[x for part in parts for x in part.text_offset],
        )

    def _first_prompt_token(
        self, token_id: int, text_offset: int, as_ids: bool
    ) -> p.CompletionLogprobs:
        """The entry of the first prompt token, which nothing predicts: no logprobs."""
        if as_ids:
            text = f"token_id:{token_id}"
        else:
            text = self.generation.processor.tokenizer.decode([token_id])
        return p.CompletionLogprobs(
            tokens=[text], token_logprobs=[None], top_logprobs=[None], text_offset=[text_offset]
        )


def _rows(rows: Sequence[dict[int, TokenLogprob] | None]) -> list[dict[int, TokenLogprob]]:
    """Prompt rows after the first: the engine scored every one."""
    out = []
    for row in rows:
        assert row is not None, "only the first prompt token lacks logprobs"
        out.append(row)
    return out
