"""Finding markers in streamed text, and holding back a tail that may be the start of one.

Marker sets used with these helpers must not contain one marker inside another; then the
earliest complete marker in the buffer is the right one to act on.
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some marker: text that
    must be held back because the next piece may complete the marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def find_first_marker(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str | None]:
    """Position and value of the earliest complete marker at or after `start`, or (-1, None)."""
    best, found = -1, None
    for marker in markers:
        pos = text.find(marker, start)
        if pos >= 0 and (best < 0 or pos < best):
            best, found = pos, marker
    return best, found


def is_proper_prefix(text: str, markers: Sequence[str]) -> bool:
    """Whether `text` could still grow into one of `markers` (and is not one yet)."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)
