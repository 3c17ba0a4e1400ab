"""The paged Llama-family forward pass against Hugging Face transformers, in float32.

Tiny random models (2-3 layers, hidden 64, grouped-query attention) are built by the tests
with a fixed seed; their parameters are copied into views of one flat region
(``bind_weights``) and every logit the engine computes is compared with a full-sequence
transformers forward over the same tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from talaria.engine.arch import ModelArch
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kv_pool import KVPool, PagedKV
from talaria.engine.model import LlamaModel
from talaria.engine.weight_layout import bind_weights
from talaria.errors import BadRequest, ConfigError, ContextTooLong
from talaria.memory.kv import MovePlan
from talaria.types import Link
from tests.helpers import hf_model, llama_config, qwen2_config, randomize_hf

transformers = pytest.importorskip("transformers")

F32 = torch.float32
RTOL, ATOL = 1e-4, 1e-5
BLOCK_SIZE = 8  # tokens per block of the widest model


# ----------------------------------------------------------------------------- helpers


def load(views: dict[str, torch.Tensor], hf: Any) -> None:
    state = hf.state_dict()
    for name, view in views.items():
        view.copy_(state[name])


@torch.no_grad()
def hf_logits(hf: Any, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' logits ``[len(tokens), vocab]`` for one full-sequence forward."""
    return hf(torch.tensor([list(tokens)], device=hf.device)).logits[0].to(F32)


class Checker:
    """assert_close with the tolerance of the issue; remembers the worst errors seen."""

    def __init__(self) -> None:
        self.max_rel = 0.0
        self.max_abs = 0.0
        self.max_ref = 0.0
        self.n = 0

    def __call__(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
        diff = (actual - expected).abs()
        big = expected.abs() > 1e-2
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_ref = max(self.max_ref, float(expected.abs().max()))
        if bool(big.any()):
            self.max_rel = max(self.max_rel, float((diff[big] / expected.abs()[big]).max()))
        self.n += actual.shape[0]


@pytest.fixture
def check(request: pytest.FixtureRequest) -> Iterator[Checker]:
    checker = Checker()
    yield checker
    if checker.n:
        print(
            f"\n[logits] {request.node.name}: {checker.n} rows, "
            f"max rel err {checker.max_rel:.2e} (where |ref| > 1e-2), "
            f"max abs err {checker.max_abs:.2e}, max |ref| {checker.max_ref:.2f}"
        )


class Engine:
    """A model bound into its own region with a KV pool sized for it."""

    def __init__(
        self, hf: Any, device_blocks: int = 32, host_blocks: int = 16, device: str = "cpu"
    ) -> None:
        self.hf = hf.to(device)
        self.arch = ModelArch.from_hf_config(hf.config.to_dict())
        self.region = torch.empty(self.arch.weight_bytes(F32), dtype=torch.uint8, device=device)
        self.views = bind_weights(self.arch, self.region, F32)
        load(self.views, hf)
        self.model = LlamaModel(self.arch, self.views)
        block_bytes = KVPool.block_bytes_for([self.arch], F32, BLOCK_SIZE)
        self.pool = KVPool(device_blocks, host_blocks, block_bytes, device)
        self.kv = self.pool.paged(self.arch, F32)

    def step(self, *seqs: SeqInput) -> list[torch.Tensor]:
        batch = BatchInput(seqs)
        return batch.split(self.model.forward(batch, self.kv))


def n_blocks(n_tokens: int, kv: PagedKV) -> int:
    return -(-n_tokens // kv.tokens_per_block)


def random_tokens(n: int, seed: int, vocab: int = 128) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def run_sequence(
    eng: Engine,
    tokens: list[int],
    chunks: Sequence[int],
    table: list[int],
    check: Checker,
    ref: torch.Tensor | None = None,
) -> None:
    """Compute ``tokens`` in prefill ``chunks`` (all logits) then one decode step per
    remaining token, checking every logit row against transformers."""
    ref = hf_logits(eng.hf, tokens) if ref is None else ref
    start = 0
    for n in chunks:
        (out,) = eng.step(SeqInput(tokens[start : start + n], start, table, all_logits=True))
        check(out, ref[start : start + n])
        start += n
    for pos in range(start, len(tokens)):
        (out,) = eng.step(SeqInput([tokens[pos]], pos, table))
        check(out, ref[pos : pos + 1])


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("make", [llama_config, qwen2_config])
@pytest.mark.parametrize("tied", [False, True])
def test_prefill_then_decode_matches_transformers(make: Any, tied: bool, check: Checker) -> None:
    eng = Engine(hf_model(make(tie_word_embeddings=tied), seed=1))
    tokens = random_tokens(40, seed=2)
    run_sequence(eng, tokens, [28], list(range(n_blocks(40, eng.kv))), check)


@pytest.mark.parametrize("make", [llama_config, qwen2_config])
def test_chunked_prefill_and_shuffled_blocks(make: Any, check: Checker) -> None:
    eng = Engine(hf_model(make(), seed=3))
    tokens = random_tokens(45, seed=4)
    table = list(range(eng.kv.num_blocks))
    random.Random(5).shuffle(table)
    run_sequence(eng, tokens, [7, 13, 1, 10], table[: n_blocks(45, eng.kv)], check)


def test_mixed_batch_prefill_and_decodes(check: Checker) -> None:
    """One batch holds a prefill chunk and decode steps of sequences of different lengths
    (the padded, masked decode path) and keeps matching."""
    eng = Engine(hf_model(llama_config(), seed=6))
    lengths = [30, 21, 12]
    tokens = [random_tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    refs = [hf_logits(eng.hf, t) for t in tokens]
    free = iter(range(eng.kv.num_blocks))
    tables = [[next(free) for _ in range(n_blocks(n, eng.kv))] for n in lengths]
    done = [5, 9, 12]  # sequence 2 prefills alone first
    (out,) = eng.step(SeqInput(tokens[2][:12], 0, tables[2], all_logits=True))
    check(out, refs[2][:12])
    outs = eng.step(
        SeqInput(tokens[0][:5], 0, tables[0], all_logits=True),
        SeqInput(tokens[1][:9], 0, tables[1]),
    )
    check(outs[0], refs[0][:5])
    check(outs[1], refs[1][8:9])
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        seqs, which = [], []
        for i, (d, n) in enumerate(zip(done, lengths, strict=True)):
            if d < n:
                k = 4 if i == 0 and d < 17 else 1  # sequence 0 keeps prefilling in chunks
                seqs.append(SeqInput(tokens[i][d : d + k], d, tables[i], all_logits=True))
                which.append((i, d, k))
        for out, (i, d, k) in zip(eng.step(*seqs), which, strict=True):
            check(out, refs[i][d : d + k])
            done[i] = d + k


def test_offload_to_host_and_restore_to_other_blocks(check: Checker) -> None:
    eng = Engine(hf_model(llama_config(), seed=7))
    tokens = random_tokens(38, seed=8)
    ref = hf_logits(eng.hf, tokens)
    kv, pool = eng.kv, eng.pool
    table = [3, 9, 4, 0, 12]
    (out,) = eng.step(SeqInput(tokens[:33], 0, table, all_logits=True))
    check(out, ref[:33])
    host_ids = [15, 2, 7, 0, 11]
    pool.execute(
        MovePlan(Link.DEVICE_TO_HOST, tuple(zip(table, host_ids, strict=True)), pool.block_bytes)
    )
    pool.device_pool.zero_()  # the device copies are gone; only host holds the KV
    new_table = [20, 1, 31, 6, 17]
    pool.execute(
        MovePlan(
            Link.HOST_TO_DEVICE, tuple(zip(host_ids, new_table, strict=True)), pool.block_bytes
        )
    )
    assert n_blocks(38, kv) == len(new_table)
    for pos in range(33, 38):
        (out,) = eng.step(SeqInput([tokens[pos]], pos, new_table))
        check(out, ref[pos : pos + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefill_decode_offload_restore(check: Checker) -> None:
    """The same engine on CUDA: pinned host tier, device pool, batched decode."""
    eng = Engine(hf_model(qwen2_config(), seed=30), device="cuda")
    assert eng.pool.host_pool.is_pinned() and eng.pool.device_pool.is_cuda
    tokens = random_tokens(40, seed=31)
    ref = hf_logits(eng.hf, tokens)
    table = [7, 3, 5, 1, 6]
    assert n_blocks(40, eng.kv) == len(table)
    (out,) = eng.step(SeqInput(tokens[:25], 0, table, all_logits=True))
    check(out, ref[:25])
    host_ids, new_table = [0, 1, 2, 3, 4], [9, 10, 2, 4, 11]
    pool = eng.pool
    pool.execute(MovePlan(Link.DEVICE_TO_HOST, tuple(zip(table, host_ids, strict=True))))
    pool.device_pool.zero_()
    pool.execute(MovePlan(Link.HOST_TO_DEVICE, tuple(zip(host_ids, new_table, strict=True))))
    for pos in range(25, 40):
        (out,) = eng.step(SeqInput([tokens[pos]], pos, new_table))
        check(out, ref[pos : pos + 1])


def test_prefix_shared_from_another_sequence(check: Checker) -> None:
    """The second sequence reuses the first one's full blocks and computes only its suffix;
    the first sequence is unaffected."""
    eng = Engine(hf_model(qwen2_config(), seed=9))
    tpb = eng.kv.tokens_per_block
    prefix = random_tokens(2 * tpb, seed=10)
    a = prefix + random_tokens(7, seed=11)
    b = prefix + random_tokens(9, seed=12)
    ref_a, ref_b = hf_logits(eng.hf, a), hf_logits(eng.hf, b)
    table_a = [5, 2, 8]
    (out,) = eng.step(SeqInput(a[:-1], 0, table_a, all_logits=True))
    check(out, ref_a[:-1])
    table_b = [*table_a[:2], 11, 13]
    (out,) = eng.step(SeqInput(b[len(prefix) : -1], len(prefix), table_b, all_logits=True))
    check(out, ref_b[len(prefix) : -1])
    outs = eng.step(SeqInput(a[-1:], len(a) - 1, table_a), SeqInput(b[-1:], len(b) - 1, table_b))
    check(outs[0], ref_a[-1:])
    check(outs[1], ref_b[-1:])


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant: str, check: Checker) -> None:
    params = {"rope_theta": 10000.0, **ROPE_VARIANTS[variant]}
    eng = Engine(hf_model(llama_config(rope_parameters=params), seed=13))
    assert eng.arch.rope_scaling is not None
    assert eng.arch.rope_scaling.kind.value == variant
    tokens = random_tokens(40, seed=14)
    run_sequence(eng, tokens, [11, 20], list(range(n_blocks(40, eng.kv))), check)


def test_dynamic_ntk_prefill_matches_transformers(check: Checker) -> None:
    """Dynamic NTK past ``max_position_embeddings``: a prefill stretches the base by its own
    length as transformers does (its decode steps would rescale cached keys, so only the
    prefill is comparable with one full-sequence forward)."""
    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    eng = Engine(hf_model(llama_config(rope_parameters=params, max_position_embeddings=16), 15))
    tokens = random_tokens(30, seed=16)
    (out,) = eng.step(SeqInput(tokens, 0, list(range(n_blocks(30, eng.kv))), all_logits=True))
    check(out, hf_logits(eng.hf, tokens))


# ----------------------------------------------------------------------------- stability


def test_pointers_stable_across_reloads_and_model_switches(check: Checker) -> None:
    """Two models share one weight region and one KV pool; ten switches copy each model's
    weights into the same views. Pointers never move, outputs follow the loaded weights,
    and a sequence's KV survives switches away and back."""
    llama_hf = hf_model(llama_config(), seed=17)
    qwen_hf = hf_model(qwen2_config(tie_word_embeddings=True), seed=18)
    archs = [ModelArch.from_hf_config(m.config.to_dict()) for m in (llama_hf, qwen_hf)]
    region = torch.empty(max(a.weight_bytes(F32) for a in archs), dtype=torch.uint8)
    pool = KVPool(40, 8, KVPool.block_bytes_for(archs, F32, BLOCK_SIZE))
    kvs = [pool.paged(a, F32) for a in archs]
    assert kvs[1].tokens_per_block > kvs[0].tokens_per_block  # narrower model, more tokens
    views = [bind_weights(a, region, F32) for a in archs]
    models = [LlamaModel(a, v) for a, v in zip(archs, views, strict=True)]
    ptrs = [{n: t.data_ptr() for n, t in v.items()} for v in views]
    pool_ptrs = (pool.device_pool.data_ptr(), pool.host_pool.data_ptr())
    tokens = random_tokens(40, seed=19)
    tables = [list(range(0, 8)), list(range(20, 28))]
    for switch in range(10):
        i = switch % 2
        hf = (llama_hf, qwen_hf)[i]
        if switch >= 2:
            randomize_hf(hf, seed=100 + switch)  # new weights of the same model ...
        rebound = bind_weights(archs[i], region, F32)
        assert {n: t.data_ptr() for n, t in rebound.items()} == ptrs[i]
        load(rebound, hf)  # ... copied into the same views
        ref = hf_logits(hf, tokens)
        batch = BatchInput([SeqInput(tokens[:30], 0, tables[i], all_logits=True)])
        check(models[i].forward(batch, kvs[i]), ref[:30])
        assert (pool.device_pool.data_ptr(), pool.host_pool.data_ptr()) == pool_ptrs
    assert {n: t.data_ptr() for n, t in views[0].items()} == ptrs[0]


def test_kv_survives_a_switch_away_and_back(check: Checker) -> None:
    llama_hf = hf_model(llama_config(), seed=20)
    qwen_hf = hf_model(qwen2_config(), seed=21)
    archs = [ModelArch.from_hf_config(m.config.to_dict()) for m in (llama_hf, qwen_hf)]
    region = torch.empty(max(a.weight_bytes(F32) for a in archs), dtype=torch.uint8)
    pool = KVPool(40, 8, KVPool.block_bytes_for(archs, F32, BLOCK_SIZE))
    views = [bind_weights(a, region, F32) for a in archs]
    models = [LlamaModel(a, v) for a, v in zip(archs, views, strict=True)]
    kvs = [pool.paged(a, F32) for a in archs]
    a_tokens, b_tokens = random_tokens(30, seed=22), random_tokens(30, seed=23)
    ref_a, ref_b = hf_logits(llama_hf, a_tokens), hf_logits(qwen_hf, b_tokens)
    table_a, table_b = [0, 1, 2, 3], [10, 11, 12]
    load(views[0], llama_hf)
    out = models[0].forward(BatchInput([SeqInput(a_tokens[:20], 0, table_a)]), kvs[0])
    check(out, ref_a[19:20])
    for pos in range(20, 30):
        load(views[1], qwen_hf)  # switch away: the other model runs on its own blocks
        batch_b = BatchInput([SeqInput(b_tokens[: pos - 10], 0, table_b)])
        check(models[1].forward(batch_b, kvs[1]), ref_b[pos - 11 : pos - 10])
        load(views[0], llama_hf)  # and back
        out = models[0].forward(BatchInput([SeqInput([a_tokens[pos]], pos, table_a)]), kvs[0])
        check(out, ref_a[pos : pos + 1])


# ----------------------------------------------------------------------------- errors


def test_bad_requests_leave_the_kv_untouched() -> None:
    eng = Engine(hf_model(llama_config(max_position_embeddings=64), seed=24))
    table = list(range(4))
    eng.step(SeqInput(random_tokens(10, seed=25), 0, table))
    before = eng.pool.device_pool.clone()
    good = SeqInput([1, 2], 10, table)
    bad_cases = [
        (SeqInput([1, 128], 10, table), BadRequest, r"seqs\[1\].token_ids\[1\] = 128"),
        (SeqInput([-1], 10, table), BadRequest, "token_ids"),
        (SeqInput([1] * 30, 10, table), BadRequest, "block_table"),
        (SeqInput([1], 70, list(range(9))), ContextTooLong, "context is 64"),
        (SeqInput([1], 10, [0, 99]), BadRequest, "block 99"),
        (SeqInput([1, 2], 10, [7, 1]), BadRequest, "same KV slot"),
    ]
    for bad, error, match in bad_cases:
        with pytest.raises(error, match=match):
            eng.step(good, bad)
        assert torch.equal(eng.pool.device_pool, before)
    with pytest.raises(BadRequest, match="token_ids"):
        SeqInput([1.5], 0, table)
    with pytest.raises(BadRequest, match="start"):
        SeqInput([1], -1, table)


def test_move_plan_errors() -> None:
    arch = ModelArch.from_hf_config(llama_config().to_dict())
    pool = KVPool(4, 2, KVPool.block_bytes_for([arch], F32, BLOCK_SIZE))
    before = pool.host_pool.clone()
    with pytest.raises(BadRequest, match="host destination block 2"):
        pool.execute(MovePlan(Link.DEVICE_TO_HOST, ((0, 1), (1, 2)), pool.block_bytes))
    with pytest.raises(BadRequest, match="disk"):
        pool.execute(MovePlan(Link.DISK_TO_HOST, ((0, 1),), pool.block_bytes))
    with pytest.raises(BadRequest, match="bytes"):
        pool.execute(MovePlan(Link.DEVICE_TO_HOST, ((0, 1),), 7))
    with pytest.raises(BadRequest, match="twice"):
        pool.execute(MovePlan(Link.DEVICE_TO_HOST, ((0, 1), (1, 1)), pool.block_bytes))
    assert torch.equal(pool.host_pool, before)
    with pytest.raises(ConfigError, match="smaller than one token"):
        KVPool(4, 0, arch.kv_bytes_per_token(F32) // 2).paged(arch, F32)
