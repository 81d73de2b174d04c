"""One tokenizer per process and model directory.

The front door (chat templates, Tokenize/Detokenize, logprob texts), the output processor
(detokenization, stop strings) and the in-process engine core (EOS ids, structured-output
vocabulary) all ask for the tokenizer of the same directory: they get one object, loaded
once (a tokenizer of a large vocabulary takes seconds and hundreds of MB)."""

from __future__ import annotations

import threading
from pathlib import Path

from kvloom.cluster.tokenizer import Tokenizer

_lock = threading.Lock()
_loaded: dict[str, Tokenizer] = {}


def shared_tokenizer(model_dir: str | Path) -> Tokenizer:
    key = str(Path(model_dir).resolve())
    with _lock:
        tokenizer = _loaded.get(key)
        if tokenizer is None:
            tokenizer = _loaded[key] = Tokenizer(model_dir)
        return tokenizer
