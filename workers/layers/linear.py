"""Linear layers written for tensor parallelism (they run unchanged with one rank).

Column-parallel layers split output features across ranks; row-parallel layers split
input features and all-reduce their partial sums. Fused projections (QKV, gate+up) keep
one weight whose row ranges are filled shard by shard at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.kernels.ops import linear
from kvloom.workers.layers.quantization.geometry import Geometry
from kvloom.workers.layers.quantization.scope import weight_device
from kvloom.workers.layers.tp_group import LocalGroup, TPGroup, shard_range

HALF_DTYPES = (torch.float16, torch.bfloat16)


def linear_float32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with float32 accumulation *and* a float32 result (no rounding to x's
    dtype). CUDA has a GEMM for it; elsewhere the operands are upcast (same products)."""
    if x.is_cuda:
        flat = x.reshape(-1, x.shape[-1])
        try:
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without the mixed-output GEMM
            out = flat.float() @ weight.float().t()
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float(), weight.float())


def check_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not match the "
            f"model's expected shape {tuple(expected)}"
        )


def check_float_tensor(name: str, loaded: torch.Tensor) -> None:
    """A float layer refuses a quantized tensor (a copy would drop its scale silently)."""
    if not loaded.dtype.is_floating_point or loaded.element_size() == 1:
        raise ValueError(
            f"weight {name}: the checkpoint stores it as {loaded.dtype}, but its "
            "quantization_config leaves this module unquantized"
        )


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over ranks. `output_sizes` lists the fused
    parts (e.g. [intermediate, intermediate] for gate+up); each part is split."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        gather_output: bool = False,
    ):
        super().__init__()
        self.tp = tp or LocalGroup()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = [s // self.tp.world_size for s in output_sizes]
        for s in output_sizes:
            shard_range(s, 0, self.tp.world_size, "linear output size")
        self.gather_output = gather_output
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(
            torch.empty(local_out, input_size, dtype=dtype, device=weight_device()), False
        )
        self.bias = nn.Parameter(torch.empty(local_out, dtype=dtype), False) if bias else None
        self.quant_method = None  # set by quantization.apply for a quantized checkpoint

    def quant_geometry(self) -> Geometry:
        ranges = [shard_range(s, self.tp.rank, self.tp.world_size, "") for s in self.output_sizes]
        return Geometry(
            tuple(self.output_sizes), tuple(ranges), self.input_size, (0, self.input_size)
        )

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """Copies this rank's slice of fused part `shard` from a full checkpoint tensor."""
        if self.quant_method is not None and param_name != "bias":
            return self.quant_method.load(self, param_name, loaded, shard)
        check_float_tensor(param_name, loaded)
        param = self.weight if param_name == "weight" else self.bias
        full = self.output_sizes[shard]
        expected = (full, self.input_size) if param_name == "weight" else (full,)
        check_shape(param_name, loaded, expected)
        start, end = shard_range(full, self.tp.rank, self.tp.world_size, "linear output size")
        offset = sum(self.local_sizes[:shard])
        param.data[offset : offset + end - start].copy_(loaded[start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, self.bias)
        else:
            y = linear(x, self.weight, self.bias)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads are split over ranks. With more ranks than
    KV heads, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        tp = tp or LocalGroup()
        if num_heads % tp.world_size:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be divisible by "
                f"tensor_parallel_size ({tp.world_size})"
            )
        self.num_kv_heads_total = num_kv_heads
        self.kv_replicas = max(1, tp.world_size // num_kv_heads)
        if num_kv_heads >= tp.world_size and num_kv_heads % tp.world_size:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) must be divisible by "
                f"tensor_parallel_size ({tp.world_size})"
            )
        kv_shards = num_kv_heads * self.kv_replicas  # kv heads after replication
        self.head_size = head_size
        self.num_heads = num_heads // tp.world_size
        self.num_kv_heads = kv_shards // tp.world_size
        super().__init__(
            hidden_size,
            [num_heads * head_size, kv_shards * head_size, kv_shards * head_size],
            bias=bias,
            tp=tp,
            dtype=dtype,
        )

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        # Rows of this tensor per output row: a block scale covers several (quantized).
        unit = 1 if self.quant_method is None else self.quant_method.row_unit(param_name)
        if shard > 0 and self.kv_replicas > 1 and unit is not None:
            if unit > 1 and self.head_size % unit:
                raise ValueError(
                    f"weight {param_name}: replicating KV heads of {self.head_size} rows needs "
                    f"scale blocks that tile a head, got {unit}-row blocks"
                )
            rows = -(-self.head_size // unit)
            loaded = loaded.unflatten(0, (self.num_kv_heads_total, rows))
            loaded = loaded.repeat_interleave(self.kv_replicas, dim=0).flatten(0, 1)
        super().load_shard(param_name, loaded, shard)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split(self.local_sizes, dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup | None = None,
        dtype: torch.dtype = torch.float32,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.tp = tp or LocalGroup()
        self.input_size = input_size
        self.output_size = output_size
        self.reduce_results = reduce_results
        start, end = shard_range(input_size, self.tp.rank, self.tp.world_size, "linear input size")
        self.in_range = (start, end)
        self.weight = nn.Parameter(
            torch.empty(output_size, end - start, dtype=dtype, device=weight_device()), False
        )
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), False) if bias else None
        self.quant_method = None  # set by quantization.apply for a quantized checkpoint

    def quant_geometry(self) -> Geometry:
        out = self.output_size
        return Geometry((out,), ((0, out),), self.input_size, self.in_range)

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if self.quant_method is not None and param_name != "bias":
            return self.quant_method.load(self, param_name, loaded, shard)
        check_float_tensor(param_name, loaded)
        if param_name == "bias":
            check_shape(param_name, loaded, (self.output_size,))
            self.bias.data.copy_(loaded)
            return
        check_shape(param_name, loaded, (self.output_size, self.input_size))
        start, end = self.in_range
        self.weight.data.copy_(loaded[:, start:end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self._quantized_forward(x)
        if self.tp.world_size > 1 and self.reduce_results and x.dtype in HALF_DTYPES:
            # Half-precision partial sums are kept in float32 through the all-reduce and
            # rounded once, where one rank's GEMM rounds: TP=N then matches TP=1 up to
            # float32 rounding instead of a half-precision rounding per rank.
            y = self.tp.all_reduce(linear_float32_out(x, self.weight))
            y = y + self.bias if self.bias is not None else y
            return y.to(x.dtype)
        y = linear(x, self.weight)
        if self.reduce_results and self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        # Bias once, after the reduction, so it is not counted world_size times.
        return y + self.bias if self.bias is not None else y

    def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        """As the float path: half-precision partial sums cross ranks in float32 (the
        quantized GEMMs accumulate in float32 and can hand that over unrounded)."""
        reduce = self.reduce_results and self.tp.world_size > 1
        wide = reduce and x.dtype in HALF_DTYPES
        y = self.quant_method.apply(self, x, None, torch.float32 if wide else None)
        if reduce:
            y = self.tp.all_reduce(y)
        y = y + self.bias if self.bias is not None else y
        return y.to(x.dtype)


class ReplicatedLinear(nn.Module):
    """A small linear kept whole on every rank (routers, gates)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype, device=weight_device()), False
        )
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), False) if bias else None
        self.quant_method = None  # set by quantization.apply for a quantized checkpoint

    def quant_geometry(self) -> Geometry:
        out, size = self.weight.shape
        return Geometry((out,), ((0, out),), size, (0, size))

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if self.quant_method is not None and param_name != "bias":
            return self.quant_method.load(self, param_name, loaded, shard)
        check_float_tensor(param_name, loaded)
        param = self.weight if param_name == "weight" else self.bias
        check_shape(param_name, loaded, tuple(param.shape))
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return linear(x, self.weight, self.bias)
