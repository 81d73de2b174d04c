"""The gRPC door's stream messages -> OpenAI objects: chunks for server-sent events, or one
whole response, for chat completions and completions alike.

A stream of either kind is deltas, then one Finish, then one Usage (generation.proto); a
delta whose text is all held back (a possible stop string, a partial tool-call marker)
gives no chunk, since its text comes later.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvloom.protos.kvloom.v1 import generation_pb2 as pb

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
    pb.FINISH_REASON_ABORT: "abort",
}


def sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def usage(msg: pb.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": msg.prompt_tokens,
        "completion_tokens": msg.completion_tokens,
        "total_tokens": msg.prompt_tokens + msg.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": msg.cached_tokens},
    }


def _stop_reason(finish: pb.Finish) -> str | int | None:
    kind = finish.WhichOneof("matched_stop")
    return getattr(finish, kind) if kind else None


def _token(lp: pb.Logprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode("utf-8"))}


def chat_logprobs(positions) -> list[dict[str, Any]]:
    out = []
    for position in positions:
        if position.HasField("sampled"):
            entry = _token(position.sampled)
            entry["top_logprobs"] = [_token(t) for t in position.top]
            out.append(entry)
    return out


class _Output:
    object_chunk = ""
    object_whole = ""

    def __init__(self, response_id: str, model: str, logprobs: bool) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.finish: pb.Finish | None = None
        self.usage: pb.Usage | None = None

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object_chunk,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [{"index": 0, **choice}],
        }

    def _finish_fields(self) -> dict[str, Any]:
        finish = self.finish or pb.Finish()
        return {
            "finish_reason": _FINISH_REASONS.get(finish.reason),
            "stop_reason": _stop_reason(finish),
        }

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk(None)
        chunk["usage"] = usage(self.usage or pb.Usage())
        return chunk

    def _whole(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object_whole,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, **choice, **self._finish_fields()}],
            "usage": usage(self.usage or pb.Usage()),
        }


class ChatOutput(_Output):
    object_chunk = "chat.completion.chunk"
    object_whole = "chat.completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._logprobs: list[dict[str, Any]] = []

    def chunk(self, msg: pb.ChatResponse) -> dict[str, Any] | None:
        """The event for one stream message; None for Usage and for an empty delta."""
        kind = msg.WhichOneof("kind")
        if kind == "finish":
            self.finish = msg.finish
            return self._chunk({"delta": {}, "logprobs": None, **self._finish_fields()})
        if kind == "usage":
            self.usage = msg.usage
            return None
        d = msg.delta
        delta: dict[str, Any] = {}
        if d.role:
            delta["role"] = d.role
        if d.content:
            delta["content"] = d.content
        if d.reasoning_content:
            delta["reasoning_content"] = d.reasoning_content
        if d.tool_calls:
            delta["tool_calls"] = [_call_delta(c) for c in d.tool_calls]
        logprobs = chat_logprobs(d.logprobs) if self.logprobs else []
        if not delta and not logprobs:
            return None
        choice = {"delta": delta, "logprobs": {"content": logprobs} if logprobs else None}
        return self._chunk({**choice, "finish_reason": None})

    def add(self, msg: pb.ChatResponse) -> None:
        """Sums a stream message into the whole response."""
        kind = msg.WhichOneof("kind")
        if kind == "finish":
            self.finish = msg.finish
        elif kind == "usage":
            self.usage = msg.usage
        else:
            d = msg.delta
            self._content.append(d.content)
            self._reasoning.append(d.reasoning_content)
            for call in d.tool_calls:
                if call.HasField("name"):
                    self._calls.append(
                        {"id": call.id, "type": "function", "function": {"name": call.name}}
                    )
                    self._calls[-1]["function"]["arguments"] = ""
                self._calls[call.index]["function"]["arguments"] += call.arguments
            if self.logprobs:
                self._logprobs += chat_logprobs(d.logprobs)

    def response(self) -> dict[str, Any]:
        content = "".join(self._content)
        reasoning = "".join(self._reasoning)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self._calls else None,
            "reasoning_content": reasoning or None,
            "tool_calls": self._calls,
        }
        logprobs = {"content": self._logprobs} if self.logprobs else None
        return self._whole({"message": message, "logprobs": logprobs})


def _call_delta(call: pb.ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": call.index}
    function: dict[str, Any] = {}
    if call.HasField("id"):
        out["id"] = call.id
        out["type"] = "function"
    if call.HasField("name"):
        function["name"] = call.name
    function["arguments"] = call.arguments
    out["function"] = function
    return out


class CompletionOutput(_Output):
    object_chunk = "text_completion"
    object_whole = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text: list[str] = []
        self._offset = 0  # characters of text so far, for logprobs' text_offset
        self._logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _delta_logprobs(self, d: pb.GenerateDelta) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        out["text_offset"] = []
        offset = self._offset
        for position in d.logprobs:
            if not position.HasField("sampled"):
                continue
            out["tokens"].append(position.sampled.token)
            out["token_logprobs"].append(position.sampled.logprob)
            out["top_logprobs"].append({t.token: t.logprob for t in position.top})
            out["text_offset"].append(offset)
            offset += len(position.sampled.token)
        return out

    def _take(self, d: pb.GenerateDelta) -> dict[str, list] | None:
        logprobs = self._delta_logprobs(d) if self.logprobs else None
        self._offset += len(d.text)
        return logprobs

    def chunk(self, msg: pb.GenerateResponse) -> dict[str, Any] | None:
        kind = msg.WhichOneof("kind")
        if kind == "finish":
            self.finish = msg.finish
            return self._chunk({"text": "", "logprobs": None, **self._finish_fields()})
        if kind == "usage":
            self.usage = msg.usage
            return None
        d = msg.delta
        logprobs = self._take(d)
        if not d.text and not (logprobs and logprobs["tokens"]):
            return None
        return self._chunk({"text": d.text, "logprobs": logprobs, "finish_reason": None})

    def add(self, msg: pb.GenerateResponse) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "finish":
            self.finish = msg.finish
        elif kind == "usage":
            self.usage = msg.usage
        else:
            self._text.append(msg.delta.text)
            logprobs = self._take(msg.delta)
            if logprobs is not None:
                for key, values in logprobs.items():
                    self._logprobs[key] += values

    def response(self) -> dict[str, Any]:
        logprobs = self._logprobs if self.logprobs else None
        return self._whole({"text": "".join(self._text), "logprobs": logprobs})
