"""The one row classification (invariant 1), over every row kind.

Mutation check (done by hand when this was written, see the issue note): replacing the
`computed > 0` guard by a query-length test (`scheduled == 1`), or dropping the
`scheduled == 0` padding guard, or counting one-token resume rows as prefills, each makes
at least one test here fail.
"""

from __future__ import annotations

import pytest

from kvloom.workers.row_kinds import RowClasses, RowKind, classify_rows


def classes(computed, scheduled):
    return RowClasses(classify_rows(computed, scheduled), scheduled)


def test_one_token_first_chunk_is_fresh_not_decode():
    rows = classes([0], [1])
    assert rows.kinds == [RowKind.FRESH]
    assert rows.has_initial_state == [False]
    assert rows.decode_rows == [] and rows.prefill_rows == [0]
    assert not rows.all_decode


def test_one_token_chunk_resuming_partial_prefill_keeps_state():
    rows = classes([7], [1])
    assert rows.kinds == [RowKind.RESUME]
    assert rows.has_initial_state == [True]
    assert rows.decode_rows == [0]


def test_multi_token_resume_is_prefill_with_state():
    rows = classes([16], [5])
    assert rows.kinds == [RowKind.RESUME]
    assert rows.prefill_rows == [0] and rows.has_initial_state == [True]


def test_padding_rows_are_neither():
    rows = classes([0, 5, 3], [0, 0, 1])
    assert rows.kinds == [RowKind.PADDING, RowKind.PADDING, RowKind.RESUME]
    assert rows.decode_rows == [2]
    assert rows.prefill_rows == []
    assert rows.all_decode  # padding never spoils a uniform decode batch


def test_all_padding_is_not_a_decode_batch():
    assert not classes([0, 4], [0, 0]).all_decode


def test_mixed_step_like_seed_000():
    # two ongoing decodes and a brand-new one-token prompt
    rows = classes([10, 20, 0], [1, 1, 1])
    assert rows.kinds == [RowKind.RESUME, RowKind.RESUME, RowKind.FRESH]
    assert rows.decode_rows == [0, 1]
    assert rows.prefill_rows == [2]
    assert rows.has_initial_state == [True, True, False]
    assert not rows.all_decode  # a uniform-decode graph must not run this step


def test_every_row_fresh_one_token():
    rows = classes([0, 0, 0], [1, 1, 1])
    assert rows.decode_rows == [] and rows.prefill_rows == [0, 1, 2]
    assert rows.has_initial_state == [False] * 3


def test_lengths_must_agree():
    with pytest.raises(ValueError):
        classify_rows([0, 1], [1])


def test_uniform_decode_shape_with_a_prompt_chunk_is_not_a_decode_step():
    # Speculative decodes of 1 + 2 drafts beside a fresh 3-token prompt chunk.
    rows = classes([12, 30, 0], [3, 3, 3])
    assert not rows.uniform_decode(3)
    assert classes([12, 30], [3, 3]).uniform_decode(3)
    assert not classes([12, 30], [3, 2]).uniform_decode(3)
