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


def test_other_row_bounds_take_their_own_picks_and_keep_the_current_tile_where_unmeasured():
    a, b = tile(64, 128), tile(128)
    rows = [row("qkv", 256, a, 0.01), row("qkv", 256, b, 0.02)]
    rows += [row("qkv", 512, a, 0.05), row("qkv", 512, b, 0.03)]
    table = batch_invariant_plans.best_table(rows, bounds=[128, 256, 512])
    current = dict(bit.SM90_MATMUL_PLANS)
    assert table == [[128, current[128]], [256, a], [512, b], [None, current[None]]]


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


@pytest.fixture
def table_restored(monkeypatch):
    """The module's tables put back after the test, whatever it set."""
    monkeypatch.setattr(bit, "SM90_MATMUL_PLANS", bit.SM90_MATMUL_PLANS)
    monkeypatch.setattr(bit, "SM90_SHAPE_PLANS", bit.SM90_SHAPE_PLANS)


def shaped_row(layer, n, k, m, plan, ms, same=True):
    return {**row(layer, m, plan, ms, same), "n": n, "k": k}


def test_the_table_file_has_a_table_per_weight_shape_without_tiles_that_changed_bits():
    small, big, wrong = tile(64), tile(128), tile(256)
    rows = [
        # qkv: `big` fastest above 512; o: `small`; `wrong` fastest for o but changed bits on qkv
        shaped_row("qkv", 6144, 4096, 4096, small, 2.0),
        shaped_row("qkv", 6144, 4096, 4096, big, 1.0),
        shaped_row("qkv", 6144, 4096, 4096, wrong, 0.5, same=False),
        shaped_row("o", 4096, 4096, 4096, small, 1.0),
        shaped_row("o", 4096, 4096, 4096, big, 1.5),
        shaped_row("o", 4096, 4096, 4096, wrong, 0.1),
    ]
    table = batch_invariant_plans.tables(rows)
    assert set(table["by_shape"]) == {"6144,4096", "4096,4096"}
    assert table["by_shape"]["6144,4096"][-1][1] == big
    assert table["by_shape"]["4096,4096"][-1][1] == small  # not `wrong`: it failed on qkv
    assert table["plans"][-1][1] == big  # 2.5 ms summed against small's 3.0
    assert batch_invariant_plans.layer_shape("o") == (4096, 4096)
    assert batch_invariant_plans.layer_shape("1024,2048") == (1024, 2048)
    with pytest.raises(SystemExit, match="--layers"):
        batch_invariant_plans.layer_shape("1024x2048")


def test_a_shape_with_its_own_tiles_takes_them_and_other_shapes_the_generic_ones(table_restored):
    bf16 = bit.torch.bfloat16
    bit.set_matmul_table(
        [[None, tile(128)]], {"6144,4096": [[256, tile(64, 128)], [None, tile(64)]]}
    )
    assert bit.matmul_plan(256, (9, 0), bf16, (6144, 4096)) == tile(64, 128)
    assert bit.matmul_plan(257, (9, 0), bf16, (6144, 4096)) == tile(64)
    assert bit.matmul_plan(256, (9, 0), bf16, (4096, 4096)) == tile(128)
    assert bit.matmul_plan(256, (9, 0), bf16) == tile(128)
    assert bit.matmul_plan(256, (8, 0), bf16, (6144, 4096)) == bit.MATMUL_PLAN  # Hopper only
    saved = bit.matmul_table()
    bit.set_matmul_table([[None, tile(64)]])
    assert bit.SM90_SHAPE_PLANS == {}
    bit.set_matmul_table(*saved)  # restores both
    assert bit.matmul_plan(1, (9, 0), bf16, (6144, 4096)) == tile(64, 128)


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "cannot read a tile table"),
        ("{not json", "cannot read a tile table"),
        ('{"by_shape": {}}', "expected"),
        ('{"plans": [[null, {"BLOCK_M": 64}]]}', "lacks integer"),
        ('{"plans": [[null, %s]], "by_shape": {"6144x4096": [[null, %s]]}}', "'N,K'"),
        ('{"plans": [[128, %s]]}', "ending in None"),
    ],
)
def test_a_bad_table_file_is_refused_naming_the_file_and_keeps_the_table(
    tmp_path, table_restored, content, match
):
    path = tmp_path / "table.json"
    if content is not None:
        plan = bit.json.dumps(tile(64))
        path.write_text(content.replace("%s", plan))
    before = bit.matmul_table()
    with pytest.raises(ValueError, match=match) as err:
        bit.load_matmul_table(path)
    assert str(path) in str(err.value)
    assert bit.matmul_table() == before


def test_the_variable_loads_a_table_where_a_deterministic_model_is_built(
    tmp_path, monkeypatch, table_restored
):
    from types import SimpleNamespace

    from kvloom.kernels import dispatch
    from kvloom.workers.layers.quantization.build import build_model

    monkeypatch.setattr(dispatch, "_batch_invariant", False)  # build_model sets it: put back
    path = tmp_path / "tiles.json"
    path.write_text(bit.json.dumps({"plans": [[None, tile(128, 128)]]}))
    monkeypatch.setenv("KVLOOM_DETERMINISTIC_TILES", str(path))
    config = SimpleNamespace(deterministic=False, quantization=None, text_config={})
    build_model(lambda *args: bit.torch.nn.Linear(2, 2), config, bit.torch.float32, None, "cpu")
    assert bit.matmul_plan(1000, (9, 0), bit.torch.bfloat16) != tile(128, 128)  # mode off
    config.deterministic = True
    build_model(lambda *args: bit.torch.nn.Linear(2, 2), config, bit.torch.float32, None, "cpu")
    assert bit.matmul_plan(1000, (9, 0), bit.torch.bfloat16) == tile(128, 128)
    monkeypatch.setenv("KVLOOM_DETERMINISTIC_TILES", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="KVLOOM_DETERMINISTIC_TILES: .*missing.json"):
        build_model(lambda *args: bit.torch.nn.Linear(2, 2), config, bit.torch.float32, None, "cpu")
