"""Compiles structured-output constraints with xgrammar on a thread pool, with a cache."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvloom.contracts.sampling_params import StructuredOutputsParams

# Compiled grammars kept for reuse (many requests share one schema: agents, tools).
CACHE_ENTRIES = 256


class GrammarCompilers:
    """One per engine. `submit` returns a Future of an xgrammar CompiledGrammar; a bad
    constraint resolves to a ValueError naming the field (`structured_outputs.json` ...).

    The tokenizer's vocabulary reaches xgrammar as a TokenizerInfo built from the model
    directory's Hugging Face tokenizer, sized to the model's logits (`vocab_size`), with the
    engine's EOS ids as the grammar's stop tokens. Built on first use, in the pool."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids, max_workers=2):
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvloom-grammar")
        self._lock = threading.Lock()  # the cache (held briefly, on the engine loop too)
        self._compiler_lock = threading.Lock()  # building the compiler (seconds, in the pool)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future:
        key = (params.kind, params.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        # A failed compile is not kept: the next request with that spec tries again (and
        # fails again, with the same message), rather than the cache holding errors.
        future.add_done_callback(lambda f, key=key: self._drop_failed(key, f))
        return future

    def _drop_failed(self, key, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def compiler(self):
        """The xgrammar GrammarCompiler (built once, on first use)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = _make_compiler(
                    self.model_dir, self.vocab_size, self.stop_token_ids
                )
            return self._compiler

    def _compile(self, kind: str, spec: str):
        try:
            compiler = self.compiler()
        except Exception as err:  # the model's tokenizer: every grammar fails the same way
            raise ValueError(
                f"structured_outputs: the model's tokenizer cannot be given to xgrammar "
                f"({type(err).__name__}: {error_reason(err)})"
            ) from None
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(spec)
            if "::=" in spec:  # EBNF (GBNF-style); otherwise Lark
                return compiler.compile_grammar(spec)
            return compiler.compile_lark(spec)
        except Exception as err:  # xgrammar raises RuntimeError/ValueError with a reason
            reason = error_reason(err)
            raise ValueError(f"structured_outputs.{kind}: does not compile: {reason}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def error_reason(err: Exception) -> str:
    """xgrammar's message without its log prefix (`[12:00:00] /path/file.cc:94: `)."""
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[0])


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (string literals escaped the
    way JSON escapes them, which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _make_compiler(model_dir: str, vocab_size: int, stop_token_ids: list[int]):
    import transformers
    import xgrammar

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
    )
    return xgrammar.GrammarCompiler(info, max_threads=2)
