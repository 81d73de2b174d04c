"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

import importlib

# Lazy "module:Class" so importing the registry does not import every model.
MODELS = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "llama:Qwen3ForCausalLM",
    "Qwen3NextForCausalLM": "qwen3_next:Qwen3NextForCausalLM",
    "KimiLinearForCausalLM": "kimi_linear:KimiLinearForCausalLM",
    "Qwen3_5ForCausalLM": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "qwen3_5:Qwen3_5MoeForCausalLM",
    # Multimodal checkpoints: their text model (config.json's text_config, weights under
    # model.language_model.); the vision tower (model.visual.) is skipped at load.
    "Qwen3_5ForConditionalGeneration": "qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5:Qwen3_5MoeForCausalLM",
}


def model_class(architecture: str):
    target = MODELS.get(architecture)
    if target is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODELS))}"
        )
    module_name, class_name = target.split(":")
    module = importlib.import_module(f"kvloom.workers.models.{module_name}")
    return getattr(module, class_name)
