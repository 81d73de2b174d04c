"""Keeps Python's cyclic garbage collector off the objects that live for the whole run.

After start-up the process holds hundreds of thousands of long-lived container objects
(modules, torch and Triton objects, the block pool's blocks). Every full collection walks
them all, and the engine's steady trickle of small per-step objects triggers collections
often: at 512 running requests a full step of host work took 21.4 ms with the default
collector and 18.4 ms with the start-up objects frozen (measured on the CPU with the model
stubbed out). Freezing moves them to a permanent generation the collector skips; objects
made later (requests, outputs) are still collected as usual.

The youngest generation's threshold is raised too (KVLOOM_GC_YOUNG_THRESHOLD, 20,000).
Python collects it whenever allocations outnumber deallocations by 700, and one decode
step holds a few objects per row alive at once (sampling rows, outputs), so at 1000 rows
the default collected the young generation several times a step and ran a full collection
every ~15 steps, walking every request's token lists (up to 24 ms each). With the model
stubbed out on the CPU (`benchmarks/host_step_cost.py --rows 1000 --offline --steps 400`,
the bench's one-output-per-request sampling): 14.8 ms of host work per step by default,
1.8 ms of it collecting, and 13.4 ms at 20,000 (one collection in the run). With a
cumulative output per row and step (`Engine.step`'s default) the run allocates more:
25.3 ms by default, 5.7 ms of it collecting, and 19.6 ms at 20,000.
Cyclic garbage is still collected, only less often.

Called where a process serves one engine for its life (`kvloom serve`, the Ray scheduler
and worker actors, `kvloom bench`), not from `Engine` itself: a frozen object is never
collected, so a program that builds and drops engines (tests, notebooks) would keep any
cyclic garbage of the old ones.

It sits with the contracts, not in either plane, because processes of both planes call it
(the scheduler side and the worker actors) and the data plane imports no control-plane
module.
"""

from __future__ import annotations

import atexit
import gc

from kvloom.contracts import envs

_registered = False


def freeze_startup_objects() -> None:
    """Collects once, freezes what is left and raises the young generation's threshold
    (call after the engine is built)."""
    global _registered
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(envs.gc_young_threshold(), middle, oldest)
    if not _registered:
        # Frozen objects are never freed at exit; native bindings (nanobind) then report
        # them as leaks. Handing them back to the collector first keeps exit quiet.
        atexit.register(gc.unfreeze)
        _registered = True
