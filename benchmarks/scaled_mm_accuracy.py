"""Where cuBLAS's blockwise FP8 GEMM loses accuracy (issue 22 follow-up): torch._scaled_mm
with 1x128 activation scales and 128x128 weight scales on Hopper, against the float64
product of the same quantized operands and beside kvloom's Triton GEMM.

On the H200 its float32 output was 4.4e-3 to 8.7e-3 of the output scale away from the
exact product on stress inputs (weights near e4m3's range, block scales spread 20x) and
1.2e-4 on mild ones; the Triton GEMM 2e-7 (kernels/fp8_gemm_dispatch.py). Five probes
tell the candidate causes apart:

1. `accumulator`: one 128-column block, scales 1, operands chosen so the exact sum needs
   more than 14 mantissa bits (one large product beside 127 small ones, in several
   placements). A float32 accumulator returns it exactly; Hopper's FP8 MMA accumulator
   (about 13-14 mantissa bits, truncating: DeepSeek-V3 report, DeepGEMM issue 50) drops
   the small products that share an MMA with the large one. A second case puts the
   large product and the small ones in different 128-blocks: exact iff cuBLAS promotes
   into float32 at each block.
2. `scale_precision`: all operands 1, block scales with every float32 mantissa bit in
   use: the output is 128 * sum_g x_s * w_s, so its error gives the precision the block
   scales are applied in (float32: ~1e-7; bf16: ~4e-3; fp16 / tf32: ~5e-4).
3. `layout`: one block per token carries the activation, every (weight block row,
   K block) its own scale: a scale read from the wrong place changes the output by a
   factor, so misplaced elements are counted. Run at K / 128 = 4, 8 (kvloom's
   multiple of 4) and 5 (unpadded: the case kvloom's dispatcher refuses; torch.
   _scaled_mm hands cuBLAS K / 128 rows where it reads round_up(K / 128, 4)).
4. `fast_accum`: whether torch accepts use_fast_accum=True with blockwise scales (its
   source refuses it), and if so how its error compares.
5. `sweep`: random operands, weights mild (|w| ~ 2) or stress (near 448), block-scale
   spread 1, 20, 100 (log-uniform), K 512 to 12,288: the largest error and the mean
   signed error (a truncating accumulator is biased) relative to the output scale, for
   cuBLAS and the Triton GEMM.

    python3 benchmarks/scaled_mm_accuracy.py --out $OUT/scaled_mm_accuracy.json

The hypothesis under test: the error is the accumulator's (probe 1: cuBLAS promotes
into float32 once per 128-column block, as the block scales require, but sums a block's
four k=32 MMAs in the tensor cores' truncating accumulator), not the scale layout (probe
3: a misread scale changes an element by up to the scale spread, 20x, not by 0.5%).
Every probe also runs `emulated_truncating_acc`, that hypothesis emulated in float64
with ACC_BITS kept bits, to compare cuBLAS's figures with. Without CUDA (`--cpu`, or no
GPU) the float32 reference (fp8_matmul_ref) and an emulated layout misread stand in for
the two GEMMs: the probes' plumbing runs, and the layout probe must flag the misread at
K / 128 = 5 only.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvloom.kernels.fp8_gemm import fp8_matmul_ref

FP8 = torch.float8_e4m3fn
BLOCK = 128
SWEEP_WIDTHS = (512, 4096, 12288)
SWEEP_SPREADS = (1.0, 20.0, 100.0)
SWEEP_WEIGHTS = {"mild": 2.0, "stress": 150.0}  # std of the weight before e4m3 (max 448)
ACC_BITS = 13  # bits kept below the leading one by the emulated FP8 MMA accumulator
MMA_K = 32  # products per Hopper FP8 wgmma (k = 32)


def row_scales(blocks: torch.Tensor) -> torch.Tensor:
    """[N / 128, K / 128] block scales -> the per-row [N, K / 128] kvloom keeps."""
    return blocks.repeat_interleave(BLOCK, dim=0).contiguous()


def exact(x_q, x_s, w_q, w_blocks) -> torch.Tensor:
    """float64 product of the quantized operands (block by block)."""
    w_s = row_scales(w_blocks).double()
    out = torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.float64, device=x_q.device)
    for g in range(x_s.shape[1]):
        cols = slice(g * BLOCK, (g + 1) * BLOCK)
        part = x_q[:, cols].double() @ w_q[:, cols].double().T
        out += part * x_s[:, g, None].double() * w_s[None, :, g]
    return out


def cublas(x_q, x_s, w_q, w_blocks) -> torch.Tensor:
    """torch._scaled_mm as kernels/fp8_gemm_dispatch.py calls it (float32 out):
    activation scales column-major, weight scales [K / 128, N / 128] with strides
    (1, K / 128)."""
    a_scale = x_s.t().contiguous().t()
    return torch._scaled_mm(x_q, w_q.t(), a_scale, w_blocks.t(), out_dtype=torch.float32)


def triton_gemm(x_q, x_s, w_q, w_blocks) -> torch.Tensor:
    from kvloom.kernels.fp8_gemm_triton import fp8_matmul_triton

    return fp8_matmul_triton(x_q, x_s, w_q, row_scales(w_blocks), BLOCK, None, torch.float32)


def reference(x_q, x_s, w_q, w_blocks) -> torch.Tensor:
    return fp8_matmul_ref(x_q, x_s, w_q, row_scales(w_blocks), BLOCK)


def truncating_accumulator(x_q, x_s, w_q, w_blocks, bits=ACC_BITS, mma_k=MMA_K):
    """The hypothesis, emulated: inside each 128-column block the products are summed
    mma_k at a time into an accumulator that keeps `bits` bits below the largest
    term's leading bit, truncated toward -inf (sign-fill right shift: DeepSeek-V3's
    description of Hopper's FP8 MMA); each block's sum is scaled and added in float32
    (promotion once per block)."""
    w_s = row_scales(w_blocks)
    out = torch.zeros(x_q.shape[0], w_q.shape[0], dtype=torch.float32, device=x_q.device)
    for g in range(x_s.shape[1]):
        acc = torch.zeros(out.shape, dtype=torch.float64, device=x_q.device)
        for c in range(g * BLOCK, (g + 1) * BLOCK, mma_k):
            prods = x_q[:, None, c : c + mma_k].double() * w_q[None, :, c : c + mma_k].double()
            terms = torch.cat([acc[..., None], prods], dim=-1)
            top = terms.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-126)
            quantum = torch.exp2(torch.floor(torch.log2(top)) - bits)
            acc = (torch.floor(terms / quantum) * quantum).sum(dim=-1)
        out += acc.float() * x_s[:, g, None] * w_s[None, :, g]
    return out


def run(gemm, *operands) -> dict:
    """The GEMM's output, or the error it raised (recorded, not raised)."""
    try:
        return {"out": gemm(*operands)}
    except Exception as exc:  # a refusal is a result here
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def errors(out: torch.Tensor, want: torch.Tensor) -> dict:
    scale = max(want.abs().max().item(), 1e-30)
    diff = out.double() - want
    return {
        "max_err_rel": diff.abs().max().item() / scale,
        "mean_signed_err_rel": diff.mean().item() / scale,
    }


def misread_padded_scales(x_q, x_s, w_q, w_blocks):
    """The layout hypothesis, emulated: the weight's [K / 128, N / 128] column-major block
    scales read with a leading dimension of round_up(K / 128, 4) from a buffer that has
    K / 128 (what cuBLAS does when torch._scaled_mm does not pad; module doc)."""
    rows, k_blocks = w_blocks.shape
    lead = -(-k_blocks // 4) * 4
    flat = torch.cat([w_blocks.contiguous().flatten(), w_blocks.new_zeros(rows * lead)])
    read = torch.stack([flat[r * lead : r * lead + k_blocks] for r in range(rows)])
    return reference(x_q, x_s, w_q, read)


def gemms(device) -> dict:
    """The GEMMs each probe runs: on a GPU cuBLAS and the Triton GEMM; without one the
    float32 reference in their place and the emulated layout misread (to show the layout
    probe catches one); everywhere the emulated accumulator hypothesis."""
    if device.type == "cuda":
        found = {"cublas": cublas, "triton": triton_gemm}
    else:
        found = {"reference_f32": reference, "emulated_misread_padded": misread_padded_scales}
    found["emulated_truncating_acc"] = truncating_accumulator
    return found


def accumulator_probe(device) -> list[dict]:
    """Where the large product sits -> the sum each GEMM returns, and how many of the
    small products (2^-6 each, 2^-14 of the large one) it lost."""
    tokens, n, k = 4, BLOCK, 4 * BLOCK
    small_product = 2.0**-6
    cases = {"large_first": 0, "large_mid": 64, "large_last": 127, "small_only": None,
             "large_in_next_block": BLOCK}  # fmt: skip
    rows = []
    for name, large_col in cases.items():
        x = torch.zeros(tokens, k)
        w = torch.zeros(n, k)
        x[:, :BLOCK], w[:, :BLOCK] = 0.125, 0.125  # the small products fill block 0
        if large_col is not None:
            x[:, large_col], w[:, large_col] = 16.0, 16.0  # product 256
        x_q, w_q = x.to(FP8).to(device), w.to(FP8).to(device)
        x_s = torch.ones(tokens, k // BLOCK, device=device)
        w_blocks = torch.ones(n // BLOCK, k // BLOCK, device=device)
        want = exact(x_q, x_s, w_q, w_blocks)
        row = {"probe": "accumulator", "case": name, "exact": want[0, 0].item()}
        for label, gemm in gemms(device).items():
            got = run(gemm, x_q, x_s, w_q, w_blocks)
            if "error" in got:
                row[f"{label}_error"] = got["error"]
                continue
            row[label] = got["out"][0, 0].item()
            row[f"{label}_small_products_lost"] = (row["exact"] - row[label]) / small_product
        rows.append(row)
        print(json.dumps(row))
    return rows


def scale_precision_probe(device, seed: int = 0) -> list[dict]:
    tokens, n, k = 8, 2 * BLOCK, 8 * BLOCK
    g = torch.Generator(device="cpu").manual_seed(seed)
    x_q = torch.ones(tokens, k).to(FP8).to(device)
    w_q = torch.ones(n, k).to(FP8).to(device)
    # Scales in [1, 2) with all 23 mantissa bits random, times a power of 2.
    x_s = ((1 + torch.rand(tokens, k // BLOCK, generator=g)) * 2.0**-10).to(device)
    w_blocks = ((1 + torch.rand(n // BLOCK, k // BLOCK, generator=g)) * 2.0**-12).to(device)
    want = exact(x_q, x_s, w_q, w_blocks)
    row = {"probe": "scale_precision"}
    for label, gemm in gemms(device).items():
        got = run(gemm, x_q, x_s, w_q, w_blocks)
        if "error" in got:
            row[f"{label}_error"] = got["error"]
            continue
        err = ((got["out"].double() - want).abs() / want.abs()).max().item()
        row[f"{label}_max_rel_err"] = err
        row[f"{label}_implied_scale_bits"] = None if err == 0 else round(-math.log2(err), 1)
    print(json.dumps(row))
    return [row]


def layout_probe(device) -> list[dict]:
    """Token t carries ones in K block t % G only, scale 2^-t there; weight block (r, g)
    has the distinct scale 1 + r + 16 g. Output (t, n) = 128 * 2^-t * (1 + n // 128 +
    16 g(t)): the decoded (row block, K block) names the scale cuBLAS used."""
    rows = []
    for k_blocks in (4, 8, 5):
        tokens, n, k = 8, 3 * BLOCK, k_blocks * BLOCK
        x = torch.zeros(tokens, k)
        x_s = torch.zeros(tokens, k_blocks)
        for t in range(tokens):
            gsel = t % k_blocks
            x[t, gsel * BLOCK : (gsel + 1) * BLOCK] = 1.0
            x_s[t, gsel] = 2.0**-t
        w_q = torch.ones(n, k).to(FP8).to(device)
        r_idx = torch.arange(n // BLOCK, dtype=torch.float32)[:, None]
        g_idx = torch.arange(k_blocks, dtype=torch.float32)[None, :]
        w_blocks = (1 + r_idx + 16 * g_idx).to(device)
        x_q, x_s = x.to(FP8).to(device), x_s.to(device)
        want = exact(x_q, x_s, w_q, w_blocks)
        row = {"probe": "layout", "k_blocks": k_blocks, "tokens": tokens, "N": n}
        for label, gemm in gemms(device).items():
            got = run(gemm, x_q, x_s, w_q, w_blocks)
            if "error" in got:
                row[f"{label}_error"] = got["error"]
                continue
            wrong = (got["out"].double() - want).abs() > 1e-6 * want.abs()
            row[f"{label}_misplaced_elements"] = int(wrong.sum())
            if wrong.any():
                t, col = (int(i) for i in wrong.nonzero()[0])
                used = got["out"][t, col].item() / (BLOCK * 2.0**-t) - 1
                row[f"{label}_first_misplaced"] = {
                    "token": t, "col": col, "wanted_scale": want[t, col].item() / (BLOCK * 2.0**-t),
                    "decoded_row_block": used % 16, "decoded_k_block": used // 16,
                }  # fmt: skip
        rows.append(row)
        print(json.dumps(row))
    return rows


def fast_accum_probe(device) -> list[dict]:
    """torch refuses use_fast_accum with blockwise scales (aten ScaledBlas.cpp, torch
    2.9-era source): recorded, and where a torch accepts it, its error beside the
    default's on one stress input."""
    if device.type != "cuda":
        return [{"probe": "fast_accum", "skipped": "needs CUDA"}]
    ops = sweep_operands(256, 1024, 4096, SWEEP_WEIGHTS["stress"], 20.0, seed=1, device=device)
    want = exact(*ops)
    x_q, x_s, w_q, w_blocks = ops
    row = {"probe": "fast_accum"}
    for fast in (False, True):
        got = run(
            lambda fast=fast: torch._scaled_mm(
                x_q, w_q.t(), x_s.t().contiguous().t(), w_blocks.t(),
                out_dtype=torch.float32, use_fast_accum=fast,
            )
        )  # fmt: skip
        tag = "fast_accum" if fast else "default"
        if "error" in got:
            row[f"{tag}_error"] = got["error"]
        else:
            row.update({f"{tag}_{k}": v for k, v in errors(got["out"], want).items()})
    print(json.dumps(row))
    return [row]


def sweep_operands(tokens, n, k, weight_std, spread, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x_q = (torch.randn(tokens, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    w_q = (torch.randn(n, k, generator=g) * weight_std).clamp(-448, 448).to(FP8)
    # Log-uniform over [1, spread], around 1e-3 (a checkpoint's typical block scale).
    x_s = 1e-3 * spread ** torch.rand(tokens, k // BLOCK, generator=g)
    w_blocks = 1e-3 * spread ** torch.rand(n // BLOCK, k // BLOCK, generator=g)
    return [t.to(device) for t in (x_q, x_s, w_q, w_blocks)]


def sweep(device, tokens, n, widths) -> list[dict]:
    rows = []
    for k in widths:
        for wname, wstd in SWEEP_WEIGHTS.items():
            for spread in SWEEP_SPREADS:
                ops = sweep_operands(tokens, n, k, wstd, spread, seed=k, device=device)
                want = exact(*ops)
                row = {"probe": "sweep", "tokens": tokens, "N": n, "K": k, "weights": wname,
                       "scale_spread": spread}  # fmt: skip
                for label, gemm in gemms(device).items():
                    got = run(gemm, *ops)
                    if "error" in got:
                        row[f"{label}_error"] = got["error"]
                        continue
                    for key, value in errors(got["out"], want).items():
                        row[f"{label}_{key}"] = value
                rows.append(row)
                print(json.dumps(row))
    return rows


def with_scaled_mm_count(fn, *args):
    """fn(*args)'s result, and whether it called torch._scaled_mm (the serving path falls
    back to the Triton GEMM where cuBLAS does not apply)."""
    calls, real = [], torch._scaled_mm

    def counted(*mm_args, **mm_kwargs):
        calls.append(mm_args[0].shape)
        return real(*mm_args, **mm_kwargs)

    torch._scaled_mm = counted
    try:
        return fn(*args), bool(calls)
    finally:
        torch._scaled_mm = real


def serving_path_probe(device) -> list[dict]:
    """The GPU test's own operands (tests/triton_interpret/test_fp8_scaled_mm_triton.py:
    bf16 randn activations, e4m3 weights randn x 40, block scales U[1e-4, 2.1e-3]) through
    the serving path (`ops.fp8_linear` with KVLOOM_SCALED_MM=1: kvloom's activation
    quantizer, padded rows, then cuBLAS) and through `cublas` above on the same quantized
    operands, against their float64 product. The test saw 0.5% of the output scale where
    the sweep's stress rows saw 0.02%: equal errors here point at the shape (cuBLAS's
    algorithm for N >= 4096), unequal ones at the serving path."""
    if device.type != "cuda":
        return [{"probe": "serving_path", "skipped": "needs CUDA"}]
    import os

    from kvloom.kernels import ops
    from kvloom.kernels.fp8_gemm_dispatch import quantize_activations

    os.environ["KVLOOM_SCALED_MM"] = "1"
    rows = []
    for tokens, n, k in ((64, 1024, 4096), (64, 4096, 4096), (4096, 4096, 4096)):
        g = torch.Generator(device="cpu").manual_seed(n + k + tokens)
        w_q = (torch.randn(n, k, generator=g) * 40).to(FP8).to(device)
        blocks = (torch.rand(n // BLOCK, k // BLOCK, generator=g) * 0.002 + 1e-4).to(device)
        x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16)
        x_q, x_s = quantize_activations(x)
        want = exact(x_q, x_s.contiguous(), w_q, blocks)
        served, took_cublas = with_scaled_mm_count(
            ops.fp8_linear, x, w_q, row_scales(blocks), BLOCK, None, None, torch.float32, blocks
        )
        row = {"probe": "serving_path", "tokens": tokens, "N": n, "K": k}
        row["serving_path_took_cublas"] = took_cublas
        for label, out in (("serving_path", served), ("cublas", cublas(x_q, x_s, w_q, blocks))):
            row.update({f"{label}_{key}": v for key, v in errors(out, want).items()})
        rows.append(row)
        print(json.dumps(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu", action="store_true", help="no GPU: build inputs only")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=1024)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if use_cuda else "cpu")
    widths = SWEEP_WIDTHS if use_cuda else (512,)
    tokens, n = (args.tokens, args.n) if use_cuda else (8, 256)
    result = {
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "accumulator": accumulator_probe(device),
        "scale_precision": scale_precision_probe(device),
        "layout": layout_probe(device),
        "fast_accum": fast_accum_probe(device),
        "serving_path": serving_path_probe(device),
        "sweep": sweep(device, tokens, n, widths),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
