"""KV-cache sizing on CUDA from a profiling run.

The pool gets what is left of `gpu_memory_utilization × total memory` after the weights,
the peak activation memory of the largest step the scheduler may send, memory outside
torch's allocator (CUDA context, communicators, other processes on the device) and a
margin for CUDA graphs. The peak is measured, not guessed: one forward of
`max_num_batched_tokens` fresh prompt tokens spread over `max_num_seqs` rows (the widest
logits) runs over a temporary cache, and the allocator's high-water mark is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.workers.input_batch import CachedRequestState

GiB = 2**30
MiB = 2**20
CUDA_GRAPH_MARGIN = 512 * MiB
# Speculation adds (rows, k) verification graphs and a drafter's proposal and catch-up
# graphs: on an H200 (Qwen3-8B shape, 64 rows, k = 4) capture took 622 MiB with n-gram and
# 772 MiB with a one-layer draft model, against 512 MiB for the margin above.
SPECULATIVE_GRAPH_MARGIN = 1024 * MiB


def graph_margin(captures_graphs: bool, speculative: bool) -> int:
    """What the KV pool leaves for CUDA-graph capture."""
    if not captures_graphs:
        return 0
    return SPECULATIVE_GRAPH_MARGIN if speculative else CUDA_GRAPH_MARGIN


logger = logging.getLogger(__name__)


def report_graph_memory(used: int, margin: int = CUDA_GRAPH_MARGIN) -> None:
    """Logs what capturing the CUDA graphs (decode, verification, drafter proposal and
    catch-up graphs) took from the device, and warns when it exceeds the margin the KV pool
    was sized to leave: the pool was planned first, so the overrun comes out of the
    memory `gpu_memory_utilization` meant to keep free."""
    if used > margin:
        logger.warning(
            "CUDA graphs took %d MiB, more than the %d MiB margin left beside the KV cache; "
            "if the device runs out of memory, lower gpu_memory_utilization or "
            "max_num_seqs (the largest graph)",
            used // MiB,
            margin // MiB,
        )
    else:
        logger.info("CUDA graphs took %d MiB of the %d MiB margin", used // MiB, margin // MiB)


@dataclass
class ProfileStep:
    """The two fields of a SchedulerOutput that `ModelRunner.build_batch` reads."""

    num_scheduled_tokens: dict[str, int]
    scheduled_spec_token_ids: dict


@dataclass
class MemoryProfile:
    total: int
    weights: int
    activations: int
    outside_torch: int
    graph_margin: int
    utilization: float

    @property
    def kv_budget(self) -> int:
        used = self.weights + self.activations + self.outside_torch + self.graph_margin
        return int(self.total * self.utilization) - used

    def describe(self) -> str:
        return (
            f"total {self.total / GiB:.2f} GiB × gpu_memory_utilization {self.utilization} "
            f"= {self.total * self.utilization / GiB:.2f} GiB; weights {self.weights / GiB:.2f} "
            f"GiB, activation peak {self.activations / GiB:.2f} GiB, outside torch "
            f"{self.outside_torch / GiB:.2f} GiB, CUDA-graph margin "
            f"{self.graph_margin / GiB:.2f} GiB"
        )


def _dummy_requests(runner, num_tokens: int, num_rows: int) -> tuple[ProfileStep, int]:
    """Fresh prompt rows covering `num_tokens`, and the size of the temporary pool they
    need (block 0 stays the null block). Every row writes the same pages: the values are
    meaningless, the activation peak is the real one, and the pool stays small (a state
    page per row would cost gigabytes on a hybrid model at hundreds of rows)."""
    lengths = [num_tokens // num_rows + (i < num_tokens % num_rows) for i in range(num_rows)]
    block_ids, next_block = [], 1
    for group in runner.groups:
        if isinstance(group.spec, LinearStateSpec):
            count = 1
        else:
            count = -(-max(lengths) // group.spec.block_size)
        block_ids.append(list(range(next_block, next_block + count)))
        next_block += count
    step = ProfileStep({}, {})
    for i, length in enumerate(lengths):
        rid = f"__profile_{i}"
        runner.input_batch.requests[rid] = CachedRequestState(
            request_id=rid,
            token_ids=[(7 * t + i) % 100 + 1 for t in range(length)],
            num_prompt_tokens=length,
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
            sampling_seed=0,
            block_ids=[list(ids) for ids in block_ids],
            num_computed_tokens=0,
        )
        step.num_scheduled_tokens[rid] = length
    return step, next_block


@torch.inference_mode()
def run_largest_step(runner, num_tokens: int, num_rows: int) -> int:
    """One forward + sampling of `num_tokens` fresh tokens over `num_rows` rows, over a
    temporary cache that is released afterwards (as are the dummy requests). Returns the
    temporary pool's block count."""
    step, num_blocks = _dummy_requests(runner, num_tokens, num_rows)
    try:
        runner.initialize_kv_cache(num_blocks, capture_graphs=False)
        input_ids, batch, sample_rows = runner.build_batch(step)
        hidden = runner.model(input_ids, batch.positions, batch)
        runner.sample_tokens(hidden, sample_rows)
    finally:
        for rid in step.num_scheduled_tokens:
            runner.input_batch.requests.pop(rid, None)
        runner.release_kv_cache()
    return num_blocks


def largest_step_shape(sched) -> tuple[int, int]:
    """(tokens, rows): the token budget over enough rows for the widest logits, and no row
    longer than max_model_len."""
    num_tokens = sched.max_num_batched_tokens
    rows = max(min(sched.max_num_seqs, num_tokens), -(-num_tokens // sched.max_model_len), 1)
    return num_tokens, rows


def profile_memory(runner, graph_margin: int) -> MemoryProfile:
    """Runs the largest step once and reports where the device's memory goes. The
    temporary cache is counted out of the peak (it is the KV budget's to spend)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens, num_rows = largest_step_shape(runner.config.scheduler)
    cache_bytes = run_largest_step(runner, num_tokens, num_rows) * runner.bytes_per_block()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(
        total=total,
        weights=weights,
        activations=max(0, peak - weights - cache_bytes),
        outside_torch=max(0, total - free - torch.cuda.memory_reserved(device)),
        graph_margin=graph_margin,
        utilization=runner.config.cache.gpu_memory_utilization,
    )
