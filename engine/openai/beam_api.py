"""A generation request with ``use_beam_search``: its prompts searched (``beam_search.py``) and
answered in the endpoint's shape, ``n`` beams per prompt as its choices, best first.

As vLLM: ``n`` is the beam width, ``length_penalty`` weighs the length in the ranking,
``temperature``, ``top_p`` and the like do not apply (the search ranks the model's own
logprobs), and the answer comes whole; streamed, it is one chunk per choice and the usage
chunk when asked. Constraints (structured outputs, tool calling) and per-token logprobs are
not searched: a request combining them with beam search gets a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from corefleet.engine.openai import protocol as p
from corefleet.engine.openai.beam_search import MAX_BEAM_WIDTH, Beam, BeamOptions, beam_search
from corefleet.engine.openai.errors import BEAM_SEARCH_CONFLICT, SSE_DONE, RequestError, sse_event
from corefleet.engine.openai.replies import Reply, StreamReply, json_reply
from corefleet.engine.openai.server_state import ServerState
from corefleet.engine.openai.serving import Generation

Body = p.CompletionRequest | p.ChatCompletionRequest


def check_beam_request(body: Body, structured: bool, max_logprobs: int) -> None:
    """400 for what beam search cannot honour. ``structured``: the request is constrained;
    ``max_logprobs``: the ranks' ``--max-logprobs`` (each step asks for 2 × n candidates).

    Raises:
        RequestError: naming the field.
    """
    widest = min(MAX_BEAM_WIDTH, max_logprobs // 2)
    if (body.n or 1) > widest:
        raise RequestError(
            f"n={body.n}: beam search keeps at most {widest} beams here (2 × n candidates "
            f"per step, within --max-logprobs {max_logprobs})",
            param="n",
            code=BEAM_SEARCH_CONFLICT,
        )
    if structured:
        raise RequestError(
            "beam search cannot be combined with structured outputs or tool calling",
            param="use_beam_search",
            code=BEAM_SEARCH_CONFLICT,
        )
    logprobs = body.logprobs if isinstance(body, p.CompletionRequest) else body.top_logprobs
    if logprobs or getattr(body, "echo", False):
        param = "logprobs" if isinstance(body, p.CompletionRequest) else "top_logprobs"
        raise RequestError(
            "beam search does not report logprobs", param=param, code=BEAM_SEARCH_CONFLICT
        )


async def beam_reply(state: ServerState, body: Body, generation: Generation) -> Reply:
    """Search every prompt of ``generation`` (built, not started) and answer ``body``."""
    params = generation.params
    max_tokens = params.max_tokens or state.engine_info().max_model_len
    options = BeamOptions(
        width=params.n,
        max_tokens=max_tokens,
        length_penalty=body.length_penalty if body.length_penalty is not None else 1.0,
        ignore_eos=params.ignore_eos,
    )
    inputs = generation.inputs
    results: list[Beam] = []
    for prompt in generation.processed:
        results += await beam_search(state.fleet, state.tokenizer, inputs, prompt, options)
    skip = params.skip_special_tokens
    texts = [state.tokenizer.decode(_text_tokens(b), skip_special_tokens=skip) for b in results]
    reasons = ["stop" if b.finished else "length" for b in results]
    usage = p.UsageInfo(
        prompt_tokens=generation.num_prompt_tokens,
        completion_tokens=sum(len(b.tokens) for b in results),
    )
    if isinstance(body, p.CompletionRequest):
        answer: Any = p.CompletionResponse(
            model=state.model_name,
            choices=[
                p.CompletionChoice(index=i, text=text, finish_reason=reason)
                for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
            ],
            usage=usage,
        )
    else:
        answer = p.ChatCompletionResponse(
            model=state.model_name,
            choices=[
                p.ChatChoice(
                    index=i, message=p.ChatResponseMessage(content=text), finish_reason=reason
                )
                for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
            ],
            usage=usage,
        )
    if not body.stream:
        return json_reply(answer.model_dump())
    return StreamReply(_chunks(body, answer, usage))


def _text_tokens(beam: Beam) -> list[int]:
    return beam.tokens[:-1] if beam.finished else beam.tokens


async def _chunks(body: Body, answer: Any, usage: p.UsageInfo) -> AsyncIterator[str]:
    """The whole answer as a stream: a chunk per choice, then the usage chunk if asked."""
    if isinstance(answer, p.CompletionResponse):
        template: Any = p.CompletionStreamResponse(id=answer.id, model=answer.model, choices=[])
        for choice in answer.choices:
            yield sse_event(template.model_copy(update={"choices": [choice]}))
    else:
        template = p.ChatCompletionChunk(id=answer.id, model=answer.model, choices=[])
        for c in answer.choices:
            delta = p.DeltaMessage(role="assistant", content=c.message.content)
            chunk = p.ChatChunkChoice(index=c.index, delta=delta, finish_reason=c.finish_reason)
            yield sse_event(template.model_copy(update={"choices": [chunk]}))
    if body.stream_options and body.stream_options.include_usage:
        yield sse_event(template.model_copy(update={"usage": usage}))
    yield SSE_DONE
