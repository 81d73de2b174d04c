"""The one block pool on shared page buffers, as the control plane plans it from the specs
the workers report (cluster/kv_cache/planner.py): groups cut to one size, pages sized for
attention blocks with a recurrent state spanning several of them, and layers viewing the
same memory, so a block freed by one group is memory another group can use."""

from __future__ import annotations

import json
import logging

import pytest

from kvloom import Engine
from kvloom.cluster.kv_cache.planner import (
    num_blocks_for_memory,
    pages_for_state,
    plan_kv_cache,
    plan_layout,
    resolve_block_size,
    split_groups,
)
from kvloom.contracts.config import CacheConfig, SchedulerConfig
from kvloom.contracts.kv_cache_plan import REPORTED_BLOCK_SIZE, KVCacheMemory, KVCacheSpecs
from kvloom.contracts.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    LinearStateSpec,
    SlidingWindowSpec,
)
from kvloom.workers.layers.attention import PagedAttention

# Qwen3-Next's widths: 2 KV heads of 256 (bf16); 32 value heads of 128x128 float32 state,
# an 8192-channel conv window of 3 taps.
ATTN = FullAttentionSpec(16, 2, 256, "bfloat16")
STATE = LinearStateSpec(16, (8192, 3), (32, 128, 128), "bfloat16")


def test_state_page_is_aligned_and_spans_attention_pages():
    assert STATE.conv_bytes == 8192 * 3 * 2  # already a multiple of 256
    assert STATE.page_size_bytes == 49152 + 32 * 128 * 128 * 4
    groups = [KVCacheGroup(STATE, [0]), KVCacheGroup(ATTN, [3])]
    layout = plan_layout(groups, dcp_size=1)
    # A page holds one 16-token attention block (32 KiB); 2,146,304 state bytes span 66.
    assert layout.page_bytes == ATTN.page_size_bytes == 32768
    assert pages_for_state(groups, layout.page_bytes, dcp_size=1) == 66
    # DCP=2 halves a rank's attention page (32 tokens over two ranks); the state is whole.
    at_32 = [KVCacheGroup(STATE, [0]), KVCacheGroup(FullAttentionSpec(32, 2, 256, "bfloat16"), [3])]
    assert pages_for_state(at_32, plan_layout(at_32, 2).page_bytes, dcp_size=2) == 66
    odd = LinearStateSpec(4, (5, 3), (2, 3, 3), "float32")
    assert odd.conv_bytes == 256 and odd.page_size_bytes == 256 + 72


def test_groups_are_cut_to_one_size():
    gdn = KVCacheGroup(STATE, list(range(18)))
    attn = KVCacheGroup(ATTN, list(range(18, 24)))
    groups = split_groups([gdn, attn])
    assert [len(g.layer_names) for g in groups] == [6, 6, 6, 6]
    assert [g.layer_names for g in groups[:3]] == [
        [0, 1, 2, 3, 4, 5],
        [6, 7, 8, 9, 10, 11],
        [12, 13, 14, 15, 16, 17],
    ]
    # Counts within 25% of each other: pad to the larger instead of cutting.
    near = split_groups(
        [KVCacheGroup(STATE, [0, 1, 2, 3, 4]), KVCacheGroup(ATTN, list(range(5, 11)))]
    )
    assert [len(g.layer_names) for g in near] == [5, 6]
    single = [KVCacheGroup(ATTN, list(range(36)))]
    assert split_groups(single) == single


def test_layout_gives_layer_i_of_every_group_buffer_i():
    groups = split_groups([KVCacheGroup(STATE, list(range(6))), KVCacheGroup(ATTN, [6, 7])])
    layout = plan_layout(groups, dcp_size=1)
    assert layout.num_buffers == 2
    assert layout.page_bytes % 256 == 0 and layout.page_bytes == ATTN.page_size_bytes
    assert [layout.buffer_of[i] for i in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert layout.bytes_per_block == 2 * layout.page_bytes


def test_block_size_is_automatic_unless_set(caplog):
    def build(n):
        return {
            0: LinearStateSpec(n, (8192, 3), (32, 128, 128), "bfloat16"),
            1: FullAttentionSpec(n, 2, 256, "bfloat16"),
        }

    # Hybrids too: 16 unless set, and a value set is never changed (invariant 10).
    specs, size = resolve_block_size(build, None, dcp_size=1)
    assert size == 16 and specs[1].block_size == 16 and specs[0].block_size == 16
    with caplog.at_level(logging.WARNING):
        specs, size = resolve_block_size(build, 64, dcp_size=1)
    assert size == 64 and specs[1].block_size == 64
    assert caplog.text == ""
    dense = {0: FullAttentionSpec(16, 8, 128, "bfloat16")}
    assert resolve_block_size(lambda n: dense, None, dcp_size=1)[1] == 16


def reported(spec, keys):
    return {key: spec for key in keys}


def test_the_plan_from_reported_specs():
    """Reported specs (block size a placeholder) -> settings applied, block size chosen,
    groups cut and laid out, drafter layers added with private pages."""
    state = LinearStateSpec(REPORTED_BLOCK_SIZE, (8192, 3), (32, 128, 128), "bfloat16")
    attn = FullAttentionSpec(REPORTED_BLOCK_SIZE, 2, 256, "bfloat16")
    draft_attn = FullAttentionSpec(REPORTED_BLOCK_SIZE, 1, 64, "bfloat16")
    specs = KVCacheSpecs(
        target={**reported(state, range(6)), **reported(attn, [6, 7])},
        draft={1000: attn, 1001: draft_attn},
    )
    plan = plan_kv_cache(specs, CacheConfig(linear_state_dtype="bfloat16"), "bfloat16")
    # 16-token attention pages of 32 KiB; the bf16 state, 49,152 + 1,048,576 bytes, spans 34.
    assert plan.block_size == 16 and plan.layout.page_bytes == 32768
    assert {g.spec.pages_per_state for g in plan.groups[:3]} == {34}
    kinds = [(type(g.spec).__name__, g.layer_names) for g in plan.groups]
    assert kinds == [
        ("LinearStateSpec", [0, 1]),
        ("LinearStateSpec", [2, 3]),
        ("LinearStateSpec", [4, 5]),
        ("FullAttentionSpec", [6, 7, 1000]),  # the drafter layer with the target's spec
        ("FullAttentionSpec", [1001]),
    ]
    assert all(g.spec.block_size == 16 for g in plan.groups)
    assert plan.groups[0].spec.state_dtype == "bfloat16"
    layout = plan.layout
    assert layout.num_buffers == 2 and sorted(layout.buffer_of) == list(range(8))
    assert layout.private_page_bytes == {
        1000: attn.page_size_bytes * 16,
        1001: -(-draft_attn.page_size_bytes * 16 // 256) * 256,
    }
    assert plan.bytes_per_block == 2 * layout.page_bytes + sum(layout.private_page_bytes.values())
    assert plan.layer_to_group[1000] == 3 and plan.layer_to_group[1001] == 4


def test_the_plan_applies_the_cache_settings(caplog):
    window = SlidingWindowSpec(REPORTED_BLOCK_SIZE, 2, 64, "float32", sliding_window=8)
    specs = KVCacheSpecs(target=reported(window, range(4)))
    # All sliding and prefix caching on: booked as full attention.
    booked = plan_kv_cache(specs, CacheConfig(), "float32")
    assert booked.block_size == 16 and type(booked.groups[0].spec) is FullAttentionSpec
    kept = plan_kv_cache(specs, CacheConfig(sliding_window_booking="window"), "float32")
    assert kept.groups[0].spec == SlidingWindowSpec(16, 2, 64, "float32", sliding_window=8)
    # DCP: a pool block spans the ranks.
    assert plan_kv_cache(specs, CacheConfig(block_size=8), "float32", dcp_size=2).block_size == 16
    # A small block size beside a large state: planned as asked, the state spans pages,
    # nothing is padded.
    state = LinearStateSpec(REPORTED_BLOCK_SIZE, (8192, 3), (32, 128, 128), "bfloat16")
    attn = FullAttentionSpec(REPORTED_BLOCK_SIZE, 2, 256, "bfloat16")
    hybrid = KVCacheSpecs(target={0: state, **reported(attn, [1, 2, 3])})
    with caplog.at_level(logging.WARNING):
        plan = plan_kv_cache(hybrid, CacheConfig(block_size=16), "bfloat16")
    assert plan.block_size == 16
    assert "is padding" not in caplog.text and plan.groups[0].spec.pages_per_state == 66
    with pytest.raises(ValueError, match="clash"):
        plan_kv_cache(KVCacheSpecs({0: attn}, {0: attn}), CacheConfig(), "bfloat16")


def test_num_blocks_from_the_reported_memory():
    specs = KVCacheSpecs(target={0: FullAttentionSpec(REPORTED_BLOCK_SIZE, 2, 64, "float32")})
    plan = plan_kv_cache(specs, CacheConfig(), "float32")
    assert plan.bytes_per_block == 2 * 16 * 2 * 64 * 4
    sched = SchedulerConfig(max_num_seqs=4, max_model_len=64)
    memory = KVCacheMemory(10 * plan.bytes_per_block + 5, "a test budget")
    assert num_blocks_for_memory(plan, memory, sched) == 10
    # No more than every sequence could hold at full length: 4 × 64 / 16.
    assert num_blocks_for_memory(plan, KVCacheMemory(1 << 30, "lots"), sched) == 16
    with pytest.raises(ValueError, match=r"does not fit.*a test budget; one block needs 16384"):
        num_blocks_for_memory(plan, KVCacheMemory(plan.bytes_per_block, "a test budget"), sched)


@pytest.fixture(scope="module")
def eight_layer_hybrid(hybrid_model, tmp_path_factory):
    """Qwen3-Next's 3:1 layer pattern over 8 layers (dummy weights)."""
    src = hybrid_model("qwen3_next")
    out = tmp_path_factory.mktemp("hybrid8")
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 8
    config["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 2
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_hybrid_engine_shares_pages_across_groups(eight_layer_hybrid):
    budget = 8 << 20
    engine = Engine(
        model=eight_layer_hybrid,
        dtype="float32",
        load_format="dummy",
        progress=False,
        kv_cache_memory_bytes=budget,
    )
    runner = engine.executor.worker.runner
    # The engine planned the cache; the runner follows that plan.
    plan = engine.kv_cache_plan
    assert runner.groups == plan.groups and runner.layout == plan.layout
    assert engine.kv_cache.groups == plan.groups
    kinds = [(type(g.spec).__name__, len(g.layer_names)) for g in runner.groups]
    assert kinds == [("LinearStateSpec", 2)] * 3 + [("FullAttentionSpec", 2)]
    # block_size unset: 16 on hybrids too, and reported; a state spans several pages.
    chosen = runner.groups[-1].spec.block_size
    assert plan.block_size == runner.block_size == chosen == 16
    assert engine.config.cache.block_size == engine.stats()["block_size"] == chosen
    span = runner.groups[0].spec.pages_per_state
    assert span > 1
    # A block costs one page in each of 2 buffers, not a page in all 8 layers.
    assert runner.bytes_per_block() == 2 * runner.layout.page_bytes
    slack = (span - 1) * runner.bytes_per_block()  # pages after the last block id
    assert engine.stats()["num_blocks"] == (budget - slack) // runner.bytes_per_block() - 1
    # The attention layers and the state layers view the same memory.
    layers = runner.model.cache_layers()
    attn = next(la for la in layers if isinstance(la, PagedAttention))
    state = next(la for la in layers if not isinstance(la, PagedAttention))
    assert {runner.layout.buffer_of[la.layer_index] for la in (attn, state)} == {0}
    ptr = attn.kv_cache.untyped_storage().data_ptr()
    assert ptr == state.conv_state.untyped_storage().data_ptr()
    pointers = {la.layer_index: _storage(la) for la in layers}
    assert len(set(pointers.values())) == runner.layout.num_buffers


def _storage(layer) -> int:
    tensor = layer.kv_cache if isinstance(layer, PagedAttention) else layer.recurrent_state
    return tensor.untyped_storage().data_ptr()
