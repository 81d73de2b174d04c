"""Per-request latency metrics: time to first token and time per output token."""

import time

import pytest

from kvloom import Engine
from kvloom.contracts.sampling_params import SamplingParams


def test_finished_outputs_carry_ttft_and_tpot(tiny_model):
    engine = Engine(model=str(tiny_model()), dtype="float32", progress=False)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    earlier = time.monotonic() - 3.0
    engine.add_request("late", {"prompt_token_ids": [5, 6, 7]}, params, arrival_time=earlier)
    engine.add_request("now", {"prompt_token_ids": [8, 9]}, params)
    engine.add_request("one", {"prompt_token_ids": [4]}, SamplingParams(max_tokens=1))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.metrics for o in engine.step() if o.finished})
    assert finished["late"]["ttft_s"] >= 3.0  # counted from the arrival the caller gave
    assert 0 <= finished["now"]["ttft_s"] < 3.0
    for rid in ("late", "now"):
        assert finished[rid]["tpot_s"] >= 0
    assert "tpot_s" not in finished["one"]  # one token: no gap to measure


def test_bad_arrival_time_names_the_field(tiny_model):
    engine = Engine(model=str(tiny_model()), dtype="float32", progress=False)
    with pytest.raises(ValueError, match="arrival_time"):
        engine.add_request("r", {"prompt_token_ids": [1, 2]}, arrival_time="yesterday")
    assert not engine.has_unfinished_requests()
