"""The drafter of `speculative_config.placement = "remote"`, in a process of its own.

`DrafterService` holds a drafter built by the one factory (draft model, EAGLE head, and any
method whose drafter implements `run(DraftStep)` on attention-only layers) and answers the
target worker's messages (workers/spec_decode/drafter_messages.py): `DraftSetup` allocates
its KV pages, one page per pool block for each of its layers, indexed by the block ids of
one of the target's attention groups (those cover every position of a request, lookahead
slots included); each `DraftRequest` is rebuilt into a DraftStep and run as the target's
workers would run it in process.

Hidden-state drafters read what the target computed this step: `DraftReady` tells the
worker what to send (final hidden states for EAGLE and MTP, auxiliary states at the capture
points for EAGLE-3 and DFlash), and each request carries them as RawTensors, for kept
tokens only where the drafter reads no others. Heads that share the target's embedding and
LM head (and MTP, whose layer is the target checkpoint's own `mtp.*` tensors) get those
parts of the target only, never its decoder layers (target_parts.py). At start the service
drafts one made-up request on scratch pages, so a drafter that reads a part of the target
this actor lacks fails then, naming it, not at the target's first step.

`DrafterActor` is the Ray actor around it (started by cluster/spec_decode/drafter_actor.py):
it loads the drafter in its constructor, so a restart by Ray loads it again, and serves a
zmq ROUTER socket from a thread of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import torch
import zmq

from kvloom.contracts import envs
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
from kvloom.workers.cache_pages import pages_for
from kvloom.workers.distributed.process_group import is_loopback_host
from kvloom.workers.dtypes import TORCH_DTYPES
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.row_kinds import RowClasses, classify_rows
from kvloom.workers.spec_decode.aux_hidden import ReceivedAuxHidden
from kvloom.workers.spec_decode.draft_model import DRAFT_LAYER_OFFSET
from kvloom.workers.spec_decode.drafter import DraftStep
from kvloom.workers.spec_decode.drafter_messages import (
    DRAFTER_PROTOCOL_VERSION,
    DraftError,
    DraftReady,
    DraftReply,
    DraftRequest,
    DraftSetup,
    encoder,
    message_version,
    to_drafter,
)
from kvloom.workers.spec_decode.factory import build_drafter
from kvloom.workers.spec_decode.remote_drafter import kept_token_index, raw_tensor
from kvloom.workers.spec_decode.target_parts import MissingTargetPart, load_target_parts

logger = logging.getLogger(__name__)

# Methods whose drafter reads parts of the target (embedding, LM head, config; MTP's layer
# kind): the actor loads those parts only (target_parts.py).
TARGET_WEIGHT_METHODS = ("eagle", "eagle3", "mtp", "dflash")
# Methods whose drafter reads the target's states at every token of the step, rejected
# drafts included (EAGLE's catch-up runs over all of them); the others read kept tokens.
ALL_ROWS_METHODS = ("eagle",)


def tensor_from_raw(raw, device) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw.data), dtype=torch.uint8)
    return flat.view(TORCH_DTYPES[raw.dtype]).view(*raw.shape).to(device)


class DrafterService:
    def __init__(self, config: EngineConfig, device: torch.device):
        spec = config.speculative
        self.device = device
        self.dtype_name = config.model.torch_dtype_name
        target = None
        if spec.method in TARGET_WEIGHT_METHODS:
            target = load_target_parts(config.model, device)
        local = dataclasses.replace(spec, placement="local")
        vocab = int(config.model.text_config["vocab_size"])
        dtype = TORCH_DTYPES[self.dtype_name]
        try:
            self.drafter = build_drafter(
                local, target, dtype, LocalGroup(), device, vocab, False, target_config=config.model
            )
        except MissingTargetPart as exc:
            raise ValueError(f"speculative_config.placement 'remote': {exc}") from None
        if self.drafter is None:
            raise ValueError(
                f"speculative_config.placement 'remote': method {spec.method!r} has no "
                "drafter model to place (use placement 'local')"
            )
        self.k = spec.num_speculative_tokens
        # Refused at start: layers that keep per-request state need the target's state pages.
        specs = self.drafter.kv_cache_specs(16, self.dtype_name)
        other = sorted({type(s).__name__ for s in specs.values() if not _attention(s)})
        if other:
            raise ValueError(
                f"speculative_config.placement 'remote' needs a drafter of attention layers; "
                f"{spec.model} has {', '.join(other)} layers (use placement 'local')"
            )
        self.method = spec.method
        self.aux: ReceivedAuxHidden | None = None
        capture = getattr(self.drafter, "capture", None)
        if capture is not None:  # hooks on this copy of the target, which never runs
            capture.remove()
            self.aux = ReceivedAuxHidden(capture.points)
            self.drafter.capture = self.aux
        self.reads_hidden = _reads_final_hidden(self.drafter, spec.method, target)
        self.hidden_size = int(config.model.text_config["hidden_size"])
        self.block_size: int | None = None
        self.groups: list[KVCacheGroup] = []
        try:
            self.trial_step()
        except MissingTargetPart as exc:
            raise ValueError(f"speculative_config.placement 'remote': {exc}") from None

    def ready_message(self, setup_id: int) -> DraftReady:
        reads_states = self.reads_hidden or self.aux is not None
        return DraftReady(
            DRAFTER_PROTOCOL_VERSION,
            setup_id,
            reads_hidden=self.reads_hidden,
            aux_points=list(self.aux.points) if self.aux is not None else [],
            kept_rows_only=reads_states and self.method not in ALL_ROWS_METHODS,
        )

    def setup(self, msg: DraftSetup) -> DraftReady:
        """Allocates zeroed pages for every drafter layer; all of them read the block
        table of group 0, the target group whose block ids the requests carry."""
        specs = self.drafter.kv_cache_specs(msg.block_size, self.dtype_name)
        for layer in self.drafter.model.cache_layers():
            layer_spec = specs[DRAFT_LAYER_OFFSET + layer.layer_index]
            layer.allocate_cache(pages_for(layer_spec, msg.num_blocks, self.device), layer_spec)
        self.drafter.bind_groups(dict.fromkeys(specs, 0))
        some = next(iter(specs.values()))
        group_spec = FullAttentionSpec(
            msg.block_size, some.num_kv_heads, some.head_size, self.dtype_name
        )
        self.groups = [KVCacheGroup(spec=group_spec, layer_names=[])]
        self.block_size = msg.block_size
        self.k = msg.num_speculative_tokens
        if hasattr(self.drafter, "history"):
            self.drafter.history.clear()  # positions from before a reconnect mean nothing
        return self.ready_message(msg.setup_id)

    def trial_step(self) -> None:
        """Drafts one made-up request (a 2-token prompt that just sampled) on scratch
        pages, as a step of the target would, then forgets it: the next DraftSetup
        allocates fresh pages and clears what the drafter kept."""
        n, block_size = 2, 16
        blocks = list(range(1, 2 + (n + self.k) // block_size))  # block 0 is the null block
        ready = self.setup(
            DraftSetup(DRAFTER_PROTOCOL_VERSION, 0, len(blocks) + 1, block_size, self.k)
        )
        dtype = TORCH_DTYPES[self.dtype_name]

        def zeros(width: int):
            return raw_tensor(torch.zeros(n, width, dtype=dtype))

        msg = DraftRequest(
            version=DRAFTER_PROTOCOL_VERSION,
            step_id=0,
            request_ids=["trial"],
            input_ids=list(range(n)),
            positions=list(range(n)),
            query_start_loc=[0, n],
            num_computed_tokens=[0],
            decode_only=False,
            block_ids={"trial": blocks},
            drafts={},
            sampled={"trial": [n]},
            finished=[],
            num_tokens={"trial": n},
            hidden=zeros(self.hidden_size) if ready.reads_hidden else None,
            aux_hidden=zeros(len(ready.aux_points) * self.hidden_size)
            if ready.aux_points
            else None,
            kept_rows_only=ready.kept_rows_only,
        )
        self.draft(msg)
        self.block_size = None
        self.groups = []

    def _slots(self, block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]

    def draft(self, msg: DraftRequest) -> DraftReply:
        dev = self.device
        qsl = msg.query_start_loc
        computed = msg.num_computed_tokens
        row_lens = [qsl[i + 1] - qsl[i] for i in range(len(msg.request_ids))]
        seq_lens = [c + n for c, n in zip(computed, row_lens)]
        rows = [msg.block_ids[rid] for rid in msg.request_ids]
        width = max((len(r) for r in rows), default=0)
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
        slots = [
            s
            for i, r in enumerate(rows)
            for s in self._slots(r, self.block_size, computed[i], seq_lens[i])
        ]
        meta = GroupMetadata(table.to(dev), torch.tensor(slots, dtype=torch.long, device=dev))
        batch = ForwardBatch(
            positions=torch.tensor(msg.positions, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            num_computed_tokens=torch.tensor(computed, dtype=torch.int32, device=dev),
            query_start_loc_list=list(qsl),
            seq_lens_list=seq_lens,
            rows=RowClasses(classify_rows(computed, row_lens), row_lens),
            groups=[meta],
            decode_only=msg.decode_only,
        )
        step = DraftStep(
            request_ids=list(msg.request_ids),
            input_ids=torch.tensor(msg.input_ids, dtype=torch.long, device=dev),
            batch=batch,
            hidden=torch.empty(0, device=dev),
            drafts=msg.drafts,
            sampled=msg.sampled,
            finished=list(msg.finished),
            block_ids={rid: [ids] for rid, ids in msg.block_ids.items()},
            num_tokens=msg.num_tokens,
            slots_fn=self._slots,
            groups=self.groups,
            k=self.k,
            next_tokens=msg.next_tokens,
        )
        self._receive_states(msg, step)
        with torch.inference_mode():
            drafts = self.drafter.run(step)
        return DraftReply(DRAFTER_PROTOCOL_VERSION, msg.step_id, drafts)

    def _receive_states(self, msg: DraftRequest, step: DraftStep) -> None:
        """Puts the shipped target states where the drafter reads them: `step.hidden`
        and the auxiliary capture, one row per input token (rows of rejected drafts,
        never read, are zeros when only kept rows travelled)."""
        rows = None
        if msg.kept_rows_only:
            rows = torch.tensor(kept_token_index(step), dtype=torch.long, device=self.device)

        def full(raw, field: str) -> torch.Tensor:
            got = tensor_from_raw(raw, self.device)
            want = len(msg.input_ids) if rows is None else len(rows)
            if got.dim() != 2 or got.shape[0] != want:
                raise ValueError(
                    f"DraftRequest.{field}: shape {list(got.shape)}, expected {want} rows"
                )
            if rows is None:
                return got
            out = torch.zeros(len(msg.input_ids), got.shape[1], dtype=got.dtype, device=got.device)
            out[rows] = got
            return out

        if msg.hidden is not None:
            step.hidden = full(msg.hidden, "hidden")
        elif self.reads_hidden:
            raise ValueError("DraftRequest.hidden: missing (this drafter reads it)")
        if self.aux is not None:
            if msg.aux_hidden is None:
                raise ValueError("DraftRequest.aux_hidden: missing (this drafter reads it)")
            states = full(msg.aux_hidden, "aux_hidden")
            parts = len(self.aux.points)
            if states.shape[1] % parts:
                raise ValueError(
                    f"DraftRequest.aux_hidden: width {states.shape[1]} does not split into "
                    f"{parts} states"
                )
            self.aux.put(list(states.chunk(parts, dim=-1)))

    def handle(self, payload: bytes):
        """One message in, its answer out (never raises: a failure is a DraftError)."""
        version = message_version(payload)
        if version != DRAFTER_PROTOCOL_VERSION:
            return DraftError(
                DRAFTER_PROTOCOL_VERSION,
                f"protocol version {version!r}; this drafter speaks {DRAFTER_PROTOCOL_VERSION}",
            )
        try:
            msg = to_drafter.decode(payload)
            if isinstance(msg, DraftSetup):
                return self.setup(msg)
            if self.block_size is None:
                return DraftError(DRAFTER_PROTOCOL_VERSION, "not set up (no DraftSetup yet)")
            return self.draft(msg)
        except Exception as exc:  # the target serves on without drafts; say why
            logger.exception("drafter step failed")
            return DraftError(DRAFTER_PROTOCOL_VERSION, f"{type(exc).__name__}: {exc}")


def _reads_final_hidden(drafter, method: str, target) -> bool:
    """Whether the drafter reads the target's final hidden states (`DraftStep.hidden`):
    EAGLE and MTP heads do, EAGLE-3 does not, DFlash where a target layer id is the
    last layer's (read after the final norm)."""
    if method in ("eagle", "mtp"):
        return True
    if method == "dflash":
        return target.config["num_hidden_layers"] in drafter.points
    return False


def _attention(spec) -> bool:
    return isinstance(spec, FullAttentionSpec | SlidingWindowSpec)


def serve_socket(service: DrafterService, host: str, started: threading.Event, out: dict):
    """Binds a ROUTER socket on `host` (a free port) and answers until `out["stop"]`."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{host}")
    out["address"] = f"tcp://{host}:{port}"
    started.set()
    try:
        while not out.get("stop"):
            if not sock.poll(200):
                continue
            identity, payload = sock.recv_multipart()
            reply = service.handle(payload)
            sock.send_multipart([identity, encoder.encode(reply)])
    finally:
        sock.close(0)
        context.term()


class DrafterActor:
    """Ray actor body: loads the drafter, serves it on a zmq socket. Construction never
    raises (Ray would report it as the actor dying); `ready()` raises what went wrong."""

    def __init__(self, config: EngineConfig, use_gpu: bool):
        self.error: BaseException | None = None
        self.state: dict = {}
        if not use_gpu:
            torch.set_num_threads(max(1, int(envs.get("KVLOOM_WORKER_THREADS"))))
        device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        try:
            service = DrafterService(config, device)
        except Exception as exc:
            self.error = exc
            return
        self.service = service
        import ray

        host = ray.util.get_node_ip_address()
        if is_loopback_host(host):
            host = "127.0.0.1"  # invariant 12: a local drafter listens on loopback only
        started = threading.Event()
        self.thread = threading.Thread(
            target=serve_socket, args=(service, host, started, self.state), daemon=True
        )
        self.thread.start()
        started.wait(30)

    def ready(self) -> bool:
        if self.error is not None:
            raise self.error
        return True

    def address(self) -> str:
        self.ready()
        return self.state["address"]

    def pid(self) -> int:
        return os.getpid()

    def target_parameters(self) -> dict[str, int]:
        """Name -> element count of every tensor of the target this actor holds (none
        for a draft model): what the placement costs beside the drafter's own weights."""
        self.ready()
        target = getattr(self.service.drafter, "target", None)
        if target is None:
            return {}
        return {name: p.numel() for name, p in target.named_parameters()}
