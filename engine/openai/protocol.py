"""OpenAI-compatible request models and their conversion to engine types; the response models
(``response_models``) are re-exported here, so the API's models are all ``protocol.X``.

Requests: the two endpoints keep fields they do not declare (``extra="allow"``) for
``extra_fields.check_extra_fields``: one that would change the answer (``guided_json``,
``tool_choice``...) gets a 400, any other is ignored with a warning (SDKs and proxies add their
own, and refusing them breaks clients). Nested objects ignore theirs. Known fields
are strict: ``"temperature": "0.5"`` or ``"stream": 1`` fail, as at OpenAI, instead of being
coerced (an int is fine for a float, and ``5.0`` for an int: JSON does not tell them apart);
``null`` means the default. Known parameters we cannot
honour (``suffix``, ``best_of`` != ``n``) get a 400:
ignoring them would silently change the answer. Ranges live in
:meth:`SamplingParams.validate`; only OpenAI-specific bounds are declared here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from corefleet.engine.messages import (
    FinishReason,
)
from corefleet.engine.openai import limits
from corefleet.engine.openai.chat_render import MAX_ROLE_CHARS, ChatCompletionTemplateFields
from corefleet.engine.openai.response_models import (  # noqa: F401 (re-exported)
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatToolCall,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    Logprob,
    ModelCard,
    ModelList,
    PromptLogprobs,
    PromptTokenUsageInfo,
    TopLogprob,
    UsageInfo,
    random_id,
)
from corefleet.engine.openai.token_request import (
    AllowedTokenIds,
    BadWords,
    LogitBias,
    LogprobTokenIds,
)
from corefleet.engine.openai.tool_request import (
    MessageToolCall,
    ToolChoice,
    ToolDefinition,
    arguments_object,
)

# Floats must be finite: NaN and Infinity are not JSON, and 1e400 overflows to inf.
_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _whole(value: Any) -> Any:
    """``5.0`` as ``5``: JSON (and JSON Schema) do not tell an integral number's spellings apart.
    Lists are converted item by item (token ids)."""
    if isinstance(value, list):
        return [_whole(x) for x in value]
    return int(value) if type(value) is float and value.is_integer() else value


_WHOLE = BeforeValidator(_whole)

# Every integer a client sends fits the wire's 64 bits (msgpack cannot carry a larger one).
Int64 = Annotated[int, Field(ge=limits.INT64_MIN, le=limits.INT64_MAX), _WHOLE]
PositiveInt64 = Annotated[int, Field(ge=1, le=limits.INT64_MAX), _WHOLE]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=limits.INT64_MAX), _WHOLE]
# How many logprobs per token: up to the ranks' --max-logprobs (checked when served), -1 for
# the whole vocabulary (vLLM's).
Logprobs = Annotated[int, Field(ge=-1, le=limits.INT64_MAX), _WHOLE]
StopString = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_STRING_CHARS)]
_StopInput = (
    StopString | Annotated[list[StopString], Field(max_length=limits.MAX_STOP_STRINGS)] | None
)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with only ``usage``."""

    model_config = _REQUEST_CONFIG
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries the usage so far.
    continuous_usage_stats: bool | None = False


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` content part, the only kind we accept."""

    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One conversation turn. ``developer`` is OpenAI's newer name for ``system``. Any other
    role goes to the chat template as sent (vLLM's rule): the template decides which it knows
    (SmolLM2's renders any; a strict one refuses with a 400)."""

    model_config = _REQUEST_CONFIG
    role: str = Field(min_length=1, max_length=MAX_ROLE_CHARS)
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        # Checked before the union so that an image part yields one clear message instead of
        # one error per union member.
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported, only 'text'")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # Only an assistant turn may lack content (it carried tool calls at OpenAI).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs content")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by newlines."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class _SamplingRequest(BaseModel):
    """Fields common to both endpoints: OpenAI's, then vLLM's extras."""

    # Undeclared fields are kept (``model_extra``) to be checked: ``extra_fields.py``.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None  # None: the served model (vLLM accepts that too)
    # At most --max-n (n × prompts): checked against the ranks' batch size when served.
    n: PositiveInt64 | None = 1
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: list[StopString] | None = Field(default=None, max_length=limits.MAX_STOP_STRINGS)
    seed: Int64 | None = None  # any 64-bit integer, -1 included, as at OpenAI and vLLM
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: LogitBias | None = None  # token id (a string) -> bias, clamped to [-100, 100]
    user: str | None = None  # accepted for compatibility; not used
    top_k: Annotated[int, Field(ge=-1, le=limits.INT64_MAX), _WHOLE] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    ignore_eos: bool | None = None
    min_tokens: NonNegativeInt64 | None = None
    stop_token_ids: list[NonNegativeInt64] | None = Field(
        default=None, max_length=limits.MAX_STOP_TOKEN_IDS
    )
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's token-level controls (token_request.py): the only tokens that may be sampled,
    # words that may not be generated, the tokens whose logprobs are reported.
    allowed_token_ids: AllowedTokenIds | None = None
    bad_words: BadWords | None = None
    logprob_token_ids: LogprobTokenIds | None = None
    # vLLM's: the logprob of every prompt token and its top-N (the first is null). A request
    # with them computes its whole prompt: the prefix cache has no logits to give.
    prompt_logprobs: Logprobs | None = None
    # vLLM's: tokens in logprobs as "token_id:<id>" (None: --return-tokens-as-token-ids), and
    # the prompt's and the answer's token ids in the response.
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # vLLM's: lower first, under ranks started with --scheduling-policy priority (a 400 else).
    priority: Int64 | None = None
    # vLLM's: the prompt shares prefix-cache blocks only with requests of the same salt, so
    # one tenant cannot time another's prompts through cache hits.
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=limits.MAX_CACHE_SALT_CHARS
    )
    # vLLM's: a longer prompt keeps its last (truncation_side "right": first) tokens.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=limits.INT64_MAX), _WHOLE] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's beam search (beam_api.py): n beams; length_penalty weighs length in the ranking.
    use_beam_search: bool | None = False
    length_penalty: float | None = None
    # Constrained output (structured_request.py): OpenAI's, then vLLM's two generations.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", mode="before", json_schema_input_type=_StopInput)
    @classmethod
    def _one_stop_is_a_list(cls, value: Any) -> Any:
        # One string is a list of one; validating the list alone gives errors without a
        # union member's name in their path.
        return [value] if isinstance(value, str) else value


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # Explicit null: up to the context length, as vLLM; 0 only with echo (the prompt alone).
    max_tokens: NonNegativeInt64 | None = 16
    logprobs: Logprobs | None = None
    echo: bool | None = False  # the prompt before the completion (``echo.py``)
    suffix: str | None = None
    best_of: PositiveInt64 | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        # One readable message instead of four union-member errors.
        value = _whole(value)

        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(type(t) is int and t >= 0 for t in x)

        if isinstance(value, str) or (
            isinstance(value, list)
            and value
            and (all(isinstance(p, str) for p in value) or is_ids(value) or all(map(is_ids, value)))
        ):
            return value
        raise ValueError("must be a string, a list of strings, token ids or token id lists")

    def prompt_inputs(self) -> list[str | dict[str, list[int]]]:
        """The prompts in ``InputProcessor.process_prompt`` form (text or token ids)."""
        items: list[Any] = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
        if isinstance(items[0], int):  # one prompt given as token ids
            return [{"prompt_token_ids": items}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in items]


class ChatCompletionRequest(_SamplingRequest, ChatCompletionTemplateFields):
    """``POST /v1/chat/completions``; the chat-template fields are in ``chat_render``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=limits.MAX_MESSAGES)
    # max_tokens is deprecated at OpenAI in favour of max_completion_tokens.
    max_tokens: PositiveInt64 | None = None
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=limits.MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: auto with tools, none without (tool_request)
    parallel_tool_calls: bool | None = None
    return_prompt_text: bool | None = None  # vLLM's: the rendered prompt in the answer
    # vLLM's: the answer starts with the last message's content when that message has the
    # answer's role (an assistant message the model continues, with continue_final_message).
    echo: bool | None = False

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages for ``Tokenizer.apply_chat_template``: content as one string
        (developer->system, since chat templates only know the classic roles), an assistant
        turn's calls with their arguments as objects, as transformers' templates expect.

        Raises:
            RequestError: a call's arguments are not a JSON object.
        """
        return [_template_message(m) for m in self.messages]


def _template_message(message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments_object(call)},
            }
            for call in message.tool_calls
        ]
    return out


def openai_finish_reason(reason: FinishReason | str | None) -> str | None:
    """The engine's finish reason as OpenAI's ``finish_reason``.

    ``stop``/``length`` are OpenAI's; ``abort``/``error`` pass through as vLLM does: OpenAI has
    no equivalent and ``stop`` would hide a cut-short answer (the official client accepts any
    string; only its declared types list fewer). ``rejected`` is re-routed by the coordinator,
    so seeing it here is a bug: ``ValueError``.
    """
    if reason is None:
        return None
    name = str(reason)
    if name not in ("stop", "length", "abort", "error"):
        raise ValueError(f"finish reason {name!r} must not reach a client")
    return name
