"""Quantization methods: how one scheme creates, loads and applies a layer's weights.

A method replaces a layer's float `weight` with the checkpoint's tensors under the
checkpoint's own names (so the weight loader expects exactly those), copies this rank's
slice of each (weights and scales shard together: rows for column-parallel layers,
input columns for row-parallel ones), and runs the layer's GEMM (`apply`) or, for stacked
expert weights, the fused MoE (`moe_forward`). Bias stays the layer's own float tensor.

Stored layouts (what the kernels read):
* FP8: `weight` float8_e4m3fn [rows, in]; the scale (`weight_scale_inv` for block-scaled
  checkpoints, `weight_scale` for compressed-tensors) float32 [rows, in / group], one row
  per output row (block scales repeated over their block's rows, a per-tensor scale over
  its part's rows), so fused parts and tensor-parallel shards never split a block row;
  `input_scale` float32 [parts] (static activations: the largest is used, one input).
  Where this rank's rows are whole blocks of the checkpoint (every fused part's kept rows
  start and end on a block boundary), the method also keeps the block form
  [rows / bn, in / bk] for cuBLAS's blockwise GEMM (`Fp8Method.block_scale`).
* W4A16: `weight_packed` int32 [rows, in / 8], `weight_scale` [rows, in / group] in the
  model dtype, `weight_shape` int64 [parts, 2] (checked against the layer, then unused).
Expert stacks carry a leading [E] on each.
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.kernels.fp8_quant import FP8_DTYPE
from kvloom.kernels.ops import fp8_fused_moe, fp8_linear, w4a16_fused_moe, w4a16_linear
from kvloom.kernels.w4a16_gemm import PACK_FACTOR
from kvloom.workers.layers.quantization.config import Fp8Scheme, Scheme, W4A16Scheme
from kvloom.workers.layers.quantization.geometry import Geometry

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class QuantMethod:
    def __init__(self, scheme: Scheme, geom: Geometry, dtype: torch.dtype, what: str):
        self.scheme = scheme
        self.geom = geom
        self.dtype = dtype
        self.what = what

    # -- what each subclass says --------------------------------------------------
    def param_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def load(self, layer: nn.Module, param_name: str, loaded: torch.Tensor, shard: int) -> None:
        raise NotImplementedError

    def row_unit(self, param_name: str) -> int | None:
        """Output rows per row of this checkpoint tensor (None: it has no row dim)."""
        return 1

    # -- shared ---------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, device) -> None:
        layer._parameters.pop("weight", None)
        for name, (shape, dtype) in self.param_shapes().items():
            tensor = torch.empty(self.geom.lead() + shape, dtype=dtype, device=device)
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def _fail(self, param_name: str, message: str) -> None:
        raise ValueError(f"{param_name} ({self.scheme.name}): {message}")

    def _check(self, param_name: str, loaded: torch.Tensor, shape: tuple, dtypes) -> None:
        if loaded.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            self._fail(param_name, f"expected dtype {names}, got {loaded.dtype}")
        if tuple(loaded.shape) != tuple(shape):
            self._fail(param_name, f"expected shape {list(shape)}, got {list(loaded.shape)}")

    def _cols(self, param_name: str, loaded: torch.Tensor, unit: int) -> torch.Tensor:
        """This rank's input columns of a tensor with `unit` inputs per column."""
        start, end = self.geom.in_range
        if (start, end) == (0, self.geom.in_full):
            return loaded
        if start % unit or end % unit:
            self._fail(
                param_name,
                f"a tensor-parallel rank's input columns [{start}, {end}) must start and end "
                f"on a multiple of {unit} (choose a tensor_parallel_size that divides "
                f"{self.geom.in_full // unit} groups evenly)",
            )
        return loaded[:, start // unit : end // unit]

    def _store_rows(self, layer, param_name: str, rows: torch.Tensor, shard: int) -> None:
        expert, part = self.geom.split_shard(shard)
        start, end = self.geom.part_ranges[part]
        offset = self.geom.part_offset(part)
        target = getattr(layer, param_name).data
        if expert is not None:
            target = target[expert]
        target[offset : offset + end - start].copy_(rows[start:end])

    def part_of(self, shard: int) -> int:
        return self.geom.split_shard(shard)[1]

    def load_parts(self, layer, param_name: str, loaded: torch.Tensor) -> None:
        """One checkpoint tensor that stacks every part's rows (Qwen3.5's in_proj_qkv):
        each part's rows, or a whole-tensor value (weight_shape, a per-tensor scale)
        checked once and given to every part."""
        unit, parts, in_full = self.row_unit(param_name), self.geom.parts, self.geom.in_full
        if param_name == "weight_shape":
            got = [int(v) for v in loaded.flatten().tolist()] if loaded.numel() <= 4 else None
            if got != [sum(parts), in_full]:
                self._fail(param_name, f"expected [{sum(parts)}, {in_full}], got {got}")
            for part, size in enumerate(parts):
                self.load(layer, param_name, torch.tensor([size, in_full]), part)
            return
        if unit is None:
            for part in range(len(parts)):
                self.load(layer, param_name, loaded, part)
            return
        offset = 0
        for part, size in enumerate(parts):
            if offset % unit:
                self._fail(
                    param_name, f"part {part} starts at row {offset}, inside a {unit}-row block"
                )
            start = offset // unit
            self.load(layer, param_name, loaded[start : start + -(-size // unit)], part)
            offset += size


class Fp8Method(QuantMethod):
    scheme: Fp8Scheme

    def __init__(self, scheme: Fp8Scheme, geom: Geometry, dtype: torch.dtype, what: str):
        super().__init__(scheme, geom, dtype, what)
        if scheme.block is not None:
            self.group = scheme.block[1]
            if geom.in_full % self.group or geom.local_in % self.group:
                raise ValueError(
                    f"{what}: input width {geom.in_full} (per rank {geom.local_in}) must be a "
                    f"multiple of weight_block_size[1] = {self.group}"
                )
        else:
            self.group = geom.local_in
        if scheme.static_input and geom.num_experts is not None:
            raise ValueError(
                f"{what}: static FP8 input scales are not supported for MoE experts yet "
                "(input_activations.dynamic: false)"
            )
        self.whole_blocks = self._rows_are_whole_blocks()
        self._block_scale: torch.Tensor | None = None  # derived on first use (block_scale)

    def _rows_are_whole_blocks(self) -> bool:
        """Whether every bn rows of the stored scale (from row 0) repeat one checkpoint
        block row: block-scaled, not an expert stack, and each fused part's kept rows
        start and end on a block boundary (so no block mixes parts or shard edges).
        Columns need no check: a rank keeps whole column blocks (`_cols`)."""
        if self.scheme.block is None or self.geom.num_experts is not None:
            return False
        bn = self.scheme.block[0]
        return all(start % bn == 0 and end % bn == 0 for start, end in self.geom.part_ranges)

    def block_scale(self, layer) -> torch.Tensor | None:
        """The checkpoint's block scale as this rank keeps it, float32 [rows / bn, in / bk]
        contiguous (None unless `whole_blocks`): every bn-th row of the stored per-row
        scale, copied on first use and again on the first use after a scale is loaded.
        Derived rather than loaded so that weights filled without the loader (dummy
        weights) have it too."""
        if not self.whole_blocks:
            return None
        if self._block_scale is None:
            scale = getattr(layer, self.scheme.scale_name)
            if scale.is_cuda and torch.cuda.is_current_stream_capturing():
                return None  # a copy captured in a graph would run only at replay
            self._block_scale = scale.detach()[:: self.scheme.block[0]].contiguous()
        return self._block_scale

    def param_shapes(self):
        rows, cols = self.geom.local_rows, self.geom.local_in
        shapes = {
            "weight": ((rows, cols), FP8_DTYPE),
            self.scheme.scale_name: ((rows, cols // self.group), torch.float32),
        }
        if self.scheme.static_input:
            shapes["input_scale"] = ((len(self.geom.parts),), torch.float32)
        return shapes

    def row_unit(self, param_name: str) -> int | None:
        if param_name == "input_scale":
            return None
        if param_name == self.scheme.scale_name and self.scheme.block is not None:
            return self.scheme.block[0]
        if param_name == self.scheme.scale_name and self.scheme.per_tensor:
            return None
        return 1

    def load(self, layer, param_name, loaded, shard):
        part_rows = self.geom.parts[self.part_of(shard)]
        if param_name == "weight":
            self._check(param_name, loaded, (part_rows, self.geom.in_full), (FP8_DTYPE,))
            self._store_rows(layer, param_name, self._cols(param_name, loaded, 1), shard)
        elif param_name == self.scheme.scale_name:
            self._store_rows(layer, param_name, self._scale_rows(loaded, part_rows), shard)
            self._block_scale = None  # derived again from the new scale
        elif param_name == "input_scale" and self.scheme.static_input:
            if loaded.numel() != 1 or loaded.dtype not in FLOAT_DTYPES:
                self._fail(
                    param_name, f"expected one float, got {loaded.dtype} {list(loaded.shape)}"
                )
            layer.input_scale.data[self.part_of(shard)] = loaded.float().reshape(())
        else:
            self._fail(param_name, f"unexpected tensor for {self.what}")

    def _scale_rows(self, loaded: torch.Tensor, part_rows: int) -> torch.Tensor:
        """The checkpoint's scale as float32 [part_rows, in / group] (full input width
        first, then this rank's columns)."""
        name, in_full = self.scheme.scale_name, self.geom.in_full
        if self.scheme.block is not None:
            bn, bk = self.scheme.block
            shape = (-(-part_rows // bn), -(-in_full // bk))
            self._check(name, loaded, shape, FLOAT_DTYPES)
            rows = loaded.float().repeat_interleave(bn, dim=0)[:part_rows]
            return self._cols(name, rows, bk)
        if self.scheme.per_tensor:
            if loaded.numel() != 1 or loaded.dtype not in FLOAT_DTYPES:
                self._fail(
                    name, f"expected one float per tensor, got {loaded.dtype} {list(loaded.shape)}"
                )
            return loaded.float().reshape(1, 1).expand(part_rows, 1)
        if loaded.dim() == 1:
            loaded = loaded[:, None]
        self._check(name, loaded, (part_rows, 1), FLOAT_DTYPES)
        return loaded.float()

    def _input_scale(self, layer) -> torch.Tensor | None:
        return layer.input_scale.max() if self.scheme.static_input else None

    def apply(self, layer, x, bias=None, out_dtype=None):
        scale = getattr(layer, self.scheme.scale_name)
        return fp8_linear(
            x,
            layer.weight,
            scale,
            self.group,
            self._input_scale(layer),
            bias,
            out_dtype,
            block_scale=self.block_scale(layer),
        )

    def moe_forward(self, moe, hidden, topk_weights, topk_ids):
        up, down = moe.gate_up, moe.down
        name = self.scheme.scale_name
        return fp8_fused_moe(
            hidden,
            up.weight,
            getattr(up, name),
            down.weight,
            getattr(down, name),
            up.quant_method.group,
            down.quant_method.group,
            topk_weights,
            topk_ids,
        )


class W4A16Method(QuantMethod):
    scheme: W4A16Scheme

    def __init__(self, scheme: W4A16Scheme, geom: Geometry, dtype: torch.dtype, what: str):
        super().__init__(scheme, geom, dtype, what)
        self.group = scheme.group_size
        if geom.in_full % self.group or geom.local_in % self.group:
            raise ValueError(
                f"{what}: input width {geom.in_full} (per rank {geom.local_in}) must be a "
                f"multiple of weights.group_size = {self.group}"
            )

    def param_shapes(self):
        rows, cols = self.geom.local_rows, self.geom.local_in
        return {
            "weight_packed": ((rows, cols // PACK_FACTOR), torch.int32),
            "weight_scale": ((rows, cols // self.group), self.dtype),
            "weight_shape": ((len(self.geom.parts), 2), torch.int64),
        }

    def row_unit(self, param_name: str) -> int | None:
        return None if param_name == "weight_shape" else 1

    def load(self, layer, param_name, loaded, shard):
        part = self.part_of(shard)
        part_rows, in_full = self.geom.parts[part], self.geom.in_full
        if param_name == "weight_packed":
            shape = (part_rows, in_full // PACK_FACTOR)
            self._check(param_name, loaded, shape, (torch.int32,))
            self._store_rows(layer, param_name, self._cols(param_name, loaded, PACK_FACTOR), shard)
        elif param_name == "weight_scale":
            shape = (part_rows, in_full // self.group)
            self._check(param_name, loaded, shape, FLOAT_DTYPES)
            self._store_rows(layer, param_name, self._cols(param_name, loaded, self.group), shard)
        elif param_name == "weight_shape":
            got = [int(v) for v in loaded.flatten().tolist()] if loaded.numel() <= 4 else None
            if loaded.dtype.is_floating_point or got != [part_rows, in_full]:
                self._fail(
                    param_name,
                    f"expected [{part_rows}, {in_full}], got {got or list(loaded.shape)}",
                )
            expert, _ = self.geom.split_shard(shard)
            target = layer.weight_shape.data if expert is None else layer.weight_shape.data[expert]
            target[part] = torch.tensor([part_rows, in_full])
        else:
            self._fail(param_name, f"unexpected tensor for {self.what}")

    def apply(self, layer, x, bias=None, out_dtype=None):
        return w4a16_linear(x, layer.weight_packed, layer.weight_scale, self.group, bias, out_dtype)

    def moe_forward(self, moe, hidden, topk_weights, topk_ids):
        up, down = moe.gate_up, moe.down
        return w4a16_fused_moe(
            hidden,
            up.weight_packed,
            up.weight_scale,
            down.weight_packed,
            down.weight_scale,
            self.group,
            topk_weights,
            topk_ids,
            self.moe_offsets(up, down),
        )

    def moe_offsets(self, up, down):
        """The experts' zero points (float32 s * z for gate_up and down), or None."""
        return None


class W4A16ZeroPointMethod(W4A16Method):
    """int4 with a zero point per group and output row (AWQ): w = (q - z) * s, with q and
    z signed as in the symmetric layout (offset 8 removed), and `weight_offset`
    [N, K / g] = s * z in float32. Dense layers: the symmetric kernels give x (q s)^T,
    then sum_g (sum of x over group g) * s * z, a [T, K / g] x [K / g, N] product, is
    taken away in float32 before the one rounding to the output dtype. MoE experts: the
    fused kernels dequantize q * s - s * z in their tiles."""

    def param_shapes(self):
        shapes = super().param_shapes()
        shapes["weight_offset"] = (shapes["weight_scale"][0], torch.float32)
        return shapes

    def load(self, layer, param_name, loaded, shard):
        if param_name != "weight_offset":
            return super().load(layer, param_name, loaded, shard)
        part = self.part_of(shard)
        shape = (self.geom.parts[part], self.geom.in_full // self.group)
        self._check(param_name, loaded, shape, FLOAT_DTYPES)
        self._store_rows(layer, param_name, self._cols(param_name, loaded, self.group), shard)

    def apply(self, layer, x, bias=None, out_dtype=None):
        out = w4a16_linear(
            x, layer.weight_packed, layer.weight_scale, self.group, None, torch.float32
        )
        group_sums = x.float().unflatten(-1, (-1, self.group)).sum(dim=-1)  # [..., K / g]
        out = out - group_sums @ layer.weight_offset.t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype or x.dtype)

    def moe_offsets(self, up, down):
        return up.weight_offset, down.weight_offset


def make_method(scheme: Scheme, geom: Geometry, dtype: torch.dtype, what: str) -> QuantMethod:
    if isinstance(scheme, Fp8Scheme):
        return Fp8Method(scheme, geom, dtype, what)
    if scheme.zero_point:
        return W4A16ZeroPointMethod(scheme, geom, dtype, what)
    return W4A16Method(scheme, geom, dtype, what)
