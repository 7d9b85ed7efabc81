"""Tool calling on the request side: the ``tools`` a chat request offers, its ``tool_choice``,
and how both reach the model (the chat template) and the sampler (a constraint).

``tool_choice`` (OpenAI's values, vLLM's rules):

- ``none``: the tools are shown to the template, the answer is plain text.
- ``auto`` (the default when there are tools): the model decides; ``--tool-call-parser`` reads
  its calls out of the text. Refused unless the server runs with ``--enable-auto-tool-choice``.
- ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` objects,
  each naming one of the tools with arguments that follow its ``parameters`` schema (at most
  one element when ``parallel_tool_calls`` is false).
- ``{"type": "function", "function": {"name": ...}}``: the output is constrained to that
  function's ``parameters`` schema; the text is its arguments.

A chat template that never reads ``tools`` (SmolLM2-135M's) would hide them from the model.
Rather than answer blind, such a conversation gets the tools in its system message, in the
hermes format (``<tool_call>`` JSON), and earlier calls are written back as ``<tool_call>``
blocks: a deviation from vLLM, which renders the template as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corefleet.engine.frontend.chat_template import template_variables
from corefleet.engine.messages import StructuredOutputsParams
from corefleet.engine.openai.errors import DUPLICATE_TOOL_NAMES, INVALID_TOOL_CHOICE, RequestError
from corefleet.engine.openai.structured_request import json_constraint
from corefleet.engine.openai.tool_options import ToolOptions
from corefleet.engine.structured_output.schema_rewrite import relocate

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# OpenAI's rule for a function's name: it is written into prompts and read back by parsers.
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    """A function the model may call: ``parameters`` is a JSON schema of its arguments."""

    model_config = _STRICT
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # always honoured where the output is constrained


class ToolDefinition(BaseModel):
    """One entry of ``tools``."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` forcing one function."""

    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    """A call an assistant turn made: ``arguments`` is JSON text, as OpenAI returns it."""

    model_config = _STRICT
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """An entry of an assistant message's ``tool_calls``."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its sampling and its answer."""

    mode: ToolMode
    tools: tuple[ToolDefinition, ...] = ()
    parser: str | None = None  # auto: the --tool-call-parser
    function: str | None = None  # named: the forced function
    constraint: StructuredOutputsParams | None = None  # required and named
    parallel: bool = True  # False: one call at most

    @property
    def reads_calls(self) -> bool:
        """Whether the answer's text is turned into ``tool_calls``."""
        return self.mode != "none"


NO_TOOLS = ToolPlan("none")


def plan_tools(
    tools: list[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    options: ToolOptions,
) -> ToolPlan:
    """The :class:`ToolPlan` of a request's tool fields under the server's ``options``.

    Raises:
        RequestError: 400 naming the field: ``tool_choice`` without tools, naming a function
            not in ``tools`` or ``auto`` on a server without it; duplicate function names; a
            ``parameters`` schema too large to constrain the output.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise _bad_choice("tool_choice needs tools")
        return NO_TOOLS
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError(
            "tools: each function needs its own name", param="tools", code=DUPLICATE_TOOL_NAMES
        )
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tuple(tools))
    if choice == "auto":
        if options.auto_parser is None:
            raise _bad_choice(
                'tool_choice "auto" (the default with tools) needs a server started with '
                '--enable-auto-tool-choice and --tool-call-parser; use "required", a named '
                'function or "none"'
            )
        return ToolPlan("auto", tuple(tools), parser=options.auto_parser, parallel=parallel)
    if choice == "required":
        schema = _calls_schema(tools, parallel)
        constraint = json_constraint("tools", schema)
        return ToolPlan("required", tuple(tools), constraint=constraint, parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise _bad_choice(f"tool_choice names the function {name[:64]!r}, which is not in tools")
    function = tools[names.index(name)].function
    schema = function.parameters or {"type": "object"}
    return ToolPlan(
        "named", tuple(tools), function=name, constraint=json_constraint("tools", schema)
    )


def _bad_choice(message: str) -> RequestError:
    return RequestError(message, param="tool_choice", code=INVALID_TOOL_CHOICE)


def _calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each naming one of ``tools`` with arguments in its schema.

    Each tool's ``$defs``/``definitions`` (pydantic writes one per nested model) are hoisted
    to the root under names of that tool alone, and its ``$ref``s follow (``relocate``):
    nested under ``items.anyOf[i]``, its own pointers would no longer resolve.

    Raises:
        RequestError: a ``parameters`` schema nested too deeply to rewrite.
    """
    calls = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        at = f"/items/anyOf/{i}/properties/arguments"
        try:
            arguments, own = relocate(tool.function.parameters or {"type": "object"}, name, at)
        except RecursionError:
            raise RequestError("tools: parameters nested too deeply", param="tools") from None
        defs |= own
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    schema |= {"$defs": defs} if defs else {}
    return schema | ({} if parallel else {"maxItems": 1})


def template_inputs(
    messages: list[dict[str, Any]], plan: ToolPlan, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra template variables (``tools``) of a conversation.

    ``messages`` are :meth:`ChatCompletionRequest.template_messages`: assistant calls carry
    their arguments as objects, as transformers' templates expect.
    """
    if not plan.tools and not any("tool_calls" in m for m in messages):
        return messages, {}  # most conversations: nothing of tools to render
    tools = [t.model_dump(exclude_none=True) for t in plan.tools]
    if template is None or "tools" in template_variables(template):
        return messages, {"tools": tools} if tools else {}
    converted = [_calls_as_text(m) for m in messages]
    if plan.mode == "none":  # no tools, or shown to a template that ignores them: none to show
        return converted, {}
    return _with_tools_in_system(converted, tools), {}


def _with_tools_in_system(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The tools described in the system message, for a template that does not render them."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    guide = (
        "You may call the functions below (JSON schemas, one per line, inside <tools>):\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call functions, answer with only "
        '<tool_call>[{"name": "<function name>", "arguments": {<its arguments>}}]</tool_call> '
        "(one object per call). A function's result comes back in a tool message. If no "
        "function helps, answer normally."
    )
    converted = messages
    if converted and converted[0]["role"] == "system":
        first = converted[0]
        return [first | {"content": f"{first['content']}\n\n{guide}"}, *converted[1:]]
    return [{"role": "system", "content": guide}, *converted]


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's calls as a ``<tool_call>`` block after its text (for templates that
    only render ``content``)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = json.dumps(
        [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls],
        ensure_ascii=False,
    )
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return rest | {"content": f"{message.get('content') or ''}<tool_call>{written}</tool_call>"}


def arguments_object(call: MessageToolCall) -> Any:
    """A past call's ``arguments`` as an object when they are a JSON object (templates write
    ``arguments | tojson``), else the text as sent (templates test ``is string``)."""
    try:
        value = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments
