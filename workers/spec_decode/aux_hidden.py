"""Captures auxiliary hidden states of the target's forward for EAGLE-3 and DFlash drafters.

A drafter conditioned on several target layers reads the residual stream at chosen
points of the decoder: point i is the stream entering decoder layer i (hidden + residual
as the layer receives them), point 0 the token embedding and point L (L layers) the
stream after the last layer, before the final norm. That is vLLM's numbering of
`eagle_aux_hidden_state_layer_ids`; DFlash's `target_layer_ids` name layer outputs, so
its layer t is point t + 1.

Forward hooks on the target's own modules do the capture, so no model file changes: every
kvloom decoder layer returns (hidden, residual), whose sum is the stream after it. Each
target forward overwrites the states of the one before; the drafter takes them right
after the forward, in the same step.
"""

from __future__ import annotations

import torch
from torch import nn


class AuxHiddenCapture:
    def __init__(self, target: nn.Module, points: list[int], field: str):
        """points: capture points (see above), in the order the drafter concatenates
        them. field: the configuration field they came from (named in errors)."""
        layers = target.model.layers
        bad = [p for p in points if not 0 <= p <= len(layers)]
        if bad:
            raise ValueError(
                f"{field}: {bad} out of range for the target's {len(layers)} decoder layers"
            )
        self.points = list(points)
        self.states: dict[int, torch.Tensor] = {}
        self.handles = []
        for point in sorted(set(points)):
            if point == 0:
                module, hook = target.model.embed_tokens, self._embedding_hook(point)
            else:
                module, hook = layers[point - 1], self._layer_hook(point)
            self.handles.append(module.register_forward_hook(hook))

    def _embedding_hook(self, point: int):
        def hook(module, args, output):
            self.states[point] = output

        return hook

    def _layer_hook(self, point: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 2):
                raise TypeError(
                    f"{type(module).__name__} does not return (hidden, residual): its "
                    "auxiliary hidden states cannot be captured"
                )
            hidden, residual = output
            self.states[point] = hidden if residual is None else hidden + residual

        return hook

    def take(self) -> list[torch.Tensor]:
        """The captured states of the latest target forward, in `points` order; each is
        handed out once (a drafter reading a stale forward's states is a bug)."""
        missing = [p for p in self.points if p not in self.states]
        if missing:
            raise RuntimeError(f"no auxiliary hidden states captured at points {missing}")
        out = [self.states[p] for p in self.points]
        self.states = {}
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class ReceivedAuxHidden:
    """Stands for AuxHiddenCapture in a remote drafter's actor, which runs no target
    forward: the states arrive with each step's message and are handed out as `take`
    hands out captured ones."""

    def __init__(self, points: list[int]):
        self.points = list(points)
        self.states: list[torch.Tensor] | None = None

    def put(self, states: list[torch.Tensor]) -> None:
        if len(states) != len(self.points):
            raise ValueError(f"{len(states)} auxiliary states for points {self.points}")
        self.states = states

    def take(self) -> list[torch.Tensor]:
        if self.states is None:
            raise RuntimeError(f"no auxiliary hidden states received for points {self.points}")
        out, self.states = self.states, None
        return out

    def remove(self) -> None:
        pass
