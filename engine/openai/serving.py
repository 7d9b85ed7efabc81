"""From an OpenAI request to a stream of per-choice deltas, over the fleet.

One user request becomes one engine request per sample (``n``) and per prompt; each is streamed
through :class:`FleetClient.generate` and folded by an :class:`OutputProcessor` (incremental
detokenization, stop strings, logprobs) that belongs to this request alone. What comes out is a
:class:`ChoiceDelta` per change: the new text and tokens of one choice, and its finish reason
when it ends. The HTTP layer turns those into OpenAI chunks or one final response.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from corefleet.engine.coordinator.fleet_client import FleetClient, StampedOutput
from corefleet.engine.frontend.input_processor import InputProcessor, ProcessedPrompt, PromptType
from corefleet.engine.frontend.output_processor import OutputProcessor
from corefleet.engine.frontend.outputs import RequestOutput, TokenLogprob
from corefleet.engine.frontend.tokenizer import Tokenizer
from corefleet.engine.messages import EngineCoreRequest, SamplingParams


@dataclass
class ChoiceDelta:
    """What one choice gained since the last delta."""

    index: int  # prompt index * n + sample index, as OpenAI numbers choices
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # On the finishing delta: the choice's whole text. A stop string can end inside text that
    # was already streamed; a non-streamed response uses this, not the sum of the deltas.
    full_text: str | None = None
    # On a choice's first delta, with prompt_logprobs: its prompt's (the first entry None).
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None


class OutputObserver(Protocol):
    """Sees every engine output of a generation, with the finish reason of its choice when
    this output ended it (the engine's, or a stop string's): the per-request metrics."""

    def observe(self, stamped: StampedOutput, finish_reason: str | None) -> None: ...


@dataclass
class _Sent:
    text: int = 0  # characters already sent
    tokens: int = 0
    finished: bool = False


class Generation:
    """Runs one user request (its prompts × ``n`` samples) and yields deltas."""

    _ids = itertools.count()
    # Several coordinators send requests to the same ranks, and a rank refuses an id it holds
    # already: each process numbers its requests under a random prefix of its own.
    _id_prefix = secrets.token_hex(8)

    def __init__(
        self,
        fleet: FleetClient,
        tokenizer: Tokenizer,
        inputs: InputProcessor,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.fleet = fleet
        self.inputs = inputs
        self.params = params
        self._stop_holdback = max((len(s) for s in params.stop), default=1) - 1
        self.processor = OutputProcessor(tokenizer)
        self.processed: list[ProcessedPrompt] = [inputs.process_prompt(p) for p in prompts]
        self.engine_requests: list[EngineCoreRequest] = []
        self._choice: dict[str, tuple[str, int, int]] = {}  # engine id -> parent, sample, choice
        self._cached: dict[str, int] = {}  # engine id -> its prompt tokens found cached
        self.observer: OutputObserver | None = None  # set before deltas() to watch outputs
        for p_index, prompt in enumerate(self.processed):
            parent = f"{request_id}-{p_index}"
            children = inputs.make_requests(parent, prompt, params, priority, cache_salt)
            self.processor.add_request(
                parent,
                prompt.prompt,
                prompt.prompt_token_ids,
                [c.request_id for c in children],
                params,
            )
            for s_index, child in enumerate(children):
                self._choice[child.request_id] = (parent, s_index, p_index * params.n + s_index)
            self.engine_requests += children

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.processed)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served, each prompt counted once (as prompt_tokens):
        the most any of its samples reported."""
        by_prompt: dict[str, int] = {}
        for engine_id, (parent, _, _) in self._choice.items():
            by_prompt[parent] = max(by_prompt.get(parent, 0), self._cached.get(engine_id, 0))
        return sum(by_prompt.values())

    def parent_of(self, engine_id: str) -> str:
        """The prompt (vLLM's parent request) an engine request is a sample of."""
        return self._choice[engine_id][0]

    def prompt_text(self, choice: int) -> str:
        """The text of the prompt choice ``choice`` answers (a chat prompt: as rendered; token
        ids: decoded, special tokens kept)."""
        processed = self.processed[choice // self.params.n]
        if processed.prompt is not None:
            return processed.prompt
        tokenizer = self.processor.tokenizer
        return tokenizer.decode(processed.prompt_token_ids, skip_special_tokens=False)

    def prompt_token_ids(self, choice: int) -> list[int]:
        """The token ids of the prompt choice ``choice`` answers."""
        return self.processed[choice // self.params.n].prompt_token_ids

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every change of every choice until all are finished; aborts the rest if stopped."""
        outputs = self._outputs()
        sent = {engine_id: _Sent() for engine_id in self._choice}
        unfinished = len(sent)
        observer = self.observer
        try:
            async for stamped in outputs:
                output = stamped.output
                if output.request_id not in sent or sent[output.request_id].finished:
                    continue
                changed, to_abort = self.processor.process_outputs([output])
                for engine_id in to_abort:  # a stop string: the engine does not know them
                    await self.fleet.abort(engine_id)
                state = sent[output.request_id]
                delta = self._delta(output.request_id, changed, state)
                unfinished -= state.finished
                if observer is not None:
                    observer.observe(stamped, delta.finish_reason if delta is not None else None)
                # Tokens that are not text yet (part of a UTF-8 character) make no chunk.
                if delta is not None and (delta.text or delta.finish_reason is not None):
                    yield delta
                if not unfinished:
                    break
        finally:  # a caller that stops early aborts what is still running
            await outputs.aclose()

    def _outputs(self) -> AsyncGenerator[StampedOutput, None]:
        """The engine requests' outputs as they come. One request (the usual case) is read
        directly; several are merged through a queue, one reading task each."""
        if len(self.engine_requests) == 1:
            return self.fleet.generate_stamped(self.engine_requests[0])
        return self._merged()

    async def _merged(self) -> AsyncGenerator[StampedOutput, None]:
        queue: asyncio.Queue[StampedOutput] = asyncio.Queue()

        async def pump(request: EngineCoreRequest) -> None:
            async for output in self.fleet.generate_stamped(request):
                queue.put_nowait(output)

        pumps = [asyncio.create_task(pump(r)) for r in self.engine_requests]
        try:
            while True:
                yield await queue.get()
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _delta(
        self, engine_id: str, changed: list[RequestOutput], state: _Sent
    ) -> ChoiceDelta | None:
        parent_id, sample, choice = self._choice[engine_id]
        parent = next((p for p in changed if p.request_id == parent_id), None)
        if parent is None:
            return None
        completion = parent.outputs[sample]
        self._cached[engine_id] = parent.num_cached_tokens
        # Hold back the last characters that could still be the start of a stop string: once
        # streamed, text cannot be taken back when the stop string completes in a later token.
        end = len(completion.text)
        if not completion.finished:
            end = max(state.text, end - self._stop_holdback)
        text = completion.text[state.text : end]
        # Tokens stay pending until they show as text, so a chunk's tokens match its text.
        tokens = completion.token_ids[state.tokens :] if text or completion.finished else []
        rows = (completion.logprobs or [])[state.tokens : state.tokens + len(tokens)]
        delta = ChoiceDelta(choice, text, tokens, rows)
        if state.tokens == 0:  # nothing of this choice went out yet: this delta may be first
            delta.prompt_logprobs = parent.prompt_logprobs
        state.text = end
        state.tokens += len(tokens)
        if completion.finished:
            state.finished = True
            delta.finish_reason = completion.finish_reason
            delta.stop_reason = completion.stop_reason
            delta.full_text = completion.text
        return delta

    @classmethod
    def new_id(cls) -> str:
        """An engine request id no other coordinator process uses."""
        return f"req-{cls._id_prefix}-{next(cls._ids)}"
