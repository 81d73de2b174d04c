"""kvloom's environment variables, in one place: each with its default and what it does.

Read through the accessors (at call time, so a test or an operator may set a variable
after import). Both planes import this module; it imports nothing of either.
"""

from __future__ import annotations

import functools
import os

# name -> (default, what it does); docs/configuration.md lists them for users.
VARIABLES: dict[str, tuple[str, str]] = {
    "KVLOOM_HOST": ("127.0.0.1", "the address `kvloom serve` binds (the image sets 0.0.0.0)"),
    "KVLOOM_SANITIZE": ("", "1: freed KV blocks and state slots are filled with NaN"),
    "KVLOOM_PLACEMENT_TIMEOUT_S": (
        "30",
        "how long a worker grid waits for its Ray resources before start fails",
    ),
    "KVLOOM_WORKER_THREADS": ("1", "torch CPU threads of each Ray worker actor"),
    "KVLOOM_MULTI_RANK_CUDA_GRAPHS": (
        "",
        "1: capture CUDA graphs at tensor_parallel_size > 1 and "
        "decode_context_parallel_size > 1 (NCCL calls inside the graph); off until a "
        "multi-GPU run verifies it",
    ),
    "KVLOOM_DRAFTER_TIMEOUT_S": (
        "2",
        "seconds a target waits for a remote drafter's drafts before serving without them",
    ),
    "KVLOOM_DISABLE_TRITON": ("", "1: every kernel takes its pure-torch reference"),
    "KVLOOM_NO_GEMV": ("", "1: small-row linears (bf16, FP8, W4A16) skip the Triton GEMVs"),
    "KVLOOM_SCALED_MM": (
        "1",
        "0: prefill-size FP8 block-scaled linears on Hopper take kvloom's Triton GEMM "
        "instead of cuBLAS's blockwise GEMM (torch._scaled_mm, the default: 2.4x faster "
        "offline on an H100, float32 sums within 2e-4 of the output scale)",
    ),
    "KVLOOM_W4A16_DEQUANT_GEMM": (
        "1",
        "0: prefill-size W4A16 linears (512 tokens and up) take kvloom's Triton W4A16 GEMM "
        "instead of the weight dequantized once and cuBLAS (the default)",
    ),
    "KVLOOM_UNFUSED": (
        "",
        "decode fusions to turn off, comma-separated (A/B timing, or an escape hatch): "
        "norm_gemv, kv_write, mul_sigmoid, gdn_decode, moe_pairs, gdn_conv, kda_norm, "
        "kda_decode, pdl, split_merge, moe_slot_sum, router_rows, router_gemv, "
        "linear_norm_tail, or all",
    ),
    "KVLOOM_FUSED": (
        "",
        "decode fusions that are off by default to turn on, comma-separated: norm_gemv "
        "(same bits, but slower on an H200), pdl (decode kernel launches overlap the "
        "launch before them on Hopper; 1.7% slower on Qwen3-8B on an H100), split_merge (the "
        "split-KV decode merges its splits in its attention launch; level with two launches "
        "on an H100), or all; "
        "KVLOOM_UNFUSED wins over it",
    ),
    "KVLOOM_PDL_PREFETCH_LINES": (
        "16",
        "with pdl: 128-byte lines of each weight row a GEMV program asks L2 for before it "
        "waits on the launch before it; 0 turns the prefetch off (an A/B of its cost)",
    ),
    "KVLOOM_PDL_RELEASE": (
        "loop",
        "with pdl: where a decode kernel lets the next launch stage: loop (a GEMV after its "
        "main loop, the other kernels at exit), start (first thing: 25% slower) or exit "
        "(every kernel at exit); the same bits at each (A/B timing)",
    ),
    "KVLOOM_MOE_DECODE_STAGES": (
        "",
        "software-pipelining depth of the fused MoE's decode (pairs) plan: one integer for "
        "its gate_up and down launches, or two, 'GATE_UP,DOWN' (empty: the plan's own: at one "
        "token 6 where its gate_up grid has no more programs than the GPU has SMs, else 4; "
        "3 above); the same bits at any depth (A/B timing)",
    ),
    "KVLOOM_DECODE_KEYS_PER_SPLIT": (
        "",
        "the split-KV decode's split size in keys (empty: the kernel's own, 256, or 128 "
        "for caches of at most two KV heads a rank, as Qwen3-Next's): a multiple of the "
        "attention plan's key tile (64 for heads of at most 128 dims in a half type, 32 for "
        "wider ones); a row's bits depend on it, never on its batch (A/B timing)",
    ),
    "KVLOOM_DETERMINISTIC_TILES": (
        "",
        "a tile table (JSON, written by benchmarks/batch_invariant_plans.py --tables on the "
        "GPU that serves) replacing the deterministic mode's built-in Hopper matmul tiles; "
        "its tiles must all give the one plan's bits, as the sweep's do",
    ),
    "KVLOOM_NO_FLA": (
        "",
        "1: linear-attention prefill (Gated DeltaNet, KDA) on CUDA skips fla-core's kernels",
    ),
    "KVLOOM_FLA_LAYOUT": (
        "fla",
        "who lays out the 64-token chunks of linear-attention prefill on fla: fla (on the "
        "host, copied with a wait for the stream once a step), device (fla's use_graph form, "
        "every layer, no wait; KDA only) or staged (kvloom, on the host once a step, copied "
        "through pinned memory with no wait); A/B timing, not yet on a GPU",
    ),
    "KVLOOM_GDN_MIXED_STEPS": (
        "auto",
        "how Gated DeltaNet serves mixed prefill + decode steps: serial (token by token, in "
        "place), chunked (the chunked kernels), split (rows over 64 tokens chunked, the rest "
        "serial) or auto (serial on CUDA for many short rows)",
    ),
    "KVLOOM_SERIAL_CONV_LOOP": (
        "",
        "1: the default mode's serial mixed steps run the causal conv as one program looping "
        "over each row's tokens (the deterministic mode's form) instead of programs over "
        "blocks of tokens (the same values; A/B timing, the token blocks not yet on a GPU)",
    ),
    "KVLOOM_KDA_MIXED_STEPS": (
        "auto",
        "how KDA (Kimi-Linear) serves mixed prefill + decode steps: chunked (fla's or the "
        "reference's chunked kernels), serial (token by token, in place), split (rows over "
        "64 tokens chunked, the rest serial) or auto (serial on CUDA for many short rows, "
        "Gated DeltaNet's rule; Kimi-Linear-16l offline on an H100: 76.52 s against 101.92 "
        "chunked, float32 state)",
    ),
    "KVLOOM_GC_YOUNG_THRESHOLD": (
        "20000",
        "net allocations between collections of Python's youngest GC generation in a "
        "process serving one engine (Python's default, 700, collected several times per "
        "decode step at 1000 rows: 12% of the host's step time, 22% with per-step outputs)",
    ),
}


def get(name: str) -> str:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a kvloom environment variable (contracts/envs.py)")
    return os.environ.get(name) or VARIABLES[name][0]


def _positive_float(name: str) -> float:
    raw = get(name)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value


def gc_young_threshold() -> int:
    raw = get("KVLOOM_GC_YOUNG_THRESHOLD")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"KVLOOM_GC_YOUNG_THRESHOLD must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"KVLOOM_GC_YOUNG_THRESHOLD must be >= 1, got {raw!r}")
    return value


def placement_timeout_s() -> float:
    return _positive_float("KVLOOM_PLACEMENT_TIMEOUT_S")


def multi_rank_cuda_graphs() -> bool:
    return get("KVLOOM_MULTI_RANK_CUDA_GRAPHS").strip().lower() in ("1", "true", "yes", "on")


def pdl_prefetch_lines() -> int:
    raw = get("KVLOOM_PDL_PREFETCH_LINES")
    try:
        lines = int(raw)
    except ValueError:
        lines = -1
    if lines < 0:
        raise ValueError(f"KVLOOM_PDL_PREFETCH_LINES: expected an integer >= 0, got {raw!r}")
    return lines


def pdl_release() -> str:
    raw = get("KVLOOM_PDL_RELEASE").strip().lower()
    if raw not in ("start", "loop", "exit"):
        raise ValueError(f"KVLOOM_PDL_RELEASE: expected start, loop or exit, got {raw!r}")
    return raw


def decode_keys_per_split() -> int | None:
    """KVLOOM_DECODE_KEYS_PER_SPLIT as a positive multiple of 16, or None when unset."""
    raw = get("KVLOOM_DECODE_KEYS_PER_SPLIT").strip()
    if not raw:
        return None
    try:
        keys = int(raw)
    except ValueError:
        keys = 0
    if keys <= 0 or keys % 16:
        raise ValueError(
            f"KVLOOM_DECODE_KEYS_PER_SPLIT: expected a positive multiple of 16, got {raw!r}"
        )
    return keys


def moe_decode_stages() -> tuple[int, int] | None:
    """(gate_up, down) pipelining depths of the fused MoE's pairs plan, or None."""
    raw = get("KVLOOM_MOE_DECODE_STAGES").strip()
    if not raw:
        return None
    try:
        depths = tuple(int(part) for part in raw.split(","))
    except ValueError:
        depths = ()
    if len(depths) == 1:
        depths = depths * 2
    if len(depths) != 2 or not all(1 <= d <= 16 for d in depths):
        raise ValueError(
            f"KVLOOM_MOE_DECODE_STAGES: expected one or two integers in [1, 16] "
            f"('6' or '6,4'), got {raw!r}"
        )
    return depths


def drafter_timeout_s() -> float:
    return _positive_float("KVLOOM_DRAFTER_TIMEOUT_S")


def set_here() -> dict[str, str]:
    """The kvloom variables set in this process. Ray actors get them in their runtime_env:
    an actor on another node, or a worker process of an embedded Ray started before a
    variable was set, would otherwise not see them."""
    return {name: os.environ[name] for name in VARIABLES if os.environ.get(name)}


# The decode-path fusions KVLOOM_UNFUSED names (each replaces launches with one that gives
# the same bits): the residual add + RMSNorm in the next GEMV's prologue, the KV-cache
# write in the q/k norm + rotary kernel, Qwen3-Next's attention output gate in one launch,
# Gated DeltaNet's gates + recurrence + gated norm in one launch, the fused MoE's pairs
# (decode) plan without its count and place launches, Gated DeltaNet's conv update in the
# epilogue of its (norm +) in_proj GEMV, KDA's gates + recurrence + output norm in one
# launch; and KDA's output norm in one launch (the one not bitwise: within an ulp of the
# torch composition it replaces). Not a fusion but switched the same way: `pdl`, the decode
# path's Triton kernels launched with programmatic dependent launch on Hopper, so that each
# starts (and a GEMV streams its weight) while the launch before drains (kernels/pdl_triton.py).
# `split_merge`: the split-KV decode merges its splits in its attention launch, no merge
# launch (kernels/paged_attention_triton.py). `moe_slot_sum`: the fused MoE's pairs plan
# sums each token's k slots in its down launch, no slot-sum launch
# (kernels/fused_moe_triton.py). `router_rows`: Kimi-Linear's post-attention RMSNorm also
# stores its rows widened to float32 for the float32 router (no cast launch before it).
# `router_gemv`: the softmax top-k router runs in the router GEMV's launch, by its last
# program to store (kernels/gemv_triton.py `gemv_route_triton`), no router launch.
# `linear_norm_tail`: where a linear-attention decode step splits a value head over
# programs, the last of them to store applies the output norm (kernels/
# gated_delta_rule_triton.py), no norm launch, at steps of up to NORM_TAIL_MAX_ROWS rows.
FUSIONS = (
    "norm_gemv",
    "kv_write",
    "mul_sigmoid",
    "gdn_decode",
    "moe_pairs",
    "gdn_conv",
    "kda_norm",
    "kda_decode",
    "pdl",
    "split_merge",
    "moe_slot_sum",
    "router_rows",
    "router_gemv",
    "linear_norm_tail",
)


# Fusions off unless KVLOOM_FUSED names them: same bits, but an H200 measured them slower
# than the launches they replace (docs/benchmarks/gpu_fast_path.md, eleventh session: the
# norm + GEMV launch took 2-5x the two launches' time at every decode shape, Qwen3-8B's
# batch-1 decode 7.02 ms/token with it, 4.74 without).
# `pdl` lost on an H100 at every release point (nineteenth session). `split_merge` passed
# its gpu tests and gained nothing end to end on an H100 (twentieth session: 5.97-5.98
# ms/token on and off). (`moe_slot_sum` left this list after its gpu tests passed and it
# gained 1.0-1.4% per token on both 16-layer hybrids on an H100, twenty-first session.)
# (`router_gemv`, now at one row only, and `linear_norm_tail` left this list after their
# gpu tests passed and each gained about 1% at batch 1 on an H100, twenty-fourth session.)
# (`linear_add_norm`, the residual add and RMSNorm in a one-row output projection's GEMV
# launch, and `moe_gate_up_halves`, gate and up of the MoE decode plan in two programs,
# were removed in the twenty-seventh session: on an H100 the first lost, 8.27 against
# 7.27 us at one row, and the second gained nothing end to end.)
OPT_IN_FUSIONS = ("norm_gemv", "pdl", "split_merge")


@functools.lru_cache(maxsize=16)
def _fusion_names(variable: str, raw: str) -> frozenset[str]:
    names = {part.strip() for part in raw.split(",") if part.strip()}
    if "all" in names:
        return frozenset(FUSIONS)
    unknown = sorted(names - set(FUSIONS))
    if unknown:
        raise ValueError(
            f"{variable}: unknown fusion(s) {unknown}; choose from {list(FUSIONS)} or all"
        )
    return frozenset(names)


def unfused(name: str) -> bool:
    """Whether the decode fusion `name` (one of FUSIONS) is off: KVLOOM_UNFUSED names it,
    or it is opt-in (OPT_IN_FUSIONS) and KVLOOM_FUSED does not name it."""
    if name not in FUSIONS:
        raise KeyError(f"{name} is not a fusion of contracts/envs.py's FUSIONS")
    if name in _fusion_names("KVLOOM_UNFUSED", get("KVLOOM_UNFUSED")):
        return True
    return name in OPT_IN_FUSIONS and name not in _fusion_names("KVLOOM_FUSED", get("KVLOOM_FUSED"))


def flag(name: str) -> bool:
    """A switch variable (1, true, yes or on), read at call time."""
    return get(name).strip().lower() in ("1", "true", "yes", "on")
