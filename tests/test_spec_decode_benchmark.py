"""benchmarks/spec_decode.py's forced acceptance: every draft accepted, the sampler restored."""

from __future__ import annotations

import json

from benchmarks import spec_decode
from kvloom import Engine
from kvloom.workers import model_runner


def test_acceptance_forced_accepts_every_draft_and_restores_the_sampler(tiny_model, tmp_path):
    """A one-layer draft of random weights (its drafts are rejected on their own) reaches
    100% acceptance and k + 1 tokens per verify step under acceptance_forced; the runner's
    real rejection sampler is back afterwards."""
    path = tiny_model("llama")
    one_layer = tmp_path / "one_layer"
    one_layer.mkdir()
    config = json.loads((path / "config.json").read_text()) | {"num_hidden_layers": 1}
    (one_layer / "config.json").write_text(json.dumps(config))
    k = 3
    spec = {"method": "draft_model", "model": str(one_layer), "num_speculative_tokens": k}
    real = model_runner.rejection_sample
    rates = {}
    for forced in (False, True):
        engine = Engine(
            model=str(path), dtype="float32", load_format="dummy", progress=False,
            speculative_config=spec, max_model_len=512,
        )  # fmt: skip
        prompts = spec_decode.workload(2, seed=0)
        if forced:
            with spec_decode.acceptance_forced():
                _, tokens = spec_decode.run(engine, prompts, 13)
        else:
            _, tokens = spec_decode.run(engine, prompts, 13)
        assert tokens == 2 * 12
        rates[forced] = engine.stats()
    assert model_runner.rejection_sample is real
    assert rates[False]["spec_acceptance_rate"] < 0.5
    assert rates[True]["spec_acceptance_rate"] == 1.0
    assert rates[True]["spec_mean_accepted_length"] > k  # k + 1 but where max_tokens trims k
