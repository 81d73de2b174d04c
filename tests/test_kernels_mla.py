"""MLA over the paged latent cache: the absorbed reference kernel and the layer.

Oracles: attention written out the decompressed way (every cached token's per-head keys and
values rebuilt with kv_b_proj, plain causal softmax), and transformers' KimiLinearAttention.
"""

from __future__ import annotations

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from kvloom.contracts.kv_cache_spec import MLASpec
from kvloom.kernels.mla_attention import mla_attention_ref, write_mla_cache_ref
from kvloom.workers.attention_metadata import ForwardBatch, GroupMetadata
from kvloom.workers.cache_pages import pages_for
from kvloom.workers.layers.mla import MultiHeadLatentAttention
from kvloom.workers.row_kinds import RowClasses, classify_rows

HEADS, RANK, ROPE, NOPE, VDIM = 3, 12, 4, 8, 6
BLOCK = 4
# Max abs errors measured: kernel 4.8e-7 (f32) / 1.0e-15 (f64); layer vs transformers 7.2e-7.
TOL = {torch.float32: 5e-6, torch.float64: 1e-12}
LAYER_TOL = 5e-6


def paged_layout(context_lens: list[int], num_blocks: int, gen: torch.Generator):
    """Random distinct blocks per sequence: block table [N, max_blocks] and slot of every
    (sequence, position)."""
    need = [-(-n // BLOCK) for n in context_lens]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)].tolist()
    tables, slots, at = [], [], 0
    for n, count in zip(context_lens, need):
        row = ids[at : at + count]
        at += count
        tables.append(row + [0] * (max(need) - count))
        slots.append([row[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    return torch.tensor(tables, dtype=torch.int32), slots


def decompressed_attention(q_nope, q_pe, latent, k_pe, w_kv_b, scale):
    """Causal attention of the last q tokens of a sequence over all its tokens, with keys and
    values rebuilt per head from the latent (transformers' way)."""
    kv = torch.einsum("sr,hdr->hsd", latent, w_kv_b)
    k_nope, v = kv.split([NOPE, VDIM], dim=-1)
    n, m = q_nope.shape[0], latent.shape[0]
    scores = torch.einsum("thd,hsd->hts", q_nope, k_nope) + torch.einsum("thd,sd->hts", q_pe, k_pe)
    q_pos = torch.arange(m - n, m)
    visible = torch.arange(m)[None, :] <= q_pos[:, None]
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    out = torch.einsum("hts,hsd->thd", scores.softmax(-1), v)
    return out, torch.logsumexp(scores, -1).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_absorbed_kernel_matches_decompressed_attention_on_mixed_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    # Rows: fresh prefill, resumed chunk, decode, zero-length padding, one-token fresh prompt,
    # a decode whose context crosses several blocks.
    context = [7, 13, 9, 5, 1, 18]
    queries = [7, 4, 1, 0, 1, 1]
    num_blocks = 24
    tables, slots = paged_layout(context, num_blocks, gen)
    latents = [torch.randn(n, RANK, generator=gen, dtype=dtype) for n in context]
    k_pes = [torch.randn(n, ROPE, generator=gen, dtype=dtype) for n in context]
    w_kv_b = torch.randn(HEADS, NOPE + VDIM, RANK, generator=gen, dtype=dtype) / RANK**0.5
    scale = (NOPE + ROPE) ** -0.5

    # Unused slots and blocks hold NaN, as the sanitizer leaves them.
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"), dtype=dtype)
    flat_slots = torch.tensor([s for row in slots for s in row])
    write_mla_cache_ref(torch.cat(latents), torch.cat(k_pes), cache, flat_slots)

    q_nope = [torch.randn(q, HEADS, NOPE, generator=gen, dtype=dtype) for q in queries]
    q_pe = [torch.randn(q, HEADS, ROPE, generator=gen, dtype=dtype) for q in queries]
    w_uk, w_uv = w_kv_b[:, :NOPE], w_kv_b[:, NOPE:]
    q_latent = torch.einsum("thd,hdr->thr", torch.cat(q_nope), w_uk)
    starts = torch.tensor([0] + queries).cumsum(0).to(torch.int32)
    o_latent, lse = mla_attention_ref(
        q_latent, torch.cat(q_pe), cache, tables, starts, torch.tensor(context), scale
    )
    out = torch.einsum("thr,hvr->thv", o_latent, w_uv)

    assert out.dtype == dtype and lse.dtype == torch.float32
    for row, q in enumerate(queries):
        a, b = starts[row].item(), starts[row + 1].item()
        if q == 0:
            continue
        ref, ref_lse = decompressed_attention(
            q_nope[row], q_pe[row], latents[row], k_pes[row], w_kv_b, scale
        )
        err = (out[a:b] - ref).abs().max().item()
        assert err <= TOL[dtype], f"row {row}: max error {err:.3g}"
        assert torch.allclose(lse[a:b], ref_lse.float(), atol=1e-5)
    assert torch.isfinite(out).all()

    # A CUDA graph's padding: tokens past the last row (query_start_loc ends below the
    # token count) come out zero with lse -inf, and the real rows are unchanged.
    pad = 3
    padded_q = torch.cat([q_latent, torch.randn(pad, HEADS, RANK, generator=gen, dtype=dtype)])
    padded_pe = torch.cat(
        [torch.cat(q_pe), torch.randn(pad, HEADS, ROPE, generator=gen, dtype=dtype)]
    )
    o_pad, lse_pad = mla_attention_ref(
        padded_q, padded_pe, cache, tables, starts, torch.tensor(context), scale
    )
    assert torch.equal(o_pad[: len(q_latent)], o_latent)
    assert torch.equal(o_pad[len(q_latent) :], torch.zeros_like(o_pad[len(q_latent) :]))
    assert torch.isneginf(lse_pad[len(q_latent) :]).all()
    with pytest.raises(ValueError, match="query_start_loc"):
        mla_attention_ref(
            q_latent[:-1], torch.cat(q_pe)[:-1], cache, tables, starts, torch.tensor(context), scale
        )


def test_write_skips_padding_slots_and_rejects_bad_shapes():
    cache = torch.zeros(3, BLOCK, RANK + ROPE)
    latent, k_pe = torch.randn(3, RANK), torch.randn(3, ROPE)
    write_mla_cache_ref(latent, k_pe, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(cache[1, 1], torch.cat([latent[0], k_pe[0]]))
    assert torch.equal(cache[0, 0], torch.cat([latent[2], k_pe[2]]))
    assert int((cache != 0).any(-1).sum()) == 2  # the padding row wrote nothing
    with pytest.raises(ValueError, match="latent_cache"):
        write_mla_cache_ref(latent, k_pe, torch.zeros(3, BLOCK, RANK), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="q_pe"):
        mla_attention_ref(
            torch.randn(2, HEADS, RANK),
            torch.randn(2, HEADS + 1, ROPE),
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 2]),
            torch.tensor([2]),
            1.0,
        )
    with pytest.raises(ValueError, match="seq_lens"):
        mla_attention_ref(
            torch.randn(3, HEADS, RANK),
            torch.randn(3, HEADS, ROPE),
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 3]),
            torch.tensor([2]),
            1.0,
        )


# ----------------------------------------------------------------------------- the layer


def forward_batch(computed: list[int], scheduled: list[int], tables, slots) -> ForwardBatch:
    positions = [p for c, s in zip(computed, scheduled) for p in range(c, c + s)]
    starts = torch.tensor([0] + scheduled).cumsum(0).tolist()
    seq_lens = [c + s for c, s in zip(computed, scheduled)]
    return ForwardBatch(
        positions=torch.tensor(positions),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        query_start_loc_list=starts,
        seq_lens_list=seq_lens,
        rows=RowClasses(classify_rows(computed, scheduled), scheduled),
        groups=[GroupMetadata(tables, torch.tensor(slots))],
        layer_to_group={0: 0},
    )


def hf_attention(q_lora_rank, bias):
    config = KimiLinearConfig(
        hidden_size=32,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=RANK,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=VDIM,
        attention_bias=bias,
        num_hidden_layers=1,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    layer = KimiLinearAttention(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    return layer


def ours_from(hf: KimiLinearAttention) -> MultiHeadLatentAttention:
    ours = MultiHeadLatentAttention(
        0,
        32,
        HEADS,
        NOPE,
        ROPE,
        VDIM,
        RANK,
        hf.q_lora_rank,
        bias=hf.o_proj.bias is not None,
    )
    modules = dict(ours.named_modules())
    for name, tensor in hf.state_dict().items():
        module, _, param = name.rpartition(".")
        modules[module].load_shard(param, tensor, 0)
    return ours


@pytest.mark.parametrize(
    "q_lora_rank,bias", [(None, False), (10, True)], ids=["q_proj", "q_lora+bias"]
)
def test_layer_matches_transformers_over_prefill_chunk_and_decodes(q_lora_rank, bias):
    hf = hf_attention(q_lora_rank, bias)
    ours = ours_from(hf)
    spec = MLASpec(BLOCK, RANK, ROPE, "float32")
    ours.allocate_cache(pages_for(spec, 8, "cpu"), spec)
    ours.poison_cache(torch.arange(8))
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 11, 32, generator=gen)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = hf(hidden, causal)[0][0]

    blocks = [5, 2, 7]  # scattered pages
    table = torch.tensor([blocks], dtype=torch.int32)
    slot_of = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(11)]
    # A fresh 6-token chunk, a resumed 3-token chunk, then two decodes.
    got, done = [], 0
    for count in (6, 3, 1, 1):
        batch = forward_batch([done], [count], table, slot_of[done : done + count])
        with torch.no_grad():
            got.append(ours(hidden[0, done : done + count], batch))
        done += count
    err = (torch.cat(got) - ref).abs().max().item()
    assert err <= LAYER_TOL, f"max |diff| vs transformers {err:.3g}"
