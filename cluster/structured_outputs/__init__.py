"""Structured outputs: grammars compiled off the engine loop, one matcher per request.

`GrammarCompilers` compiles a request's constraint (JSON schema, regex, choice, EBNF,
any JSON object) on a thread pool with a cache keyed by (kind, spec); `RequestGrammar`
tracks one request's position in its grammar on the control plane and writes the token
bitmask its next sampled token must fall in (docs/structured_outputs.md).
"""

from kvloom.cluster.structured_outputs.compiler import GrammarCompilers
from kvloom.cluster.structured_outputs.request_grammar import RequestGrammar

__all__ = ["GrammarCompilers", "RequestGrammar"]
