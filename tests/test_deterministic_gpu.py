"""`deterministic=True` on the GPU in bfloat16 (CUDA graphs on): 16 probe prompts give the
same greedy and seeded tokens alone, among 200 others, under chunked prefill, with
prefix-cache hits and with forced preemption, for a dense model and for Qwen3-Next."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels.dispatch import set_batch_invariant
from tests.test_llm_deterministic import (
    assert_all_schedules_agree,
    probe_prompts,
    run_probe_schedules,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GPU_SETTINGS = dict(dtype="bfloat16", device="cuda", block_size=16, max_num_seqs=64, progress=False)


@pytest.mark.parametrize("arch,blocks", [("qwen3", 160), ("qwen3_next", 160)])
def test_gpu_probes_identical_alone_batched_chunked_cached_preempted(
    arch, blocks, tiny_model, hybrid_model
):
    path = str(tiny_model("qwen3") if arch == "qwen3" else hybrid_model("qwen3_next"))
    probes = probe_prompts(16, 200, seed=11, length=(8, 80))
    others = probe_prompts(200, 200, seed=12, length=(8, 120))  # issue 23: 200 others
    try:
        results, preemptions, _ = run_probe_schedules(path, probes, others, GPU_SETTINGS, blocks)
    finally:
        set_batch_invariant(False)
    print(f"{arch}: preemptions={preemptions}")
    assert preemptions > 0, "the small pool did not preempt: the schedule tests nothing"
    assert_all_schedules_agree(results)
