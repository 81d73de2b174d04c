"""A ChatRequest's messages, tools and template options: checked, then shaped as chat
templates expect them (OpenAI's message and tool dicts)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvloom.cluster.frontend.errors import InvalidArgument
from kvloom.cluster.frontend.limits import (
    DEFAULT_LIMITS,
    FrontendLimits,
    check_count,
    check_text,
    parse_json,
    utf8_size,
)
from kvloom.cluster.parsers import reasoning_parser_class
from kvloom.cluster.structured_outputs.tool_call_grammar import (
    ReasoningRoom,
    ToolChoiceError,
    tool_choice_constraint,
)
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.protos.kvloom.v1 import generation_pb2 as pb

# OpenAI's function-name rule, plus "." and ":" (Kimi writes functions.NAME:IDX).
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
_ROLES_WITH_CONTENT = ("system", "user", "tool", "developer")
Mode = pb.ToolChoice.Mode


@dataclass
class ChatInputs:
    messages: list[dict[str, Any]]
    # The tools offered to the model (after tool_choice); None when none are.
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # tool_choice "required" or a named tool (then `tools` is that one): calls are forced.
    calls_forced: bool = False
    named_tool: str | None = None
    # OpenAI's parallel_tool_calls: False forces exactly one call under "required".
    parallel_tool_calls: bool = True


def reasoning_room(
    reasoning_parser: str | None, request: pb.ChatRequest, prompt: str
) -> ReasoningRoom | None:
    """The reasoning block a forced tool choice leaves room for: the one the request's
    reasoning parser reads (none when the server has none or the request turns it off)."""
    wanted = request.parse_reasoning if request.HasField("parse_reasoning") else True
    if not wanted or reasoning_parser is None:
        return None
    cls = reasoning_parser_class(reasoning_parser)
    return ReasoningRoom(cls.start_tags[0], cls.end_tags[0], cls.prompt_opens_reasoning(prompt))


def constrain_to_tool_choice(
    params: SamplingParams,
    inputs: ChatInputs,
    tool_call_parser: str | None,
    reasoning: ReasoningRoom | None = None,
) -> SamplingParams:
    """`params` with the grammar of a forced tool choice (calls in the parser's format,
    arguments by the tools' schemas, after a reasoning block where `reasoning` allows);
    unchanged when tool_choice forces nothing."""
    if not inputs.calls_forced:
        return params
    if params.structured_outputs is not None:
        raise InvalidArgument(
            "tool_choice", "a forced tool choice cannot be combined with structured outputs"
        )
    if tool_call_parser is None:
        raise InvalidArgument("tool_choice", "this server has no tool-call parser to force")
    try:
        constraint = tool_choice_constraint(
            tool_call_parser,
            inputs.tools or [],
            inputs.named_tool,
            reasoning,
            inputs.parallel_tool_calls,
        )
    except ToolChoiceError as err:
        raise InvalidArgument(err.field, err.reason) from None
    return replace(params, structured_outputs=constraint)


class _Budget:
    """The bytes of text a chat may still carry (messages and tool schemas together)."""

    def __init__(self, limits: FrontendLimits) -> None:
        self.limits = limits
        self.left = limits.max_prompt_bytes or 0

    def spend(self, field_name: str, text: str, limit: int | None = None) -> None:
        limit = self.left if limit is None else min(limit, self.left)
        size = utf8_size(text, limit)
        if size > limit:
            whole = self.limits.max_prompt_bytes
            if limit < self.left:
                raise InvalidArgument(field_name, f"too large: over {limit} bytes")
            raise InvalidArgument(
                field_name, f"too large: the chat's text is over {whole} bytes in all"
            )
        self.left -= size


def _json_object(
    field_name: str, text: str, empty: Any, limits: FrontendLimits = DEFAULT_LIMITS
) -> Any:
    if not text.strip():
        return empty
    value = parse_json(field_name, text, limits.max_json_depth)
    if not isinstance(value, dict):
        raise InvalidArgument(field_name, f"must be a JSON object, got {type(value).__name__}")
    return value


def _message(i: int, msg: pb.ChatMessage, budget: _Budget) -> dict[str, Any]:
    where = f"messages[{i}]"
    role = msg.role
    if not role:
        raise InvalidArgument(f"{where}.role", "must not be empty")
    if len(role) > 64 or not role.isprintable():
        raise InvalidArgument(f"{where}.role", f"not a role name: {role[:64]!r}")
    out: dict[str, Any] = {"role": role}
    if msg.HasField("content"):
        content = msg.content  # each access builds a new str
        budget.spend(f"{where}.content", content)
        out["content"] = content
    elif role in _ROLES_WITH_CONTENT:
        raise InvalidArgument(f"{where}.content", f"a {role} message needs content")
    if msg.tool_calls:
        if role != "assistant":
            raise InvalidArgument(f"{where}.tool_calls", "only assistant messages make tool calls")
        calls = []
        for j, call in enumerate(msg.tool_calls):
            at = f"{where}.tool_calls[{j}]"
            if not _TOOL_NAME.match(call.name):
                raise InvalidArgument(f"{at}.name", f"not a function name: {call.name[:80]!r}")
            budget.spend(f"{at}.arguments", call.arguments)
            _json_object(f"{at}.arguments", call.arguments, {}, budget.limits)
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments or "{}"},
                }
            )
        out["tool_calls"] = calls
    elif role == "assistant" and not msg.HasField("content"):
        raise InvalidArgument(
            f"{where}.content", "an assistant message needs content or tool_calls"
        )
    if msg.tool_call_id:
        if role != "tool":
            raise InvalidArgument(f"{where}.tool_call_id", "only tool messages answer a call")
        budget.spend(f"{where}.tool_call_id", msg.tool_call_id)
        out["tool_call_id"] = msg.tool_call_id
    if msg.name:
        budget.spend(f"{where}.name", msg.name)
        out["name"] = msg.name
    if msg.HasField("reasoning_content"):
        if role != "assistant":
            raise InvalidArgument(f"{where}.reasoning_content", "only assistant messages reason")
        budget.spend(f"{where}.reasoning_content", msg.reasoning_content)
        out["reasoning_content"] = msg.reasoning_content
    return out


def _tool(i: int, tool: pb.Tool, seen: set[str], budget: _Budget) -> dict[str, Any]:
    if not _TOOL_NAME.match(tool.name):
        raise InvalidArgument(
            f"tools[{i}].name",
            f"must be 1-64 letters, digits, '_', '-', '.' or ':', got {tool.name[:80]!r}",
        )
    if tool.name in seen:
        raise InvalidArgument(f"tools[{i}].name", f"{tool.name!r} is offered twice")
    seen.add(tool.name)
    budget.spend(f"tools[{i}].description", tool.description)
    limits = budget.limits
    budget.spend(f"tools[{i}].parameters", tool.parameters, limits.max_tool_schema_bytes)
    parameters = _json_object(
        f"tools[{i}].parameters", tool.parameters, {"type": "object", "properties": {}}, limits
    )
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def _offered_tools(request: pb.ChatRequest, budget: _Budget) -> list[dict[str, Any]] | None:
    check_count("tools", len(request.tools), budget.limits.max_tools, "tools")
    seen: set[str] = set()
    tools = [_tool(i, tool, seen, budget) for i, tool in enumerate(request.tools)]
    choice = request.tool_choice
    if choice.mode not in Mode.values():
        raise InvalidArgument("tool_choice.mode", f"unknown mode {choice.mode}")
    if choice.function_name and choice.mode != pb.ToolChoice.TOOL_CHOICE_NAMED:
        raise InvalidArgument("tool_choice.function_name", "only with TOOL_CHOICE_NAMED")
    if choice.mode == pb.ToolChoice.TOOL_CHOICE_NONE:
        return None
    forcing = (pb.ToolChoice.TOOL_CHOICE_REQUIRED, pb.ToolChoice.TOOL_CHOICE_NAMED)
    if choice.mode in forcing and not tools:
        raise InvalidArgument("tool_choice.mode", f"{Mode.Name(choice.mode)} needs tools")
    if choice.mode == pb.ToolChoice.TOOL_CHOICE_NAMED:
        named = [t for t in tools if t["function"]["name"] == choice.function_name]
        if not named:
            raise InvalidArgument(
                "tool_choice.function_name",
                f"{choice.function_name!r} is not one of the tools",
            )
        return named
    return tools or None


def chat_inputs(request: pb.ChatRequest, limits: FrontendLimits = DEFAULT_LIMITS) -> ChatInputs:
    """`limits` with max_prompt_bytes resolved (FrontendLimits.for_model_len)."""
    if not request.messages:
        raise InvalidArgument("messages", "must not be empty")
    check_count("messages", len(request.messages), limits.max_messages, "messages")
    budget = _Budget(limits)
    messages = [_message(i, msg, budget) for i, msg in enumerate(request.messages)]
    tools = _offered_tools(request, budget)
    check_text(
        "chat_template_kwargs", request.chat_template_kwargs, limits.max_template_kwargs_bytes
    )
    kwargs = _json_object("chat_template_kwargs", request.chat_template_kwargs, {}, limits)
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_VARIABLES:
            raise InvalidArgument(f"chat_template_kwargs.{key}", "is set by the server")
    add_generation_prompt = (
        request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    )
    if request.continue_final_message:
        if request.HasField("add_generation_prompt") and request.add_generation_prompt:
            raise InvalidArgument(
                "continue_final_message", "cannot be combined with add_generation_prompt"
            )
        if messages[-1]["role"] != "assistant":
            raise InvalidArgument(
                "continue_final_message", "the final message must be an assistant message"
            )
        add_generation_prompt = False
    mode = request.tool_choice.mode
    named = mode == pb.ToolChoice.TOOL_CHOICE_NAMED
    return ChatInputs(
        messages=messages,
        tools=tools,
        template_kwargs=kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=request.continue_final_message,
        calls_forced=named or mode == pb.ToolChoice.TOOL_CHOICE_REQUIRED,
        named_tool=request.tool_choice.function_name if named else None,
        parallel_tool_calls=(
            request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
        ),
    )
