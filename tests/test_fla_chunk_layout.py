"""kernels/fla_chunk_layout.py: fla's chunk layout made by kvloom (`KVLOOM_FLA_LAYOUT=staged`)."""

from __future__ import annotations

import pytest
import torch

from kvloom.kernels import fla_chunk_layout


def test_bad_layout_names_the_variable(monkeypatch):
    monkeypatch.setenv("KVLOOM_FLA_LAYOUT", "graph")
    with pytest.raises(ValueError, match="KVLOOM_FLA_LAYOUT"):
        fla_chunk_layout.fla_layout()


def test_chunk_layout_covers_every_token_once():
    """Each chunk's sequence and place give its tokens [bounds[s] + 64 j, +64) clipped to
    the sequence; over random lengths (empty ones and chunk edges included) the chunks
    cover every token exactly once, in order, and the offsets count each sequence's."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        lengths = torch.randint(0, 200, (int(torch.randint(1, 9, (1,), generator=gen)),),
                                generator=gen).tolist()  # fmt: skip
        lengths += [0, 64, 128, 65]
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        indices, offsets = fla_chunk_layout.chunk_layout(bounds)
        covered = []
        for s, j in indices.tolist():
            start = bounds[s] + fla_chunk_layout.FLA_CHUNK * j
            assert start < bounds[s + 1]
            covered += range(start, min(start + fla_chunk_layout.FLA_CHUNK, bounds[s + 1]))
        assert covered == list(range(bounds[-1]))
        want = [0, *torch.tensor([-(-n // 64) for n in lengths]).cumsum(0).tolist()]
        assert offsets.tolist() == want


def test_chunk_layout_rejects_decreasing_bounds():
    with pytest.raises(ValueError, match="cu_seqlens"):
        fla_chunk_layout.chunk_layout([0, 5, 3])


def test_staged_layout_is_made_once_per_bounds_object():
    """Every layer of a step passes the same device bounds: one layout (one copy) for all
    of them; a new bounds object, even with equal values, gets a new one, and so does the
    same object holding other bounds."""
    bounds = [0, 3, 70]
    first = torch.tensor(bounds)  # "the device" is the CPU here
    a = fla_chunk_layout.staged_chunk_layout(bounds, first)
    assert fla_chunk_layout.staged_chunk_layout(bounds, first) is a
    b = fla_chunk_layout.staged_chunk_layout(bounds, torch.tensor(bounds))
    assert b is not a and all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].tolist() == [[0, 0], [1, 0], [1, 1]] and a[1].tolist() == [0, 1, 3]
    # The same object refilled with other bounds gets their layout, not the old one.
    first.copy_(torch.tensor([0, 65, 70]))
    c = fla_chunk_layout.staged_chunk_layout([0, 65, 70], first)
    assert c[0].tolist() == [[0, 0], [0, 1], [1, 0]] and c[1].tolist() == [0, 2, 3]
