"""Host time and Triton launches per decoder-layer part, by kind of step (decode or mixed).

An eager step (no CUDA graph: kvloom's mixed steps) is held to the host's pace wherever the
host takes longer to launch a part's kernels than the device takes to run them. The
thirty-second lease measured Kimi-Linear-16l's split mixed steps at ~67 ms of host forward
against ~38 ms on the serial path, but not which parts of a layer take that time. This
hooks each decoder layer and its modules two levels down (attention or linear attention
and their projections, MLP or MoE and theirs), labelled by path and class
(`self_attn.f_b_proj:ColumnParallelLinear`), and records per kind of step:

- `ms_per_step`: host time between a part's entry and exit, its hooked parts included (no
  device sync: on a GPU, the launch cost while the host runs ahead, plus any wait inside);
- `own_ms_per_step`: the same less its hooked parts' (a layer's own: the norms and
  residuals it calls itself; a linear-attention layer's own: its kernels and glue);
- `launches_per_step`: Triton launches made in the part itself, outside its hooked parts
  (`JITFunction.run` calls: fla's and kvloom's kernels); `all_launches_per_step` per kind.

`functions` names callables to time as parts of their own, `module:attr` or
`module:Class.method` (`kvloom.workers.layers.kda_layer:chunk_kda`, fla's chunked KDA as
that layer calls it): a module-level function is patched where the caller looks it up. They
split a part's own time, e.g. fla's chunked forward from kvloom's glue around it.

Each hook costs a few microseconds of host time itself, so totals read a little high.

    host = LayerHost(decoder_layers(model), kind_of=lambda: timer.kind)
    ... run the workload ...
    host.close(); host.summary()
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterable

from torch import nn


def triton_jit_class():
    """The class whose `run` every Triton launch goes through (autotuned and heuristic
    kernels end there too)."""
    from triton.runtime.jit import JITFunction

    return JITFunction


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its first ModuleList named `layers`."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"{type(model).__name__}: no ModuleList named 'layers'")


class LayerHost:
    """Forward hooks on each layer of `layers` and its modules down to `depth` levels;
    `kind_of()` names the step being run. `launch_class`: the class whose `run` counts as
    one launch (Triton's JITFunction by default; a test passes its own)."""

    def __init__(
        self,
        layers: Iterable[nn.Module],
        kind_of: Callable[[], str],
        clock=time.perf_counter,
        launch_class=None,
        depth: int = 2,
        functions: Iterable[str] = (),
    ):
        self.kind_of = kind_of
        self.clock = clock
        self.seconds = defaultdict(float)  # (kind, part) -> host seconds, parts included
        self.own = defaultdict(float)  # (kind, part) -> host seconds less hooked parts'
        self.launches = defaultdict(int)  # (kind, part) -> Triton launches of its own
        self.calls = defaultdict(int)  # (kind, part) -> entries
        self.steps = defaultdict(int)  # kind -> forwards seen (the first layer's entries)
        self._stack: list[tuple[str, float]] = []
        self._handles = []
        for index, layer in enumerate(layers):
            for path, module in layer.named_modules():
                if path.count(".") >= depth:
                    continue
                label = f"{path or 'layer'}:{type(module).__name__}"
                self._hook(module, label, first=index == 0 and not path)
        self._saved_functions: list[tuple[object, str, object]] = []
        for name in functions:
            self._wrap_function(name)
        self._launch_class = launch_class
        self._saved_run = None
        self._patch_launches()

    def _hook(self, module: nn.Module, part: str, first: bool = False) -> None:
        def enter(_module, _args):
            if first:
                self.steps[self.kind_of()] += 1
            self._enter(part)

        def leave(_module, _args, _output):
            self._leave()

        self._handles.append(module.register_forward_pre_hook(enter))
        self._handles.append(module.register_forward_hook(leave))

    def _enter(self, part: str) -> None:
        self._stack.append((part, self.clock()))

    def _leave(self) -> None:
        label, started = self._stack.pop()
        kind = self.kind_of()
        spent = self.clock() - started
        self.seconds[(kind, label)] += spent
        self.own[(kind, label)] += spent
        self.calls[(kind, label)] += 1
        if self._stack:  # the enclosing part's own time excludes this one
            self.own[(kind, self._stack[-1][0])] -= spent

    def _wrap_function(self, name: str) -> None:
        """Times `module:attr` or `module:Class.method` as the part `fn:attr` while a hooked
        part runs (outside the layers it is left alone)."""
        module_name, _, path = name.partition(":")
        if not path:
            raise ValueError(f"function {name!r}: expected module:attr")
        owner = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        inner = getattr(owner, attr)  # AttributeError names a missing one
        label = f"fn:{path}"
        host = self

        def timed(*args, **kwargs):
            if not host._stack:
                return inner(*args, **kwargs)
            host._enter(label)
            try:
                return inner(*args, **kwargs)
            finally:
                host._leave()

        self._saved_functions.append((owner, attr, inner))
        setattr(owner, attr, timed)

    def _patch_launches(self) -> None:
        owner = self._launch_class or triton_jit_class()
        self._launch_class = owner
        inner = owner.run
        self._saved_run = inner
        host = self

        def counted_run(fn_self, *args, **kwargs):
            if host._stack:
                host.launches[(host.kind_of(), host._stack[-1][0])] += 1
            return inner(fn_self, *args, **kwargs)

        owner.run = counted_run

    def close(self) -> None:
        """Removes the hooks and restores the launch class's `run` and wrapped functions."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner, attr, inner in reversed(self._saved_functions):
            setattr(owner, attr, inner)
        self._saved_functions.clear()
        if self._saved_run is not None:
            self._launch_class.run = self._saved_run
            self._saved_run = None

    def summary(self) -> dict:
        """{kind: {"all_launches_per_step": n, part: {ms_per_step, own_ms_per_step,
        launches_per_step, calls}}}, per step of that kind (a part's launches are its own)."""
        out = defaultdict(dict)
        for (kind, part), seconds in self.seconds.items():
            steps = max(1, self.steps[kind])
            out[kind][part] = {
                "ms_per_step": round(seconds * 1e3 / steps, 3),
                "own_ms_per_step": round(self.own[(kind, part)] * 1e3 / steps, 3),
                "launches_per_step": round(self.launches[(kind, part)] / steps, 1),
                "calls": self.calls[(kind, part)],
            }
        for kind, parts in out.items():
            launches = sum(n for (k, _), n in self.launches.items() if k == kind)
            parts["all_launches_per_step"] = round(launches / max(1, self.steps[kind]), 1)
        return {kind: dict(sorted(parts.items())) for kind, parts in out.items()}
