"""GPU time per kernel of one eager decode forward (what the CUDA graph replays), and the
achieved bandwidth of the decode GEMMs alone, on a `kvloom bench` shape.

    python benchmarks/kernel_profile.py --shape qwen3-8b --batch 1
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from kvloom import Engine, SamplingParams
from kvloom.cluster.bench import shape_dir


def gemm_bandwidth(shapes, dtype=torch.bfloat16) -> None:
    for n_in, n_out in shapes:
        x = torch.randn(1, n_in, dtype=dtype, device="cuda")
        w = torch.randn(n_out, n_in, dtype=dtype, device="cuda")
        for _ in range(3):
            F.linear(x, w)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            F.linear(x, w)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 50
        print(f"RESULT gemv_{n_in}x{n_out}_us {ms * 1e3:.1f} GBps {w.nbytes / ms / 1e6:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    gemm_bandwidth([(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)])
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(
            model=str(shape_dir(args.shape, Path(tmp))),
            dtype="bfloat16",
            load_format="dummy",
            progress=False,
            max_model_len=4096,
            max_num_seqs=args.batch,
            enforce_eager=True,
        )
        runner = engine.executor.worker.runner
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
        for i in range(args.batch):
            engine.add_request(str(i), {"prompt_token_ids": list(range(10, 138))}, params)
        for _ in range(4):
            engine.step()
        forward = runner.model.forward
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
        del forward
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        print(table[-9000:])


if __name__ == "__main__":
    main()
