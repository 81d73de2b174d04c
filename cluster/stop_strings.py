"""Stop strings matched on detokenized text, across token boundaries."""

from __future__ import annotations


class StopStringMatcher:
    """Finds the earliest stop string in the growing output text.

    Only the tail that could contain a new match is searched each time. `safe_length`
    tells a streamer how much text can be sent without emitting the start of a stop
    string that the next token might complete.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False):
        self.stops = list(stops)
        self.include = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.searched = 0  # text length already searched
        # Every proper prefix of a stop string: what a text may not end in when streamed.
        self._prefixes = {stop[:k] for stop in self.stops for k in range(1, len(stop))}

    def check(self, text: str) -> tuple[str, str] | None:
        """Returns (truncated text, matched stop) if a stop string occurs, else None."""
        if not self.stops:
            return None
        start = max(0, self.searched - self.max_len + 1)
        self.searched = len(text)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        end = pos + len(stop) if self.include else pos
        return text[:end], stop

    def safe_length(self, text: str) -> int:
        """Length of the prefix of `text` that cannot be the start of a stop string."""
        prefixes = self._prefixes
        for keep in range(min(self.max_len - 1, len(text)), 0, -1):
            if text[-keep:] in prefixes:
                return len(text) - keep
        return len(text)
