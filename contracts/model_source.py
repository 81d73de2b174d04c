"""Where a model's files come from: a local directory, or a Hugging Face repo id.

`resolve_model("org/name", revision)` returns the local snapshot directory through
`huggingface_hub.snapshot_download`: its cache (HF_HOME / HF_HUB_CACHE), a download with
progress bars when the files are not there yet, and HF_HUB_OFFLINE=1 (cache only, never the
network). An existing local directory always wins over a repo id of the same spelling.
Only what kvloom reads is fetched (configs, safetensors, tokenizer files, chat templates),
never `.bin`/`.pth`/GGUF copies of the weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# `org/name` (or a bare `name`): Hugging Face's repo-id characters, no path syntax.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tiktoken.model",
    "tokenizer.model",
    "*.txt",
]


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, not when huggingface_hub was
    imported."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.startswith(".")


def resolve_model(
    model: str, revision: str | None = None, progress: bool = True, cache_dir: str | None = None
) -> str:
    """The local directory holding `model` (a directory, or a repo id resolved through the
    Hugging Face cache). Raises ValueError naming the model when it cannot be had."""
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    if not looks_like_repo_id(model):
        raise ValueError(
            f"model must be a checkpoint directory or a Hugging Face repo id (org/name), "
            f"got {model!r}: no such directory"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    offline = is_offline()
    kwargs = {}
    if not progress:
        from tqdm.auto import tqdm

        class _Silent(tqdm):
            def __init__(self, *args, **kw):
                kw["disable"] = True
                super().__init__(*args, **kw)

        kwargs["tqdm_class"] = _Silent
    try:
        return snapshot_download(
            model,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
            **kwargs,
        )
    except GatedRepoError:
        raise ValueError(
            f"model: {model!r} is a gated Hugging Face repository; accept its terms on the Hub "
            "and log in (HF_TOKEN or `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"model: no Hugging Face repository {model!r} (and no local directory of that "
            "name); private repositories need HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"revision: {model!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        if offline:
            raise ValueError(
                f"model: {model!r}{at} is not in the Hugging Face cache and HF_HUB_OFFLINE=1 "
                "forbids downloading it; download it once online or unset HF_HUB_OFFLINE"
            ) from None
        raise ValueError(
            f"model: could not reach the Hugging Face Hub for {model!r}{at}, and it is not "
            "in the cache"
        ) from None
