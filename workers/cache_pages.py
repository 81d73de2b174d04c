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


def span_view(pages: torch.Tensor, dtype: torch.dtype, shape: tuple, offset: int = 0):
    """Like `page_view` for an entry larger than a page: entry i starts at page i and runs
    on over the next pages (a recurrent state spanning several small pool pages). The
    buffer holds slack pages after the last block, so every block id has a full entry:
    [num_pages - span + 1, *shape], at the page stride."""
    num_pages, page_bytes = pages.shape
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    span = -(-(offset + nbytes) // page_bytes)
    if span <= 1:
        return page_view(pages, dtype, shape, offset)
    rows = num_pages - span + 1
    flat = pages.view(-1)[offset:]
    raw = flat.as_strided((rows, nbytes), (page_bytes, 1))
    return raw.view(dtype).view(rows, *shape)


def allocate_pages(num_blocks: int, page_bytes: int, device) -> torch.Tensor:
    """Zeroed pages: a fresh pool reads as zeros in every dtype."""
    return torch.zeros((num_blocks, page_bytes), dtype=torch.uint8, device=device)


def pages_for(spec, num_blocks: int, device) -> torch.Tensor:
    """Private pages for one layer of `spec` (tests, drafter layers)."""
    page_bytes = -(-spec.page_size_bytes // PAGE_ALIGN) * PAGE_ALIGN
    return allocate_pages(num_blocks, page_bytes, device)
