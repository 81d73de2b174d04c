"""The worker as a Ray actor: one per device, in a placement-group bundle.

Ray starts it, and Ray calls set it up (load, KV sizing) and health-check it. Steps do not
travel as Ray calls: `run_loop` reads each SchedulerOutput from the zmq step channel, runs
it, and world rank 0 (the driver worker, which samples) sends the ModelRunnerOutput back
over the result channel.
"""

from __future__ import annotations

import socket

import torch

from kvloom.contracts import envs
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.gc_freeze import freeze_startup_objects
from kvloom.contracts.kv_cache_plan import KVCacheMemory, KVCachePlan, KVCacheSpecs
from kvloom.contracts.scheduler_output import GrammarBitmasks, SchedulerOutput
from kvloom.contracts.step_channel import FLUSH, ChannelClosed, ResultSender, StepSubscriber
from kvloom.workers.distributed.process_group import (
    RankLayout,
    init_parallel_state,
    is_loopback_host,
    loopback_init_address,
)
from kvloom.workers.worker import Worker


def free_port() -> int:
    """A TCP port free on every interface (a multi-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorkerActor:
    def __init__(self, config: EngineConfig, rank: int, use_gpu: bool, progress: bool = False):
        self.config = config
        self.progress = progress
        self.rank = rank
        self.use_gpu = use_gpu
        self.layout = RankLayout(
            config.parallel.tensor_parallel_size, config.parallel.decode_context_parallel_size
        )
        if not use_gpu:
            # One CPU slot per rank: keep torch from oversubscribing the cores.
            torch.set_num_threads(max(1, int(envs.get("KVLOOM_WORKER_THREADS"))))
        self.worker: Worker | None = None

    def node_address(self) -> str:
        """An address for torch.distributed to rendezvous at: a tcp:// port on this actor's
        node, or, on a loopback node (the embedded local Ray, one machine), a file store,
        so nothing listens beyond 127.0.0.1 (invariant 12)."""
        import ray

        host = ray.util.get_node_ip_address()
        if is_loopback_host(host):
            return loopback_init_address()
        return f"tcp://{host}:{free_port()}"

    def setup(self, init_address: str) -> None:
        device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        parallel = init_parallel_state(self.layout, self.rank, init_address, device)
        self.worker = Worker(self.config, parallel, progress=self.progress, device=device)

    def kv_cache_specs(self) -> KVCacheSpecs:
        return self.worker.kv_cache_specs()

    def available_kv_memory(self, plan: KVCachePlan) -> KVCacheMemory:
        return self.worker.available_kv_memory(plan)

    def initialize_kv_cache(self, plan: KVCachePlan, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(plan, num_blocks)
        freeze_startup_objects()  # the worker process is fully built now

    def attach_drafter(self, handle) -> None:
        """speculative_config.placement "remote": the drafter actor this rank drafts with."""
        self.worker.runner.draft.attach(handle)

    def health(self) -> bool:
        return self.worker is not None

    def run_loop(self, step_address: str, result_address: str) -> int:
        """Runs steps until the scheduler closes the channel; returns the steps run.

        Steps are pipelined as the in-process engine pipelines them under async
        scheduling: each step is launched on the runner when it arrives, and the step
        before it is read back (rank 0 sends its output) only after that, so step N+1 is
        queued on the device behind N and reads N's sampled ids there. A flush marker
        (the scheduler waits for the newest step and sends nothing after it) reads back
        the step still open, so a scheduler waiting for a result always gets it. A step
        that completed on the host inside `submit` (speculative decoding) is sent at
        once, in order after the open one. A step whose grammar masks follow
        (`GrammarBitmasks`, a side message) samples when they arrive, before the next step
        or flush marker. Every rank gets the same messages and so launches the same steps in the same order
        (their collectives match)."""
        subscriber = StepSubscriber(
            step_address, msg_type=SchedulerOutput, side_type=GrammarBitmasks
        )
        sender = ResultSender(result_address, rank=self.rank) if self.rank == 0 else None
        steps = 0
        open_step = None  # launched, not read back yet
        try:
            while True:
                try:
                    msg = subscriber.recv()
                except ChannelClosed:
                    return steps
                if isinstance(msg, GrammarBitmasks):
                    # The open step's grammar masks: it samples now and stays open.
                    self.worker.supply_bitmasks(msg)
                    continue
                launched = None
                if msg is not FLUSH:
                    launched = self.worker.submit(msg)
                    steps += 1
                if open_step is not None:
                    out = open_step.result()
                    if sender is not None:
                        sender.send(out)
                open_step = launched
                if open_step is not None and open_step.ready is not None:
                    # Finished on the host already (a speculative step verifies and
                    # proposes within submit): send it now, so the scheduler's update
                    # overlaps the next step instead of waiting behind it.
                    if sender is not None:
                        sender.send(open_step.ready)
                    open_step = None
        finally:
            subscriber.close()
            if sender is not None:
                sender.close()
            if self.worker is not None and self.worker.parallel is not None:
                self.worker.parallel.destroy()
