"""The parts of the target a remote hidden-state drafter reads, without the target.

EAGLE, EAGLE-3, MTP and DFlash drafters share the target's token embedding and LM head
and read its config; MTP builds its layer of the target's decoder-layer kind. Nothing
else of the target runs in the drafter actor (its hidden states arrive with each step),
so `TargetParts` holds only that, loaded by streaming just the embedding and LM head
tensors from the target checkpoint: on an 80B target a few hundred MB, not the model.

    target.config                 the target class's own config (as the class derives it)
    target.model.embed_tokens     the token embedding
    target.model.layers           stand-ins: one per decoder layer, no weights (the
                                  drafter's capture hooks go there and are replaced by
                                  the shipped states); running one raises
    target.lm_head, target.compute_logits(hidden)
                                  the LM head; with `tie_word_embeddings` and no
                                  `lm_head.weight` in the checkpoint it IS the embedding
    target.model_class, target.decoder_layer_class
                                  what the target's model and decoder layers are

What the class derives (its config, its layer class, how checkpoint names map onto its
modules) is read from the target class built on the meta device, which holds no memory.
Reading any other attribute raises MissingTargetPart, naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvloom.kernels.dispatch import set_batch_invariant
from kvloom.workers.dtypes import TORCH_DTYPES
from kvloom.workers.layers.tp_group import LocalGroup
from kvloom.workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvloom.workers.models.registry import model_class
from kvloom.workers.weight_loader import checkpoint_files, load_weights, resolve_name

EMBEDDING, LM_HEAD = "model.embed_tokens", "lm_head"


class MissingTargetPart(AttributeError):
    """A drafter read a part of the target the drafter actor does not hold."""


def _missing(where: str, name: str) -> MissingTargetPart:
    return MissingTargetPart(
        f"{where}.{name}: the remote drafter's actor holds only the target's config, "
        "token embedding and LM head (workers/spec_decode/target_parts.py); this drafter "
        "reads more of it (use placement 'local', or load that part there too)"
    )


class _Strict(nn.Module):
    """A module whose unknown attributes raise MissingTargetPart, naming them."""

    where = "target"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise _missing(type(self).where, name) from None


class AbsentLayer(nn.Module):
    """Decoder layer `index` of the target, not loaded here: a hook point, no weights."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise _missing("target.model.layers", f"{self.index} (run)")


class PartsModel(_Strict):
    where = "target.model"

    def __init__(self, embedding: VocabParallelEmbedding, num_layers: int):
        super().__init__()
        self.embed_tokens = embedding
        self.layers = nn.ModuleList(AbsentLayer(i) for i in range(num_layers))


class TargetParts(_Strict):
    def __init__(self, config: dict, klass: type, layer_class: type | None, dtype, tied: bool):
        """tied: the LM head is the embedding (one tensor, not a copy)."""
        super().__init__()
        vocab, hidden = config["vocab_size"], config["hidden_size"]
        self.config = config
        self.model_class = klass
        self.decoder_layer_class = layer_class
        self.model = PartsModel(
            VocabParallelEmbedding(vocab, hidden, LocalGroup(), dtype),
            config["num_hidden_layers"],
        )
        if tied:
            with torch.device("meta"):
                self.lm_head = ParallelLMHead(vocab, hidden, LocalGroup(), dtype)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = ParallelLMHead(vocab, hidden, LocalGroup(), dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)  # as every kvloom target computes them


def _parts_names(skeleton: nn.Module, keys: list[str]) -> dict[str, str]:
    """Checkpoint name -> parts name, for the tensors of the embedding and the LM head,
    resolved by the target class's own rules (as load_weights resolves them)."""
    custom = getattr(skeleton, "map_weight_name", None)
    ignored = tuple(skeleton.ignored_weight_prefixes)
    wanted = {}
    for key in keys:
        if key.startswith(ignored):
            continue
        entry = (custom(key) if custom else None) or resolve_name(key, skeleton.stacked_params)
        if entry[0] in (EMBEDDING, LM_HEAD):
            wanted[key] = f"{entry[0]}.{entry[1]}"
    return wanted


def load_target_parts(model_config, device: torch.device) -> TargetParts:
    """The target's config, embedding and LM head, read from its checkpoint."""
    if model_config.load_format == "dummy":
        raise ValueError(
            "speculative_config.placement 'remote' with load_format 'dummy': the drafter "
            "actor cannot draw the target's random embedding and LM head (use placement "
            "'local')"
        )
    set_batch_invariant(model_config.deterministic)  # this process's kernel plans
    klass = model_class(model_config.architecture)
    dtype = TORCH_DTYPES[model_config.torch_dtype_name]
    with torch.device("meta"):  # the class's derived config, layer kind and name rules
        skeleton = klass(model_config.text_config, dtype, LocalGroup())
    layers = skeleton.model.layers
    files = checkpoint_files(Path(model_config.model))
    names: dict[Path, dict[str, str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names[path] = _parts_names(skeleton, list(f.keys()))
    has_head = any(n.startswith(LM_HEAD + ".") for found in names.values() for n in found.values())
    tied = bool(skeleton.tied) and not has_head
    with torch.device(device):
        parts = TargetParts(
            skeleton.config, klass, type(layers[0]) if len(layers) else None, dtype, tied
        )

    def tensors():
        for path, wanted in names.items():
            with safe_open(str(path), framework="pt") as f:
                for key, name in wanted.items():
                    yield name, f.get_tensor(key)

    # Raises naming the embedding or LM head if either is missing, as the target's load.
    load_weights(parts, tensors(), tied={LM_HEAD: EMBEDDING} if tied else None)
    return parts.eval()
