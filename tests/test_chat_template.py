"""Chat template loading and rendering, with transformers' apply_chat_template as the oracle."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvloom.cluster.chat_template import (
    ChatTemplate,
    add_special_tokens_for,
    load_chat_templates,
)
from kvloom.cluster.tokenizer import Tokenizer

# A Qwen-style template written for these tests: tools listed as JSON in the system turn,
# calls as <tool_call> JSON, results as <tool_response>, `enable_thinking=False` pre-filling an
# empty think block, and `tojson` printing arguments (which double-encodes a JSON string).
QWEN_STYLE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nAnswer a call with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'system' %}
  {%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
    {%- if message.reasoning_content %}
{{- '\\n<think>\\n' + message.reasoning_content + '\\n</think>' }}
    {%- endif %}
    {%- if message.content is defined %}{{- '\\n' + message.content }}{%- endif %}
    {%- for call in message.tool_calls or [] %}
      {%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}
    {%- endfor %}
{{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
  {%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b> & later — 天气",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def conversation(arguments: str | dict) -> list[dict]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris, 2 days? 😀"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]


ARGS_DICT = {"city": "Paris", "days": 2}
ARGS_TEXT = json.dumps(ARGS_DICT)


def _vocab_tokenizer() -> HFTokenizer:
    words = ["<s>", "</s>", "<unk>", "hello", "world", "[user]", "[assistant]"]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Like Llama's tokenizer: BOS is added to plain text.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def write_model_dir(path: Path, template: str | None) -> PreTrainedTokenizerFast:
    """A model directory as transformers saves it (tokenizer.json, tokenizer_config.json,
    chat_template.jinja); returns the tokenizer transformers loads back from it."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=_vocab_tokenizer(), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> tuple[Path, PreTrainedTokenizerFast]:
    path = tmp_path_factory.mktemp("qwen_style")
    return path, write_model_dir(path, QWEN_STYLE)


def test_tools_and_tool_call_history_match_transformers(qwen_dir) -> None:
    path, oracle = qwen_dir
    ours = ChatTemplate.from_model_dir(path)
    assert ours is not None
    rendered = ours.render(conversation(ARGS_TEXT), TOOLS, add_generation_prompt=True)
    expected = oracle.apply_chat_template(
        conversation(ARGS_DICT), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert rendered.text == expected
    assert '"arguments": {"city": "Paris", "days": 2}' in rendered.text
    assert "天气" in rendered.text and "<b>now</b> & later" in rendered.text  # tojson as HF's
    assert "None" not in rendered.text  # content=None is dropped, not printed
    # Why arguments are normalised: the same template double-encodes the OpenAI string form.
    raw = oracle.apply_chat_template(
        conversation(ARGS_TEXT), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert raw != expected and '"arguments": "{\\"city\\"' in raw


def test_tools_given_as_json_text_render_the_same(qwen_dir) -> None:
    path, _ = qwen_dir
    ours = ChatTemplate.from_model_dir(path)
    as_dicts = ours.render(conversation(ARGS_DICT), TOOLS, add_generation_prompt=True)
    as_text = ours.render(
        conversation(ARGS_TEXT), [json.dumps(t) for t in TOOLS], add_generation_prompt=True
    )
    assert as_text == as_dicts


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_extra_kwargs_match_transformers(qwen_dir, enable_thinking: bool) -> None:
    path, oracle = qwen_dir
    messages = [{"role": "user", "content": "hi"}]
    rendered = ChatTemplate.from_model_dir(path).render(
        messages,
        add_generation_prompt=True,
        chat_template_kwargs={"enable_thinking": enable_thinking},
    )
    expected = oracle.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )
    assert rendered.text == expected
    assert rendered.text.endswith("<think>\n\n</think>\n\n") is (not enable_thinking)


def test_without_generation_prompt_matches_transformers(qwen_dir) -> None:
    path, oracle = qwen_dir
    messages = conversation(ARGS_DICT)[:2]
    assert ChatTemplate.from_model_dir(path).render(messages).text == (
        oracle.apply_chat_template(messages, tokenize=False)
    )


def test_continue_final_message_matches_transformers(qwen_dir) -> None:
    path, oracle = qwen_dir
    messages = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two,"},
    ]
    rendered = ChatTemplate.from_model_dir(path).render(messages, continue_final_message=True)
    expected = oracle.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert rendered.text == expected
    assert rendered.text.endswith("One, two,")


def test_template_errors_become_value_errors(qwen_dir) -> None:
    path, _ = qwen_dir
    ours = ChatTemplate.from_model_dir(path)
    with pytest.raises(ValueError, match="Unknown role: critic"):
        ours.render([{"role": "system", "content": "x"}, {"role": "critic", "content": "y"}])
    # Content parts where this template concatenates a string: the template fails on input.
    with pytest.raises(ValueError, match="messages"):
        ours.render([{"role": "user", "content": [{"type": "text", "text": "x"}]}])


@pytest.mark.parametrize(
    "messages,kwargs,field",
    [
        ("hello", {}, "messages"),
        ([{"content": "no role"}], {}, r"messages\[0\].role"),
        ([{"role": "user", "content": "x"}, 3], {}, r"messages\[1\]"),
        (
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                },
            ],
            {},
            r"messages\[1\].tool_calls\[0\].function.arguments",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                }
            ],
            {},
            r"messages\[0\].tool_calls\[0\].function.arguments",
        ),
        (
            [{"role": "user", "content": "x"}],
            {"chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs.messages",
        ),
        ([{"role": "user", "content": "x"}], {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        (
            [{"role": "user", "content": "x"}],
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
    ],
)
def test_bad_input_names_the_field(qwen_dir, messages, kwargs, field) -> None:
    path, _ = qwen_dir
    with pytest.raises(ValueError, match=field):
        ChatTemplate.from_model_dir(path).render(messages, **kwargs)


def test_caller_messages_are_not_modified(qwen_dir) -> None:
    path, _ = qwen_dir
    messages = conversation(ARGS_TEXT)
    before = json.dumps(messages)
    ChatTemplate.from_model_dir(path).render(messages, TOOLS)
    assert json.dumps(messages) == before


def test_the_sandbox_blocks_python_internals() -> None:
    for source in (
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.append(1) }}",  # immutable sandbox: no mutating methods
        "{% set ns = namespace(_x=1) %}",
    ):
        with pytest.raises(ValueError):
            ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_syntax_errors_are_reported_at_load() -> None:
    with pytest.raises(ValueError, match="chat_template: line 1"):
        ChatTemplate("{% for m in messages %}")


def test_globals_filters_and_generation_blocks_match_transformers(tmp_path: Path) -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{% generation %}[{{ m.role }}]{{ m.content }}"
        "{% endgeneration %}{% endfor %}|{{ strftime_now('%Y') }}|{{ {'k': '<é&>'} | tojson }}"
        "|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}"
        "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}{{ eos_token }}"
    )
    oracle = write_model_dir(tmp_path, source)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    rendered = ChatTemplate.from_model_dir(tmp_path).render(messages)
    assert rendered.text == oracle.apply_chat_template(messages, tokenize=False)
    assert f"|{datetime.now().year}|" in rendered.text
    assert rendered.text.endswith("0122</s>")


def test_no_double_bos(tmp_path: Path) -> None:
    """The template writes BOS and the tokenizer adds BOS to plain text: the prompt must
    still start with exactly one."""
    source = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    write_model_dir(tmp_path, source)
    template = ChatTemplate.from_model_dir(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("hello") == [bos, 3]  # this tokenizer does add BOS to plain text
    rendered = template.render([{"role": "user", "content": "hello world"}])
    assert rendered.starts_with_bos
    assert not add_special_tokens_for(rendered.text, template.bos_token)
    ids = tokenizer.encode(
        rendered.text, add_special_tokens=add_special_tokens_for(rendered.text, template.bos_token)
    )
    assert ids == [bos, 5, 3, 4]
    assert tokenizer.encode(rendered.text, add_special_tokens=False) == ids
    assert add_special_tokens_for("hello", template.bos_token)


def test_template_without_bos_is_flagged(qwen_dir) -> None:
    path, _ = qwen_dir
    rendered = ChatTemplate.from_model_dir(path).render([{"role": "user", "content": "x"}])
    assert not rendered.starts_with_bos


def test_loading_prefers_jinja_file_and_reads_named_templates(tmp_path: Path) -> None:
    write_model_dir(tmp_path, None)
    assert ChatTemplate.from_model_dir(tmp_path) is None
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "default:{{ messages | length }}"},
        {"name": "tool_use", "template": "tools:{{ (tools or []) | length }}"},
    ]
    config_path.write_text(json.dumps(config))
    named = ChatTemplate.from_model_dir(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    assert named.render(messages).text == "default:1"
    assert named.render(messages, TOOLS).text == "tools:1"
    assert named.render(messages, template_name="tool_use").text == "tools:0"
    with pytest.raises(ValueError, match="chat_template"):
        named.render(messages, template_name="nope")
    oracle = AutoTokenizer.from_pretrained(tmp_path)
    assert oracle.apply_chat_template(messages, tools=TOOLS, tokenize=False) == "tools:1"

    config["chat_template"] = "from config"
    config_path.write_text(json.dumps(config))
    assert load_chat_templates(tmp_path) == {"default": "from config"}
    (tmp_path / "chat_template.jinja").write_text("from file")
    assert load_chat_templates(tmp_path) == {"default": "from file"}

    config["chat_template"] = 7
    config_path.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_templates(tmp_path)
