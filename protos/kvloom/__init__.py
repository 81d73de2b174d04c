"""Proto package root: kvloom/v1/*.proto and their generated stubs."""
