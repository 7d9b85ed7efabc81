"""An OpenAI request (``protocol``'s models) as the engine's :class:`SamplingParams`: the
fields renamed (``max_completion_tokens``, ``top_logprobs``), the constraints built
(structured outputs, a forced tool), vLLM's token controls, and every value validated with the
field named as the client named it."""

from __future__ import annotations

from corefleet.engine.frontend.input_processor import all_vocab_logprobs
from corefleet.engine.messages import (
    DEFAULT_MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)
from corefleet.engine.openai.errors import (
    PROMPT_LOGPROBS_WITH_STREAM,
    ZERO_MAX_TOKENS_WITHOUT_ECHO,
    RequestError,
    error_from_sampling,
    unsupported,
)
from corefleet.engine.openai.protocol import ChatCompletionRequest, CompletionRequest
from corefleet.engine.openai.structured_options import StructuredOutputsConfig
from corefleet.engine.openai.structured_request import GUIDED_FIELDS, structured_params
from corefleet.engine.openai.token_request import token_controls

_SAME_NAME = (
    *("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty"),
    *("frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos"),
    *("skip_special_tokens", "include_stop_str_in_output"),
)


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    vocab_size: int | None = None,
    tools: StructuredOutputsParams | None = None,
    output_config: StructuredOutputsConfig | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> SamplingParams:
    """The engine's :class:`SamplingParams` for ``request``, validated. ``tools``: the
    constraint of its ``tool_choice`` (``tool_request.ToolPlan.constraint``); ``output_config``:
    the server's ``--structured-outputs-config`` (None: its defaults); ``max_logprobs``: the
    ranks' ``--max-logprobs`` (a ``-1`` asks for the whole vocabulary).

    Raises:
        RequestError: 400 naming the request field (``top_logprobs``, not the engine's
            ``logprobs``) when a parameter is unsupported, inconsistent or out of range.
    """
    renamed: dict[str, str] = {}  # engine name -> the request field the user actually set
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs is not None:
            renamed["logprobs"] = "top_logprobs"
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            renamed["max_tokens"] = "max_completion_tokens"
    else:
        if request.max_tokens == 0 and not request.echo:
            raise RequestError(
                "max_tokens=0 requires echo=true",
                param="max_tokens",
                code=ZERO_MAX_TOKENS_WITHOUT_ECHO,
            )
        if request.suffix:
            raise unsupported("suffix", "suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise unsupported("best_of", "best_of other than n")
        logprobs, max_tokens = request.logprobs, request.max_tokens
        if request.echo and max_tokens == 0:
            max_tokens = 1  # as vLLM: one engine step, its token dropped (``echo.py``)
    prompt_logprobs = request.prompt_logprobs
    if request.stream:  # as vLLM: a stream has no place for them (0, asking for none, passes)
        if prompt_logprobs:
            raise RequestError(
                "prompt_logprobs are not available when stream=true",
                param="prompt_logprobs",
                code=PROMPT_LOGPROBS_WITH_STREAM,
            )
        prompt_logprobs = None
    if isinstance(request, CompletionRequest) and request.echo and prompt_logprobs is None:
        prompt_logprobs = logprobs  # as vLLM: the echoed prompt gets logprobs like the rest
    if isinstance(request, ChatCompletionRequest) and request.echo and prompt_logprobs is None:
        # vLLM's chat echo: the prompt's logprobs too, top_logprobs of them (never streamed).
        prompt_logprobs = None if request.stream else request.top_logprobs
    if request.stream_options is not None and not request.stream:
        raise RequestError("stream_options requires stream=true", param="stream_options")
    # Same names on both sides; a null leaves SamplingParams' (vLLM's) default.
    same = {k: getattr(request, k) for k in _SAME_NAME if getattr(request, k) is not None}
    guided = {k: getattr(request, k) for k in GUIDED_FIELDS if getattr(request, k) is not None}
    free_end = {"ignore_eos": request.ignore_eos, "min_tokens": request.min_tokens}
    structured = structured_params(
        request.response_format,
        request.structured_outputs,
        guided,
        free_end,
        tools,
        output_config or StructuredOutputsConfig(),
    )
    logprobs, controls = token_controls(request, logprobs)
    params = SamplingParams(
        **same,
        **controls,
        max_tokens=max_tokens,
        stop=list(request.stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        logprobs=logprobs,
        structured_outputs=structured,
        prompt_logprobs=prompt_logprobs,
    )
    try:
        if vocab_size is not None:
            params = all_vocab_logprobs(params, vocab_size)
        params.validate(vocab_size, max_logprobs)
    except ValueError as exc:
        raise error_from_sampling(exc, renamed) from None
    return params
