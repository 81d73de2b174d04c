"""`LLM(data_parallel_size=N)`: the offline API runs N replicas on local Ray (as
`kvloom serve --data-parallel-size` does) and gives the same outputs as one engine."""

from __future__ import annotations

import pytest

from kvloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

SETTINGS = dict(dtype="float64", block_size=4, max_num_seqs=16, progress=False)


def test_two_replicas_generate_what_one_engine_does(tiny_model, local_ray):
    path = str(tiny_model("qwen2"))
    prompts = [
        {"prompt_token_ids": [5 + (i * 13 + j) % 300 for j in range(3 + i)]} for i in range(8)
    ]
    params = [
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True),
    ] * 4
    one = LLM(path, **SETTINGS)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    one.shutdown()

    llm = LLM(path, data_parallel_size=2, routing="round-robin", **SETTINGS)
    try:
        assert llm.engine.stats()["data_parallel_size"] == 2
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        # Round-robin spread the requests over both replicas.
        assert [r["routed"] for r in llm.engine.stats()["replicas"]] == [4, 4]
        assert llm.get_tokenizer().encode("hi") == one.get_tokenizer().encode("hi")
    finally:
        llm.shutdown()


def test_bad_data_parallel_size_names_the_field(tiny_model):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tiny_model("qwen2")), data_parallel_size=0, **SETTINGS)
