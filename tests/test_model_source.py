"""`--model org/name`: a Hugging Face repo id resolves to its snapshot in the Hugging Face
cache (revision included), HF_HUB_OFFLINE=1 reads the cache only, a local directory wins,
and a missing repo is a clear error naming the model.

No test here touches the network: the cache is laid out by hand, downloads are a stand-in
for snapshot_download, and every socket connection to a non-loopback address fails.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import huggingface_hub
import pytest

from kvloom.cluster import cli
from kvloom.contracts.config import EngineConfig
from kvloom.contracts.model_source import ALLOW_PATTERNS, resolve_model

MAIN, V1 = "a" * 40, "b" * 40


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    real_connect = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        remote = isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost")
        if remote and self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"test tried to reach {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, demo_tokenizer_dir) -> Path:
    """A Hugging Face cache holding acme/tiny at two revisions (main and tag v1), laid out
    as huggingface_hub writes it (refs/<name> -> commit, snapshots/<commit>/files)."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    for ref, commit in (("main", MAIN), ("v1", V1)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        shutil.copytree(demo_tokenizer_dir, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def test_offline_repo_id_resolves_from_the_cache(hub_cache):
    assert resolve_model("acme/tiny") == str(hub_cache / "snapshots" / MAIN)
    assert resolve_model("acme/tiny", revision="v1") == str(hub_cache / "snapshots" / V1)
    config = EngineConfig.from_kwargs(model="acme/tiny", revision="v1")
    assert config.model.model == str(hub_cache / "snapshots" / V1)
    assert config.model.text_config["vocab_size"] > 0


def test_llm_loads_and_generates_from_a_repo_id(hub_cache):
    from kvloom import LLM, SamplingParams

    llm = LLM("acme/tiny", progress=False, dtype="float32")
    assert llm.engine.config.model.model == str(hub_cache / "snapshots" / MAIN)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_offline_missing_repo_is_a_clear_error(hub_cache):
    with pytest.raises(ValueError, match=r"'acme/missing'.*HF_HUB_OFFLINE=1"):
        resolve_model("acme/missing")
    with pytest.raises(ValueError, match=r"'acme/tiny' at revision 'v9'.*HF_HUB_OFFLINE"):
        EngineConfig.from_kwargs(model="acme/tiny", revision="v9")


def test_serve_names_the_missing_model(hub_cache, capsys):
    assert cli.main(["serve", "--model", "acme/missing", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "kvloom serve: error:" in err and "acme/missing" in err and "HF_HUB_OFFLINE" in err


def test_local_directory_wins(tmp_path, monkeypatch, demo_tokenizer_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(demo_tokenizer_dir, tmp_path / "acme" / "tiny")

    def no_download(*args, **kwargs):
        raise AssertionError("a local directory must not be looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    assert resolve_model("acme/tiny") == "acme/tiny"
    assert EngineConfig.from_kwargs(model="acme/tiny").model.model == "acme/tiny"


def test_download_call_and_its_errors(tmp_path, monkeypatch, demo_tokenizer_dir):
    """Online: snapshot_download gets the revision, kvloom's file patterns and (with
    progress) its own progress bars; its errors become errors naming the model."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if repo_id == "acme/absent":
            import httpx2  # huggingface_hub's HTTP client

            response = httpx2.Response(404, request=httpx2.Request("GET", "http://127.0.0.1/"))
            raise huggingface_hub.errors.RepositoryNotFoundError("404", response=response)
        return str(demo_tokenizer_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model("acme/tiny", revision="v2") == str(demo_tokenizer_dir)
    repo_id, kwargs = calls[-1]
    assert repo_id == "acme/tiny" and kwargs["revision"] == "v2"
    assert kwargs["local_files_only"] is False and "tqdm_class" not in kwargs  # HF's bars
    assert kwargs["allow_patterns"] == ALLOW_PATTERNS
    assert "*.safetensors" in ALLOW_PATTERNS and "tiktoken.model" in ALLOW_PATTERNS
    assert not any(p.endswith((".bin", ".pth", ".gguf")) for p in ALLOW_PATTERNS)
    resolve_model("acme/tiny", progress=False)
    bar = calls[-1][1]["tqdm_class"](total=3)
    assert bar.disable
    bar.close()
    with pytest.raises(ValueError, match=r"no Hugging Face repository 'acme/absent'"):
        resolve_model("acme/absent")


def test_not_a_directory_nor_a_repo_id(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model(str(tmp_path / "missing" / "dir"))
    with pytest.raises(ValueError, match="revision must be"):
        EngineConfig.from_kwargs(model=str(tmp_path), revision="")
