"""Chat templates: loaded from a Hugging Face model directory, rendered as transformers does.

Loading: `chat_template.jinja` (and named ones in `chat_templates/*.jinja`) win over
`tokenizer_config.json`'s `chat_template`, which is a string or a list of
{"name", "template"}. With several named templates, `tool_use` is chosen when tools are given
and it exists, else `default`.

Rendering: a sandboxed jinja2 environment set up like transformers' (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols; a `tojson` that keeps non-ASCII and does not escape
HTML; `raise_exception`; `strftime_now`; `{% generation %}` blocks accepted), with the variables
`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens (`bos_token`,
`eos_token`, ...) and any extra kwargs (`enable_thinking`, ...). As transformers does, keys whose
value is None are dropped from messages and reasoning is aliased (`reasoning_content`,
`thinking`). Before rendering, tool-call arguments given as JSON text (as OpenAI clients send
them) become dicts: templates differ in how they print a string (double-encoding it, or
iterating `|items` and failing), and all of them print a dict right.

BOS: templates write their own BOS (`{{ bos_token }}`) where the model wants one, so a rendered
chat is encoded with `add_special_tokens=False` (as transformers and vLLM do), which can never
add a second one. `RenderedChat.starts_with_bos` lets a caller that encodes the text some other
way (a RenderChat result sent back as a raw Generate prompt) skip the tokenizer's BOS;
`add_special_tokens_for(text, bos_token)` says which to use.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES_DIR = "chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Variables the renderer sets; chat_template_kwargs may not replace them.
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass
class RenderedChat:
    text: str
    # The text starts with the BOS token: encode it without adding special tokens.
    starts_with_bos: bool


def add_special_tokens_for(text: str, bos_token: str | None) -> bool:
    """For a text prompt: let the tokenizer add its special tokens (BOS) only if the text does
    not already start with BOS (a rendered chat does when its template writes one)."""
    return not (bos_token and text.startswith(bos_token))


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_templates(model_dir: str | Path) -> dict[str, str]:
    """Named templates of a model directory ({} if it has none)."""
    model_dir = Path(model_dir)
    templates: dict[str, str] = {}
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    named_dir = model_dir / CHAT_TEMPLATES_DIR
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    config = _read_tokenizer_config(model_dir)
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        f"chat_template in {model_dir / TOKENIZER_CONFIG_FILE} must be a string or a list of "
        '{"name", "template"} objects'
    )


def _read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def load_special_tokens(model_dir: str | Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (from tokenizer_config.json, with
    a legacy special_tokens_map.json filling gaps)."""
    model_dir = Path(model_dir)
    tokens: dict[str, str] = {}
    legacy = model_dir / "special_tokens_map.json"
    sources = [_read_tokenizer_config(model_dir)]
    if legacy.is_file():
        sources.append(json.loads(legacy.read_text(encoding="utf-8")))
    for source in sources:
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(source.get(key))
            if text is not None and key not in tokens:
                tokens[key] = text
    return tokens


# ----- the jinja environment


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}…{% endgeneration %}` (used by templates that mark assistant
    tokens for training) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _GuardedNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, keeping templates away from internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _GuardedNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _GuardedNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _GuardedNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: line {exc.lineno}: {exc.message}") from None


# ----- inputs


def _parse_arguments(arguments: Any, field: str) -> Any:
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        raise ValueError(f"{field}: not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{field}: must be a JSON object, got {type(parsed).__name__}")
    return parsed


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages as templates want them: None-valued keys dropped, tool-call
    arguments as dicts, reasoning under both of its common names."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        msg = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            for j, call in enumerate(tool_calls):
                field = f"messages[{i}].tool_calls[{j}]"
                if not isinstance(call, dict):
                    raise ValueError(f"{field} must be an object")
                function = call.get("function")
                if isinstance(function, dict) and "arguments" in function:
                    function["arguments"] = _parse_arguments(
                        function["arguments"], f"{field}.function.arguments"
                    )
                elif "arguments" in call:
                    call["arguments"] = _parse_arguments(call["arguments"], f"{field}.arguments")
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        result.append(msg)
    return result


def normalize_tools(tools: Sequence[Mapping[str, Any] | str] | None) -> list[dict] | None:
    """Tools as dicts (JSON text accepted), passed to the template as given."""
    if tools is None:
        return None
    result = []
    for i, tool in enumerate(tools):
        if isinstance(tool, str):
            try:
                tool = json.loads(tool)
            except ValueError as exc:
                raise ValueError(f"tools[{i}]: not valid JSON: {exc}") from None
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be an object")
        result.append(copy.deepcopy(dict(tool)))
    return result


# ----- the template


class ChatTemplate:
    """A model's chat template(s) and the special tokens its templates may print."""

    def __init__(
        self, templates: Mapping[str, str] | str, special_tokens: Mapping[str, str] | None = None
    ) -> None:
        if isinstance(templates, str):
            templates = {"default": templates}
        if not templates:
            raise ValueError("chat_template: no template given")
        self.templates = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        for source in self.templates.values():
            compile_template(source)  # fail at load, not at the first request

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The directory's templates, or None when it has none."""
        templates = load_chat_templates(model_dir)
        if not templates:
            return None
        return cls(templates, load_special_tokens(model_dir))

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def source(self, name: str | None = None, with_tools: bool = False) -> str:
        if name is not None:
            if name not in self.templates:
                raise ValueError(
                    f"chat_template: no template named {name!r}; have {sorted(self.templates)}"
                )
            return self.templates[name]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if with_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ValueError(
            f"chat_template: several templates and no default; name one of {sorted(self.templates)}"
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any] | str] | None = None,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        template_name: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> RenderedChat:
        """Renders the prompt text. `chat_template_kwargs` (a request's JSON object) and extra
        kwargs become template variables and may override the special tokens; errors raised by
        the template (such as `raise_exception('roles must alternate')`) become ValueError."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError("chat_template_kwargs must be a JSON object")
        kwargs = {**(chat_template_kwargs or {}), **kwargs}
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message: cannot be combined with add_generation_prompt"
            )
        for key in kwargs:
            if key in _RESERVED:
                raise ValueError(f"chat_template_kwargs.{key}: is set by the server")
        chat = normalize_messages(messages)
        tool_list = normalize_tools(tools)
        template = compile_template(self.source(template_name, with_tools=bool(tool_list)))
        final_text = None
        if continue_final_message:
            final_text = self._tag_final_message(chat)
        try:
            text = template.render(
                messages=chat,
                tools=tool_list,
                documents=copy.deepcopy(documents),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            # raise_exception(...) or a template tripping over input it does not expect (content
            # parts where it wants a string): the request's fault, so ValueError.
            raise ValueError(f"messages: the chat template rejected them: {exc}") from None
        if final_text is not None:
            text = self._cut_after_final_message(text, final_text)
        bos = self.bos_token
        return RenderedChat(text=text, starts_with_bos=bool(bos) and text.startswith(bos))

    @staticmethod
    def _tag_final_message(chat: list[dict[str, Any]]) -> str:
        """Marks the end of the final message's text so the rendering can be cut there (the
        template would otherwise close the message)."""
        if not chat:
            raise ValueError("continue_final_message: messages is empty")
        content = chat[-1].get("content")
        if isinstance(content, str):
            chat[-1]["content"] = content + _CONTINUE_TAG
            return content
        if isinstance(content, list):
            for part in reversed(content):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    original = part["text"]
                    part["text"] = original + _CONTINUE_TAG
                    return original
        raise ValueError("continue_final_message: the final message has no text to continue")

    @staticmethod
    def _cut_after_final_message(text: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if tag not in text or final_text.strip() not in text:
            raise ValueError(
                "continue_final_message: the chat template does not print the final message"
            )
        pos = text.rindex(tag)
        if text[pos : pos + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:pos]
        return text[:pos].rstrip()  # the template trimmed the message's trailing space
