"""Messages between a target worker and a remote drafter (`placement: "remote"`).

One zmq channel per target worker: the worker's DEALER socket connects to the drafter
actor's ROUTER socket. Every message carries `version` (DRAFTER_PROTOCOL_VERSION); a side
that reads another version answers `DraftError` and the target serves without speculation.
Messages are msgspec Structs encoded as msgpack, tagged so one decoder reads them all; a
tensor travels as `RawTensor` (contracts/step_channel.py). Nothing is pickled.

    target ── DraftSetup ──────► drafter   (on every (re)connect: the cache to allocate)
           ◄─ DraftReady ───────
           ── DraftRequest ────► drafter   (each step with sampled rows: DraftStep's inputs)
           ◄─ DraftReply ──────            (same step_id; a late reply is dropped)
           ◄─ DraftError ──────            (bad version, not set up, a failed step)
"""

from __future__ import annotations

import msgspec

from kvloom.contracts.step_channel import RawTensor

# Bump on any change to the messages below.
DRAFTER_PROTOCOL_VERSION = 2


class DraftSetup(msgspec.Struct, tag=True):
    version: int
    setup_id: int
    num_blocks: int  # pages to allocate per drafter layer (the target's pool size)
    block_size: int  # tokens per block of the target group whose block ids are sent
    num_speculative_tokens: int


class DraftReady(msgspec.Struct, tag=True):
    version: int
    setup_id: int
    # What the drafter reads of each target forward, so the worker sends only that:
    # the final hidden states, and the auxiliary states at these capture points
    # (workers/spec_decode/aux_hidden.py numbering, in the order the drafter fuses them).
    reads_hidden: bool = False
    aux_points: list[int] = []
    # True: it reads those states at kept tokens only (rejected drafts' rows not sent).
    kept_rows_only: bool = False


class DraftRequest(msgspec.Struct, tag=True):
    """What DraftStep holds, as plain data (workers/spec_decode/drafter.py)."""

    version: int
    step_id: int
    request_ids: list[str]  # the step's rows, in batch order
    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    num_computed_tokens: list[int]  # per row, before this step
    decode_only: bool
    block_ids: dict[str, list[int]]  # per scheduled request: its block ids (one group)
    drafts: dict[str, list[int]]  # drafts verified this step
    sampled: dict[str, list[int]]  # emitted tokens: accepted drafts + the target's own
    finished: list[str]
    num_tokens: dict[str, int]  # per sampled request: its tokens before this step's emitted
    hidden: RawTensor | None  # the target's hidden state per input token (EAGLE heads)
    # Rows that did not sample: the prompt token after their chunk (DraftStep.next_tokens).
    next_tokens: dict[str, int] = {}
    # The auxiliary states at DraftReady.aux_points, concatenated along the last dim
    # (EAGLE-3, DFlash).
    aux_hidden: RawTensor | None = None
    # True: `hidden` and `aux_hidden` hold rows of the kept tokens only, in batch order
    # (DraftStep.kept_tokens: a row's real tokens and accepted drafts).
    kept_rows_only: bool = False


class DraftReply(msgspec.Struct, tag=True):
    version: int
    step_id: int
    drafts: dict[str, list[int]]


class DraftError(msgspec.Struct, tag=True):
    version: int
    message: str


ToDrafter = DraftSetup | DraftRequest
FromDrafter = DraftReady | DraftReply | DraftError

encoder = msgspec.msgpack.Encoder()
to_drafter = msgspec.msgpack.Decoder(ToDrafter)
from_drafter = msgspec.msgpack.Decoder(FromDrafter)


def message_version(payload: bytes) -> int | None:
    """The `version` field of any message, read without its schema (an incompatible peer
    may have changed the rest); None when the payload is not a message at all."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    version = raw.get("version") if isinstance(raw, dict) else None
    return version if isinstance(version, int) else None
