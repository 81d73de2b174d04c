"""The target worker's side of a drafter in its own actor (`placement: "remote"`).

`RemoteDrafter` stands where a drafter stands on the worker (`run(DraftStep)` returns
drafts), but sends each step's DraftStep inputs to the drafter actor over zmq
(workers/spec_decode/drafter_messages.py) and waits at most `timeout_s` for its drafts.

While the drafter is unavailable (its actor died or is restarting, it answered late, it
speaks another protocol version, it failed a step) the target serves without speculation:
`run` returns no drafts, so the scheduler schedules none (and a placeholder slot under
async scheduling is verified as zero drafts and counted rejected). The first step of each
outage logs one warning. The worker then asks Ray for the actor's address without
waiting (a pending call answers once Ray restarted it) and, when it has one, sets the
drafter up again and speculates again. A drafter back from a restart has empty KV for the
tokens it missed: its drafts for those requests are worse, never wrong (the target
verifies every draft).

What the drafter reads of the target's forward, it says in DraftReady: the final hidden
states (EAGLE, MTP) and auxiliary states at capture points (EAGLE-3, DFlash: rank 0 then
hooks the target's own layers, as the in-process drafters do, aux_hidden.py), for every
token or for kept tokens only. Each DraftRequest carries exactly that.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq

from kvloom.contracts import envs
from kvloom.contracts.config import SpeculativeConfig
from kvloom.contracts.kv_cache_spec import FullAttentionSpec, MLASpec, SlidingWindowSpec
from kvloom.contracts.step_channel import RawTensor
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.spec_decode.aux_hidden import AuxHiddenCapture
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.drafter_messages import (
    DRAFTER_PROTOCOL_VERSION,
    DraftError,
    DraftReady,
    DraftReply,
    DraftRequest,
    DraftSetup,
    encoder,
    from_drafter,
    message_version,
)

logger = logging.getLogger(__name__)

# Seconds between attempts to reach the drafter again (how long one step waits for its
# drafts is KVLOOM_DRAFTER_TIMEOUT_S, contracts/envs.py).
RETRY_S = 1.0


def kept_token_index(step: DraftStep) -> list[int]:
    """The step's token indices whose results stand (DraftStep.kept_tokens), in order."""
    qsl = step.batch.query_start_loc_list
    return [t for i, n in enumerate(step.kept_tokens()) for t in range(qsl[i], qsl[i] + n)]


def raw_tensor(tensor: torch.Tensor) -> RawTensor:
    host = tensor.detach().to("cpu").contiguous()
    data = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return RawTensor(str(host.dtype).removeprefix("torch."), tuple(host.shape), data)


class _NoCacheLayers:
    """The runner lists a drafter's cache layers with the target's: here there are none
    (the drafter's KV lives in its actor)."""

    def cache_layers(self) -> list:
        return []


def drafter_group(groups) -> int:
    """The target group whose block ids the drafter's layers use: one that keeps every
    position's block (full attention or MLA; sliding-window groups free old blocks)."""
    for g, group in enumerate(groups):
        spec = group.spec
        if isinstance(spec, FullAttentionSpec | MLASpec) and not isinstance(
            spec, SlidingWindowSpec
        ):
            return g
    raise ValueError(
        "speculative_config.placement 'remote' needs a target with a full-attention (or MLA) "
        "KV-cache group; this target has none"
    )


class RemoteDrafter:
    model = _NoCacheLayers()

    def __init__(
        self, spec: SpeculativeConfig, timeout_s: float | None = None, tp=None, target=None
    ):
        """target: the worker's target model (hooked when the drafter reads auxiliary
        hidden states)."""
        self.method = spec.method
        self.target = target
        # Under tensor parallelism rank 0 talks to the drafter and shares its drafts, so
        # every rank verifies (and carries over) the same ones.
        self.tp = tp if tp is not None else LocalGroup()
        self.k = spec.num_speculative_tokens
        # What the drafter reads (its DraftReady says; nothing until it is set up).
        self.send_hidden = False
        self.kept_rows_only = False
        self.capture: AuxHiddenCapture | None = None
        self.timeout_s = envs.drafter_timeout_s() if timeout_s is None else timeout_s
        self.handle = None  # the drafter actor's Ray handle (attach)
        self.group: int | None = None
        self.block_size: int | None = None
        self.num_blocks: int | None = None
        self.available = False
        self.num_outages = 0
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._address_ref = None
        self._retry_at = 0.0
        self._step_id = 0
        self._setup_id = 0
        self._last_reason: str | None = None

    # -- the drafter interface the runner uses -----------------------------------------
    def kv_cache_specs(self, block_size: int, dtype_name: str) -> dict:
        return {}  # nothing in the target's pool

    def bind_groups(self, layer_to_group: dict[int, int]) -> None:
        pass

    def attach(self, handle) -> None:
        """The drafter actor (cluster/spec_decode/drafter_actor.py)."""
        self.handle = handle

    def kv_cache_ready(self, num_blocks: int, groups) -> None:
        """The target's pool is allocated: the drafter sizes its pages to it."""
        if self.handle is None:
            raise ValueError(
                "speculative_config.placement 'remote' needs executor='ray' (the drafter "
                "runs in a Ray actor)"
            )
        self.group = drafter_group(groups)
        self.block_size = groups[self.group].spec.block_size
        self.num_blocks = num_blocks
        if self.tp.rank == 0:
            self._reconnect(wait_s=60.0)

    def run(self, step: DraftStep) -> dict[str, list[int]]:
        drafts = self._draft(step) if self.tp.rank == 0 else {}
        if self.tp.world_size == 1:
            return drafts
        return self._share(drafts, list(step.sampled), step.input_ids.device)

    def _share(self, drafts: dict[str, list[int]], order: list[str], device) -> dict:
        """Rank 0's drafts on every rank: one row per sampled request (its draft count,
        then the drafts), zeros elsewhere, summed over the group."""
        table = torch.zeros((len(order), self.k + 1), dtype=torch.long)
        for row, rid in enumerate(order):
            got = drafts.get(rid, [])[: self.k]
            table[row, 0] = len(got)
            table[row, 1 : 1 + len(got)] = torch.tensor(got, dtype=torch.long)
        table = self.tp.all_reduce(table.to(device)).cpu().tolist()
        return {rid: row[1 : 1 + row[0]] for rid, row in zip(order, table) if row[0]}

    def _draft(self, step: DraftStep) -> dict[str, list[int]]:
        hooked = self.capture
        if not self.available and not self._reconnect():
            return {}
        if self.capture is not hooked:
            return {}  # hooks installed after this step's forward: nothing captured yet
        self._step_id += 1
        batch = step.batch
        hidden, aux = self._states(step)
        msg = DraftRequest(
            version=DRAFTER_PROTOCOL_VERSION,
            step_id=self._step_id,
            request_ids=list(step.request_ids),
            input_ids=step.input_ids.tolist(),
            positions=batch.positions.tolist(),
            query_start_loc=list(batch.query_start_loc_list),
            num_computed_tokens=batch.num_computed_tokens.tolist(),
            decode_only=batch.decode_only,
            block_ids={rid: ids[self.group] for rid, ids in step.block_ids.items()},
            drafts=step.drafts,
            sampled=step.sampled,
            finished=list(step.finished),
            num_tokens=step.num_tokens,
            hidden=hidden,
            next_tokens=step.next_tokens,
            aux_hidden=aux,
            kept_rows_only=self.kept_rows_only,
        )
        reply = self._exchange(msg, self.timeout_s)
        if isinstance(reply, DraftReply):
            return reply.drafts
        return {}

    def _states(self, step: DraftStep) -> tuple[RawTensor | None, RawTensor | None]:
        """This step's final and auxiliary hidden states, as much as the drafter reads."""
        rows = None
        if self.kept_rows_only:
            index = kept_token_index(step)
            rows = torch.tensor(index, dtype=torch.long, device=step.input_ids.device)

        def pick(tensor: torch.Tensor) -> RawTensor:
            return raw_tensor(tensor if rows is None else tensor[rows])

        hidden = pick(step.hidden) if self.send_hidden else None
        aux = None
        if self.capture is not None:
            aux = pick(torch.cat(self.capture.take(), dim=-1))
        return hidden, aux

    def _adopt(self, ready: DraftReady) -> None:
        """Sends what this drafter reads; hooks the target where it reads auxiliary
        states (once: a restarted drafter of the same head reads the same points)."""
        self.send_hidden = ready.reads_hidden
        self.kept_rows_only = ready.kept_rows_only
        points = list(ready.aux_points)
        if self.capture is not None and self.capture.points == points:
            return
        if self.capture is not None:
            self.capture.remove()
            self.capture = None
        if points:
            if self.target is None:
                raise ValueError(
                    "speculative_config.placement 'remote': the drafter reads auxiliary "
                    "hidden states but this worker has no target model to capture them from"
                )
            self.capture = AuxHiddenCapture(
                self.target, points, f"speculative_config.model ({self.method})"
            )

    # -- the channel -------------------------------------------------------------------
    def _exchange(self, msg, timeout_s: float):
        """Sends `msg` and returns its answer, or None after marking the drafter lost."""
        self._socket.send(encoder.encode(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._socket.poll(int(left * 1000) + 1):
                self._lost(f"no answer within {timeout_s:g} s")
                return None
            payload = self._socket.recv()
            version = message_version(payload)
            if version != DRAFTER_PROTOCOL_VERSION:
                self._lost(
                    f"it speaks protocol version {version!r}, this worker "
                    f"{DRAFTER_PROTOCOL_VERSION}"
                )
                return None
            reply = from_drafter.decode(payload)
            if isinstance(reply, DraftError):
                self._lost(reply.message)
                return None
            if isinstance(msg, DraftRequest) and isinstance(reply, DraftReply):
                if reply.step_id == msg.step_id:
                    return reply
                continue  # a late answer to a step already served without drafts
            ready = isinstance(msg, DraftSetup) and isinstance(reply, DraftReady)
            if ready and reply.setup_id == msg.setup_id:
                return reply
            # anything else is left over from before: skip it

    def _lost(self, reason: str) -> None:
        if self.available or self._last_reason is None:
            self.num_outages += 1
            logger.warning(
                "the remote drafter is unavailable (%s): serving without speculation "
                "until it is back",
                reason,
            )
        self.available = False
        self._last_reason = reason
        self._close_socket()
        self._retry_at = time.monotonic() + RETRY_S

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def _reconnect(self, wait_s: float = 0.0) -> bool:
        """Asks Ray for the actor's address without blocking the step (or for up to
        `wait_s` at start); with one, sets the drafter up. True when it is available."""
        import ray

        if self.handle is None or self.num_blocks is None or time.monotonic() < self._retry_at:
            return False  # not attached, or the target's pool not allocated yet
        if self._address_ref is None:
            self._address_ref = self.handle.address.remote()
        ready, _ = ray.wait([self._address_ref], timeout=wait_s)
        if not ready:
            if wait_s:
                self._lost(f"its actor did not answer within {wait_s:g} s")
            return False
        ref, self._address_ref = self._address_ref, None
        try:
            address = ray.get(ref)
        except Exception as exc:  # the actor died for good, or failed to load
            self._lost(f"its actor is gone: {type(exc).__name__}")
            return False
        self._close_socket()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._setup_id += 1
        setup = DraftSetup(
            version=DRAFTER_PROTOCOL_VERSION,
            setup_id=self._setup_id,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_speculative_tokens=self.k,
        )
        ready = self._exchange(setup, max(self.timeout_s, 10.0))
        if ready is None:
            return False
        self._adopt(ready)
        if self._last_reason is not None:
            logger.warning("the remote drafter is back at %s: speculating again", address)
        self.available = True
        self._last_reason = None
        return True

    def close(self) -> None:
        self._close_socket()
        if self.capture is not None:
            self.capture.remove()
            self.capture = None
