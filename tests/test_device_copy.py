"""kernels/device_copy.py: packed staging keeps each array's values, shape and alignment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvloom.kernels.device_copy import PACK_ALIGN_BYTES, to_device_packed


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_packed_views_hold_the_arrays_each_16_byte_aligned(dtype):
    """Every view starts on a 16-byte boundary whatever the sizes before it: a Triton
    kernel compiles apart for unaligned pointers, so unaligned views would cost a compile
    whenever a step's sizes shifted them."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        arrays = [
            rng.integers(-5, 1000, size=tuple(rng.integers(0, 7, size=rng.integers(1, 3))))
            for _ in range(rng.integers(1, 6))
        ]
        views = to_device_packed(arrays, dtype, torch.device("cpu"))
        assert len(views) == len(arrays)
        for a, v in zip(arrays, views):
            assert v.dtype == dtype and tuple(v.shape) == a.shape
            assert v.tolist() == a.tolist()
            assert v.data_ptr() % PACK_ALIGN_BYTES == 0


def test_no_arrays_and_empty_arrays():
    assert to_device_packed([], torch.int64, torch.device("cpu")) == []
    (empty, one) = to_device_packed([np.zeros(0), np.array([7])], torch.int32, torch.device("cpu"))
    assert empty.numel() == 0 and one.tolist() == [7] and one.data_ptr() % PACK_ALIGN_BYTES == 0
