"""Speculative decoding, data plane: proposing drafts (n-gram, draft model, EAGLE) and
verifying them against the target."""
