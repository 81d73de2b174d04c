"""Deferred weight allocation while a quantized model is built.

A quantized checkpoint's layers learn their scheme only once the model exists (the rules
name checkpoint modules, `apply.quantize_model`), so their float weights would be
allocated first and replaced: twice a model's float size at the peak, more than an H200
holds for an 80B model. Inside `deferred_weights()` the quantizable layers allocate their
float weight on the meta device (no memory); `quantize_model` then creates every such
weight for real, quantized or float.
"""

from __future__ import annotations

import contextlib
import contextvars

_DEFERRED = contextvars.ContextVar("kvloom_deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights(enabled: bool = True):
    token = _DEFERRED.set(bool(enabled))
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_device() -> str | None:
    """The device a quantizable layer allocates its float weight on: "meta" while
    deferred, else None (the ambient default device)."""
    return "meta" if _DEFERRED.get() else None
