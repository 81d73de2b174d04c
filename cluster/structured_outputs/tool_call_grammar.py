"""The grammar of a forced tool choice: `tool_choice="required"` (one or more calls to the
offered tools) or a named tool (exactly one call to it), written in the call format of the
server's tool-call parser, so whatever the model samples parses as calls.

The grammar is an xgrammar structural tag (StructuredOutputsParams.structural_tag). Each
call's arguments follow the tool's JSON schema, as compact JSON (`{"a": 1, "b": [2]}`, no
free whitespace: a model cannot spend its budget on spaces), or, for `qwen3_coder`, as XML
parameters whose values are raw text where the schema allows a string and JSON otherwise
(what its parser types back by the schema). Formats are those the parsers read
(cluster/parsers/tool_calls/*) and the models' chat templates write.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvloom.cluster.parsers.registry import TOOL_CALL_PARSER_ALIASES, tool_call_parser_class
from kvloom.cluster.parsers.tool_calls.parameter_values import _schema_types
from kvloom.cluster.parsers.tool_calls.tool_schemas import function_of
from kvloom.cluster.structured_outputs.compiler import error_reason
from kvloom.contracts.sampling_params import StructuredOutputsParams

Format = dict[str, Any]
_NO_PARAMETERS = {"type": "object", "properties": {}}
# Text a raw XML value may not contain: each would end the value (or the call) in the parser.
_XML_VALUE_EXCLUDES = ["</parameter>", "<parameter=", "</function>", "</tool_call>"]


class ToolChoiceError(ValueError):
    """A forced tool choice that cannot be enforced; `field` names what to fix."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# ----- structural-tag building blocks (xgrammar's JSON format)


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _sequence(*elements: Format | None) -> Format:
    kept = [e for e in elements if e is not None]
    return kept[0] if len(kept) == 1 else {"type": "sequence", "elements": kept}


def _one_of(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


@lru_cache(maxsize=256)
def _compact_json_grammar(schema_text: str) -> str:
    """EBNF of the schema's documents without free whitespace (xgrammar's converter;
    no tokenizer needed, so the front door can check a schema before the engine sees it)."""
    import xgrammar

    return str(xgrammar.Grammar.from_json_schema(schema_text, any_whitespace=False))


def _json_value(schema: Any, name: str) -> Format:
    try:
        grammar = _compact_json_grammar(json.dumps(schema, sort_keys=False))
    except Exception as err:  # xgrammar's RuntimeError/ValueError with a reason
        raise ToolChoiceError(
            "tool_choice",
            f"the parameters schema of tool {name!r} does not compile: {error_reason(err)}",
        ) from None
    return {"type": "grammar", "grammar": grammar}


def _arguments(schema: Any, name: str) -> Format:
    """A call's arguments: always a JSON object (the parsers take nothing else), so a
    schema that leaves the type open is read as an object's."""
    if not isinstance(schema, dict):
        schema = _NO_PARAMETERS
    declared = schema.get("type", "object")
    if declared != "object" and not (isinstance(declared, list) and "object" in declared):
        raise ToolChoiceError(
            "tool_choice", f"the parameters of tool {name!r} must be an object schema"
        )
    return _json_value({**schema, "type": "object"}, name)


# ----- one call, per format


def _json_call(name: str, schema: Any, key: str) -> Format:
    """`{"name": NAME, "<key>": ARGS}`: the call object of hermes, llama3_json, mistral, minimax."""
    head = '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{key}": '
    return _sequence(_const(head), _arguments(schema, name), _const("}"))


def _hermes_call(name: str, schema: Any) -> Format:
    return _sequence(_const("<tool_call>\n"), _json_call(name, schema, "arguments"),
                     _const("\n</tool_call>"))  # fmt: skip


def _kimi_call(name: str, schema: Any) -> Format:
    # The id is functions.NAME:IDX; the parser keeps the index the model wrote.
    return _sequence(
        _const(f"<|tool_call_begin|>functions.{name}:"),
        {"type": "regex", "pattern": "0|[1-9][0-9]{0,2}"},
        _const("<|tool_call_argument_begin|>"),
        _arguments(schema, name),
        _const("<|tool_call_end|>"),
    )


def _deepseek_call(name: str, schema: Any) -> Format:
    # DeepSeek-V3's form (the parser reads V3.1's too): name line, then a fenced JSON block.
    return _sequence(
        _const(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"),
        _arguments(schema, name),
        _const("\n```<｜tool▁call▁end｜>"),
    )


def _deepseek_v31_call(name: str, schema: Any) -> Format:
    # DeepSeek-V3.1's form: the name before the separator, the JSON right after it.
    return _sequence(
        _const(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>"),
        _arguments(schema, name),
        _const("<｜tool▁call▁end｜>"),
    )


def _xml_value(schema: Any, name: str) -> Format:
    """A qwen3_coder parameter value: raw text where the schema allows a string (the parser
    keeps such text a string), JSON of the parameter's schema otherwise."""
    schema = schema if isinstance(schema, dict) else {}
    if "string" in _schema_types(schema):
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) and v for v in enum):
            return _one_of([_const(v) for v in enum])
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and pattern:
            return {"type": "regex", "pattern": pattern}
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) or isinstance(high, int):
            # Counted in characters, as JSON Schema counts (xgrammar's any_text max_chars
            # lets raw bytes through); such a value cannot hold a tag, so no `<`.
            low = low if isinstance(low, int) else 0
            high = "" if not isinstance(high, int) else high
            return {"type": "regex", "pattern": f"[^<]{{{low},{high}}}"}
        return {"type": "any_text", "excludes": list(_XML_VALUE_EXCLUDES)}
    return _json_value(schema, name)


def _qwen3_coder_call(name: str, schema: Any) -> Format:
    schema = schema if isinstance(schema, dict) else _NO_PARAMETERS
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    definitions = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parameters: list[Format] = []
    for key, sub in properties.items():
        if isinstance(sub, dict) and definitions:
            sub = {**definitions, **sub}  # a `$ref` inside still finds its definitions
        parameter = _sequence(
            _const(f"<parameter={key}>\n"), _xml_value(sub, name), _const("\n</parameter>\n")
        )
        parameters.append(
            parameter if key in required else {"type": "optional", "content": parameter}
        )
    return _sequence(
        _const(f"<tool_call>\n<function={name}>\n"),
        *parameters,
        _const("</function>\n</tool_call>"),
    )


@dataclass(frozen=True)
class _CallFormat:
    """A parser's calls: `begin CALL (separator CALL)* end`. `marked`: the calls open with
    one of the parser's start markers (which also end an open reasoning block)."""

    call: Callable[[str, Any], Format]
    separator: str
    begin: str = ""
    end: str = ""
    marked: bool = True


CALL_FORMATS: dict[str, _CallFormat] = {
    "hermes": _CallFormat(_hermes_call, "\n"),
    "qwen3_coder": _CallFormat(_qwen3_coder_call, "\n"),
    "kimi_k2": _CallFormat(
        _kimi_call, "", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    ),
    "llama3_json": _CallFormat(
        lambda n, s: _json_call(n, s, "parameters"), "; ", marked=False
    ),  # bare JSON: no marker
    "mistral": _CallFormat(lambda n, s: _json_call(n, s, "arguments"), ", ", "[TOOL_CALLS][", "]"),
    "deepseek_v3": _CallFormat(
        _deepseek_call, "\n", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    ),
    "deepseek_v31": _CallFormat(
        _deepseek_v31_call, "\n", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    ),
    "minimax": _CallFormat(
        lambda n, s: _json_call(n, s, "arguments"), "\n", "<tool_calls>\n", "\n</tool_calls>"
    ),
}


@dataclass(frozen=True)
class ReasoningRoom:
    """A reasoning block the model may write before its calls (the request's reasoning
    parser's tags); `opened`: the prompt opened it, so the output starts inside it."""

    start: str
    end: str
    opened: bool = False


def _with_reasoning(
    calls: Format, room: ReasoningRoom, call_markers: tuple[str, ...], marked: bool
) -> Format:
    """Free reasoning (no end tag and no call marker inside), its end tag, then the calls,
    as vLLM constrains only what follows the reasoning. Where the prompt opened the block
    and the format has a start marker, the calls may also come at once: the marker ends
    the block (docs/parsers.md)."""
    text = {"type": "any_text", "excludes": [room.end, *call_markers]}
    gap = {"type": "regex", "pattern": "\\n{0,2}"}
    if room.opened:
        closed = _sequence(text, _const(room.end), gap, calls)
        return _one_of([calls, closed]) if marked else closed
    block = _sequence(_const(room.start), text, _const(room.end), gap)
    return _sequence({"type": "optional", "content": block}, calls)


def tool_call_structural_tag(
    parser: str,
    tools: Sequence[dict[str, Any] | str],
    named: str | None = None,
    reasoning: ReasoningRoom | None = None,
    parallel: bool = True,
) -> str:
    """The structural tag (JSON text) whose sentences are calls in `parser`'s format: one
    call to the tool `named`, or, without a name, one or more calls to any of `tools`
    (exactly one where `parallel` is False: OpenAI's `parallel_tool_calls: false`); after
    a reasoning block where `reasoning` allows one."""
    # A variant's own format first (deepseek_v31), else its parser's.
    key = parser if parser in CALL_FORMATS else TOOL_CALL_PARSER_ALIASES.get(parser, parser)
    call_format = CALL_FORMATS.get(key)
    if call_format is None:
        raise ToolChoiceError(
            "tool_choice",
            f"cannot be enforced with the {parser!r} tool-call parser (forced calls are "
            f'written for: {", ".join(sorted(CALL_FORMATS))}); use "auto"',
        )
    functions = [function_of(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if named is not None:
        functions = [f for f in functions if f["name"] == named]
        if not functions:
            raise ToolChoiceError("tool_choice", f"{named!r} is not one of the tools")
    if not functions:
        raise ToolChoiceError("tool_choice", "needs tools")
    one = _one_of(
        [call_format.call(f["name"], f.get("parameters") or _NO_PARAMETERS) for f in functions]
    )
    if named is not None or not parallel:
        calls = one
    elif call_format.separator:
        calls = _sequence(
            one, {"type": "star", "content": _sequence(_const(call_format.separator), one)}
        )
    else:
        calls = {"type": "plus", "content": one}
    begin = _const(call_format.begin) if call_format.begin else None
    end = _const(call_format.end) if call_format.end else None
    root = _sequence(begin, calls, end)
    if reasoning is not None:
        markers = tool_call_parser_class(key).start_markers
        root = _with_reasoning(root, reasoning, tuple(markers), call_format.marked)
    return json.dumps({"type": "structural_tag", "format": root}, ensure_ascii=False)


def tool_choice_constraint(
    parser: str,
    tools: Sequence[dict[str, Any] | str],
    named: str | None = None,
    reasoning: ReasoningRoom | None = None,
    parallel: bool = True,
) -> StructuredOutputsParams:
    tag = tool_call_structural_tag(parser, tools, named, reasoning, parallel)
    return StructuredOutputsParams(structural_tag=tag)


def forced_tool_choice(
    tools: Sequence[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
) -> tuple[list[dict[str, Any]] | None, str | bool | None]:
    """OpenAI's tool_choice, offline (`LLM.chat`): the tools to render and what is forced
    (None: nothing; True: one or more calls; a name: one call to it), as the doors do:
    "none" renders no tools, a named tool renders only that one."""
    offered = list(tools) if tools else None
    if tool_choice is None or tool_choice == "auto":
        return offered, None
    if tool_choice == "none":
        return None, None
    if not offered:
        raise ToolChoiceError("tool_choice", f"{tool_choice!r} needs tools")
    if tool_choice == "required":
        return offered, True
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ToolChoiceError(
            "tool_choice",
            '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {tool_choice!r}",
        )
    named = [t for i, t in enumerate(offered) if function_of(t, f"tools[{i}]")["name"] == name]
    if not named:
        raise ToolChoiceError("tool_choice", f"{name!r} is not one of the tools")
    return named, name


def default_tool_call_parser(model_dir: str, template) -> str | None:
    """The tool-call parser the server picks for this model (`--tool-call-parser auto`)."""
    from pathlib import Path

    from kvloom.cluster.frontend.model_files import tool_call_parser_for_template
    from kvloom.cluster.parsers.registry import parsers_for_model

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    model_type = str(
        config.get("model_type") or (config.get("text_config") or {}).get("model_type") or ""
    )
    return tool_call_parser_for_template(template) or parsers_for_model(model_type, model_dir)[0]
