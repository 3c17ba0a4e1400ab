"""The native paged decode kernel (``talaria.engine.kernels``): against a float64 reference
over the same bf16 KV, on both code paths (AVX512-BF16 head dims and portable ones), through
the model, and its build: cache reuse, disabling, a failing compiler."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kernels import DecodeKernel, KernelUnavailable, build_decode_kernel
from talaria.engine.kv_pool import KVPool
from talaria.engine.model import LlamaModel
from talaria.engine.weight_layout import bind_weights
from tests.helpers import examples

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel:
    return build_decode_kernel(tmp_path_factory.mktemp("kernels"))


def _arch(n_heads: int, n_kv_heads: int, head_dim: int, layers: int = 2) -> ModelArch:
    return ModelArch.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": head_dim * n_heads,
            "head_dim": head_dim,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads,
            "vocab_size": 64,
            "max_position_embeddings": 4096,
        }
    )


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: list[int],
    ctx: int,
) -> torch.Tensor:
    """float64 attention of ``q`` ``[heads, hd]`` over its sequence's first ``ctx`` tokens."""
    idx = torch.tensor(table)
    k = k_cache[idx].flatten(0, 1)[:ctx].double()  # [ctx, kvh, hd]
    v = v_cache[idx].flatten(0, 1)[:ctx].double()
    heads, hd = q.shape
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, hd]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (k @ q.double().unsqueeze(-1)).squeeze(-1) * hd**-0.5  # [heads, ctx]
    return (scores.softmax(-1).unsqueeze(1) @ v).squeeze(1)


def _check(
    kernel: DecodeKernel,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    tpb: int,
    ctxs: list[int],
    seed: int,
    layer: int = 1,
) -> None:
    arch = _arch(n_heads, n_kv_heads, head_dim)
    need = sum(-(-c // tpb) for c in ctxs)
    pool = KVPool(need + 3, 0, KVPool.block_bytes_for([arch], BF16, tpb))
    kv = pool.paged(arch, BF16)
    gen = torch.Generator().manual_seed(seed)
    kv.blocks.copy_(torch.randn(kv.blocks.shape, generator=gen))
    ids = list(range(kv.num_blocks))
    random.Random(seed).shuffle(ids)
    tables = [[ids.pop() for _ in range(-(-c // tpb))] for c in ctxs]
    width = max(map(len, tables))
    padded = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    # q as the model hands it over: a view with a row stride wider than the row
    qkv = torch.randn(len(ctxs), n_heads + 2, head_dim, generator=gen).to(BF16)
    q = qkv[:, :n_heads]
    k_rows, v_rows = kv.rows(layer)
    out = kernel.attend(q, k_rows, v_rows, padded, torch.tensor(ctxs), tpb, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == BF16
    k_cache, v_cache = kv.layer(layer)
    for i, (table, ctx) in enumerate(zip(tables, ctxs, strict=True)):
        expected = _reference(q[i], k_cache, v_cache, table, ctx)
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "head_dim"),
    [(9, 3, 64), (14, 2, 64), (8, 8, 128), (4, 1, 32), (6, 2, 80), (16, 1, 64)],
)
def test_matches_float64_reference(
    kernel: DecodeKernel, n_heads: int, n_kv_heads: int, head_dim: int
) -> None:
    """64 and 128 take the AVX512-BF16 path (where the CPU has it), 32 and 80 the portable
    one; contexts cover one token, partial blocks and several 16-token chunks per block."""
    _check(kernel, n_heads, n_kv_heads, head_dim, 16, [1, 15, 16, 17, 100, 300], seed=head_dim)


@pytest.mark.parametrize("tpb", [1, 5, 32, 48])
def test_block_sizes_other_than_sixteen(kernel: DecodeKernel, tpb: int) -> None:
    _check(kernel, 9, 3, 64, tpb, [1, 7, 47, 200], seed=tpb)


@settings(max_examples=examples(25), deadline=None)
@given(
    kv_heads=st.integers(1, 4),
    group=st.integers(1, 8),
    head_dim=st.sampled_from([32, 64, 128]),
    tpb=st.integers(1, 40),
    ctxs=st.lists(st.integers(1, 120), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_random_shapes(
    kernel: DecodeKernel,
    kv_heads: int,
    group: int,
    head_dim: int,
    tpb: int,
    ctxs: list[int],
    seed: int,
) -> None:
    _check(kernel, kv_heads * group, kv_heads, head_dim, tpb, ctxs, seed, layer=0)


def test_loading_it_leaves_subnormal_floats_alone(kernel: DecodeKernel) -> None:
    """A library linked with -ffast-math would set flush-to-zero for the whole process."""
    smallest_normal = torch.finfo(torch.float64).tiny
    assert kernel.path.exists()
    assert smallest_normal / 2 != 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0
    assert (torch.tensor([1e-38]) / 100).item() != 0.0


def test_rejects_operands_it_cannot_read(kernel: DecodeKernel) -> None:
    arch = _arch(4, 2, 64)
    kv = KVPool(4, 0, KVPool.block_bytes_for([arch], BF16, 16)).paged(arch, BF16)
    k_rows, v_rows = kv.rows(0)
    tables, ctxs = torch.tensor([[0, 1]]), torch.tensor([20])
    q = torch.zeros(1, 4, 64, dtype=BF16)
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.attend(q.float(), k_rows, v_rows, tables, ctxs, 16, 0.125)
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.attend(
            q.transpose(1, 2).contiguous().transpose(1, 2), k_rows, v_rows, tables, ctxs, 16, 0.125
        )
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.attend(q, k_rows, v_rows, tables.int(), ctxs, 16, 0.125)
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.attend(q, k_rows, v_rows, tables, torch.tensor([20, 3]), 16, 0.125)
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.attend(torch.zeros(1, 3, 64, dtype=BF16), k_rows, v_rows, tables, ctxs, 16, 0.1)
    assert not DecodeKernel.supports(4, 2, 64, torch.float32)
    assert not DecodeKernel.supports(34, 2, 64, BF16)  # group 17 > 16
    assert not DecodeKernel.supports(4, 3, 64, BF16)


def test_model_decode_with_the_kernel_matches_gather_and_sdpa(kernel: DecodeKernel) -> None:
    """A bf16 model decoding a mixed batch (a prefill chunk between decodes of ragged
    contexts) through the kernel gives the gather + SDPA path's logits within bf16 noise."""
    arch = _arch(6, 2, 64, layers=3)
    region = torch.empty(arch.weight_bytes(BF16), dtype=torch.uint8)
    views = bind_weights(arch, region, BF16)
    gen = torch.Generator().manual_seed(5)
    for view in views.values():
        view.copy_(torch.randn(view.shape, generator=gen) * 0.2)
    plain, fast = LlamaModel(arch, views), LlamaModel(arch, views, kernel)
    assert plain.decode_kernel is None and fast.decode_kernel is kernel
    pool = KVPool(40, 0, KVPool.block_bytes_for([arch], BF16, 16))
    kv = pool.paged(arch, BF16)
    rng = random.Random(3)
    lengths = [40, 7, 90, 16]
    free = iter(range(kv.num_blocks))
    tables = [[next(free) for _ in range(-(-(n + 4) // 16))] for n in lengths]
    tokens = [[rng.randrange(64) for _ in range(n)] for n in lengths]
    for t, table in zip(tokens, tables, strict=True):
        plain.forward(BatchInput([SeqInput(t, 0, table)]), kv)
    for step in range(3):
        seqs = [
            SeqInput([rng.randrange(64)], n + step, table)
            for n, table in zip(lengths, tables, strict=True)
        ]
        seqs.insert(2, SeqInput([rng.randrange(64) for _ in range(5)], 0, [next(free)]))
        expected = plain.forward(BatchInput(seqs), kv).float()
        got = fast.forward(BatchInput(seqs), kv).float()
        torch.testing.assert_close(
            got, expected, rtol=0.03, atol=0.03 * expected.abs().max().item()
        )
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_float32_models_keep_pytorch_attention(kernel: DecodeKernel) -> None:
    arch = _arch(4, 2, 64)
    views = bind_weights(
        arch, torch.zeros(arch.weight_bytes(torch.float32), dtype=torch.uint8), torch.float32
    )
    assert LlamaModel(arch, views, kernel).decode_kernel is None


def test_build_reuses_the_cache_and_can_be_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build_decode_kernel(tmp_path)
    built = list(tmp_path.glob("decode-kernels-*.so"))
    assert built == [first.path]
    stamp = first.path.stat().st_mtime_ns
    again = build_decode_kernel(tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp
    monkeypatch.setenv("TALARIA_NATIVE_KERNELS", "0")
    with pytest.raises(KernelUnavailable, match="TALARIA_NATIVE_KERNELS"):
        build_decode_kernel(tmp_path)


def test_a_failing_compiler_is_reported_not_raised_into_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from talaria.engine.kernels import optional_decode_kernel

    monkeypatch.setenv("CC", "false")
    with pytest.raises(KernelUnavailable, match=r"false .*failed"):
        build_decode_kernel(tmp_path / "k")
    monkeypatch.setenv("TALARIA_CACHE_DIR", str(tmp_path))
    assert optional_decode_kernel("cpu") is None
    assert optional_decode_kernel("meta") is None
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize(
    ("m", "rows", "k", "bias"),
    [
        (1, 1, 32, False),
        (1, 37, 64, True),
        (1, 960, 576, True),
        (2, 100, 1536, False),
        (2, 7, 96, True),
        (2, 576, 576, False),
    ],
)
def test_small_gemm_matches_float64(
    kernel: DecodeKernel, m: int, rows: int, k: int, bias: bool
) -> None:
    """Both batch sizes, row counts that leave a partial tile, strided weight and input rows,
    with and without bias."""
    if not kernel.avx512bf16:
        pytest.skip("the small-batch product needs AVX512-BF16")
    gen = torch.Generator().manual_seed(rows + k + m)
    w = torch.randn(rows, k + 64, generator=gen).to(BF16)[:, 32 : 32 + k]  # rows k + 64 apart
    x = torch.randn(m, k + 32, generator=gen).to(BF16)[:, :k]
    b = torch.randn(rows, generator=gen).to(BF16) if bias else None
    assert kernel.gemm_supports(w)
    y = kernel.gemm_small(x, w, b)
    expected = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert y.shape == (m, rows) and y.dtype == BF16
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2 * k**0.5)


def test_small_gemm_refuses_what_it_cannot_take(kernel: DecodeKernel) -> None:
    w = torch.zeros(16, 64, dtype=BF16)
    assert not kernel.gemm_supports(w.float())
    assert not kernel.gemm_supports(torch.zeros(16, 48, dtype=BF16))  # 48 columns
    assert not kernel.gemm_supports(w.t())
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.gemm_small(torch.zeros(3, 64, dtype=BF16), w)  # more than 2 rows
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.gemm_small(torch.zeros(1, 64, dtype=BF16), w, torch.zeros(15, dtype=BF16))
    with pytest.raises(ValueError, match="unsupported operands"):
        kernel.gemm_small(torch.zeros(64, 2, dtype=BF16).t(), w)  # strided columns


def test_model_batch_one_decode_with_the_kernel_matches_pytorch(kernel: DecodeKernel) -> None:
    """Batch-1 decode takes the kernel's attention and small-batch product (bias included:
    a Qwen2-style model); logits agree with PyTorch's operators within bf16 noise."""
    arch = ModelArch.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 96,
            "max_position_embeddings": 512,
        }
    )
    assert arch.attention_bias
    views = bind_weights(arch, torch.empty(arch.weight_bytes(BF16), dtype=torch.uint8), BF16)
    gen = torch.Generator().manual_seed(9)
    for view in views.values():
        view.copy_(torch.randn(view.shape, generator=gen) * 0.2)
    plain, fast = LlamaModel(arch, views), LlamaModel(arch, views, kernel)
    assert fast._gemm is (kernel if kernel.avx512bf16 else None)  # every projection fits
    kv = KVPool(8, 0, KVPool.block_bytes_for([arch], BF16, 16)).paged(arch, BF16)
    prompt = [int(t) for t in torch.randint(0, 96, (30,), generator=gen)]
    plain.forward(BatchInput([SeqInput(prompt, 0, [0, 1, 2])]), kv)
    token = 7
    for pos in range(30, 36):
        seq = BatchInput([SeqInput([token], pos, [0, 1, 2])])
        expected = plain.forward(seq, kv).float()
        got = fast.forward(seq, kv).float()
        torch.testing.assert_close(
            got, expected, rtol=0.03, atol=0.03 * expected.abs().max().item()
        )
        assert int(got.argmax()) == int(expected.argmax())
        token = int(expected.argmax())
