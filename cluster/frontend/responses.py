"""Per-request responders: the output processor's OutputDeltas in, the stream's protobuf
messages out.

Each stream is zero or more deltas, then one Finish, then one Usage. The deltas come with
their text already detokenized and cut at stop strings (what may start one held back until
the finished delta: cluster/output_processor.py), so a responder only shapes messages. Chat
runs the text through the request's ChatOutputParser (reasoning, then tool calls) and
flushes the parser when the request finishes or is aborted, so a partial marker held back
is never lost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvloom.cluster.outputs import Logprob, OutputDelta
from kvloom.cluster.parsers import ChatOutputParser, Delta
from kvloom.protos.kvloom.v1 import generation_pb2 as pb

_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}


class TokenTexts:
    """Token id -> its text decoded on its own (for logprobs); cached, as the vocabulary is
    finite and the same ids come back all the time."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.text = functools.lru_cache(maxsize=65536)(self._one)

    def _one(self, token_id: int) -> str:
        return self._decode([token_id])


def position_logprobs(
    token_id: int, entry: dict[int, Logprob], num_top: int, texts: TokenTexts
) -> pb.PositionLogprobs:
    """The sampled token's logprob and the top `num_top` alternatives, best first."""

    def one(tid: int, lp: Logprob) -> pb.Logprob:
        return pb.Logprob(token_id=tid, logprob=lp.logprob, rank=lp.rank, token=texts.text(tid))

    sampled = entry.get(token_id)
    top = sorted(
        ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
        key=lambda item: item[1].rank,
    )
    return pb.PositionLogprobs(
        sampled=one(token_id, sampled) if sampled is not None else None,
        top=[one(tid, lp) for tid, lp in top],
    )


def finish_message(reason: str | None, stop_reason: int | str | None) -> pb.Finish:
    finish = pb.Finish(reason=_FINISH_REASONS.get(reason or "", pb.FINISH_REASON_UNSPECIFIED))
    if isinstance(stop_reason, str):
        finish.stop_str = stop_reason
    elif isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
        finish.stop_token_id = stop_reason
    return finish


def usage_message(delta: OutputDelta) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=delta.prompt_tokens,
        completion_tokens=delta.completion_tokens,
        cached_tokens=delta.cached_tokens,
    )


class _Responder:
    def __init__(self, request_id: str, num_logprobs: int | None, texts: TokenTexts) -> None:
        self.request_id = request_id
        self.num_logprobs = num_logprobs
        self.texts = texts
        self.finished = False

    def _logprobs(self, delta: OutputDelta) -> list[pb.PositionLogprobs]:
        if self.num_logprobs is None:
            return []
        return [
            position_logprobs(tid, entry, self.num_logprobs, self.texts)
            for tid, entry in zip(delta.token_ids, delta.logprobs)
        ]


class GenerateResponder(_Responder):
    def update(self, delta: OutputDelta) -> list[pb.GenerateResponse]:
        rid = self.request_id
        messages = []
        if not delta.empty:
            messages.append(
                pb.GenerateResponse(
                    request_id=rid,
                    delta=pb.GenerateDelta(
                        text=delta.text, token_ids=delta.token_ids, logprobs=self._logprobs(delta)
                    ),
                )
            )
        if delta.finished:
            self.finished = True
            messages.append(
                pb.GenerateResponse(
                    request_id=rid, finish=finish_message(delta.finish_reason, delta.stop_reason)
                )
            )
            messages.append(pb.GenerateResponse(request_id=rid, usage=usage_message(delta)))
        return messages


def chat_delta(delta: Delta) -> pb.ChatDelta:
    return pb.ChatDelta(
        content=delta.content,
        reasoning_content=delta.reasoning,
        tool_calls=[
            pb.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
            for c in delta.tool_calls
        ],
    )


class ChatResponder(_Responder):
    """`parser` None: all text is content."""

    def __init__(self, *args, parser: ChatOutputParser | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parser = parser
        self._role_sent = False

    def _parse(self, text: str, end: bool) -> list[Delta]:
        if self.parser is None:
            return [Delta(content=text)] if text else []
        deltas = self.parser.feed(text) if text else []
        return deltas + self.parser.finish() if end else deltas

    def update(self, delta: OutputDelta) -> list[pb.ChatResponse]:
        rid = self.request_id
        chat = [chat_delta(d) for d in self._parse(delta.text, end=delta.finished)]
        if delta.token_ids:
            if not chat:
                chat.append(pb.ChatDelta())
            chat[0].token_ids.extend(delta.token_ids)
            chat[0].logprobs.extend(self._logprobs(delta))
        if chat and not self._role_sent:
            chat[0].role = "assistant"
            self._role_sent = True
        messages = [pb.ChatResponse(request_id=rid, delta=d) for d in chat]
        if delta.finished:
            self.finished = True
            reason = delta.finish_reason
            if reason == "stop" and self.parser is not None and self.parser.num_tool_calls:
                reason = "tool_calls"
            messages.append(
                pb.ChatResponse(request_id=rid, finish=finish_message(reason, delta.stop_reason))
            )
            messages.append(pb.ChatResponse(request_id=rid, usage=usage_message(delta)))
        return messages
