"""Streaming reasoning parsers: split generated text into reasoning and content."""
