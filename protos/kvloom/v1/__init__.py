"""Generated stubs for the kvloom.v1 protos (see protos/generate.py)."""
