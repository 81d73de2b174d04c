"""Streaming tool-call parsers, one module per output format."""
