"""Speculative decoding, data plane: verifying drafted tokens against the target."""
