"""Step channel: order, no loss (slow joiners, unread backlogs, 1000+ messages across
processes), timeouts, clean close, typed messages, the result path, and use between Ray
actors together with a gloo group (the shape of the Ray executor's step)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from kvloom.contracts import step_channel
from kvloom.contracts.step_channel import (
    FLUSH,
    ChannelClosed,
    ChannelError,
    RawTensor,
    ResultChannel,
    ResultSender,
    StepPublisher,
    StepSubscriber,
)


class Step(msgspec.Struct):
    step_id: int
    req_ids: list[str]
    num_tokens: list[int]


class Reply(msgspec.Struct):
    rank: int
    count: int
    checksum: int


@dataclasses.dataclass
class DataclassStep:
    step_id: int
    block_ids: list[list[int]]


def make_step(i: int) -> Step:
    return Step(i, [f"req-{i}-{j}" for j in range(i % 5)], [i * 3 + j for j in range(i % 5)])


def _subscriber_process(step_address: str, result_address: str, rank: int) -> None:
    """Receive until the publisher closes; report how many arrived in order, and a checksum."""
    with (
        StepSubscriber(step_address, Step) as sub,
        ResultSender(result_address, rank=rank) as out,
    ):
        count = checksum = 0
        while True:
            try:
                msg = sub.recv(timeout=30)
            except ChannelClosed:
                break
            if msg != make_step(count):
                raise AssertionError(f"rank {rank}: message {count} was {msg}")
            count += 1
            checksum += sum(msg.num_tokens) + msg.step_id
        out.send(Reply(rank, count, checksum))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_thousand_messages_reach_every_process_in_order(transport):
    n = 1000
    ctx = multiprocessing.get_context("spawn")
    with (
        StepPublisher(2, transport=transport, ready_timeout=30) as pub,
        ResultChannel(Reply, transport=transport) as results,
    ):
        procs = [
            ctx.Process(target=_subscriber_process, args=(pub.address, results.address, r))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        # Published as one burst, starting before the processes have even connected:
        # the first publish waits for both to join, the rest must all arrive.
        for i in range(n):
            pub.publish(make_step(i))
        pub.close()
        replies = sorted((results.recv(timeout=30) for _ in procs), key=lambda r: r.rank)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    want = sum(sum(make_step(i).num_tokens) + i for i in range(n))
    assert replies == [Reply(0, n, want), Reply(1, n, want)]


@pytest.mark.timeout(30)
def test_slow_joiner_gets_the_first_message():
    pub = StepPublisher(1, ready_timeout=10)
    published = threading.Event()

    def publish_early():
        pub.publish(b"first")
        pub.publish(b"second")
        published.set()

    thread = threading.Thread(target=publish_early)
    thread.start()
    time.sleep(0.3)  # the publisher is already trying to send
    assert not published.is_set(), "publish must wait until the subscriber has joined"
    sub = StepSubscriber(pub.address)
    thread.join(timeout=10)
    assert published.is_set()
    assert sub.recv(timeout=5) == b"first"
    assert sub.recv(timeout=5) == b"second"
    pub.close()
    sub.close()


@pytest.mark.timeout(30)
def test_unread_backlog_beyond_default_high_water_mark_is_kept():
    n, payload = 5000, bytes(range(256)) * 4  # zmq's default high-water mark is 1000
    with StepPublisher(2) as pub:
        subs = [StepSubscriber(pub.address) for _ in range(2)]
        pub.wait_ready(timeout=10)
        for i in range(n):
            pub.publish(i.to_bytes(4, "little") + payload)
        for sub in subs:
            for i in range(n):
                msg = sub.recv(timeout=5)
                assert int.from_bytes(msg[:4], "little") == i and msg[4:] == payload
            sub.close()
        assert pub.num_published == n


@pytest.mark.timeout(30)
def test_recv_timeout_raises_and_channel_stays_usable():
    with StepPublisher(1) as pub, StepSubscriber(pub.address) as sub:
        pub.wait_ready(timeout=10)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="within 0.2 s"):
            sub.recv(timeout=0.2)
        elapsed = time.monotonic() - start
        assert 0.19 <= elapsed < 2.0
        with pytest.raises(TimeoutError):
            sub.recv(timeout=0)
        pub.publish(b"late")
        assert sub.recv(timeout=5) == b"late"


@pytest.mark.timeout(30)
def test_publish_times_out_while_a_subscriber_is_missing():
    with StepPublisher(2, ready_timeout=0.3) as pub, StepSubscriber(pub.address):
        with pytest.raises(TimeoutError, match="1 of 2 subscribers"):
            pub.publish(b"x")
        assert not pub.ready


@pytest.mark.timeout(30)
def test_close_delivers_pending_messages_then_signals_closed():
    pub = StepPublisher(2, transport="ipc")
    ipc_path = pub.address.removeprefix("ipc://")
    subs = [StepSubscriber(pub.address, Step) for _ in range(2)]
    for i in range(3):
        pub.publish(make_step(i))
    start = time.monotonic()
    pub.close()
    pub.close()  # idempotent
    assert time.monotonic() - start < 3.0
    assert not os.path.exists(os.path.dirname(ipc_path))
    with pytest.raises(ChannelClosed):
        pub.publish(make_step(3))
    for sub in subs:
        assert [sub.recv(timeout=5).step_id for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ChannelClosed, match="closed the channel"):
            sub.recv(timeout=5)
        with pytest.raises(ChannelClosed):  # and stays closed
            sub.recv(timeout=0)
        sub.close()
        sub.close()
        with pytest.raises(ChannelClosed, match="StepSubscriber is closed"):
            sub.recv()


@pytest.mark.timeout(30)
def test_a_lost_message_is_detected():
    with StepPublisher(1) as pub, StepSubscriber(pub.address) as sub:
        pub.publish(b"0")
        pub._seq += 1  # as if message 1 had been sent and lost on the way
        pub.publish(b"2")
        assert sub.recv(timeout=5) == b"0"
        with pytest.raises(ChannelError, match="expected message 1, got 2"):
            sub.recv(timeout=5)


@pytest.mark.timeout(30)
def test_flush_markers_keep_their_place_and_number():
    with StepPublisher(2) as pub:
        subs = [StepSubscriber(pub.address, Step) for _ in range(2)]
        try:
            pub.publish(make_step(0))
            pub.publish_flush()
            pub.publish(make_step(1))
            pub.publish(make_step(2))
            pub.publish_flush()
            assert pub.num_published == 5
            for sub in subs:
                got = [sub.recv(timeout=5) for _ in range(5)]
                assert got == [make_step(0), FLUSH, make_step(1), make_step(2), FLUSH]
                assert got[1] is FLUSH and repr(FLUSH) == "FLUSH"
        finally:
            for sub in subs:
                sub.close()
    with pytest.raises(ChannelClosed):
        pub.publish_flush()


@pytest.mark.timeout(30)
def test_structs_dataclasses_and_raw_tensors_round_trip():
    import torch

    from kvloom.workers.distributed.raw_tensor_codec import raw_to_tensor, tensor_to_raw

    with StepPublisher(1) as pub:
        plain = StepSubscriber(pub.address)
        pub.publish(DataclassStep(7, [[1, 2], [], [3]]))
        got = msgspec.msgpack.decode(plain.recv(timeout=5), type=DataclassStep)
        assert got == DataclassStep(7, [[1, 2], [], [3]])
        plain.close()

    with StepPublisher(1) as pub, StepSubscriber(pub.address, RawTensor) as sub:
        gen = torch.Generator().manual_seed(0)
        tensors = [
            torch.randn(3, 4, generator=gen, dtype=torch.float64),
            torch.randn(5, generator=gen).to(torch.bfloat16),
            torch.randint(0, 1000, (2, 3, 2), generator=gen),
            torch.rand(4, generator=gen) > 0.5,
            torch.randn(2, 3, generator=gen).t(),  # non-contiguous
            torch.empty(0, 3),
        ]
        for t in tensors:
            pub.publish(tensor_to_raw(t))
        for t in tensors:
            back = raw_to_tensor(sub.recv(timeout=5))
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back, t)
    with pytest.raises(ValueError, match="raw.data"):
        raw_to_tensor(RawTensor("float32", (2,), b"\x00" * 4))
    with pytest.raises(ValueError, match="raw.dtype"):
        raw_to_tensor(RawTensor("floaty", (1,), b"\x00" * 4))


@pytest.mark.timeout(30)
def test_result_channel_keeps_per_sender_order():
    with ResultChannel(Reply) as results:
        senders = [ResultSender(results.address, rank=r) for r in range(3)]
        for i in range(50):
            for s in senders:
                s.send(Reply(s.rank, i, 0))
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for _ in range(150):
            rank, reply = results.recv_from(timeout=5)
            assert reply.rank == rank
            seen[rank].append(reply.count)
        assert seen == {r: list(range(50)) for r in range(3)}
        with pytest.raises(TimeoutError, match="no result"):
            results.recv(timeout=0.05)
        for s in senders:
            s.close()
            with pytest.raises(ChannelClosed):
                s.send(Reply(0, 0, 0))
    with pytest.raises(ChannelClosed):
        results.recv(timeout=0)


def test_bad_arguments_name_the_field():
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(ValueError, match="num_subscribers"):
            StepPublisher(bad)
    with pytest.raises(ValueError, match="transport"):
        StepPublisher(1, transport="udp")
    with pytest.raises(ValueError, match="advertise_host"):
        StepPublisher(1, host="0.0.0.0")
    with pytest.raises(ValueError, match="address"):
        StepSubscriber("localhost:5555")
    with pytest.raises(ValueError, match="cannot be connected"):
        StepSubscriber("tcp://127.0.0.1:notaport")
    with pytest.raises(ValueError, match="cannot be connected"):
        ResultSender("tcp://127.0.0.1:notaport")
    with pytest.raises(ValueError, match="rank"):
        ResultSender("tcp://127.0.0.1:1", rank=-1)
    with StepPublisher(1) as pub, StepSubscriber(pub.address) as sub:
        with pytest.raises(ValueError, match="timeout"):
            sub.recv(timeout=-1)
        with pytest.raises(ValueError, match="msg must be bytes or a msgspec-encodable"):
            pub.publish(object())


def test_wildcard_bind_advertises_the_given_host():
    with StepPublisher(1, host="0.0.0.0", advertise_host="127.0.0.1") as pub:
        assert pub.address.startswith("tcp://127.0.0.1:")
        with StepSubscriber(pub.address) as sub:
            pub.publish(b"hi")
            assert sub.recv(timeout=5) == b"hi"


def test_control_plane_module_does_not_import_torch():
    # Load the file on its own with torch made unimportable: it must not need it.
    code = (
        "import importlib.util, sys\n"
        "sys.modules['torch'] = None\n"
        "try:\n    import torch\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('torch was not blocked')\n"
        f"spec = importlib.util.spec_from_file_location('step_channel', {step_channel.__file__!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "assert mod.StepPublisher\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# Between Ray actors: the Ray executor's step, in miniature. The driver publishes each step;
# two worker actors receive it, run an uneven all_gatherv in their gloo group, and rank 0
# answers on the result channel.


class GatherStep(msgspec.Struct):
    step_id: int
    lengths: list[int]  # rows each rank contributes


class GatherResult(msgspec.Struct):
    step_id: int
    gathered: list[int]


@pytest.mark.timeout(120)
def test_step_channel_between_ray_actors_with_a_gloo_group():
    import ray

    from kvloom.cluster.ray_local import connect_ray, shutdown_ray
    from kvloom.workers.distributed.process_group import pick_init_address

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, rank: int):
            self.rank = rank

        def join(self, init_address, step_address, result_address):
            from kvloom.workers.distributed.process_group import RankLayout, init_parallel_state

            self.state = init_parallel_state(RankLayout(2), self.rank, init_address, timeout_s=60)
            self.steps = StepSubscriber(step_address, GatherStep)
            self.results = ResultSender(result_address, rank=self.rank)
            return True

        def serve(self):
            import torch

            served = 0
            while True:
                try:
                    step = self.steps.recv(timeout=60)
                except ChannelClosed:
                    break
                n = step.lengths[self.rank]
                piece = torch.arange(n, dtype=torch.int64) + 100 * self.rank + step.step_id
                gathered = self.state.world.all_gatherv(piece)
                if self.state.is_driver_worker:
                    self.results.send(GatherResult(step.step_id, gathered.tolist()))
                served += 1
            self.steps.close()
            self.results.close()
            self.state.destroy()
            return served

    # The actors unpickle this module's message types by name: let them import it.
    job_config = ray.job_config.JobConfig(code_search_path=[os.path.dirname(__file__)])
    connect_ray(2, log_to_driver=False, job_config=job_config)  # loopback, free ports
    try:
        workers = [Worker.remote(r) for r in range(2)]
        with StepPublisher(2, ready_timeout=60) as pub, ResultChannel(GatherResult) as results:
            init_address = pick_init_address()
            joins = [w.join.remote(init_address, pub.address, results.address) for w in workers]
            assert ray.get(joins, timeout=90) == [True, True]
            serving = [w.serve.remote() for w in workers]
            steps = [GatherStep(i, [i % 3, (i * 5) % 4]) for i in range(50)]
            for step in steps:
                pub.publish(step)
                got = results.recv(timeout=30)
                want = [
                    100 * r + step.step_id + k for r in range(2) for k in range(step.lengths[r])
                ]
                assert got == GatherResult(step.step_id, want)
            pub.close()
            assert ray.get(serving, timeout=30) == [50, 50]
    finally:
        shutdown_ray()
