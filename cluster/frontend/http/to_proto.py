"""OpenAI requests -> the gRPC door's request messages, and field names back.

The gRPC door's checks (request_validation.py, chat_request.py) name proto fields
(`sampling.top_p`, `tools[0].parameters`); `FieldNames.openai` says which OpenAI field the
client wrote instead (`top_p`, `tools[0].function.parameters`), so an HTTP error names what
the client sent.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvloom.cluster.frontend.errors import InvalidArgument
from kvloom.cluster.frontend.http.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    SamplingFields,
)
from kvloom.protos.kvloom.v1 import generation_pb2 as pb

_UINT32 = 2**32 - 1
_INT32 = 2**31 - 1
_UINT64 = 2**64 - 1
_TOOL_CHOICE_MODES = {
    "auto": pb.ToolChoice.TOOL_CHOICE_AUTO,
    "none": pb.ToolChoice.TOOL_CHOICE_NONE,
    "required": pb.ToolChoice.TOOL_CHOICE_REQUIRED,
}
# proto path -> OpenAI path, for paths under messages[i] and tools[i]
_NESTED = [
    (re.compile(r"^(messages\[\d+\]\.tool_calls\[\d+\])\.(name|arguments)"), r"\1.function.\2"),
    (re.compile(r"^(tools\[\d+\])\.(name|description|parameters)"), r"\1.function.\2"),
]


class FieldNames:
    """Proto field path -> the OpenAI field the client wrote."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {
            "tool_choice.mode": "tool_choice",
            "tool_choice.function_name": "tool_choice.function.name",
            "text": "prompt",
            "token_ids": "prompt",
        }

    def set(self, proto: str, openai: str) -> None:
        self._names[proto] = openai

    def openai(self, field: str) -> str:
        if field in self._names:
            return self._names[field]
        if field.startswith("sampling."):
            return field.removeprefix("sampling.")
        for pattern, replacement in _NESTED:
            if pattern.match(field):
                return pattern.sub(replacement, field, count=1)
        return field


def _int_in(field: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(field, f"must be an integer in [{low}, {high}], got {value}")
    return value


def _refuse_unsupported(req: SamplingFields) -> None:
    if req.n != 1:
        raise InvalidArgument("n", f"only n = 1 is supported, got {req.n}")
    if req.logit_bias:
        raise InvalidArgument("logit_bias", "is not supported")


def _stop_strings(stop: Any, names: FieldNames) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        names.set("sampling.stop[0]", "stop")
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    return stop


def _sampling(req: SamplingFields, max_tokens: int | None, names: FieldNames) -> pb.SamplingParams:
    _refuse_unsupported(req)
    msg = pb.SamplingParams()
    if max_tokens is not None:
        msg.max_tokens = _int_in(names.openai("sampling.max_tokens"), max_tokens, 0, _UINT32)
    if req.min_tokens is not None:
        msg.min_tokens = _int_in("min_tokens", req.min_tokens, 0, _UINT32)
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            setattr(msg, name, value)
    if req.top_k is not None:
        msg.top_k = _int_in("top_k", req.top_k, -_INT32 - 1, _INT32)
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            setattr(msg, name, value)
    if req.seed is not None:
        msg.seed = _int_in("seed", req.seed, 0, _UINT64)
    msg.stop.extend(_stop_strings(req.stop, names))
    for i, token_id in enumerate(req.stop_token_ids or []):
        msg.stop_token_ids.append(_int_in(f"stop_token_ids[{i}]", token_id, 0, _UINT32))
    msg.ignore_eos = req.ignore_eos
    msg.include_stop_str_in_output = req.include_stop_str_in_output
    if req.skip_special_tokens is not None:
        msg.skip_special_tokens = req.skip_special_tokens
    return msg


def _content(where: str, content: Any) -> str | None:
    """A message's content: a string, null, or text parts (joined, as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(where, "must be a string, a list of text parts, or null")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidArgument(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgument(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "\n".join(texts)


def _arguments(where: str, arguments: Any) -> str:
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    raise InvalidArgument(where, "must be a JSON object text")


def _message(i: int, message: Message) -> pb.ChatMessage:
    where = f"messages[{i}]"
    out = pb.ChatMessage(role=message.role)
    content = _content(f"{where}.content", message.content)
    if content is not None:
        out.content = content
    for j, call in enumerate(message.tool_calls or []):
        at = f"{where}.tool_calls[{j}].function.arguments"
        out.tool_calls.append(
            pb.ToolCall(
                id=call.id,
                name=call.function.name,
                arguments=_arguments(at, call.function.arguments),
            )
        )
    if message.tool_call_id is not None:
        out.tool_call_id = message.tool_call_id
    if message.name is not None:
        out.name = message.name
    if message.reasoning_content is not None:
        out.reasoning_content = message.reasoning_content
    return out


def _tool_choice(choice: Any) -> pb.ToolChoice:
    if choice is None:
        return pb.ToolChoice()
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE_MODES:
            raise InvalidArgument(
                "tool_choice", f'must be "auto", "none", "required" or a function, got {choice!r}'
            )
        return pb.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidArgument(
            "tool_choice", 'an object must be {"type": "function", "function": {"name": ...}}'
        )
    return pb.ToolChoice(mode=pb.ToolChoice.TOOL_CHOICE_NAMED, function_name=name)


def _response_format(value: Any, sampling: pb.SamplingParams, names: FieldNames) -> None:
    """OpenAI's response_format -> structured outputs: `json_schema` (its `schema`) or
    `json_object` (any JSON object); `text` (or none) leaves the output free."""
    if value is None:
        return
    kind = value.get("type", "text")
    if kind == "text":
        return
    if kind == "json_object":
        sampling.structured_outputs.json_object = True
        names.set("sampling.structured_outputs.json_object", "response_format")
        return
    if kind != "json_schema":
        raise InvalidArgument(
            "response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
        raise InvalidArgument(
            "response_format.json_schema.schema", "must be a JSON schema (an object)"
        )
    sampling.structured_outputs.json = json.dumps(spec["schema"], ensure_ascii=False)
    names.set("sampling.structured_outputs.json", "response_format.json_schema.schema")


def chat_request(req: ChatCompletionRequest, request_id: str) -> tuple[pb.ChatRequest, FieldNames]:
    names = FieldNames()
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:  # the newer name wins, as in vLLM
        max_tokens = req.max_completion_tokens
        names.set("sampling.max_tokens", "max_completion_tokens")
    sampling = _sampling(req, max_tokens, names)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    if req.logprobs:
        top = req.top_logprobs or 0
        sampling.logprobs = _int_in("top_logprobs", top, 0, _UINT32)
    names.set("sampling.logprobs", "top_logprobs")
    _response_format(req.response_format, sampling, names)
    out = pb.ChatRequest(
        request_id=request_id,
        messages=[_message(i, m) for i, m in enumerate(req.messages)],
        tool_choice=_tool_choice(req.tool_choice),
        sampling=sampling,
        continue_final_message=req.continue_final_message,
        cache_salt=req.cache_salt or "",
    )
    if req.parallel_tool_calls is not None:
        out.parallel_tool_calls = req.parallel_tool_calls
    for tool in req.tools or []:
        function = tool.function
        out.tools.append(
            pb.Tool(
                name=function.name,
                description=function.description or "",
                parameters=json.dumps(function.parameters, ensure_ascii=False)
                if function.parameters is not None
                else "",
            )
        )
    if req.chat_template_kwargs:
        out.chat_template_kwargs = json.dumps(req.chat_template_kwargs, ensure_ascii=False)
    if req.add_generation_prompt is not None:
        out.add_generation_prompt = req.add_generation_prompt
    return out, names


def _prompt(prompt: Any) -> str | list[int]:
    """One prompt: text or token ids (a batch of one is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        for i, token_id in enumerate(prompt):
            _int_in(f"prompt[{i}]", token_id, 0, _UINT32)
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise InvalidArgument("prompt", f"one prompt per request, got {len(prompt)}")
    raise InvalidArgument("prompt", "must be a string or a list of token ids")


def generate_request(
    req: CompletionRequest, request_id: str
) -> tuple[pb.GenerateRequest, FieldNames]:
    names = FieldNames()
    if req.echo:
        raise InvalidArgument("echo", "is not supported")
    if req.suffix:
        raise InvalidArgument("suffix", "is not supported")
    if req.best_of not in (None, 1):
        raise InvalidArgument("best_of", f"only best_of = 1 is supported, got {req.best_of}")
    sampling = _sampling(req, req.max_tokens, names)
    if req.logprobs is not None:
        sampling.logprobs = _int_in("logprobs", req.logprobs, 0, _UINT32)
    out = pb.GenerateRequest(
        request_id=request_id, sampling=sampling, cache_salt=req.cache_salt or ""
    )
    prompt = _prompt(req.prompt)
    if isinstance(prompt, str):
        out.text = prompt
    else:
        out.token_ids.ids.extend(prompt)
    if req.add_special_tokens is not None:
        out.add_special_tokens = req.add_special_tokens
    return out, names
