"""`linear_state_dtype`: the recurrent state of Gated DeltaNet / KDA layers in a half type
(vLLM's default keeps it in the model dtype) instead of float32."""

from __future__ import annotations

import pytest
import torch

from kvloom import Engine
from kvloom.contracts.config import CacheConfig
from kvloom.contracts.kv_cache_spec import LinearStateSpec
from kvloom.contracts.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, run_to_completion

PROMPTS = [[5, 17, 230, 44, 9, 301, 12], [88, 7, 150]]


def make_engine(path, state_dtype: str, dtype: str = "float32") -> Engine:
    return Engine(
        model=str(path),
        dtype=dtype,
        progress=False,
        linear_state_dtype=state_dtype,
        enable_prefix_caching=False,
    )


def state_pools(engine: Engine) -> list[torch.Tensor]:
    layers = engine.executor.worker.runner.model.cache_layers()
    return [layer.recurrent_state for layer in layers if hasattr(layer, "recurrent_state")]


def test_rejects_an_unknown_state_dtype():
    with pytest.raises(ValueError, match="linear_state_dtype"):
        CacheConfig(linear_state_dtype="int8")


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear"])
def test_bfloat16_state_halves_the_pages_and_tracks_float32(hybrid_model, arch):
    path = hybrid_model(arch)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for state_dtype in ("float32", "bfloat16"):
        engine = make_engine(path, state_dtype)
        pools = state_pools(engine)
        assert pools and all(p.dtype == getattr(torch, state_dtype) for p in pools)
        specs = [g.spec for g in engine.executor.worker.runner.groups]
        linear = [s for s in specs if isinstance(s, LinearStateSpec)]
        assert linear and all(s.state_dtype == state_dtype for s in linear)
        runs[state_dtype] = (run_to_completion(engine, PROMPTS, params), linear[0])
        assert_pool_full(engine)
    (full, full_spec), (half, half_spec) = runs["float32"], runs["bfloat16"]
    recurrent = full_spec.page_size_bytes - full_spec.conv_bytes
    assert half_spec.page_size_bytes - half_spec.conv_bytes == recurrent // 2
    for a, b in zip(full, half):
        # bf16 rounding of the state moves logits by far less than these tiny models'
        # top-2 margins, so the greedy tokens agree and their logprobs stay close.
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lp_b = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        assert lp_a == pytest.approx(lp_b, abs=2e-2)
        assert lp_a != lp_b  # the state really was rounded


def test_auto_follows_the_model_dtype(hybrid_model):
    engine = make_engine(hybrid_model("qwen3_next"), "auto", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in state_pools(engine))
    out = run_to_completion(engine, PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
