"""benchmarks/layer_host.py: host time and launches per decoder-layer part, by kind of step;
the layer's own rest; hooks and the launch class restored on close."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from tests.fake_clock import FakeClock

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import layer_host  # noqa: E402


class Kernel:
    """Stands in for Triton's JITFunction: `run` is what a launch calls."""

    def run(self, *args, **kwargs):
        return "ran"


class Part(nn.Module):
    def __init__(self, clock: FakeClock, seconds: float, launches: int):
        super().__init__()
        self.clock, self.seconds, self.launches = clock, seconds, launches

    def forward(self, x):
        for _ in range(self.launches):
            Kernel().run()
        self.clock.now += self.seconds
        return x


class Attention(Part):
    pass


class Mixer(Part):
    pass


class Layer(nn.Module):
    def __init__(self, clock: FakeClock, attn: Part, own_seconds: float, own_launches: int):
        super().__init__()
        self.clock, self.own_seconds, self.own_launches = clock, own_seconds, own_launches
        self.attn = attn
        self.mlp = Mixer(clock, 0.003, 4)

    def forward(self, x):
        Kernel().run()  # a norm the layer launches itself
        self.clock.now += self.own_seconds
        for _ in range(self.own_launches - 1):
            Kernel().run()
        return self.mlp(self.attn(x))


class Model(nn.Module):
    def __init__(self, clock: FakeClock):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            [
                Layer(clock, Attention(clock, 0.010, 7), 0.001, 2),
                Layer(clock, Attention(clock, 0.020, 9), 0.001, 2),
            ]
        )

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_parts_are_timed_and_counted_by_kind_of_step():
    clock = FakeClock()
    model = Model(clock)
    kind = ["mixed"]
    host = layer_host.LayerHost(
        layer_host.decoder_layers(model), kind_of=lambda: kind[0], clock=clock,
        launch_class=Kernel,
    )  # fmt: skip
    for _ in range(2):
        model(0)
    kind[0] = "decode"
    model(0)
    Kernel().run()  # outside every layer: not counted
    summary = host.summary()
    host.close()

    mixed = summary["mixed"]
    # Per mixed step (two of them): attention 10 + 20 ms, MLP 3 + 3, the layers' own 1 + 1.
    attn, mlp, layer = mixed["attn:Attention"], mixed["mlp:Mixer"], mixed["layer:Layer"]
    assert attn == {"ms_per_step": 30.0, "own_ms_per_step": 30.0, "launches_per_step": 16.0,
                    "calls": 4}  # fmt: skip
    assert mlp == {"ms_per_step": 6.0, "own_ms_per_step": 6.0, "launches_per_step": 8.0,
                   "calls": 4}  # fmt: skip
    assert layer["ms_per_step"] == pytest.approx(38.0)
    assert layer["own_ms_per_step"] == pytest.approx(2.0)
    assert layer["launches_per_step"] == 4.0 and layer["calls"] == 4
    assert mixed["all_launches_per_step"] == 28.0
    decode = summary["decode"]
    assert decode["layer:Layer"]["ms_per_step"] == pytest.approx(38.0)
    assert decode["attn:Attention"]["calls"] == 2
    assert decode["all_launches_per_step"] == 28.0


class Deep(nn.Module):
    def __init__(self, clock: FakeClock, seconds: float, inner: nn.Module | None = None):
        super().__init__()
        self.clock, self.seconds, self.inner = clock, seconds, inner

    def forward(self, x):
        Kernel().run()
        self.clock.now += self.seconds
        return x if self.inner is None else self.inner(x)


def test_parts_two_levels_down_are_hooked_and_own_time_excludes_them():
    clock = FakeClock()
    # layer -> attn (1 ms) -> proj (2 ms) -> inner (4 ms, three levels down: not hooked)
    layer = Deep(clock, 0.0, Deep(clock, 0.001, Deep(clock, 0.002, Deep(clock, 0.004))))
    host = layer_host.LayerHost([layer], lambda: "mixed", clock, launch_class=Kernel)
    layer(0)
    summary = host.summary()["mixed"]
    host.close()
    assert set(summary) == {"layer:Deep", "inner:Deep", "inner.inner:Deep",
                            "all_launches_per_step"}  # fmt: skip
    middle = summary["inner.inner:Deep"]
    # Its unhooked child's time and launch are its own.
    assert middle["ms_per_step"] == pytest.approx(6.0)
    assert middle["own_ms_per_step"] == pytest.approx(6.0)
    assert middle["launches_per_step"] == 2.0
    top = summary["inner:Deep"]
    assert top["ms_per_step"] == pytest.approx(7.0)
    assert top["own_ms_per_step"] == pytest.approx(1.0)
    assert summary["all_launches_per_step"] == 4.0


def test_close_restores_hooks_and_launch_class():
    clock = FakeClock()
    model = Model(clock)
    run = Kernel.run
    host = layer_host.LayerHost(model.model.layers, lambda: "mixed", clock, launch_class=Kernel)
    assert Kernel.run is not run
    host.close()
    assert Kernel.run is run
    model(0)
    assert host.summary() == {}


def test_default_launch_class_is_tritons_jit_function():
    from triton.runtime.jit import JITFunction

    assert layer_host.triton_jit_class() is JITFunction


def test_a_model_without_layers_is_named():
    with pytest.raises(ValueError, match="Linear: no ModuleList named 'layers'"):
        layer_host.decoder_layers(nn.Linear(2, 2))


def test_named_functions_are_parts_of_their_own_and_restored_on_close(monkeypatch):
    import types

    clock = FakeClock()
    helpers = types.ModuleType("fake_fla")

    def chunked(x):
        Kernel().run()
        Kernel().run()
        clock.now += 0.005
        return x

    helpers.chunked = chunked
    monkeypatch.setitem(sys.modules, "fake_fla", helpers)

    class Calls(Part):  # 1 ms and one launch of its own, then the helper (5 ms, 2 launches)
        def forward(self, x):
            return sys.modules["fake_fla"].chunked(super().forward(x))

    layer = Layer(clock, Calls(clock, 0.001, 1), 0.0, 1)
    host = layer_host.LayerHost(
        [layer], lambda: "mixed", clock, launch_class=Kernel, functions=["fake_fla:chunked"]
    )
    layer(0)
    helpers.chunked(0)  # outside every hooked part: not counted
    summary = host.summary()["mixed"]
    host.close()
    assert helpers.chunked is chunked
    part = summary["fn:chunked"]
    assert part == {"ms_per_step": 5.0, "own_ms_per_step": 5.0, "launches_per_step": 2.0,
                    "calls": 1}  # fmt: skip
    attn = summary["attn:Calls"]
    assert attn["ms_per_step"] == pytest.approx(6.0)
    assert attn["own_ms_per_step"] == pytest.approx(1.0)
    assert attn["launches_per_step"] == 1.0


def test_function_names_are_checked():
    with pytest.raises(ValueError, match="expected module:attr"):
        layer_host.LayerHost([], lambda: "mixed", FakeClock(), launch_class=Kernel,
                             functions=["no_colon"])  # fmt: skip
    with pytest.raises(AttributeError):
        layer_host.LayerHost([], lambda: "mixed", FakeClock(), launch_class=Kernel,
                             functions=["collections:no_such_thing"])  # fmt: skip
