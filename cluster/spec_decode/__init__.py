"""Speculative decoding, control plane: acceptance statistics (proposers run on the
workers, workers/spec_decode)."""
