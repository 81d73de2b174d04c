"""kvloom against Hugging Face transformers on tiny random-weight dense models (fp32).

Teacher-forced logits must match within LOGIT_TOL; greedy continuations of 8 prompts
batched together must equal transformers' tokens, except at a position where
transformers' own top-2 margin is below MARGIN_TOL (there either token is a correct
argmax within float error) — such positions are reported.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kvloom import LLM
from tests.engine_helpers import PROMPTS
from tests.oracle_helpers import assert_batched_greedy_matches, kvloom_prompt_logits

LOGIT_TOL = 1e-4
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_model):
    path = tiny_model(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", progress=False, block_size=16)
    return request.param, hf, llm


def test_teacher_forced_logits_match_transformers(pair):
    arch, hf, llm = pair
    for prompt in (PROMPTS[3], PROMPTS[7], list(range(3, 100))):
        ours = kvloom_prompt_logits(llm, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        err = (ours - ref).abs().max().item()
        assert err <= LOGIT_TOL, f"{arch}: max |logit diff| {err:.3g} over {len(prompt)} tokens"


def test_batched_greedy_matches_transformers(pair):
    arch, hf, llm = pair
    assert_batched_greedy_matches(llm, hf, PROMPTS, arch)
