"""The Responses API's request (``POST /v1/responses``) and its conversion to a chat request.

A Responses request is a conversation in another shape: ``instructions`` is the system
message, ``input`` a string or a list of items (messages, the function calls an earlier answer
made and their outputs), ``previous_response_id`` the conversation so far. It is served as the
chat completion it amounts to, so every check, limit, tool and constraint of
``/v1/chat/completions`` applies unchanged; ``responses_api.py`` turns the answer back into a
``response`` object. Only what the engine can honour is declared; a field that would change
the answer and is not supported (hosted tools, reasoning, background runs) gets a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corefleet.engine.openai import limits
from corefleet.engine.openai.protocol import PositiveInt64
from corefleet.engine.openai.tool_request import FUNCTION_NAME_PATTERN

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class InputText(BaseModel):
    """A text part of a message: ``input_text`` (the user's) or ``output_text`` (an answer's)."""

    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    """A turn of the conversation. ``type`` may be left out, as OpenAI allows."""

    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call an earlier answer made (sent back so the model sees it)."""

    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """What the client's function returned for ``call_id``."""

    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


InputItem = FunctionCallItem | FunctionCallOutputItem | MessageItem


class FunctionTool(BaseModel):
    """A function tool, in the Responses API's flat form (no ``function`` wrapper)."""

    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class PlainTextFormat(BaseModel):
    """``text.format`` of a free answer (``text``) or of any JSON object (``json_object``)."""

    model_config = _STRICT
    type: Literal["text", "json_object"]


class JsonSchemaFormat(BaseModel):
    """``text.format`` of an answer following ``schema``."""

    model_config = _STRICT
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(BaseModel):
    model_config = _STRICT
    format: PlainTextFormat | JsonSchemaFormat | None = Field(default=None, discriminator="type")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Undeclared fields are checked by ``extra_fields``."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: PositiveInt64 | None = None  # 5.0 is 5, as in every request
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    tools: list[FunctionTool] | None = Field(default=None, max_length=limits.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    truncation: Literal["disabled"] | None = None

    def chat_request(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion this request amounts to, after the conversation ``history``
        (the messages of the response it continues, its answer included)."""
        # As OpenAI: the instructions of an earlier response do not carry over (``history``
        # holds none), this request's come first.
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat: dict[str, Any] = {
            "messages": system + history + self.conversation(),
            "stream": bool(self.stream),
        }
        for name, value in (
            ("model", self.model),
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("parallel_tool_calls", self.parallel_tool_calls),
        ):
            if value is not None:
                chat[name] = value
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        response_format = self._response_format()
        if response_format is not None:
            chat["response_format"] = response_format
        return chat

    def _response_format(self) -> dict[str, Any] | None:
        form = self.text.format if self.text else None
        if form is None or form.type == "text":
            return None
        if isinstance(form, PlainTextFormat):
            return {"type": "json_object"}
        spec = {"name": form.name, "schema": form.schema_, "strict": form.strict}
        return {"type": "json_schema", "json_schema": spec}

    def conversation(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (see :func:`input_messages`)."""
        return input_messages(self.input)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Responses input as chat messages: consecutive function calls become one assistant
    turn's ``tool_calls``, their outputs ``tool`` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages
