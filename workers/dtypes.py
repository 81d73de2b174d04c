"""Dtype names used in configs and KV-cache specs -> torch dtypes."""

from __future__ import annotations

import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,  # kv_cache_dtype="fp8" attention pages
}
