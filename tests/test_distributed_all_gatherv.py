"""all_gatherv over gloo with 2 and 4 local processes: uneven and zero-length pieces, several
dtypes, known or exchanged sizes, and mismatches reported on every rank (invariant 9)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvloom.workers.distributed.all_gatherv import all_gatherv
from kvloom.workers.distributed.local_ranks import run_local_ranks
from kvloom.workers.distributed.process_group import GroupCoordinator, ParallelState, RankLayout

# name -> (dtype, lengths per rank for world size 2, for world size 4, trailing shape)
CASES = {
    "float32_uneven": (torch.float32, [3, 1], [3, 1, 4, 2], (4,)),
    "float64_uneven": (torch.float64, [1, 5], [2, 5, 1, 3], (2, 3)),
    "bfloat16_uneven": (torch.bfloat16, [4, 2], [1, 2, 3, 4], (8,)),
    "int64_uneven": (torch.int64, [2, 7], [7, 2, 2, 1], ()),
    "bool_uneven": (torch.bool, [5, 3], [3, 5, 1, 6], (3,)),
    "int16_uneven": (torch.int16, [2, 1], [1, 1, 2, 3], (2,)),  # gloo has no int16
    "zero_length_rank": (torch.float32, [0, 3], [3, 0, 5, 1], (2,)),
    "zero_length_last_rank": (torch.int64, [4, 0], [2, 3, 1, 0], ()),
    "all_zero_length": (torch.float32, [0, 0], [0, 0, 0, 0], (5,)),
    "equal_lengths": (torch.float32, [3, 3], [2, 2, 2, 2], (3,)),
    "zero_width_rows": (torch.float32, [2, 1], [1, 0, 2, 1], (0,)),
}
# How each rank names the group, and whether it passes the sizes it already knows.
VARIANTS = ("coordinator", "coordinator_known_sizes", "process_group", "default_group")


def make_piece(case: str, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contribution: random, never all zeros, different on every rank."""
    dtype, lengths2, lengths4, rest = CASES[case]
    n = (lengths2 if world_size == 2 else lengths4)[rank]
    gen = torch.Generator().manual_seed(1000 * sorted(CASES).index(case) + rank)
    if dtype == torch.bool:
        return torch.rand((n, *rest), generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn((n, *rest), generator=gen, dtype=torch.float64) + 3.0).to(dtype)
    return torch.randint(1, 30_000, (n, *rest), generator=gen, dtype=torch.int64).to(dtype)


def expected(case: str, world_size: int) -> torch.Tensor:
    return torch.cat([make_piece(case, r, world_size) for r in range(world_size)], dim=0)


def _gather_all_cases(state: ParallelState) -> dict:
    world, dev = state.world, state.device
    out = {}
    for case, (_, lengths2, lengths4, _) in CASES.items():
        piece = make_piece(case, state.rank, world.world_size).to(dev)
        sizes = lengths2 if world.world_size == 2 else lengths4
        out[case, "coordinator"] = all_gatherv(piece, world)
        out[case, "coordinator_known_sizes"] = world.all_gatherv(piece, sizes=sizes)
        out[case, "process_group"] = all_gatherv(piece, dist.group.WORLD)
        out[case, "default_group"] = all_gatherv(piece)

    # Along dim 1 of a non-contiguous (transposed) piece: (3, n) per rank -> (3, sum n).
    piece = make_piece("float32_uneven", state.rank, world.world_size).to(dev).t()[:3]
    out["dim1_noncontiguous"] = all_gatherv(piece, world, dim=1)
    out["dim_minus1"] = all_gatherv(piece, world, dim=-1)

    # NaN payloads and signed zeros travel bit for bit.
    special = torch.tensor([float("nan"), -0.0, float("inf")] * (state.rank + 1), device=dev)
    out["special_floats"] = all_gatherv(special, world)
    out = {k: v.cpu() for k, v in out.items()}

    # Mismatches are found after the exchange, so every rank raises (nobody hangs).
    for name, piece in {
        "mismatch_trailing": torch.zeros(2, 3 + state.rank),
        "mismatch_dtype": torch.zeros(2, dtype=torch.float32 if state.rank else torch.float64),
        "mismatch_ndim": torch.zeros((2, 2) if state.rank else (2,)),
    }.items():
        try:
            all_gatherv(piece.to(dev), world)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gathered(request):
    world_size = request.param
    results = run_local_ranks(_gather_all_cases, RankLayout(world_size), timeout_s=60)
    return world_size, results


def _check_all(world_size: int, results: list[dict]) -> None:
    for case in CASES:
        for variant in VARIANTS:
            want = expected(case, world_size)
            for rank, res in enumerate(results):
                got = res[case, variant]
                assert got.dtype == want.dtype and got.shape == want.shape, (case, variant, rank)
                assert torch.equal(got, want), (case, variant, rank)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_gatherv_matches_concatenation_on_every_rank(gathered, case, variant):
    world_size, results = gathered
    want = expected(case, world_size)
    for rank, res in enumerate(results):
        got = res[case, variant]
        assert got.dtype == want.dtype, (rank, got.dtype)
        assert got.shape == want.shape, (rank, tuple(got.shape), tuple(want.shape))
        assert torch.equal(got, want), f"rank {rank}: gathered values differ"


@pytest.mark.timeout(180)
def test_gatherv_along_other_dims(gathered):
    world_size, results = gathered
    want = torch.cat(
        [make_piece("float32_uneven", r, world_size).t()[:3] for r in range(world_size)], dim=1
    )
    for res in results:
        assert torch.equal(res["dim1_noncontiguous"], want)
        assert torch.equal(res["dim_minus1"], want)


@pytest.mark.timeout(180)
def test_gatherv_keeps_special_float_bits(gathered):
    world_size, results = gathered
    want = torch.cat(
        [torch.tensor([float("nan"), -0.0, float("inf")] * (r + 1)) for r in range(world_size)]
    )
    for res in results:
        got = res["special_floats"]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "name,needle",
    [
        ("mismatch_trailing", "shapes differ"),
        ("mismatch_dtype", "dtype"),
        ("mismatch_ndim", "shapes"),
    ],
)
def test_gatherv_mismatch_raises_on_every_rank(gathered, name, needle):
    _, results = gathered
    for rank, res in enumerate(results):
        assert needle in res[name], f"rank {rank}: {res[name]}"


# World size 1: no processes, no torch.distributed.


def test_single_rank_returns_input_and_checks_sizes():
    group = GroupCoordinator.single()
    t = torch.arange(6.0).reshape(3, 2)
    assert all_gatherv(t, group) is t
    assert all_gatherv(t, group, sizes=[3]) is t
    assert all_gatherv(t, None) is t  # torch.distributed not initialized: world of one
    empty = torch.empty(0, 4)
    assert all_gatherv(empty, group).shape == (0, 4)
    with pytest.raises(ValueError, match=r"sizes\[0\] = 2"):
        all_gatherv(t, group, sizes=[2])
    with pytest.raises(ValueError, match="one entry per rank"):
        all_gatherv(t, group, sizes=[3, 0])
    with pytest.raises(ValueError, match=r"sizes\[0\] must be an int"):
        all_gatherv(t, group, sizes=[-1])


def test_bad_arguments_name_the_field():
    group = GroupCoordinator.single()
    with pytest.raises(ValueError, match="dim"):
        all_gatherv(torch.zeros(2, 2), group, dim=2)
    with pytest.raises(ValueError, match="0-d"):
        all_gatherv(torch.tensor(1.0), group)
    with pytest.raises(ValueError, match="tensor must be a torch.Tensor"):
        all_gatherv([1, 2], group)
    with pytest.raises(ValueError, match="group must be"):
        all_gatherv(torch.zeros(2), group="world")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gatherv_over_nccl_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    results = run_local_ranks(_gather_all_cases, RankLayout(2), device_type="cuda", timeout_s=120)
    _check_all(2, results)
    for rank, res in enumerate(results):
        for name in ("mismatch_trailing", "mismatch_dtype", "mismatch_ndim"):
            assert res[name] != "no error", (rank, name)
