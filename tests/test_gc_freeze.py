"""Start-up objects are frozen out of the cyclic collector (contracts/gc_freeze.py)."""

import gc
from types import SimpleNamespace

import pytest

from kvloom.cluster.bench import make_engine
from kvloom.contracts.gc_freeze import freeze_startup_objects


def test_freeze_skips_objects_alive_at_the_call_only():
    gc.unfreeze()
    before = [object()]  # a tracked container alive at the freeze
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        # Frozen objects sit in the permanent generation, which collections never walk.
        assert not any(obj is before for obj in gc.get_objects())
        after = [object()]
        assert any(obj is after for obj in gc.get_objects())
    finally:
        gc.unfreeze()


def test_bench_engine_is_frozen(tiny_model):
    gc.unfreeze()
    args = SimpleNamespace(
        dtype="float32",
        load_format="safetensors",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
    )
    engine = make_engine(str(tiny_model()), args)
    try:
        params = list(engine.executor.worker.runner.model.parameters())
        assert gc.get_freeze_count() > 1000
        assert not any(any(obj is p for p in params) for obj in gc.get_objects())
    finally:
        engine.shutdown()
        gc.unfreeze()


def test_freeze_raises_the_young_generation_threshold(monkeypatch):
    """Python's 700 collected the young generation every ~75 decode rows (host time)."""
    saved = gc.get_threshold()
    try:
        freeze_startup_objects()
        assert gc.get_threshold() == (20000, saved[1], saved[2])
        monkeypatch.setenv("KVLOOM_GC_YOUNG_THRESHOLD", "5000")
        freeze_startup_objects()
        assert gc.get_threshold()[0] == 5000
        monkeypatch.setenv("KVLOOM_GC_YOUNG_THRESHOLD", "lots")
        with pytest.raises(ValueError, match="KVLOOM_GC_YOUNG_THRESHOLD must be an integer"):
            freeze_startup_objects()
    finally:
        gc.set_threshold(*saved)
        gc.unfreeze()
