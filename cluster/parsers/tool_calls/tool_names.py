"""Resolving the name a model wrote for a call against the tools the request offered.

Models write names in forms their templates taught them: Kimi's `functions.NAME:IDX` ids
(also `functions_NAME_IDX` and `functionsNAME` once clients sanitise ids), names with spaces
or a different case. The rule (docs/parsers.md): the written name, then its forms without a
`functions` prefix and a trailing call index, are looked up in order; then the one offered
name equal to it up to case and separators (space, `-`, `.`, `_`). A name that resolves to no
offered tool, or to two, is not a call. Without offered tools the name is taken as written,
unless it holds whitespace.
"""

from __future__ import annotations

import re
from collections.abc import Collection

_PREFIX = re.compile(r"^(?:functions?|tools?)(?:[._:]|(?=[A-Za-z]))", re.IGNORECASE)
_INDEX = re.compile(r"[:._\-]?\d+$")
_SEPARATORS = re.compile(r"[\s\-._]+")


def _forms(name: str) -> list[str]:
    forms = [name]
    unprefixed = _PREFIX.sub("", name, count=1)
    for base in dict.fromkeys([name, unprefixed]):
        forms += [base, _INDEX.sub("", base)]
    return [f for f in dict.fromkeys(forms) if f]


def _key(name: str) -> str:
    return _SEPARATORS.sub("_", name).strip("_").casefold()


def resolve_tool_name(written: str, offered: Collection[str]) -> str | None:
    """The offered tool `written` names, or None; without offered tools, `written` stripped
    (None if empty or if it holds whitespace)."""
    name = written.strip()
    if not name:
        return None
    if not offered:
        return None if any(c.isspace() for c in name) else name
    forms = _forms(name)
    for form in forms:
        if form in offered:
            return form
    keys = {_key(f) for f in forms} - {""}
    matches = [tool for tool in offered if _key(tool) in keys]
    return matches[0] if len(matches) == 1 else None


def call_index_of(written: str) -> str | None:
    """The trailing call index of an id such as `functions.f:3` (here "3"), or None."""
    match = re.search(r"\d+$", written.strip())
    return match.group() if match else None
