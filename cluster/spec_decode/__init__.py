"""Speculative decoding, control plane: draft proposers and acceptance statistics."""
