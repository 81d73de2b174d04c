"""One render worker process: `python -m kvloom.cluster.frontend.render_worker MODEL_DIR PPID`.

It loads the model's tokenizer and chat template and answers jobs from the front door's
render pool (cluster/frontend/render_pool.py) over stdin/stdout: encode a text, decode ids,
render a chat and encode it. It runs in a process of its own so that the pool can kill it
when a job overruns its time limit: a jinja loop cannot be stopped inside a thread, and the
tokenizer holds the GIL while it encodes.

Frames both ways: an 8-byte little-endian length, then a pickle. A reply is ("ok", result),
("invalid", message) for the request's fault (a ValueError: the template refused the
messages), or ("error", message).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO

HEADER = struct.Struct("<Q")
READY = "ready"


def read_frame(stream: BinaryIO) -> Any:
    """The next object, or None at end of stream."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return pickle.loads(stream.read(size))


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _die_with_parent(parent_pid: int) -> None:
    """A worker never outlives the server: on Linux the kernel kills it when its parent
    exits; elsewhere a closed stdin ends it between jobs."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


class Renderer:
    def __init__(self, model_dir: str) -> None:
        from kvloom.cluster.chat_template import ChatTemplate
        from kvloom.cluster.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(model_dir)
        self.template = ChatTemplate.from_model_dir(model_dir)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        template_kwargs: dict,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> tuple[str, list[int]]:
        """The prompt text and its ids. Templates write their own BOS, so the text is encoded
        without special tokens (never a second BOS)."""
        if self.template is None:
            raise ValueError("messages: the model has no chat template")
        rendered = self.template.render(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=template_kwargs,
        )
        return rendered.text, self.tokenizer.encode(rendered.text, add_special_tokens=False)


def serve(renderer: Renderer, jobs: BinaryIO, replies: BinaryIO) -> None:
    write_frame(replies, (READY, None))
    while (job := read_frame(jobs)) is not None:
        name, args = job
        try:
            reply = ("ok", getattr(renderer, name)(*args))
        except ValueError as exc:
            reply = ("invalid", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the server, which logs it
            reply = ("error", f"{type(exc).__name__}: {exc}")
        write_frame(replies, reply)


def main(argv: list[str]) -> int:
    model_dir, parent_pid = argv[1], int(argv[2])
    _die_with_parent(parent_pid)
    # Ctrl-C or SIGTERM to the process group is the server's to handle: it drains (renders
    # in flight finish), then kills its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The protocol owns the real stdout; anything a library prints goes to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        renderer = Renderer(model_dir)
    except Exception as exc:  # noqa: BLE001 - the pool reports it as the start-up failure
        write_frame(replies, ("error", f"{type(exc).__name__}: {exc}"))
        return 1
    serve(renderer, sys.stdin.buffer, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
