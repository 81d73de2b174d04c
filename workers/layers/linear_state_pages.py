"""The state pages of a linear-attention layer (Gated DeltaNet, KDA).

A run of consecutive blocks of the one pool holds, per layer, a causal-conv window and a
recurrent state: a request's live state, or a prefix-cache checkpoint of it. A state is
indexed by the pool block id of its run's first page.

Both layers serve a step whose every row resumes its state with the same few tokens (a
speculative verification, k + 1 tokens a row) one position at a time through their
single-step kernels (`resume_token_by_token`): the recurrence a plain decode computes,
with device-side indices only, so CUDA graphs can capture it.
"""

from __future__ import annotations

import torch

from kvloom.contracts import envs
from kvloom.kernels import batch_invariant as bi
from kvloom.kernels.device_copy import to_device
from kvloom.kernels.dispatch import batch_invariant
from kvloom.workers.attention_metadata import ForwardBatch
from kvloom.workers.cache_pages import span_view
from kvloom.workers.dtypes import TORCH_DTYPES

# Longest uniform resume row served token by token (verifications are k + 1 <= 9 tokens).
MAX_SERIAL_RESUME = 9
# A mixed step goes token by token when it has at least this many rows, none longer than
# SERIAL_MAX_ROW_TOKENS: the serial kernels run one program per (row, value head) through a
# row's tokens in sequence, so they need many rows to fill the GPU and short rows to stay
# short. Both measured H200 workloads (Gated DeltaNet, gated_deltanet.py) lie inside these
# bounds; a lone long prompt (time to first token) lies outside and keeps the chunked kernels.
SERIAL_MIN_ROWS = 8
SERIAL_MAX_ROW_TOKENS = 2048


def serial_suits(rows, device: torch.device) -> bool:
    """Whether a mixed step (RowClasses `rows`) suits the serial kernels: on CUDA, for at
    least SERIAL_MIN_ROWS rows of at most SERIAL_MAX_ROW_TOKENS tokens. Any state dtype:
    outside the deterministic mode the serial kernels keep a row's state in float32
    through its tokens and round it once, when stored, as the chunked kernels do (a bf16
    state: Qwen3-Next-16l offline 27.79 s serial on an H100, against 40.71 chunked in an
    earlier H100 lease; docs/benchmarks/gpu_fast_path.md, twenty-sixth session)."""
    lens = rows.num_scheduled_tokens
    return (
        device.type == "cuda"
        and len(lens) >= SERIAL_MIN_ROWS
        and max(lens, default=0) <= SERIAL_MAX_ROW_TOKENS
    )


def mixed_step_choice(env_name: str, rows, device: torch.device) -> str:
    """The mixed-step path a linear-attention layer takes (serial, split or chunked) as the
    environment variable `env_name` picks it; auto takes serial where `serial_suits`."""
    choice = envs.get(env_name).strip().lower()
    if choice not in ("auto", "serial", "split", "chunked"):
        raise ValueError(f"{env_name} must be auto, serial, split or chunked, got {choice!r}")
    if choice != "auto":
        return choice
    return "serial" if serial_suits(rows, device) else "chunked"


def serial_rows(batch: ForwardBatch, slots: torch.Tensor | None, device: torch.device):
    """(row bounds [N+1], state pages [N], has_initial_state [N] bool) of a step's rows for
    the serial kernels (kernels/batch_invariant.py); the flags are copied to the device
    once a step and shared by the layers."""
    if slots is None:
        raise ValueError("state_indices: missing for a linear-state layer's group")
    cu = batch.query_start_loc
    cache = batch.__dict__.setdefault("_serial_has_state", {})
    if device not in cache:
        cache[device] = to_device(batch.rows.has_initial_state, torch.bool, device)
    return cu, slots[: cu.shape[0] - 1], cache[device]


def uniform_resume_len(batch: ForwardBatch, num_tokens: int) -> int | None:
    """q when every row resumes its own state with exactly q tokens, 2 <= q <= 9."""
    rows = batch.rows
    n = len(rows.kinds)
    if n == 0 or num_tokens % n:
        return None
    q = num_tokens // n
    # uniform_decode skips padding rows, but a padding row (no tokens) leaves the real
    # rows more than num_tokens / n each: such a step never passes.
    return q if 2 <= q <= MAX_SERIAL_RESUME and rows.uniform_decode(q) else None


class LinearStatePages:
    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None
    # Uniform multi-token resume rows need no host sync (`resume_token_by_token`).
    captures_uniform_resume = True

    def resume_token_by_token(self, mixed, g, beta, slots: torch.Tensor, q: int) -> torch.Tensor:
        """Rows of q tokens each, every row resuming its state: q single-step passes, pass
        j over token j of every row (device-side indices only), through the layer's own
        `_decode_all` (its single-step kernels over every row)."""
        first = torch.arange(slots.shape[0], device=mixed.device) * q
        core = None
        for j in range(q):
            index = first + j
            out = self._decode_all(mixed[index], g[index], beta[index], slots)
            if core is None:
                core = out.new_empty((mixed.shape[0], *out.shape[1:]))
            core[index] = out
        return core

    def _split_step(self, mixed, g, beta, slots, batch: ForwardBatch, min_tokens: int):
        """A mixed step in two parts: rows of more than `min_tokens` tokens through the
        layer's chunked kernels (`_chunked_rows`: work parallel over a row's tokens), every
        other row token by token through its serial ones (`_serial_all`), which skip the
        long rows (their slot -1 there). Returns the core output [T, Hv, Dv]."""
        long = batch.long_rows(mixed.device, min_tokens)
        if not long.prefill_rows:
            return self._serial_all(mixed, g, beta, slots, batch)
        if slots is None:
            raise ValueError("state_indices: missing for a linear-state layer's group")
        rows = batch.query_start_loc.shape[0] - 1
        short_slots = slots[:rows].index_fill(0, long.prefill_rows_index, -1)
        core = self._serial_all(mixed, g, beta, short_slots, batch)
        self._chunked_rows(mixed, g, beta, slots, long, core)
        return core

    def serial_conv(self, mixed, cu, slots, has_state) -> torch.Tensor:
        """The layer's causal conv over a step's rows token by token, in place on the pool
        (`serial_rows` gives the row arguments); token-parallel outside the deterministic
        mode, which keeps the one-program-a-row loop its bits were checked with (as does
        KVLOOM_SERIAL_CONV_LOOP=1)."""
        token_parallel = not batch_invariant() and not envs.flag("KVLOOM_SERIAL_CONV_LOOP")
        return bi.serial_causal_conv1d(
            mixed, self.conv1d.weight, None, self.conv_state, cu, slots, has_state,
            self.activation, token_parallel=token_parallel,
        )  # fmt: skip

    def allocate_cache(self, pages: torch.Tensor, spec) -> None:
        """Views the pool's pages: the conv window first, the recurrent state after it. A
        state larger than a page runs on over the next pages (`span_view`): the pool hands
        state groups runs of `spec.pages_per_state` consecutive pages."""
        self.conv_state = span_view(pages, TORCH_DTYPES[spec.dtype], spec.conv_state_shape)
        self.recurrent_state = span_view(
            pages, TORCH_DTYPES[spec.state_dtype], spec.recurrent_state_shape, spec.conv_bytes
        )

    def release_cache(self) -> None:
        """Drops the pages (the model runner re-allocates after its profiling run)."""
        self.conv_state = None
        self.recurrent_state = None

    def poison_cache(self, block_ids: torch.Tensor) -> None:
        self.conv_state[block_ids] = float("nan")
        self.recurrent_state[block_ids] = float("nan")

    def copy_cache(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """State checkpoints (prefix caching): page src[i] -> page dst[i]."""
        self.conv_state[dst] = self.conv_state[src]
        self.recurrent_state[dst] = self.recurrent_state[src]
