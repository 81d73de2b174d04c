"""Write a tiny random-weight Hugging Face checkpoint with a real BPE tokenizer.

The output directory looks like a real model repository (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json), so every kvloom command and
test can run on a fresh machine with no downloads. The tokenizer is trained on a small text
shipped in `kvloom.cluster/data`; weights are random, drawn under a fixed seed, so the same
arguments always give byte-identical files.

torch, transformers and tokenizers are imported inside the functions that need them, so
that importing this module (the CLI does, to list choices) stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_next", "kimi_linear")
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")
# "tokenizers": tokenizer.json; "tiktoken": Kimi's layout (tiktoken.model + special tokens
# in tokenizer_config.json after the ranks, 258 slots), loaded by cluster/tiktoken_tokenizer.
TOKENIZER_FORMATS = ("tokenizers", "tiktoken")
DEFAULT_VOCAB_SIZE = {"tiny": 512, "small": 2048}

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Plain added tokens: never split by BPE, but kept in decoded text (skip_special_tokens
# does not drop them), as reasoning and tool-call parsers expect.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# Byte-level BPE starts from all 256 byte symbols; the vocabulary cannot be smaller.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
MAX_POSITION_EMBEDDINGS = 4096

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_PATH = DATA_DIR / "demo_corpus.txt"
CHAT_TEMPLATE_PATH = DATA_DIR / "demo_chat_template.jinja"

# Files this writer produces, plus files a previous checkpoint in the same directory could
# have left that a loader would read instead of (or beside) ours. `force` removes these.
_CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
)
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")

# Layer shapes per size. Dense models use all of `dense`; hybrids add their own keys below.
_SHAPES = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hybrid_layers": 4,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "linear_heads": 4,
        "linear_head_dim": 16,
        "kv_lora_rank": 32,
        "initializer_range": 0.02,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hybrid_layers": 4,
        "num_experts": 8,
        "moe_intermediate_size": 128,
        "linear_heads": 8,
        "linear_head_dim": 32,
        "kv_lora_rank": 64,
        # At the default 0.02 the wider layers attend almost uniformly, and greedy decoding
        # falls into a loop of a few tokens; a larger draw makes attention content-dependent.
        "initializer_range": 0.1,
    },
}


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def train_demo_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE["tiny"]):
    """Train the byte-level BPE tokenizer on the shipped corpus; returns a `tokenizers.Tokenizer`.

    Deterministic: the BPE trainer breaks count ties by pair order, so the same corpus and
    vocabulary size give the same merges in every process.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int; got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + special and added "
            f"tokens); got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so any UTF-8 text round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is more than the demo corpus supports: training stopped "
            f"at {tokenizer.get_vocab_size()} tokens"
        )
    return tokenizer


def _tokenizer_config(tokenizer) -> dict:
    added = {
        str(token_id): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for token_id, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        # ChatML models do not prepend BOS; the chat template carries all structure.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
    }


def _tiktoken_files(tokenizer) -> tuple[str, dict, dict[str, int]]:
    """The trained BPE in Kimi's tiktoken layout: the plain tokens ranked in merge order
    (the trainer numbers them that way), then the special and added tokens, then reserved
    ids up to NUM_SPECIAL_SLOTS. Returns (tiktoken.model text, tokenizer_config, special ids,
    vocabulary size)."""
    import base64

    from kvloom.cluster.tiktoken_tokenizer import NUM_SPECIAL_SLOTS, _bytes_to_unicode

    byte_of = {char: b for b, char in _bytes_to_unicode().items()}
    added_ids = set(tokenizer.get_added_tokens_decoder())
    plain = sorted((tid, tok) for tok, tid in tokenizer.get_vocab(with_added_tokens=False).items())
    lines = [
        f"{base64.b64encode(bytes(byte_of[c] for c in tok)).decode()} {rank}"
        for rank, (_, tok) in enumerate(t for t in plain if t[0] not in added_ids)
    ]
    num_base = len(lines)
    ids = {text: num_base + k for k, text in enumerate(SPECIAL_TOKENS + ADDED_TOKENS)}
    config = _tokenizer_config(tokenizer)
    config["tokenizer_class"] = "TikTokenTokenizer"
    config["added_tokens_decoder"] = {
        str(i): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text in SPECIAL_TOKENS,
        }
        for text, i in ids.items()
    }
    return "\n".join(lines) + "\n", config, ids, num_base + NUM_SPECIAL_SLOTS


def _model_config(arch: str, size: str, vocab_size: int, bos: int, eos: int, tie: bool):
    """The transformers config object of one demo architecture."""
    import transformers

    s = _SHAPES[size]
    common = {
        "vocab_size": vocab_size,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_attention_heads": s["num_attention_heads"],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "tie_word_embeddings": tie,
        "initializer_range": s["initializer_range"],
    }
    dense = {
        **common,
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_key_value_heads"],
        "head_dim": s["head_dim"],
    }
    n = s["hybrid_layers"]
    # Three linear-attention layers per full-attention layer, as the released models have.
    hybrid_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if arch == "llama":
        # Llama 3 rope scaling: original context x factor = max_position_embeddings.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": MAX_POSITION_EMBEDDINGS // 4,
        }
        return transformers.LlamaConfig(rope_parameters=rope, **dense)
    if arch == "qwen2":
        return transformers.Qwen2Config(**dense)
    if arch == "qwen3":
        return transformers.Qwen3Config(**dense)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **dense)
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **{**dense, "num_hidden_layers": n},
            layer_types=hybrid_types,
            linear_num_key_heads=s["linear_heads"] // 2,
            linear_num_value_heads=s["linear_heads"],
            linear_key_head_dim=s["linear_head_dim"],
            linear_value_head_dim=s["linear_head_dim"],
            num_experts=s["num_experts"],
            num_experts_per_tok=2,
            moe_intermediate_size=s["moe_intermediate_size"],
            shared_expert_intermediate_size=s["moe_intermediate_size"],
        )
    if arch == "kimi_linear":
        head = s["head_dim"]
        return transformers.KimiLinearConfig(
            **common,
            num_hidden_layers=n,
            # MLA expands its latent to one key/value head per query head.
            num_key_value_heads=s["num_attention_heads"],
            layer_types=hybrid_types,
            mlp_layer_types=["dense" if i == 0 else "sparse" for i in range(n)],
            first_k_dense_replace=1,
            linear_num_heads=s["linear_heads"],
            linear_head_dim=s["linear_head_dim"],
            # The released checkpoint's own spelling (1-based layer numbers), kept beside
            # transformers' layer_types so loaders written against either form work.
            linear_attn_config={
                "kda_layers": [i + 1 for i, t in enumerate(hybrid_types) if t != "full_attention"],
                "full_attn_layers": [
                    i + 1 for i, t in enumerate(hybrid_types) if t == "full_attention"
                ],
                "head_dim": s["linear_head_dim"],
                "num_heads": s["linear_heads"],
                "short_conv_kernel_size": 4,
            },
            kv_lora_rank=s["kv_lora_rank"],
            q_lora_rank=None,
            qk_nope_head_dim=head,
            qk_rope_head_dim=head // 2,
            v_head_dim=head,
            num_experts=s["num_experts"],
            num_experts_per_tok=2,
            moe_intermediate_size=s["moe_intermediate_size"],
            n_shared_experts=1,
        )
    raise AssertionError(arch)  # unreachable: arch was validated


def _prepare_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(
                f"out_dir {str(out)!r} is not empty; pass force=True (--force) to overwrite"
            )
        stale = [out / name for name in _CHECKPOINT_FILES]
        stale += [p for pattern in _WEIGHT_PATTERNS for p in out.glob(pattern)]
        for path in stale:
            if path.is_file() or path.is_symlink():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def write_demo_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int | None = None,
    force: bool = False,
    tie_word_embeddings: bool = False,
    tokenizer_format: str = "tokenizers",
) -> Path:
    """Write a demo checkpoint of `arch` into `out_dir` and return its path.

    `out_dir` must be missing or empty unless `force`, which replaces checkpoint files there
    (config, weights, tokenizer files) and leaves anything else. `tie_word_embeddings` is off
    by default because a tied tiny random model greedily repeats its last input token.
    `tokenizer_format="tiktoken"` writes Kimi's tokenizer layout instead of tokenizer.json
    (the same trained BPE; the model's vocabulary grows to the tiktoken ids).
    """
    _check_choice("arch", arch, ARCHS)
    _check_choice("tokenizer_format", tokenizer_format, TOKENIZER_FORMATS)
    _check_choice("size", size, SIZES)
    _check_choice("dtype", dtype, DTYPES)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    if vocab_size is None:
        vocab_size = DEFAULT_VOCAB_SIZE[size]
    tokenizer = train_demo_tokenizer(vocab_size)  # validates vocab_size before touching disk
    out = Path(out_dir)
    _prepare_dir(out, force)

    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    if tokenizer_format == "tiktoken":
        tiktoken_text, tok_config, ids, vocab_size = _tiktoken_files(tokenizer)
    bos, eos = ids[ENDOFTEXT], ids[IM_END]
    config = _model_config(arch, size, vocab_size, bos, eos, tie_word_embeddings)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # Initialise in float32 and round afterwards, so every dtype holds the same draw.
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
        model.config.kvloom_demo = True  # is_demo_model: say the replies are random
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=bos, eos_token_id=[eos, ids[ENDOFTEXT]], pad_token_id=bos
        )
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()

    if tokenizer_format == "tiktoken":
        (out / "tiktoken.model").write_text(tiktoken_text, encoding="ascii")
    else:
        tokenizer.save(str(out / "tokenizer.json"))
        tok_config = _tokenizer_config(tokenizer)
    config_text = json.dumps(tok_config, indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config_text + "\n", encoding="utf-8")
    return out


RANDOM_WEIGHTS_NOTE = (
    "the demo model's weights are random, so its replies are gibberish; everything around "
    "them (tokenizer, chat template, parsers, serving) is real"
)


def is_demo_model(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a checkpoint written by write_demo_model (random weights)."""
    config_file = Path(model_dir) / "config.json"
    try:
        return bool(json.loads(config_file.read_text(encoding="utf-8")).get("kvloom_demo"))
    except (OSError, ValueError):
        return False
