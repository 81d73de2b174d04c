"""What the front door reads from the model directory itself: the tokenizer, the chat
template, config.json, and which output parsers fit the model. The front door never
reaches into the engine, which may live in another process; the tokenizer is the process's
one (cluster/shared_tokenizer.py), so where the engine runs in this process, the front
door, its output processor and the engine core share one object."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloom.cluster.chat_template import ChatTemplate
from kvloom.cluster.frontend.options import AUTO, NONE
from kvloom.cluster.parsers import (
    parsers_for_model,
    reasoning_parser_class,
    tool_call_parser_class,
)
from kvloom.cluster.shared_tokenizer import shared_tokenizer
from kvloom.cluster.tokenizer import Tokenizer


@dataclass
class ModelFiles:
    model: str
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    tool_call_parser: str | None
    reasoning_parser: str | None

    @property
    def text_config(self) -> dict[str, Any]:
        return self.hf_config.get("text_config") or self.hf_config

    @property
    def model_type(self) -> str:
        # The checkpoint's own type ("qwen3_5"), not its text half's ("qwen3_5_text").
        return str(self.hf_config.get("model_type") or self.text_config.get("model_type") or "")

    @property
    def architectures(self) -> list[str]:
        return list(
            self.hf_config.get("architectures") or self.text_config.get("architectures") or []
        )


# What a chat template writes when it renders an assistant's tool call, most specific
# first: the template, not the model type, says how the model was taught to call tools.
_TOOL_CALL_MARKERS = (
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "deepseek_v3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
)


def tool_call_parser_for_template(template: ChatTemplate | None) -> str | None:
    """The tool-call parser whose format the chat template writes, if it writes a known one."""
    if template is None:
        return None
    sources = "".join(template.templates.values())
    return next((name for marker, name in _TOOL_CALL_MARKERS if marker in sources), None)


def _choose(flag: str, by_model: str | None, resolve) -> str | None:
    if flag == NONE:
        return None
    if flag == AUTO:
        return by_model
    resolve(flag)  # raises ValueError naming the flag and the choices
    return flag


def load_model_files(
    model: str, tool_call_parser: str = AUTO, reasoning_parser: str = AUTO
) -> ModelFiles:
    path = Path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: no config.json in {model}")
    hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    files = ModelFiles(
        model=str(model),
        hf_config=hf_config,
        tokenizer=shared_tokenizer(path),
        chat_template=ChatTemplate.from_model_dir(path),
        tool_call_parser=None,
        reasoning_parser=None,
    )
    default_tools, default_reasoning = parsers_for_model(files.model_type, str(model))
    # A llama checkpoint whose template writes Hermes calls (the demo model, many
    # fine-tunes) is parsed as its template writes, not as Llama 3's JSON.
    default_tools = tool_call_parser_for_template(files.chat_template) or default_tools
    files.tool_call_parser = _choose(tool_call_parser, default_tools, tool_call_parser_class)
    files.reasoning_parser = _choose(reasoning_parser, default_reasoning, reasoning_parser_class)
    return files
