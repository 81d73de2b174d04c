"""Tokenizer loading from a Hugging Face directory.

`Tokenizer(model_dir)` reads `tokenizer.json` through the `tokenizers` library; a directory
that ships a tiktoken vocabulary instead (`tiktoken.model`, as Kimi models do) gets a
`TiktokenTokenizer` (cluster/tiktoken_tokenizer.py) with the same interface.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"


def _token_text(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(model_dir: Path) -> dict:
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    return config


class Tokenizer:
    """Encodes and decodes; knows the special tokens and the EOS ids."""

    def __new__(cls, model_dir: str | Path | None = None):
        # None: unpickling, which restores the instance's own class and state.
        path = Path(model_dir) if model_dir is not None else None
        if (
            cls is Tokenizer
            and path is not None
            and not (path / TOKENIZER_JSON).is_file()
            and (path / TIKTOKEN_MODEL).is_file()
        ):
            from kvloom.cluster.tiktoken_tokenizer import TiktokenTokenizer

            return super().__new__(TiktokenTokenizer)
        return super().__new__(cls)

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.config: dict = read_tokenizer_config(model_dir)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._load(model_dir)
        self.eos_token_ids = self._read_eos_ids(model_dir)

    def _load(self, model_dir: Path) -> None:
        tokenizer_file = model_dir / TOKENIZER_JSON
        if not tokenizer_file.is_file():
            raise ValueError(f"model: no {TOKENIZER_JSON} (or {TIKTOKEN_MODEL}) in {model_dir}")
        self._tok = HFTokenizer.from_file(str(tokenizer_file))
        self.special_ids = {
            token.id if hasattr(token, "id") else tid
            for tid, token in self._tok.get_added_tokens_decoder().items()
            if token.special
        }

    def _read_eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            path = model_dir / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                if value is not None:
                    ids = value if isinstance(value, list) else [value]
                    break
        if not ids and self.eos_token is not None:
            eos = self.token_to_id(self.eos_token)
            ids = [] if eos is None else [eos]
        return tuple(int(i) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> HFTokenizer | None:
        """The `tokenizers` object, for its native incremental decoder; None for a
        vocabulary loaded another way (tiktoken)."""
        tok = getattr(self, "_tok", None)
        return tok if isinstance(tok, HFTokenizer) else None

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
