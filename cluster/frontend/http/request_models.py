"""The OpenAI request bodies kvloom serves, as pydantic models.

Unknown fields are ignored (as vLLM does: clients send `user`, `store`, `metadata`, ...);
fields kvloom knows but cannot honour (`n` > 1, `logit_bias`) are refused by to_proto.py,
naming the field. Fields whose OpenAI type is a union (`stop`, `content`, `prompt`,
`tool_choice`, `response_format`) are taken as they come and checked there, so an error
names the field rather than a union member.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class FunctionCall(_Lenient):
    name: str
    arguments: Any = None  # JSON text, as OpenAI sends it (an object is accepted too)


class ToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: str
    content: Any = None  # a string, a list of text parts, or null
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class SamplingFields(_Lenient):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", ...}
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: Any  # a string, token ids, or a list of one of either
    max_tokens: int | None = 16  # OpenAI's default here (and vLLM's); null: as many as fit
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None
