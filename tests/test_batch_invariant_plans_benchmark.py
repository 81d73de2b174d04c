"""benchmarks/batch_invariant_plans.py's table choice and the kernel module's table setter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import kvloom.kernels.batch_invariant_triton as bit

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import batch_invariant_plans  # noqa: E402


def tile(bm, bn=64):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def row(layer, m, plan, ms, same=True):
    return {"layer": layer, "m": m, "plan": plan, "ms": ms, "same_bits_as_plan": same}


def test_each_range_takes_the_least_summed_tile_that_kept_the_bits_everywhere():
    fast_once, steady, wrong_bits = tile(64, 128), tile(128), tile(256)
    rows = [
        # 129-512: fast_once wins M=256 but was not measured at 512 on 'down': not eligible
        row("qkv", 256, fast_once, 0.01), row("qkv", 256, steady, 0.05),
        row("down", 256, steady, 0.05), row("qkv", 512, steady, 0.09),
        row("down", 512, steady, 0.09), row("qkv", 256, wrong_bits, 0.001, same=False),
        row("qkv", 512, wrong_bits, 0.001), row("down", 256, wrong_bits, 0.001),
        row("down", 512, wrong_bits, 0.001),
        # > 512: the sum decides, not one case
        row("qkv", 4096, fast_once, 1.0), row("down", 4096, fast_once, 3.0),
        row("qkv", 4096, steady, 1.5), row("down", 4096, steady, 2.0),
    ]  # fmt: skip
    table = batch_invariant_plans.best_table(rows)
    assert [most for most, _ in table] == [most for most, _ in bit.SM90_MATMUL_PLANS]
    assert table[0][1] == bit.SM90_MATMUL_PLANS[0][1]  # no M <= 128 measured: kept
    assert table[1][1] == steady
    assert table[2][1] == steady  # 3.5 ms summed against 4.0


def test_every_candidate_pipeline_fits_the_shared_memory_budget():
    tried = list(batch_invariant_plans.candidates())
    assert {p["BLOCK_M"] for p in tried} == {64, 128, 256}
    for p in tried:
        stage = (p["BLOCK_M"] + p["BLOCK_N"]) * p["BLOCK_K"] * 2
        assert p["num_stages"] * stage <= batch_invariant_plans.SHARED_MEMORY_BYTES


def test_each_tile_is_tried_with_pointer_bulk_copy_and_persistent_loads():
    every = list(batch_invariant_plans.candidates())
    pointers = list(batch_invariant_plans.candidates(["pointers"]))
    bulk = list(batch_invariant_plans.candidates(["tma"]))
    persistent = list(batch_invariant_plans.candidates(["persistent"]))
    assert not any("tma" in p or "persistent" in p for p in pointers)
    assert all(p.pop("tma") is True and "persistent" not in p for p in bulk)
    assert all(p.pop("tma") is True and p.pop("persistent") is True for p in persistent)
    assert bulk == pointers == persistent and len(every) == 3 * len(pointers)


def test_a_table_is_checked_then_set_for_the_process(monkeypatch):
    monkeypatch.setattr(bit, "SM90_MATMUL_PLANS", bit.SM90_MATMUL_PLANS)
    with pytest.raises(ValueError, match="ending in None"):
        bit.set_matmul_table([[512, tile(64)], [128, tile(128)], [None, tile(64)]])
    with pytest.raises(ValueError, match="ending in None"):
        bit.set_matmul_table([[128, tile(64)]])
    bit.set_matmul_table([[100, tile(64, 128)], [None, tile(128)]])
    assert bit.matmul_plan(100, (9, 0), bit.torch.bfloat16) == tile(64, 128)
    assert bit.matmul_plan(101, (9, 0), bit.torch.bfloat16) == tile(128)
    assert bit.matmul_plan(101, (8, 0), bit.torch.bfloat16) == bit.MATMUL_PLAN  # Hopper only
