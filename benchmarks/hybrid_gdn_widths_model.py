"""Writes a small Qwen3-Next checkpoint at the released Gated DeltaNet widths (16 key and 32
value heads of 128, a 4-tap conv): 3 GDN + 1 attention layers, hidden 128, vocabulary 512,
fp32 random weights (std 0.1), with the demo tokenizer. For CPU runs of
benchmarks/multi_turn_replay.py where the state page has its real size.

    python benchmarks/hybrid_gdn_widths_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from kvloom.cluster.demo_model import write_demo_model


def write_model(out: Path, tokenizer_dir: Path | None = None, vocab_size: int = 512) -> Path:
    """Saves the checkpoint to `out` with the demo tokenizer (or `tokenizer_dir`'s)."""
    config = transformers.Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=8192,
        bos_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        src = tokenizer_dir or write_demo_model(Path(tmp) / "m", arch="qwen3_next")
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    print(write_model(parser.parse_args().out))


if __name__ == "__main__":
    main()
