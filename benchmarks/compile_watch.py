"""Triton compiles that happen inside a timed run: which kernel, at which engine step, how
long each took.

A compile in the middle of an offline run is a stall no steady state has: a kernel first
launched with a new specialization (an integer argument that turns divisible by 16, a new
dtype) or an autotuned kernel meeting a new key compiles on the host while the device
waits, seconds on a cold cache. The twenty-ninth lease found such stalls in fla's
autotuned l2norm only by reading step spans; this names them. It hangs on Triton's
`knobs.runtime` JIT hooks, which fire around every in-memory cache miss (a kernel loaded
from the on-disk cache counts too, with a short duration), and chains any hooks already
installed.

    with CompileWatch(step_of=lambda: len(step_times)) as watch:
        ... run the workload ...
    watch.summary()
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable


class CompileWatch:
    """Records (kernel, step, seconds) for each Triton JIT compile between enter and exit.
    `step_of()` gives the engine step a compile belongs to (the caller's own count)."""

    def __init__(self, step_of: Callable[[], int] = lambda: 0, clock=time.perf_counter):
        self.step_of = step_of
        self.clock = clock
        self.events: list[dict] = []
        self._started: dict[tuple, float] = {}
        self._saved = None

    def __enter__(self) -> CompileWatch:
        from triton import knobs

        runtime = knobs.runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        before, after = self._saved

        def cache_hook(**kwargs):
            self._started[_compile_id(kwargs)] = self.clock()
            # A true return would tell Triton to skip the compile: pass on the chained one's.
            return before(**kwargs) if before is not None else None

        def post_compile_hook(**kwargs):
            started = self._started.pop(_compile_id(kwargs), None)
            if started is not None:
                self.events.append(
                    dict(
                        kernel=kwargs["fn"].name,
                        step=self.step_of(),
                        seconds=round(self.clock() - started, 4),
                    )
                )
            return after(**kwargs) if after is not None else None

        runtime.jit_cache_hook = cache_hook
        runtime.jit_post_compile_hook = post_compile_hook
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def summary(self, top: int = 15) -> dict:
        """Count and seconds in all, and per kernel (slowest first: count, seconds, the
        first step it compiled at)."""
        by_kernel = defaultdict(lambda: [0, 0.0, None])
        for event in self.events:
            row = by_kernel[event["kernel"]]
            row[0] += 1
            row[1] += event["seconds"]
            row[2] = event["step"] if row[2] is None else min(row[2], event["step"])
        ranked = sorted(by_kernel.items(), key=lambda item: -item[1][1])[:top]
        return dict(
            compiles=len(self.events),
            seconds=round(sum(e["seconds"] for e in self.events), 3),
            by_kernel={
                name: dict(count=count, seconds=round(seconds, 3), first_step=first)
                for name, (count, seconds, first) in ranked
            },
        )


def _compile_id(kwargs: dict) -> tuple:
    """One compile's identity across its two hooks: the function and its specialization key
    (the same objects Triton passes to both)."""
    return id(kwargs["fn"].jit_function), str(kwargs["key"])
