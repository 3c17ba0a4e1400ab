"""Paged attention (``talaria.engine.attention``) against a plain gather + SDPA reference, and
the model's chunked decode path against transformers, in float32."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.engine.arch import ModelArch
from talaria.engine.attention import (
    PagedGroup,
    Scratch,
    attend_decode,
    attend_prefill,
    gather_kv,
    sdpa_gqa,
)
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kv_pool import KVPool
from talaria.engine.model import LlamaModel
from talaria.engine.weight_layout import bind_weights
from tests.helpers import examples, hf_model, llama_config

transformers = pytest.importorskip("transformers")

F32 = torch.float32
TPB = 4


def _arch(n_heads: int, n_kv_heads: int) -> ModelArch:
    return ModelArch.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 8 * n_heads,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads,
            "vocab_size": 32,
            "max_position_embeddings": 256,
        }
    )


def _reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], ctx: int
) -> torch.Tensor:
    """One decode query ``[heads, hd]`` over its sequence, gathered with advanced indexing."""
    idx = torch.tensor(table)
    k = k_cache[idx].flatten(0, 1)[:ctx].transpose(0, 1)  # [kvh, ctx, hd]
    v = v_cache[idx].flatten(0, 1)[:ctx].transpose(0, 1)
    o = F.scaled_dot_product_attention(q.unsqueeze(1), k, v, enable_gqa=True)
    return o.squeeze(1)


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 2), (6, 2), (3, 3)])
def test_decode_matches_a_gathered_reference(n_heads: int, n_kv_heads: int) -> None:
    arch = _arch(n_heads, n_kv_heads)
    pool = KVPool(40, 0, KVPool.block_bytes_for([arch], F32, TPB))
    kv = pool.paged(arch, F32)
    gen = torch.Generator().manual_seed(0)
    kv.blocks.copy_(torch.randn(kv.blocks.shape, generator=gen))
    ctxs = [13, 4, 1, 9]  # padded to 13, masked
    ids = list(range(kv.num_blocks))
    random.Random(1).shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-c // TPB))] for c in ctxs]
    width, max_ctx = max(map(len, tables)), max(ctxs)
    blocks = torch.tensor([b for t in tables for b in t + [t[0]] * (width - len(t))])
    pad = torch.arange(max_ctx).unsqueeze(0) >= torch.tensor(ctxs).unsqueeze(1)
    mask = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))[:, None, None, :]
    group = PagedGroup(len(ctxs), blocks, width, max_ctx, mask)
    q = torch.randn(len(ctxs), n_heads, arch.head_dim, generator=gen)
    shape = (TPB, n_kv_heads, arch.head_dim)
    k_rows, v_rows = kv.rows(1)
    k_ctx, v_ctx = gather_kv(k_rows, v_rows, group, shape, Scratch())
    out = attend_decode(q, k_ctx, v_ctx, group.mask)
    k_cache, v_cache = kv.layer(1)
    for i, (table, ctx) in enumerate(zip(tables, ctxs, strict=True)):
        expected = _reference(q[i], k_cache, v_cache, table, ctx)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-6)


def test_prefill_matches_a_gathered_reference() -> None:
    arch = _arch(4, 2)
    pool = KVPool(12, 0, KVPool.block_bytes_for([arch], F32, TPB))
    kv = pool.paged(arch, F32)
    gen = torch.Generator().manual_seed(2)
    kv.blocks.copy_(torch.randn(kv.blocks.shape, generator=gen))
    table, ctx, m = [7, 2, 9, 0], 14, 5  # the last 5 of 14 tokens
    q = torch.randn(m, 4, arch.head_dim, generator=gen)
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - m, ctx).unsqueeze(1)
    group = PagedGroup(1, torch.tensor(table), len(table), ctx, None)
    k_rows, v_rows = kv.rows(0)
    k_ctx, v_ctx = gather_kv(k_rows, v_rows, group, (TPB, 2, arch.head_dim), Scratch())
    out = attend_prefill(q, k_ctx, v_ctx, mask)
    k_cache, v_cache = kv.layer(0)
    k = k_cache[torch.tensor(table)].flatten(0, 1)[:ctx].transpose(0, 1)
    v = v_cache[torch.tensor(table)].flatten(0, 1)[:ctx].transpose(0, 1)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_scratch_is_reused_bounded_and_regrown() -> None:
    scratch = Scratch(limit=1000)
    a = scratch.get("k", 100, F32, torch.device("cpu"))
    b = scratch.get("k", 50, F32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 50
    c = scratch.get("k", 200, F32, torch.device("cpu"))  # grows
    assert c.numel() == 200 and scratch.nbytes == 800
    big = scratch.get("k", 300, F32, torch.device("cpu"))  # over the limit: not kept
    assert big.numel() == 300 and scratch.nbytes == 800
    assert scratch.get("k", 200, F32, torch.device("cpu")).data_ptr() == c.data_ptr()
    assert scratch.get("v", 10, torch.float64, torch.device("cpu")).dtype == torch.float64


def test_chunked_and_reordered_decodes_match_transformers() -> None:
    """Decodes split over several scratch-sized chunks, rows interleaved with a prefill chunk
    (non-consecutive decode rows), match full-sequence transformers logits."""
    hf = hf_model(llama_config(), seed=11)
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    region = torch.empty(arch.weight_bytes(F32), dtype=torch.uint8)
    views = bind_weights(arch, region, F32)
    state = hf.state_dict()
    for name, view in views.items():
        view.copy_(state[name])
    model = LlamaModel(arch, views)
    pool = KVPool(64, 0, KVPool.block_bytes_for([arch], F32, 8))
    kv = pool.paged(arch, F32)
    row_bytes = kv.rows(0)[0].shape[1] * 4
    model.scratch.limit = 8 * row_bytes  # at most 8 blocks gathered per chunk
    lengths = [17, 9, 30, 5, 12]
    rng = random.Random(12)
    tokens = [[rng.randrange(128) for _ in range(n)] for n in lengths]
    free = iter(range(kv.num_blocks))
    tables = [[next(free) for _ in range(-(-n // kv.tokens_per_block))] for n in lengths]
    for t, table in zip(tokens, tables, strict=True):  # prefill all but the last token
        model.forward(BatchInput([SeqInput(t[:-1], 0, table)]), kv)
    seqs = [SeqInput(t[-1:], len(t) - 1, table) for t, table in zip(tokens, tables, strict=True)]
    extra = [rng.randrange(128) for _ in range(6)]  # a fresh 6-token prefill in the middle
    seqs.insert(1, SeqInput(extra, 0, [next(free)], all_logits=True))
    batch = BatchInput(seqs)
    chunks = model._plan(batch, kv).decode  # blocks 3+2 | 4+1 | 2, rows 0,7 | 8,9 | 10
    assert [c.group.n for c in chunks] == [2, 2, 1]
    assert isinstance(chunks[0].rows, torch.Tensor) and chunks[1].rows == slice(8, 10)
    outs = batch.split(model.forward(batch, kv))
    del outs[1], seqs[1]
    with torch.no_grad():
        for out, t in zip(outs, tokens, strict=True):
            ref = hf(torch.tensor([t])).logits[0, -1:]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@settings(max_examples=examples(40), deadline=None)
@given(
    b=st.integers(1, 3),
    kvh=st.integers(1, 3),
    group=st.integers(1, 4),
    m=st.integers(1, 6),
    extra=st.integers(0, 9),
    seed=st.integers(0, 2**16),
    per_row=st.booleans(),
)
def test_folded_groups_equal_enable_gqa(
    b: int, kvh: int, group: int, m: int, extra: int, seed: int, per_row: bool
) -> None:
    """``sdpa_gqa(fold=True)`` (the CUDA layout with a mask: query groups folded into the
    query length) computes what ``enable_gqa`` computes, for a decode-style padding mask
    ``[b, 1, 1, ctx]`` and a prefill-style causal mask ``[m, ctx]`` continuing a prefix."""
    gen = torch.Generator().manual_seed(seed)
    hd, ctx = 8, m + extra
    q = torch.randn(b, kvh * group, m, hd, generator=gen)
    k = torch.randn(b, kvh, ctx, hd, generator=gen)
    v = torch.randn(b, kvh, ctx, hd, generator=gen)
    if per_row:  # prefill continuing `extra` cached tokens: token t sees positions <= extra + t
        mask = torch.arange(ctx).unsqueeze(0) <= (extra + torch.arange(m)).unsqueeze(1)
    else:  # decode-style padding: sequence i sees its first lengths[i] positions
        lengths = torch.randint(1, ctx + 1, (b,), generator=gen)
        mask = (torch.arange(ctx).unsqueeze(0) < lengths.unsqueeze(1)).view(b, 1, 1, ctx)
    want = sdpa_gqa(q, k, v, mask, fold=False)
    got = sdpa_gqa(q, k, v, mask, fold=True)
    assert got.shape == want.shape == (b, kvh * group, m, hd)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fold_refuses_is_causal_and_defaults_off_on_cpu() -> None:
    q = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="explicit mask"):
        sdpa_gqa(q, kv, kv, None, is_causal=True, fold=True)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(sdpa_gqa(q, kv, kv, mask), ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_folded_groups_run_on_the_memory_efficient_kernel() -> None:
    """On CUDA the folded layout with a padding mask runs on the memory-efficient kernel
    (forced: ``No available kernel`` otherwise) and matches the math kernel's enable_gqa."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(3)
    b, kvh, group, ctx, hd = 4, 8, 5, 700, 128
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        for shape in ((b, kvh * group, 1, hd), (b, kvh, ctx, hd), (b, kvh, ctx, hd))
    )
    lengths = torch.tensor([700, 512, 9, 300], device="cuda")
    pad = torch.arange(ctx, device="cuda").unsqueeze(0) >= lengths.unsqueeze(1)
    mask = torch.zeros(b, 1, 1, ctx, device="cuda", dtype=torch.bfloat16)
    mask.masked_fill_(pad.view(b, 1, 1, ctx), float("-inf"))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        got = sdpa_gqa(q, k, v, mask)  # folds: CUDA with a mask
    with sdpa_kernel(SDPBackend.MATH):
        want = sdpa_gqa(q, k, v, mask, fold=False)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
