"""`LLM.chat` as vLLM's: the model's chat template (tools included) renders each
conversation, the text is encoded as the template wrote it (its own BOS, no second one), and
generation is `LLM.generate`'s."""

from __future__ import annotations

import json
import shutil

import pytest

from kvloom import LLM, SamplingParams
from kvloom.cluster.chat_template import ChatTemplate

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def llm(demo_tokenizer_dir):
    return LLM(model=str(demo_tokenizer_dir), dtype="float32", progress=False)


def test_chat_is_generate_over_the_rendered_prompt(llm, demo_tokenizer_dir):
    conversations = [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather in Paris?"},
        ],
    ]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False, tools=TOOLS)
    template = ChatTemplate.from_model_dir(demo_tokenizer_dir)
    tokenizer = llm.get_tokenizer()
    for conversation, out in zip(conversations, outs):
        text = template.render(conversation, TOOLS, add_generation_prompt=True).text
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        assert "get_weather" in tokenizer.decode(ids)  # the tools reached the template
        want = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    # One conversation (a list of messages) gives one output.
    (single,) = llm.chat(conversations[0], GREEDY, use_tqdm=False)
    assert (
        single.outputs[0].token_ids == llm.chat([conversations[0]], GREEDY)[0].outputs[0].token_ids
    )


def test_chat_errors_name_the_field(llm, demo_tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"messages\[0\]\.role"):
        llm.chat([{"content": "hi"}], GREEDY, use_tqdm=False)
    # A model directory without a chat template.
    bare = tmp_path / "bare"
    shutil.copytree(demo_tokenizer_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert ChatTemplate.from_model_dir(bare) is None
    with pytest.raises(ValueError, match="has no chat template"):
        LLM(model=str(bare), dtype="float32", progress=False).chat(
            [{"role": "user", "content": "hi"}], GREEDY
        )
