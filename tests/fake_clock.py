"""A clock that moves only when a test moves it: benchmark tools that time the host take
it in place of `time.perf_counter`, so their sums are exact."""

from __future__ import annotations


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
