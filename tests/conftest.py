"""Shared fixtures: tiny random-weight Hugging Face checkpoints built with transformers.

The whole suite runs with the sanitizer on (invariant 2): freed KV blocks and state slots
are NaN-filled, so a stale read turns into NaN and fails a test.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("KVLOOM_SANITIZE", "1")
# Triton fixes interpreted vs compiled at its first import: without a GPU, interpret, so the
# kernel tests in tests/triton_interpret run in this process whatever imported triton first.
if not os.path.exists("/dev/nvidia0") and "CUDA_VISIBLE_DEVICES" not in os.environ:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models on 2 shared cores: more threads only add contention (measured 4x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests start private local clusters: a token left in ~/.ray by another Ray on this machine
# must not switch on token auth for them (it did here; its warning was in one failed run).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# After the environment above (kvloom may import triton): importing kvloom takes the name
# `kernels` for Hugging Face's package before a test module imports transformers, which the
# repository's own `kernels/` folder on pytest's pythonpath would otherwise shadow.
import kvloom  # noqa: E402, F401

VOCAB = 512
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# Tiny configs of each architecture: few layers, small widths, the demo tokenizer's vocab.
TINY_CONFIGS = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=False,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=None,
    ),
}
CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
}


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory) -> Path:
    from kvloom.cluster.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo-tokenizer"), arch="llama")


def build_hf_model(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Saves a random-weight transformers model of `arch` with the demo tokenizer."""
    import torch
    import transformers

    cfg_cls = getattr(transformers, CONFIG_CLASSES[arch])
    kwargs = dict(TINY_CONFIGS[arch], vocab_size=VOCAB, max_position_embeddings=4096)
    kwargs.update(bos_token_id=0, eos_token_id=2, **overrides)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Default init (std 0.02) gives near-uniform logits; widen it so greedy margins are real.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, demo_tokenizer_dir):
    """tiny_model(arch, **config overrides) -> checkpoint dir (cached per session)."""
    cache: dict = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_hf_model(arch, out, demo_tokenizer_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory):
    """hybrid_model(arch) -> a tiny demo checkpoint of a hybrid architecture (cached)."""
    from kvloom.cluster.demo_model import write_demo_model

    cache: dict = {}

    def make(arch: str = "qwen3_next") -> Path:
        if arch not in cache:
            cache[arch] = write_demo_model(tmp_path_factory.mktemp(f"hybrid-{arch}"), arch=arch)
        return cache[arch]

    return make


@pytest.fixture(scope="module")
def local_ray():
    """An embedded local Ray on loopback (kvloom's own start: 127.0.0.1, free ports), for a
    module's Ray tests; stopped with every process it started."""
    import ray

    from kvloom.cluster.ray_local import connect_ray, shutdown_ray

    connect_ray(num_cpus_for_local=16, log_to_driver=False)
    yield ray
    shutdown_ray()


@pytest.fixture(scope="session")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (and kvloom.test), made by the openssl CLI,
    for the TLS tests of both doors. No openssl is a failure, not a skip: the TLS tests
    would otherwise vanish unnoticed."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make the TLS tests' certificate")
    out = tmp_path_factory.mktemp("tls")
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=kvloom.test",
         "-addext", "subjectAltName=DNS:kvloom.test,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def norm_gemv_on(monkeypatch):
    """Turn on the opt-in norm_gemv fusion (contracts/envs.py OPT_IN_FUSIONS) for its tests."""
    monkeypatch.setenv("KVLOOM_FUSED", "norm_gemv")
