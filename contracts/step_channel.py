"""Per-step messages from the scheduler to the worker processes, and results back.

ARCHITECTURE §2: the per-step `SchedulerOutput` does not travel as a Ray call (≈1.3 ms per
round trip to two actors); Ray only sets the channel up (it passes `address` strings to the
actors). Two one-way zmq channels:

    StepPublisher (scheduler, XPUB bind) ──► StepSubscriber × N (workers, SUB connect)
    ResultChannel (scheduler, PULL bind) ◄── ResultSender × k (sampling rank, PUSH connect)

Messages are msgspec Structs or dataclasses encoded as msgpack (or bytes sent as they are);
a tensor, if one must travel here, goes as `RawTensor` (dtype name, shape, raw bytes).
Nothing is pickled. This module must not import torch: the control plane imports it too.

No message is lost:
- Slow joiners. A SUB socket's subscription reaches the publisher asynchronously, and a PUB
  socket silently drops what it sends before then. Here every subscriber subscribes to all
  messages and then to a "hello" topic carrying a unique id; the XPUB socket (verbose) hands
  those subscriptions to the publisher, and `publish` first waits until `num_subscribers`
  distinct ids arrived (`wait_ready`). The hello topic starts with a byte no message header
  starts with, so it never matches a message.
- Overflow. High-water marks are unlimited and XPUB never drops, so a subscriber that is
  slow to read gets everything, in order.
- Anything else (a reconnect that lost data): every message carries a sequence number and
  the receiver raises `ChannelError` on a gap instead of running a step it only half saw.

Besides data the publisher can send a flush marker (`publish_flush`; `recv` returns
`FLUSH`): it carries no payload and tells workers that pipeline steps (async scheduling)
to send back the result of the last step they were sent now, since no later step is
coming before the scheduler reads it. It is numbered and ordered like any message. So is a
side message (`publish_side`), which the subscriber decodes with its own type: the grammar
masks that follow a step scheduled ahead (contracts/scheduler_output.py `GrammarBitmasks`).

Sockets are not thread-safe: use each endpoint from one thread.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
import uuid
from typing import Any

import msgspec
import zmq

__all__ = [
    "ChannelClosed",
    "ChannelError",
    "FLUSH",
    "RawTensor",
    "ResultChannel",
    "ResultSender",
    "StepPublisher",
    "StepSubscriber",
]

_DATA = b"D"
_CLOSE = b"C"
_FLUSH = b"F"
_SIDE = b"S"
# kind (1 byte) + sequence number; results add the sender's rank.
_STEP_HEADER = struct.Struct("<cQ")
_RESULT_HEADER = struct.Struct("<cIQ")
_HELLO_TOPIC = b"\xffkvloom-step-hello:"
_SUBSCRIBE = 1  # first byte of an XPUB subscription message (0 is unsubscribe)
_TRANSPORTS = ("tcp", "ipc")
_WILDCARD_HOSTS = ("0.0.0.0", "*", "::")


class ChannelClosed(RuntimeError):
    """The other end closed the channel (or this end was closed)."""


class ChannelError(RuntimeError):
    """The channel broke its guarantees (e.g. a message went missing)."""


class _Flush:
    """The type of `FLUSH`, the flush marker `StepSubscriber.recv` returns (compare with
    `is`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FLUSH"


FLUSH = _Flush()


class RawTensor(msgspec.Struct, array_like=True, frozen=True):
    """A tensor as plain data: torch dtype name without `torch.` (e.g. "bfloat16"), shape,
    and the row-major bytes. The worker side rebuilds it with `torch.frombuffer`."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


_encoder = msgspec.msgpack.Encoder()


def _encode(msg: Any) -> bytes | memoryview:
    if isinstance(msg, bytes | memoryview):
        return msg
    if isinstance(msg, bytearray):
        return bytes(msg)
    try:
        return _encoder.encode(msg)
    except TypeError as exc:
        raise ValueError(
            f"msg must be bytes or a msgspec-encodable object (Struct, dataclass, builtins); "
            f"got {type(msg).__name__}: {exc}"
        ) from None


def _make_decoder(msg_type: Any):
    return None if msg_type is None else msgspec.msgpack.Decoder(msg_type)


# Contexts of endpoints not yet closed. Held strongly so the garbage collector never
# terminates one: zmq_ctx_term on a context whose socket sits in the same garbage cycle
# blocks forever. An endpoint leaked without close() leaks its context instead of hanging.
_LIVE_CONTEXTS: set[zmq.Context] = set()


def _open_socket(socket_type: int, linger_s: float) -> tuple[zmq.Context, zmq.Socket]:
    # One context per endpoint, so close() can terminate it, which waits (up to the linger)
    # until queued messages are handed to the OS: a process that sends and exits loses none.
    context = zmq.Context(io_threads=1)
    _LIVE_CONTEXTS.add(context)
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
    return context, sock


def _close_socket(context: zmq.Context, sock: zmq.Socket, linger_s: float) -> None:
    sock.close(linger=int(linger_s * 1000))
    context.term()
    _LIVE_CONTEXTS.discard(context)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (not isinstance(timeout, int | float) or timeout < 0):
        raise ValueError(f"timeout must be None or a number >= 0, got {timeout!r}")


def _timeout_ms(timeout: float | None) -> int | None:
    return None if timeout is None else max(0, int(timeout * 1000))


class _BoundEndpoint:
    """A socket bound to a fresh address: a free tcp port picked by zmq, or an ipc path in a
    private temporary directory (removed on close)."""

    def __init__(
        self,
        socket_type: int,
        transport: str,
        host: str,
        advertise_host: str | None,
        name: str,
        linger_s: float,
    ) -> None:
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {_TRANSPORTS}, got {transport!r}")
        if transport == "tcp" and host in _WILDCARD_HOSTS and not advertise_host:
            raise ValueError(
                f"advertise_host is required when host is a wildcard ({host!r}): "
                "connecting processes need a reachable address"
            )
        self._ipc_dir: str | None = None
        self._context, self.socket = _open_socket(socket_type, linger_s)
        try:
            if transport == "tcp":
                # Port `*`: the OS picks a free port as part of the bind, so no other process races us.
                bind_host = "*" if host in _WILDCARD_HOSTS else host
                self.socket.bind(f"tcp://{bind_host}:*")
                endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
                port = endpoint.rsplit(":", 1)[1]
                self.address = f"tcp://{advertise_host or host}:{port}"
            else:
                self._ipc_dir = tempfile.mkdtemp(prefix="kvloom-")
                self.address = f"ipc://{os.path.join(self._ipc_dir, name)}"
                self.socket.bind(self.address)
        except Exception:
            self.close(linger_s=0)
            raise

    def close(self, linger_s: float) -> None:
        _close_socket(self._context, self.socket, linger_s)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None


class StepPublisher:
    """One writer (the scheduler) broadcasting each step to `num_subscribers` workers.

    Create it, hand `address` to the workers (each makes a `StepSubscriber`), then
    `publish`. The first `publish` waits until all subscribers have joined (or call
    `wait_ready` yourself), up to `ready_timeout` seconds. The set of subscribers is fixed:
    workers that restart get a new publisher (their sequence numbers start again at 0).
    """

    def __init__(
        self,
        num_subscribers: int,
        *,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        ready_timeout: float = 120.0,
        close_linger_s: float = 2.0,
    ) -> None:
        if isinstance(num_subscribers, bool) or not isinstance(num_subscribers, int):
            raise ValueError(f"num_subscribers must be an int >= 1, got {num_subscribers!r}")
        if num_subscribers < 1:
            raise ValueError(f"num_subscribers must be an int >= 1, got {num_subscribers}")
        _check_timeout(ready_timeout)
        self.num_subscribers = num_subscribers
        self.ready_timeout = ready_timeout
        self._close_linger_s = close_linger_s
        self._endpoint = _BoundEndpoint(
            zmq.XPUB, transport, host, advertise_host, "step", close_linger_s
        )
        sock = self._endpoint.socket
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass every subscription up, duplicates too
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        self.address: str = self._endpoint.address
        self._joined: set[bytes] = set()
        self._seq = 0
        self._closed = False

    @property
    def ready(self) -> bool:
        return len(self._joined) >= self.num_subscribers

    @property
    def num_published(self) -> int:
        return self._seq

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every subscriber has joined; TimeoutError after `timeout` seconds."""
        _check_timeout(timeout)
        if self._closed:
            raise ChannelClosed("StepPublisher is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._endpoint.socket
        while not self.ready:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not sock.poll(_timeout_ms(remaining)):
                raise TimeoutError(
                    f"StepPublisher at {self.address}: {len(self._joined)} of "
                    f"{self.num_subscribers} subscribers joined within {timeout} s"
                )
            frame = sock.recv()
            if frame[:1] == bytes([_SUBSCRIBE]) and frame[1:].startswith(_HELLO_TOPIC):
                self._joined.add(frame[1 + len(_HELLO_TOPIC) :])

    def publish(self, msg: Any) -> None:
        """Send one message to every subscriber: bytes as they are, anything else as msgpack."""
        if self._closed:
            raise ChannelClosed("StepPublisher is closed")
        payload = _encode(msg)
        if not self.ready:
            self.wait_ready(self.ready_timeout)
        self._endpoint.socket.send_multipart([_STEP_HEADER.pack(_DATA, self._seq), payload])
        self._seq += 1

    def publish_side(self, msg: Any) -> None:
        """Send a side message: numbered and ordered like a step, decoded by the
        subscribers' `side_type` (async scheduling's grammar masks that follow a step)."""
        if self._closed:
            raise ChannelClosed("StepPublisher is closed")
        payload = _encode(msg)
        if not self.ready:
            self.wait_ready(self.ready_timeout)
        self._endpoint.socket.send_multipart([_STEP_HEADER.pack(_SIDE, self._seq), payload])
        self._seq += 1

    def publish_flush(self) -> None:
        """Send the flush marker: every subscriber's `recv` returns `FLUSH` in its place in
        the stream. Counted in `num_published` like any message."""
        if self._closed:
            raise ChannelClosed("StepPublisher is closed")
        if not self.ready:
            self.wait_ready(self.ready_timeout)
        self._endpoint.socket.send_multipart([_STEP_HEADER.pack(_FLUSH, self._seq), b""])
        self._seq += 1

    def close(self) -> None:
        """Tell the subscribers the stream ended (they get `ChannelClosed` after every message
        sent before it), then release the socket. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._joined:
                self._endpoint.socket.send_multipart([_STEP_HEADER.pack(_CLOSE, self._seq), b""])
        finally:
            self._endpoint.close(self._close_linger_s)

    def __enter__(self) -> StepPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepSubscriber:
    """A worker's end of the step broadcast. `msg_type` (a Struct or dataclass type) makes
    `recv` decode; without it `recv` returns the payload bytes. `side_type` decodes side
    messages (`publish_side`); without it they come as bytes too."""

    def __init__(self, address: str, msg_type: Any = None, side_type: Any = None) -> None:
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"address must be a tcp:// or ipc:// address, got {address!r}")
        self.address = address
        self._decoder = _make_decoder(msg_type)
        self._side_decoder = _make_decoder(side_type)
        # Linger 0: a subscriber only ever sends subscriptions.
        self._context, self._socket = _open_socket(zmq.SUB, linger_s=0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            _close_socket(self._context, self._socket, linger_s=0)
            raise ValueError(f"address {address!r} cannot be connected to: {exc}") from None
        # Order matters: the catch-all subscription is processed by the publisher before the
        # hello that tells it this subscriber is ready.
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.SUBSCRIBE, _HELLO_TOPIC + uuid.uuid4().hex.encode())
        self._expected_seq = 0
        self._peer_closed = False
        self._closed = False

    def recv(self, timeout: float | None = None) -> Any:
        """The next message, in publish order (`FLUSH` for a flush marker). TimeoutError if
        none arrives within `timeout` seconds (None waits forever); ChannelClosed once the
        publisher closed."""
        _check_timeout(timeout)
        if self._closed:
            raise ChannelClosed("StepSubscriber is closed")
        if self._peer_closed:
            raise ChannelClosed(f"publisher at {self.address} closed the channel")
        if timeout is not None and not self._socket.poll(_timeout_ms(timeout)):
            raise TimeoutError(f"no step message from {self.address} within {timeout} s")
        header, payload = self._socket.recv_multipart()
        kind, seq = _STEP_HEADER.unpack(header)
        if seq != self._expected_seq:
            raise ChannelError(
                f"step channel {self.address}: expected message {self._expected_seq}, got {seq}"
            )
        self._expected_seq += 1
        if kind == _CLOSE:
            self._peer_closed = True
            raise ChannelClosed(f"publisher at {self.address} closed the channel")
        if kind == _FLUSH:
            return FLUSH
        if kind == _SIDE:
            return payload if self._side_decoder is None else self._side_decoder.decode(payload)
        return payload if self._decoder is None else self._decoder.decode(payload)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _close_socket(self._context, self._socket, linger_s=0)

    def __enter__(self) -> StepSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResultChannel:
    """The scheduler's end of the way back: receives what `ResultSender`s send (normally the
    sampling rank's `ModelRunnerOutput`). Per-sender order is kept and checked."""

    def __init__(
        self,
        msg_type: Any = None,
        *,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
    ) -> None:
        self._endpoint = _BoundEndpoint(zmq.PULL, transport, host, advertise_host, "result", 0)
        self._endpoint.socket.setsockopt(zmq.RCVHWM, 0)
        self.address: str = self._endpoint.address
        self._decoder = _make_decoder(msg_type)
        self._expected_seq: dict[int, int] = {}
        self._closed = False

    def recv_from(self, timeout: float | None = None) -> tuple[int, Any]:
        """(sender rank, message). TimeoutError if none arrives within `timeout` seconds."""
        _check_timeout(timeout)
        if self._closed:
            raise ChannelClosed("ResultChannel is closed")
        sock = self._endpoint.socket
        if timeout is not None and not sock.poll(_timeout_ms(timeout)):
            raise TimeoutError(f"no result on {self.address} within {timeout} s")
        header, payload = sock.recv_multipart()
        _kind, sender, seq = _RESULT_HEADER.unpack(header)
        expected = self._expected_seq.get(sender, 0)
        if seq != expected:
            raise ChannelError(
                f"result channel {self.address}: expected message {expected} from rank "
                f"{sender}, got {seq}"
            )
        self._expected_seq[sender] = expected + 1
        return sender, (payload if self._decoder is None else self._decoder.decode(payload))

    def recv(self, timeout: float | None = None) -> Any:
        return self.recv_from(timeout)[1]

    @property
    def socket(self) -> zmq.Socket:
        """The receiving socket, for a `zmq.Poller` waiting on several channels at once."""
        return self._endpoint.socket

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._endpoint.close(linger_s=0)

    def __enter__(self) -> ResultChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResultSender:
    """A worker's end of the way back. Messages sent before the connection completes are
    queued by zmq (PUSH), so nothing is lost to a slow connect."""

    def __init__(self, address: str, rank: int = 0, close_linger_s: float = 2.0) -> None:
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"address must be a tcp:// or ipc:// address, got {address!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**32:
            raise ValueError(f"rank must be an int in [0, 2**32), got {rank!r}")
        self.address = address
        self.rank = rank
        self._close_linger_s = close_linger_s
        self._context, self._socket = _open_socket(zmq.PUSH, close_linger_s)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            _close_socket(self._context, self._socket, linger_s=0)
            raise ValueError(f"address {address!r} cannot be connected to: {exc}") from None
        self._seq = 0
        self._closed = False

    def send(self, msg: Any) -> None:
        if self._closed:
            raise ChannelClosed("ResultSender is closed")
        payload = _encode(msg)
        header = _RESULT_HEADER.pack(_DATA, self.rank, self._seq)
        self._socket.send_multipart([header, payload])
        self._seq += 1

    def close(self) -> None:
        """Flush what is queued (up to `close_linger_s`), then release the socket."""
        if self._closed:
            return
        self._closed = True
        _close_socket(self._context, self._socket, self._close_linger_s)

    def __enter__(self) -> ResultSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
