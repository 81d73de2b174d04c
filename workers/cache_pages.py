"""Typed views into the pool's shared page buffers (laid out by the control plane's plan:
cluster/kv_cache/planner.py, contracts/kv_cache_plan.py).

A buffer is uint8 [num_blocks, page_bytes]; a layer views the start of every page as its
own tensor. The views keep the page stride, so kernels index blocks by stride, never by
assuming the cache is contiguous.
"""

from __future__ import annotations

import math

import torch

from kvloom.contracts.kv_cache_spec import PAGE_ALIGN


def page_view(pages: torch.Tensor, dtype: torch.dtype, shape: tuple, offset: int = 0):
    """[num_blocks, *shape] of `dtype`, starting `offset` bytes into every page."""
    num_blocks, page_bytes = pages.shape
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if offset + nbytes > page_bytes:
        raise ValueError(
            f"pages: {page_bytes}-byte pages cannot hold {nbytes} bytes at offset {offset}"
        )
    return pages[:, offset : offset + nbytes].view(dtype).view(num_blocks, *shape)


def allocate_pages(num_blocks: int, page_bytes: int, device) -> torch.Tensor:
    """Zeroed pages: a fresh pool reads as zeros in every dtype."""
    return torch.zeros((num_blocks, page_bytes), dtype=torch.uint8, device=device)


def pages_for(spec, num_blocks: int, device) -> torch.Tensor:
    """Private pages for one layer of `spec` (tests, drafter layers)."""
    page_bytes = -(-spec.page_size_bytes // PAGE_ALIGN) * PAGE_ALIGN
    return allocate_pages(num_blocks, page_bytes, device)
