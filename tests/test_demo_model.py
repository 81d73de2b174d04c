"""`kvloom demo-model`: the written directory is a real Hugging Face checkpoint."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvloom.cluster import cli
from kvloom.cluster.demo_model import (
    ADDED_TOKENS,
    ARCHS,
    SPECIAL_TOKENS,
    train_demo_tokenizer,
    write_demo_model,
)

ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}
CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
MIXED_TEXT = (
    "Hello, world! naïve café, Größe.\n"
    "def f(x):\n    return {'a': [1, 2.5, -3e-4]}\n"
    "今天天气很好，我们去公园散步。今日はいい天気ですね。안녕하세요!\n"
    "Emoji 😀🎉🍞 ❤️ and flags 🇵🇹, zero-width\u200bjoiner 👩\u200d💻, tab\tend"
)


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo")
    return {arch: write_demo_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def tokenizer(demo_dirs):
    return AutoTokenizer.from_pretrained(demo_dirs["llama"])


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation of exactly `steps` tokens (EOS does not stop it)."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False
    )
    return out[0, len(ids) :].tolist()


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_loads_runs_and_is_not_degenerate(arch, demo_dirs, tokenizer):
    directory = demo_dirs[arch]
    assert {p.name for p in directory.iterdir()} == CHECKPOINT_FILES
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(model).__name__ == ARCH_CLASS[arch]
    cfg = model.config
    assert cfg.vocab_size == len(tokenizer) == 512
    assert cfg.bos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert cfg.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert cfg.max_position_embeddings == 4096
    assert model.generation_config.eos_token_id == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the river."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer(text)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits
    assert logits.shape == (1, len(prompt), 512)
    assert torch.isfinite(logits).all()
    generated = _greedy(model, prompt, 16)
    # Random weights, but greedy decoding must not collapse onto a token or two.
    assert len(set(generated)) >= 8, generated


def test_architecture_specific_fields(demo_dirs):
    def cfg(arch):
        return json.loads((demo_dirs[arch] / "config.json").read_text())

    assert cfg("mistral")["sliding_window"] is None
    assert cfg("llama")["rope_parameters"]["rope_type"] == "llama3"
    for arch in ("qwen3_next", "kimi_linear"):
        types = cfg(arch)["layer_types"]
        assert set(types) == {"linear_attention", "full_attention"}, arch
    kimi = cfg("kimi_linear")
    assert kimi["mlp_layer_types"][0] == "dense" and "sparse" in kimi["mlp_layer_types"]
    full = [i + 1 for i, t in enumerate(kimi["layer_types"]) if t == "full_attention"]
    assert kimi["linear_attn_config"]["full_attn_layers"] == full
    assert kimi["q_lora_rank"] is None and kimi["kv_lora_rank"] > 0
    assert cfg("qwen3_next")["num_experts"] > cfg("qwen3_next")["num_experts_per_tok"] > 1


def test_tokenizer_round_trips_any_text(demo_dirs, tokenizer):
    ids = tokenizer(MIXED_TEXT)["input_ids"]
    assert tokenizer.decode(ids) == MIXED_TEXT
    assert tokenizer.bos_token_id not in ids  # ChatML: no BOS prepended
    # The raw tokenizers library (what the engine uses) reads the same file.
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(demo_dirs["llama"] / "tokenizer.json"))
    assert raw.encode(MIXED_TEXT).ids == ids
    assert raw.decode(ids) == MIXED_TEXT
    # The corpus taught merges for multi-byte text: fewer tokens than UTF-8 bytes.
    for text in ("今天天气很好", "天气 公园 散步", "😀😊🎉👍"):
        assert len(tokenizer(text)["input_ids"]) < len(text.encode("utf-8")), text


def test_special_and_added_tokens(tokenizer):
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        assert tokenizer(token)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)], token
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    # Added tokens survive skip_special_tokens (parsers need them); special ones do not.
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nhmm\n</think>\n<tool_call>\n{}\n</tool_call>"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.model_max_length == 4096


def test_chat_template_without_tools(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(
        messages[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert (
        closed == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert no_prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_chat_template_with_tools(tokenizer):
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Lisbon and Porto?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Porto"}'},
                },
            ],
        },
        {"role": "tool", "content": '{"temp": 22}'},
        {"role": "tool", "content": '{"temp": 19}'},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    system, rest = rendered.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert "\n<tools>\n" + json.dumps(tool) + "\n</tools>\n" in system
    assert system.endswith("</tool_call>")  # the call format is spelled out
    assert rest == (
        "<|im_start|>user\nLisbon and Porto?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Porto"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n"
        '<tool_response>\n{"temp": 22}\n</tool_response>\n'
        '<tool_response>\n{"temp": 19}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    # Tools without a system message still get a system turn.
    text = tokenizer.apply_chat_template(
        messages[1:2], tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n# Tools\n") and "<tools>" in text
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, demo_dirs):
    again = write_demo_model(tmp_path / "again", arch="qwen3_next", seed=0)
    assert _digests(again) == _digests(demo_dirs["qwen3_next"])
    other = write_demo_model(tmp_path / "other", arch="qwen3_next", seed=1)
    a, b = _digests(again), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_tokenizer_training_is_deterministic_across_processes():
    code = (
        "import hashlib\n"
        "from kvloom.cluster.demo_model import train_demo_tokenizer\n"
        "print(hashlib.sha256(train_demo_tokenizer(512).to_str().encode()).hexdigest())\n"
    )
    here = hashlib.sha256(train_demo_tokenizer(512).to_str().encode()).hexdigest()
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == here


def test_dtype_and_size(tmp_path, demo_dirs):
    bf16 = write_demo_model(tmp_path / "bf16", arch="llama", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    with (
        safe_open(str(bf16 / "model.safetensors"), "pt") as low,
        safe_open(str(demo_dirs["llama"] / "model.safetensors"), "pt") as full,
    ):
        assert set(low.keys()) == set(full.keys())
        for name in low.keys():  # noqa: SIM118 - safe_open is not iterable
            # The same float32 draw, rounded.
            assert low.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(low.get_tensor(name), full.get_tensor(name).to(torch.bfloat16))

    small = write_demo_model(tmp_path / "small", arch="llama", size="small")
    model = AutoModelForCausalLM.from_pretrained(small).eval()
    assert model.config.hidden_size == 256 and model.config.num_hidden_layers == 4
    tok = AutoTokenizer.from_pretrained(small)
    assert len(tok) == model.config.vocab_size == 2048
    assert tok.decode(tok(MIXED_TEXT)["input_ids"]) == MIXED_TEXT
    assert len(set(_greedy(model, tok("The keeper of the lighthouse")["input_ids"], 16))) >= 8


def test_global_rng_untouched(tmp_path):
    before = torch.random.get_rng_state()
    write_demo_model(tmp_path / "m", arch="qwen2", seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_tied_embeddings_option(tmp_path):
    out = write_demo_model(tmp_path / "tied", arch="qwen3", tie_word_embeddings=True)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 - safe_open is not iterable
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"size": "huge"}, "size"),
        ({"dtype": "float64"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"vocab_size": 10**6}, "vocab_size"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        write_demo_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()  # nothing written on bad input


def test_cli_writes_and_refuses_non_empty_dir(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["demo-model", str(out), "--arch", "kimi_linear", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "KimiLinearForCausalLM" in printed
    for name in CHECKPOINT_FILES:
        assert str(out / name) in printed
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "KimiLinearForCausalLM"
    ]
    before = _digests(out)

    # Non-empty without --force: refused, nothing changed.
    assert cli.main(["demo-model", str(out), "--arch", "llama"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--force" in err
    assert _digests(out) == before

    # --force replaces checkpoint files (a stale shard too) and keeps unrelated files.
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    (out / "notes.txt").write_text("keep me")
    assert cli.main(["demo-model", str(out), "--arch", "llama", "--force"]) == 0
    capsys.readouterr()
    assert {p.name for p in out.iterdir()} == CHECKPOINT_FILES | {"notes.txt"}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_pretrained(out)

    # A bad value is a clear error naming the option, not a traceback.
    assert cli.main(["demo-model", str(tmp_path / "v"), "--vocab-size", "10"]) == 2
    assert "vocab_size" in capsys.readouterr().err


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        write_demo_model(path, force=True)
