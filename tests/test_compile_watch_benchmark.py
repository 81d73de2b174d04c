"""benchmarks/compile_watch.py: Triton's JIT hooks record each compile's kernel, step and
duration, chain the hooks already installed and are restored on exit. (Triton calls these
hooks only when it compiles for a device: here they are called as Triton calls them.)"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from triton import knobs

from tests.fake_clock import FakeClock

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import compile_watch  # noqa: E402


def compile_hooks(name: str, key: str, function: object, clock: FakeClock, seconds: float):
    """One compile as Triton's `_do_compile` reports it: the cache hook, then (after the
    compile's time) the post-compile hook, both with the same keyword arguments."""
    kwargs = dict(
        key=key,
        repr=f"{name}[...]",
        fn=SimpleNamespace(module="m", name=name, jit_function=function),
        compile={"key": key},
        is_manual_warmup=False,
        already_compiled=False,
    )
    skip = knobs.runtime.jit_cache_hook(**kwargs)
    clock.now += seconds
    knobs.runtime.jit_post_compile_hook(**kwargs)
    return skip


@pytest.fixture
def restore_hooks():
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_compiles_are_recorded_by_kernel_and_step(restore_hooks):
    clock, step = FakeClock(), [0]
    conv, norm = object(), object()
    with compile_watch.CompileWatch(step_of=lambda: step[0], clock=clock) as watch:
        assert compile_hooks("_conv", "k1", conv, clock, 0.5) is None  # compile goes on
        step[0] = 7
        compile_hooks("_norm", "k1", norm, clock, 2.0)
        step[0] = 9
        compile_hooks("_conv", "k2", conv, clock, 0.25)  # a new specialization
    assert watch.events == [
        dict(kernel="_conv", step=0, seconds=0.5),
        dict(kernel="_norm", step=7, seconds=2.0),
        dict(kernel="_conv", step=9, seconds=0.25),
    ]
    summary = watch.summary()
    assert summary["compiles"] == 3 and summary["seconds"] == 2.75
    assert list(summary["by_kernel"]) == ["_norm", "_conv"]  # slowest first
    assert summary["by_kernel"]["_conv"] == dict(count=2, seconds=0.75, first_step=0)


def test_installed_hooks_are_chained_and_restored(restore_hooks):
    seen = []

    def before(**kwargs):
        seen.append(("before", kwargs["fn"].name))
        return True  # Triton skips the compile on a true answer: it must reach Triton

    def after(**kwargs):
        seen.append(("after", kwargs["fn"].name))

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    clock = FakeClock()
    with compile_watch.CompileWatch(clock=clock) as watch:
        assert compile_hooks("_gemm", "k", object(), clock, 1.0) is True
    assert seen == [("before", "_gemm"), ("after", "_gemm")]
    assert [e["kernel"] for e in watch.events] == ["_gemm"]
    assert knobs.runtime.jit_cache_hook is before
    assert knobs.runtime.jit_post_compile_hook is after
    compile_hooks("_gemm", "k", object(), clock, 1.0)  # outside: not recorded
    assert len(watch.events) == 1


def test_hooks_are_restored_when_the_run_raises(restore_hooks):
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    with pytest.raises(RuntimeError), compile_watch.CompileWatch():
        raise RuntimeError("run failed")
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
