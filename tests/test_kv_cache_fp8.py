"""`kv_cache_dtype="fp8"`: attention KV pages (full attention, sliding window, MLA latent)
stored as float8_e4m3fn with per-tensor k/v scales; linear state keeps its own dtype.

How correctness is checked here (CPU, float32 models, the torch reference kernels; the
Triton paths are in tests/triton_interpret/test_kv_cache_fp8_triton.py):

- Exactness of the paging: an FP8 run equals a float32 run whose keys and values are
  rounded through e4m3 before they are cached ("fake-quantized"): same greedy tokens, and
  logprobs within float32 rounding (FAKE_QUANT_TOL). This isolates what the FP8 pages
  change (storage, scales, dequantization on read) from the rounding itself.
- The cost of the rounding: against kv_cache_dtype="auto", teacher-forced logits move by
  at most FP8_LOGIT_TOL (absolute; the tiny test models' logits span about +-8, and e4m3
  keeps 3 mantissa bits: up to 2^-4 relative error per cached element). Greedy tokens may
  differ from "auto" only at a position where auto's top-2 logit margin is at most
  2 * FP8_LOGIT_TOL (a flip needs the two logits to cross); each such position is printed.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvloom import LLM, Engine
from kvloom.cluster.kv_cache.planner import num_blocks_for_memory, plan_kv_cache
from kvloom.contracts.config import CacheConfig, SchedulerConfig
from kvloom.contracts.kv_cache_plan import REPORTED_BLOCK_SIZE, KVCacheMemory, KVCacheSpecs
from kvloom.contracts.kv_cache_spec import (
    FullAttentionSpec,
    LinearStateSpec,
    MLASpec,
    SlidingWindowSpec,
)
from kvloom.contracts.sampling_params import SamplingParams
from kvloom.kernels.kv_cache_write import (
    FP8_DTYPE,
    dequantize_kv,
    quantize_kv,
    write_kv_cache_ref,
)
from kvloom.kernels.mla_attention import mla_attention_ref, write_mla_cache_ref
from kvloom.kernels.paged_attention import paged_attention_ref
from kvloom.workers import kv_cache_scales
from kvloom.workers.layers import attention as attention_layer
from kvloom.workers.layers import mla as mla_layer
from tests.engine_helpers import assert_pool_full, greedy, run_to_completion
from tests.oracle_helpers import kvloom_prompt_logits

FAKE_QUANT_TOL = 1e-6  # logprobs of FP8 pages vs fake-quantized float32 pages (measured: 0)
FP8_LOGIT_TOL = 2.0  # teacher-forced |logit(fp8) - logit(auto)|, measured up to 1.39
PROMPTS = [[5 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate([1, 7, 17, 33])]


# ------------------------------------------------------------------------ configuration


def test_bad_kv_cache_dtype_names_the_field():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int3'"):
        CacheConfig(kv_cache_dtype="int3")
    for ok in ("auto", "fp8", "fp8_e4m3"):
        assert CacheConfig(kv_cache_dtype=ok).kv_cache_dtype == ok


def test_serve_flag_reaches_the_engine():
    from kvloom.cluster.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--kv-cache-dtype", "fp8"])
    assert serve.engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    args = parser.parse_args(["serve", "--model", "m"])
    assert "kv_cache_dtype" not in serve.engine_kwargs(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--kv-cache-dtype", "int3"])


def test_bench_flag_reaches_the_engine(tmp_path, monkeypatch):
    from kvloom.cluster import bench
    from kvloom.cluster.cli import main

    made = []
    monkeypatch.setattr(bench, "Engine", lambda **kw: made.append(kw) or Engine(**kw))
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--shape", "tiny", "--dtype", "float32", "--steps", "2"]
    assert main([*argv, "--kv-cache-dtype", "fp8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "fp8" and result["ms_per_token"] > 0
    assert [kw["kv_cache_dtype"] for kw in made] == ["fp8"]


def test_helm_value_renders_the_flag():
    from tests.helm_render import container, helm, manifests, one, render

    def serve_args(values):
        raycluster = one(manifests(render(values)), "RayCluster")
        return container(raycluster["spec"]["headGroupSpec"]["template"]["spec"], "kvloom")["args"]

    args = serve_args({"engine": {"kvCacheDtype": "fp8"}})
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--kv-cache-dtype" not in serve_args({})  # auto: the default, no flag
    with pytest.raises(helm().HelmValuesError, match="kvCacheDtype"):
        render({"engine": {"kvCacheDtype": "int3"}})


# ------------------------------------------------------------------------- page math


def reported(spec, keys):
    return {key: spec for key in keys}


@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(REPORTED_BLOCK_SIZE, 8, 128, "bfloat16"),
        SlidingWindowSpec(REPORTED_BLOCK_SIZE, 8, 128, "bfloat16", sliding_window=64),
        MLASpec(REPORTED_BLOCK_SIZE, 512, 64, "bfloat16"),
    ],
)
def test_fp8_doubles_the_blocks_at_a_fixed_budget(spec):
    specs = KVCacheSpecs(target=reported(spec, range(4)))
    sched = SchedulerConfig(max_num_seqs=1024, max_model_len=1 << 16)
    memory = KVCacheMemory(64 << 20, "a test budget")
    cache = dict(sliding_window_booking="window")
    bf16 = plan_kv_cache(specs, CacheConfig(**cache), "bfloat16")
    fp8 = plan_kv_cache(specs, CacheConfig(kv_cache_dtype="fp8", **cache), "bfloat16")
    assert {g.spec.dtype for g in fp8.groups} == {"float8_e4m3fn"}
    assert fp8.layout.page_bytes * 2 == bf16.layout.page_bytes
    assert num_blocks_for_memory(fp8, memory, sched) == 2 * num_blocks_for_memory(
        bf16, memory, sched
    )


def test_fp8_leaves_linear_state_alone():
    state = LinearStateSpec(REPORTED_BLOCK_SIZE, (8192, 3), (32, 128, 128), "bfloat16")
    attn = FullAttentionSpec(REPORTED_BLOCK_SIZE, 2, 256, "bfloat16")
    specs = KVCacheSpecs(target={**reported(state, range(3)), 3: attn}, draft={1000: attn})
    auto = plan_kv_cache(specs, CacheConfig(), "bfloat16")
    fp8 = plan_kv_cache(specs, CacheConfig(kv_cache_dtype="fp8_e4m3"), "bfloat16")
    for a, b in zip(auto.groups, fp8.groups):
        if isinstance(a.spec, LinearStateSpec):
            assert (b.spec.dtype, b.spec.state_dtype) == (a.spec.dtype, a.spec.state_dtype)
            # Pages halve with the attention page, so a state spans about twice as many.
            assert fp8.layout.page_bytes * 2 == auto.layout.page_bytes
            assert b.spec.pages_per_state == -(-b.spec.page_size_bytes // fp8.layout.page_bytes)
            assert b.spec.pages_per_state in (
                2 * a.spec.pages_per_state - 1,
                2 * a.spec.pages_per_state,
            )
        else:
            assert b.spec.dtype == "float8_e4m3fn"
    # The drafter's attention pages follow the setting too.
    assert fp8.layout.private_page_bytes[1000] * 2 == auto.layout.private_page_bytes[1000]


# ----------------------------------------------------------------- quantization rules


def test_quantize_saturates_keeps_nan_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, float("nan"), 1.0625, 1.1875, 0.3, -17.0])
    q = quantize_kv(x, FP8_DTYPE, 1.0)
    back = q.float()
    assert back[0] == 448 and back[1] == -448 and back[2].isnan()
    # 1.0625 is the midpoint of 1.0 and 1.125: even mantissa (1.0); 1.1875 -> 1.25.
    assert back[3] == 1.0 and back[4] == 1.25
    # A scale divides on write and multiplies on read.
    s = 0.25
    q = quantize_kv(x[5:], FP8_DTYPE, s)
    assert torch.equal(q, (x[5:] * 4).to(FP8_DTYPE))
    assert torch.equal(dequantize_kv(q, torch.float32, s), (x[5:] * 4).to(FP8_DTYPE).float() / 4)
    # Non-FP8 caches ignore the scale.
    assert torch.equal(quantize_kv(x, torch.float32, 0.5).nan_to_num(), x.nan_to_num())


def random_paged_case(seed=0, page=4, heads=2, dim=8, num_blocks=10):
    g = torch.Generator().manual_seed(seed)
    context = [5, 9, 1]
    queries = [5, 1, 1]
    tables = torch.zeros(len(context), 4, dtype=torch.int32)
    slots, used = [], 1
    for row, n in enumerate(context):
        pages = list(range(used, used + -(-n // page)))
        used += len(pages)
        tables[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots += [pages[i // page] * page + i % page for i in range(n)]
    k = torch.randn(len(slots), heads, dim, generator=g) * 3
    v = torch.randn(len(slots), heads, dim, generator=g) * 3
    q = torch.randn(sum(queries), 2 * heads, dim, generator=g)
    return dict(
        k=k,
        v=v,
        q=q,
        slots=torch.tensor(slots),
        tables=tables,
        qsl=torch.tensor([0] + queries).cumsum(0),
        lens=torch.tensor(context),
        num_blocks=num_blocks,
    )


def test_paged_attention_reads_fp8_pages_as_dequantized_values():
    c = random_paged_case()
    ks, vs = 0.75, 1.5
    fp8 = torch.zeros(2, c["num_blocks"], 4, 2, 8, dtype=FP8_DTYPE)
    write_kv_cache_ref(c["k"], c["v"], fp8, c["slots"], ks, vs)
    # The same values, dequantized into a float32 cache.
    fake = torch.zeros(2, c["num_blocks"], 4, 2, 8)
    fq_k = dequantize_kv(quantize_kv(c["k"], FP8_DTYPE, ks), torch.float32, ks)
    fq_v = dequantize_kv(quantize_kv(c["v"], FP8_DTYPE, vs), torch.float32, vs)
    write_kv_cache_ref(fq_k, fq_v, fake, c["slots"])
    args = (c["tables"], c["qsl"], c["lens"], 0.3)
    out, lse = paged_attention_ref(c["q"], fp8, *args, k_scale=ks, v_scale=vs)
    want, want_lse = paged_attention_ref(c["q"], fake, *args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_dcp_shards_of_fp8_pages_merge_to_the_whole():
    """Decode context parallelism attends over FP8 shards in the reference path (rank r
    holds positions p % 2 == r): the merged shards equal one rank over the whole cache."""
    from kvloom.kernels.merge_attention_states import merge_attention_states_ref

    c = random_paged_case(seed=2)
    ks, vs = 0.6, 1.7
    whole = torch.zeros(2, c["num_blocks"], 4, 2, 8, dtype=FP8_DTYPE)
    write_kv_cache_ref(c["k"], c["v"], whole, c["slots"], ks, vs)
    want, want_lse = paged_attention_ref(
        c["q"], whole, c["tables"], c["qsl"], c["lens"], 0.3, k_scale=ks, v_scale=vs
    )
    # Token i of a row is position i; each row's tokens are its slots in order.
    starts = [0, *c["lens"].cumsum(0).tolist()]
    outs, lses = [], []
    for rank in range(2):
        shard = torch.zeros(2, c["num_blocks"], 2, 2, 8, dtype=FP8_DTYPE)
        slots = []
        for row in range(len(c["lens"])):
            for pos in range(int(c["lens"][row])):
                local = pos // 2 if pos % 2 == rank else None
                block = int(c["tables"][row, local // 2]) if local is not None else 0
                slots.append(-1 if local is None else block * 2 + local % 2)
        assert len(slots) == starts[-1]
        write_kv_cache_ref(c["k"], c["v"], shard, torch.tensor(slots), ks, vs)
        out, lse = paged_attention_ref(
            c["q"], shard, c["tables"], c["qsl"], c["lens"], 0.3, None, 2, rank, ks, vs
        )
        outs.append(out)
        lses.append(lse)
    merged, merged_lse = merge_attention_states_ref(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(merged_lse, want_lse, atol=1e-6, rtol=1e-6)


def test_mla_reference_reads_fp8_latent_pages():
    g = torch.Generator().manual_seed(3)
    rank, rope, heads, page = 16, 4, 2, 4
    latent = torch.randn(6, rank, generator=g) * 2
    k_pe = torch.randn(6, rope, generator=g)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    fp8 = torch.zeros(4, page, rank + rope, dtype=FP8_DTYPE)
    fake = torch.zeros(4, page, rank + rope)
    s = 0.5
    write_mla_cache_ref(latent, k_pe, fp8, slots, s)
    row = torch.cat([latent, k_pe], -1)
    fq = dequantize_kv(quantize_kv(row, FP8_DTYPE, s), torch.float32, s)
    write_mla_cache_ref(fq[:, :rank], fq[:, rank:], fake, slots)
    q_latent = torch.randn(2, heads, rank, generator=g)
    q_pe = torch.randn(2, heads, rope, generator=g)
    args = (tables, torch.tensor([0, 2]), torch.tensor([6]), 0.2)
    out, lse = mla_attention_ref(q_latent, q_pe, fp8, *args, kv_scale=s)
    want, want_lse = mla_attention_ref(q_latent, q_pe, fake, *args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


# ------------------------------------------------------------------------- sanitizer


def test_sanitizer_nan_fill_shows_up_in_fp8_pages():
    """The sanitizer fills freed pages with 0xFF bytes: NaN in float8_e4m3fn too, so a
    stale read of an FP8 page reaches the attention output as NaN."""
    assert torch.tensor([0xFF], dtype=torch.uint8).view(FP8_DTYPE).float().isnan().all()
    c = random_paged_case(seed=1)
    pages = torch.zeros(c["num_blocks"], 2 * 4 * 2 * 8, dtype=torch.uint8)
    kv = pages.view(FP8_DTYPE).view(c["num_blocks"], 2, 4, 2, 8).transpose(0, 1)
    write_kv_cache_ref(c["k"], c["v"], kv, c["slots"])
    args = (c["tables"], c["qsl"], c["lens"], 0.3)
    clean, _ = paged_attention_ref(c["q"], kv, *args)
    assert not clean.isnan().any()
    stale = int(c["tables"][1, 1])  # the second page of row 1
    pages[stale] = 0xFF  # what ModelRunner.poison_blocks does to a freed block
    out, _ = paged_attention_ref(c["q"], kv, *args)
    assert out[5:6].isnan().all()  # row 1 (its one query token) read the stale page
    assert torch.equal(out[:5], clean[:5]) and torch.equal(out[6:], clean[6:])


def test_freed_fp8_pages_of_an_engine_read_as_nan(tiny_model):
    """End to end: the blocks a finished request freed are poisoned in the pool, and the
    attention layers' float8_e4m3fn views of them read NaN."""
    eng = engine(tiny_model("llama"), "fp8", enable_prefix_caching=False, num_kv_blocks=16)
    run_to_completion(eng, [PROMPTS[3]], greedy(4))
    # Freed blocks are poisoned with the next step (a one-token request, one new block).
    run_to_completion(eng, [PROMPTS[0]], greedy(1))
    runner = eng.executor.worker.runner
    poisoned = (runner.page_buffers[0] == 0xFF).all(dim=1).nonzero().flatten()
    assert len(poisoned) >= -(-(len(PROMPTS[3]) + 4) // runner.block_size) - 1
    for layer in runner.model.cache_layers():
        assert layer.kv_cache.dtype == FP8_DTYPE
        assert layer.kv_cache[:, poisoned].isnan().all()


# ------------------------------------------------------------------------ engine runs


def fake_quantized(monkeypatch):
    """Makes float32 caches hold e4m3-rounded keys and values (the FP8 run's values)."""

    def fq(x, scale):  # written out here, independent of the kernels' helpers
        stored = (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return stored.to(x.dtype) * scale

    write_kv, write_mla = attention_layer.write_kv_cache, mla_layer.write_mla_cache

    def write_kv_fq(k, v, cache, slots, k_scale=1.0, v_scale=1.0):
        assert cache.dtype == torch.float32
        write_kv(fq(k, k_scale), fq(v, v_scale), cache, slots)

    def write_mla_fq(latent, k_pe, cache, slots, kv_scale=1.0):
        assert cache.dtype == torch.float32
        write_mla(fq(latent, kv_scale), fq(k_pe, kv_scale), cache, slots)

    monkeypatch.setattr(attention_layer, "write_kv_cache", write_kv_fq)
    monkeypatch.setattr(mla_layer, "write_mla_cache", write_mla_fq)


def engine(path, kv_cache_dtype, **kw):
    return Engine(
        model=str(path),
        dtype="float32",
        progress=False,
        kv_cache_dtype=kv_cache_dtype,
        sanitize=True,
        **kw,
    )


def logprob_runs(eng):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = run_to_completion(eng, PROMPTS, params)
    assert_pool_full(eng)
    return [
        (o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
        for o in outs
    ]


def attention_dtypes(eng) -> set[str]:
    return {
        g.spec.dtype
        for g in eng.executor.worker.runner.groups
        if not isinstance(g.spec, LinearStateSpec)
    }


@pytest.mark.parametrize("arch", ["llama", "llama-scaled", "mistral", "qwen3_next", "kimi_linear"])
def test_fp8_pages_equal_fake_quantized_float32(
    tiny_model, hybrid_model, monkeypatch, tmp_path, arch
):
    """Dense (full attention; with checkpoint k/v scales; Mistral with a sliding window),
    Qwen3-Next (gated attention + Gated DeltaNet) and Kimi-Linear (MLA + KDA): FP8 pages
    give the tokens and logprobs of float32 pages holding the same e4m3-rounded values;
    linear state stays float32."""
    if arch in ("qwen3_next", "kimi_linear"):
        path = hybrid_model(arch)
    elif arch == "mistral":
        path = tiny_model("mistral", sliding_window=8)
    elif arch == "llama-scaled":
        scales = {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.3),
            "model.layers.0.self_attn.v_scale": torch.tensor(0.04),
            "model.layers.1.self_attn.k_scale": torch.tensor(3.0),
            "model.layers.1.self_attn.v_scale": torch.tensor(0.7),
        }
        path = with_scales(tiny_model("llama"), tmp_path, scales)
    else:
        path = tiny_model(arch)
    eng = engine(path, "fp8", enable_prefix_caching=False)
    assert attention_dtypes(eng) == {"float8_e4m3fn"}
    runner = eng.executor.worker.runner
    for g in runner.groups:
        if isinstance(g.spec, LinearStateSpec):
            assert (g.spec.dtype, g.spec.state_dtype) == ("float32", "float32")
    got = logprob_runs(eng)
    monkeypatch.setattr(kv_cache_scales.logger, "warning", lambda *a, **k: None)
    fake_quantized(monkeypatch)
    auto = engine(path, "auto", enable_prefix_caching=False)
    # "auto" leaves the checkpoint's scales unused; the fake quantization needs them.
    fp8_layers = runner.model.cache_layers()
    for layer, fp8_layer in zip(auto.executor.worker.runner.model.cache_layers(), fp8_layers):
        if hasattr(layer, "k_scale"):
            layer.k_scale, layer.v_scale = fp8_layer.k_scale, fp8_layer.v_scale
    want = logprob_runs(auto)
    worst = max(max(abs(a - b) for a, b in zip(g[1], w[1])) for g, w in zip(got, want))
    print(f"{arch}: max |logprob(fp8 pages) - logprob(fake-quantized float32)| = {worst:.2e}")
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(
            torch.tensor(lps), torch.tensor(want_lps), atol=FAKE_QUANT_TOL, rtol=0
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_against_auto_teacher_forced_and_greedy(tiny_model, arch):
    """The rounding's cost, with the rule stated in the module docstring."""
    path = tiny_model(arch)
    prompt = [5 + (j * 37) % 500 for j in range(24)]
    llms = {
        dt: LLM(
            model=str(path),
            dtype="float32",
            kv_cache_dtype=dt,
            progress=False,
            enable_prefix_caching=False,
        )
        for dt in ("auto", "fp8")
    }
    auto_out = llms["auto"].generate([{"prompt_token_ids": prompt}], greedy(16))
    auto_tokens = auto_out[0].outputs[0].token_ids
    # Teacher forcing: both read prompt + auto's continuation in one prefill.
    forced = prompt + auto_tokens
    auto = kvloom_prompt_logits(llms["auto"], forced)
    fp8 = kvloom_prompt_logits(llms["fp8"], forced)
    delta = (fp8 - auto).abs().max(dim=-1).values
    print(f"{arch}: teacher-forced max |logit(fp8) - logit(auto)| = {delta.max():.3f}")
    assert delta.max() <= FP8_LOGIT_TOL
    top2 = auto.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    flips = (fp8.argmax(-1) != auto.argmax(-1)).nonzero().flatten().tolist()
    for pos in flips:
        assert margin[pos] <= 2 * delta[pos], (pos, margin[pos], delta[pos])
    print(f"{arch}: teacher-forced argmax flips (position, auto margin): ", end="")
    print([(p, round(float(margin[p]), 3)) for p in flips])
    # Free-running greedy: identical up to the first divergence, which must sit where auto's
    # margin allows it (the teacher-forced logits above are exactly auto's path).
    fp8_tokens = llms["fp8"].generate([{"prompt_token_ids": prompt}], greedy(16))[0]
    fp8_tokens = fp8_tokens.outputs[0].token_ids
    for step, (a, b) in enumerate(zip(auto_tokens, fp8_tokens)):
        if a != b:
            pos = len(prompt) + step - 1
            assert margin[pos] <= 2 * FP8_LOGIT_TOL
            print(f"{arch}: greedy diverges at step {step} (auto margin {margin[pos]:.3f})")
            break


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_fp8_against_auto_greedy_on_hybrids(hybrid_model, arch):
    """Hybrids: free-running greedy tokens equal auto's up to a first divergence, which
    must sit where auto's top-2 margin (from its top-2 logprobs) is at most
    2 * FP8_LOGIT_TOL; divergences are printed."""
    path = hybrid_model(arch)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for dt in ("auto", "fp8"):
        eng = engine(path, dt, enable_prefix_caching=False)
        runs[dt] = run_to_completion(eng, PROMPTS, params)
    diverged = []
    for prompt, a, b in zip(PROMPTS, runs["auto"], runs["fp8"]):
        auto_tokens, fp8_tokens = a.outputs[0].token_ids, b.outputs[0].token_ids
        for step, (x, y) in enumerate(zip(auto_tokens, fp8_tokens)):
            if x != y:
                top = sorted(lp.logprob for lp in a.outputs[0].logprobs[step].values())
                margin = top[-1] - top[-2]
                assert margin <= 2 * FP8_LOGIT_TOL, (len(prompt), step, margin)
                diverged.append((len(prompt), step, round(margin, 3)))
                break
    print(f"{arch}: greedy divergences from auto (prompt len, step, auto margin): {diverged}")


def test_prefix_caching_works_unchanged_with_fp8(tiny_model):
    """Multi-turn prompts with prefix hits give the tokens of a run without prefix caching
    (sanitizer on: freed and recycled FP8 pages read as NaN if anything reads them)."""
    path = tiny_model("llama")
    base = [5 + (j * 13) % 400 for j in range(40)]
    prompts = [base + [7, 8, 9], base + [10, 11], base[:35] + [12]]
    runs = {}
    for caching in (True, False):
        eng = engine(path, "fp8", enable_prefix_caching=caching, block_size=8)
        outs = [run_to_completion(eng, [p], greedy(6))[0] for p in prompts]
        runs[caching] = outs
        assert_pool_full(eng)
    assert [o.num_cached_tokens for o in runs[True]][1:] == [40, 32]
    assert [o.outputs[0].token_ids for o in runs[True]] == [
        o.outputs[0].token_ids for o in runs[False]
    ]


# --------------------------------------------------------------- checkpoint scales


def with_scales(src, dst, scales: dict[str, torch.Tensor], quant_config=None):
    """A copy of checkpoint `src` with extra scale tensors (and a quantization_config)."""
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({**tensors, **scales}, str(dst / "model.safetensors"))
    if quant_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quant_config
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def attention_scales(eng):
    layers = eng.executor.worker.runner.model.cache_layers()
    return [(layer.k_scale, layer.v_scale) for layer in layers if hasattr(layer, "k_scale")]


def test_checkpoint_scales_are_read_as_vllm_names_them(tiny_model, tmp_path):
    src = tiny_model("llama")
    one = torch.tensor(1.0)
    ckpt = with_scales(
        src,
        tmp_path,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
            "model.layers.1.self_attn.kv_scale": 2 * one,  # deprecated: both
        },
    )
    eng = engine(ckpt, "fp8")
    assert attention_scales(eng) == [(0.5, 0.25), (2.0, 2.0)]
    # Layer 0's keys are computed from the embeddings alone, so its cache must hold them
    # quantized by its scale: compare with the float32 cache of an "auto" run.
    prompt = PROMPTS[2]
    pages = {}
    for dt in ("fp8", "auto"):
        e = engine(ckpt, dt, enable_prefix_caching=False, num_kv_blocks=8)
        if dt == "auto":
            assert attention_scales(e) == [(1.0, 1.0), (1.0, 1.0)]  # unused
        e.add_request("r", {"prompt_token_ids": prompt}, greedy(1))
        layer0 = e.executor.worker.runner.model.cache_layers()[0]
        e.step()  # the prefill writes the cache; pages are poisoned once it finishes
        pages[dt] = layer0.kv_cache[:, 1:3].clone()
        while e.has_unfinished_requests():
            e.step()
    n = len(prompt)
    auto_kv = pages["auto"].flatten(1, 2)[:, :n]
    fp8_kv = pages["fp8"].flatten(1, 2)[:, :n]
    assert torch.equal(fp8_kv[0], quantize_kv(auto_kv[0], FP8_DTYPE, 0.5))
    assert torch.equal(fp8_kv[1], quantize_kv(auto_kv[1], FP8_DTYPE, 0.25))


def test_modelopt_and_compressed_tensors_scale_names(tiny_model, tmp_path):
    src = tiny_model("llama")
    (tmp_path / "modelopt").mkdir()
    modelopt = with_scales(
        src,
        tmp_path / "modelopt",
        {
            "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(0.125),
        },
    )
    assert attention_scales(engine(modelopt, "fp8")) == [(0.5, 0.125), (1.0, 1.0)]
    # compressed-tensors: k_proj / v_proj output scales are the cache scales only when the
    # quantization_config has a kv_cache_scheme (a full checkpoint of that format is the
    # quantized-weights tests' business; the name rules are checked on a weight stream).
    assert kv_cache_scales.has_kv_cache_scheme(
        {"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}
    )
    assert not kv_cache_scales.has_kv_cache_scheme({"quantization_config": {"format": "x"}})
    stream = [
        ("model.layers.1.self_attn.k_proj.output_scale", torch.tensor([0.75])),
        ("model.layers.1.self_attn.v_proj.output_scale", torch.tensor([1.5])),
        ("model.layers.1.self_attn.k_proj.weight", torch.zeros(2, 2)),
    ]
    scales = kv_cache_scales.KVCacheScales(compressed_tensors_kv=True)
    assert [name for name, _ in scales.take(stream)] == ["model.layers.1.self_attn.k_proj.weight"]
    assert scales.found == {1: {"k": 0.75, "v": 1.5}}
    plain = kv_cache_scales.KVCacheScales()
    assert len(list(plain.take(stream))) == 3 and plain.found == {}
    # Scales under the model's ignored prefixes (an MTP head's layer 0) are left to the
    # loader, which skips them: they never set the target's layer 0.
    mtp = kv_cache_scales.KVCacheScales(ignored_prefixes=("mtp.",))
    kept = list(mtp.take([("mtp.layers.0.self_attn.k_scale", torch.tensor(9.0))]))
    assert [name for name, _ in kept] == ["mtp.layers.0.self_attn.k_scale"] and mtp.found == {}


def test_bad_scales_are_errors_naming_the_tensor(tiny_model, tmp_path):
    src = tiny_model("llama")
    cases = {
        "per_head": ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, "per-tensor"),
        "negative": ({"model.layers.0.self_attn.v_scale": torch.tensor(-1.0)}, "positive"),
        "no_layer": ({"model.norm.k_scale": torch.tensor(1.0)}, "no layer index"),
        "stray": ({"model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, "layer 7 has no"),
    }
    for label, (scales, message) in cases.items():
        (tmp_path / label).mkdir()
        ckpt = with_scales(src, tmp_path / label, scales)
        name = next(iter(scales))
        with pytest.raises(ValueError, match=rf"{message}") as err:
            engine(ckpt, "fp8")
        assert name in str(err.value)
