"""What streaming parsers emit: deltas of content, reasoning and tool calls, and their sum."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    """One step of one tool call. The first delta of a call carries its id and name (once);
    later ones carry only argument fragments, which concatenate to the call's JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    """A piece of the assistant message. Parsers emit one kind per Delta, in text order."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParsedMessage:
    """The sum of a stream of deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class DeltaBuilder:
    """Collects parser output, merging consecutive pieces of the same kind into one Delta."""

    def __init__(self) -> None:
        self._deltas: list[Delta] = []

    def _last(self) -> Delta | None:
        return self._deltas[-1] if self._deltas else None

    def content(self, text: str) -> None:
        if not text:
            return
        last = self._last()
        if last is not None and not last.tool_calls and not last.reasoning:
            last.content += text
        else:
            self._deltas.append(Delta(content=text))

    def reasoning(self, text: str) -> None:
        if not text:
            return
        last = self._last()
        if last is not None and not last.tool_calls and not last.content:
            last.reasoning += text
        else:
            self._deltas.append(Delta(reasoning=text))

    def call_start(self, index: int, call_id: str, name: str) -> None:
        self._deltas.append(Delta(tool_calls=[ToolCallDelta(index=index, id=call_id, name=name)]))

    def call_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self._last()
        if last is not None and last.tool_calls and last.tool_calls[-1].index == index:
            last.tool_calls[-1].arguments += text
        else:
            self._deltas.append(Delta(tool_calls=[ToolCallDelta(index=index, arguments=text)]))

    def extend(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            self.reasoning(delta.reasoning)
            self.content(delta.content)
            for call in delta.tool_calls:
                if call.name is not None:
                    self.call_start(call.index, call.id or "", call.name)
                self.call_arguments(call.index, call.arguments)

    def take(self) -> list[Delta]:
        deltas, self._deltas = self._deltas, []
        return deltas


def collect(deltas: list[Delta]) -> ParsedMessage:
    """Sums deltas into a message, checking the streaming contract: a call's id and name come
    once, in its first delta, and calls are numbered 0, 1, 2, ... in order."""
    message = ParsedMessage()
    content: list[str] = []
    reasoning: list[str] = []
    arguments: list[list[str]] = []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for call in delta.tool_calls:
            if call.name is not None or call.id is not None:
                if call.index != len(message.tool_calls):
                    raise ValueError(f"tool call {call.index} started out of order")
                if call.name is None or call.id is None:
                    raise ValueError(f"tool call {call.index} started without both id and name")
                message.tool_calls.append(ToolCall(call.id, call.name, ""))
                arguments.append([])
            elif call.index >= len(message.tool_calls):
                raise ValueError(f"tool call {call.index} got arguments before its id and name")
            arguments[call.index].append(call.arguments)
    message.content = "".join(content)
    message.reasoning = "".join(reasoning)
    for call, parts in zip(message.tool_calls, arguments):
        call.arguments = "".join(parts)
    return message
