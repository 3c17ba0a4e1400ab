"""Per-request logits processing: the min-tokens mask, repetition / frequency / presence
penalties (exact values on small tensors, and hypothesis properties against a plain-Python
reference), and the logprobs of a drawn token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from talaria.engine.logits import LogitsProcessor, token_logprob
from talaria.generation import SamplingParams
from tests.helpers import examples

INF = float("inf")


def params(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kw)  # type: ignore[arg-type]


def test_min_tokens_masks_the_end_ids_until_enough_tokens_came() -> None:
    proc = LogitsProcessor(params(min_tokens=2), [0], end_ids={3, 1, 99}, vocab=4)
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert proc(logits).tolist() == [1.0, -INF, 3.0, -INF]  # 99 is outside the vocabulary
    proc.observe(2)
    assert proc(logits).tolist() == [1.0, -INF, 3.0, -INF]
    proc.observe(0)
    assert proc(logits).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # the input is never mutated


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_ids() -> None:
    proc = LogitsProcessor(params(repetition_penalty=2.0), [0, 1, 1], end_ids=(), vocab=4)
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    assert proc(logits).tolist() == [1.0, -4.0, 1.0, 0.5]
    proc.observe(3)  # generated ids count as seen too
    assert proc(logits).tolist() == [1.0, -4.0, 1.0, 0.25]


def test_a_tiny_repetition_penalty_caps_instead_of_overflowing() -> None:
    # 1e-160 turns every seen positive logit into +inf (found by the fuzz: the draw failed)
    proc = LogitsProcessor(params(repetition_penalty=1e-160), [0, 1], end_ids=(), vocab=3)
    out = proc(torch.tensor([2.0, -2.0, 1.0]))
    big = torch.finfo(torch.float32).max
    assert out.tolist() == [big, -0.0, 1.0]  # -2e-160 is below float32's range
    assert torch.isfinite(out).all()


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    p = params(frequency_penalty=0.5, presence_penalty=1.0)
    proc = LogitsProcessor(p, [2, 2, 2], end_ids=(), vocab=4)  # the prompt does not count
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert proc(logits).tolist() == [1.0, 1.0, 1.0, 1.0]
    for token in (0, 0, 1):
        proc.observe(token)
    # id 0: 1 - 0.5 * 2 - 1; id 1: 1 - 0.5 - 1
    assert proc(logits).tolist() == [-1.0, -0.5, 1.0, 1.0]


def test_negative_penalties_encourage_repeats() -> None:
    proc = LogitsProcessor(params(presence_penalty=-1.0), [], end_ids=(), vocab=3)
    proc.observe(1)
    assert proc(torch.tensor([0.0, 0.0, 0.0])).tolist() == [0.0, 1.0, 0.0]


def test_processor_checks_the_logits_shape() -> None:
    proc = LogitsProcessor(params(min_tokens=1), [], end_ids={0}, vocab=4)
    with pytest.raises(ValueError, match=r"\[4\]"):
        proc(torch.zeros(5))


def test_params_say_whether_they_process_logits() -> None:
    assert not params().processes_logits
    assert not params(logprobs=3, ignore_eos=True, stop_token_ids=[1]).processes_logits
    for kw in (
        {"min_tokens": 1},
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
    ):
        assert params(**kw).processes_logits, kw


def test_token_logprob_is_the_log_softmax_with_the_top_alternatives() -> None:
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    lp = token_logprob(logits + 7.0, 2, top=2)  # a shift changes nothing
    assert lp.token_id == 2 and lp.logprob == pytest.approx(math.log(0.3), abs=1e-6)
    assert [i for i, _ in lp.top] == [3, 2]
    assert [v for _, v in lp.top] == pytest.approx([math.log(0.4), math.log(0.3)], abs=1e-6)
    assert token_logprob(logits, 0, top=0).top == ()
    assert len(token_logprob(logits, 0, top=20).top) == 4  # at most the vocabulary


def test_token_logprob_orders_ties_by_id() -> None:
    lp = token_logprob(torch.tensor([1.0, 3.0, 3.0, 3.0]), 0, top=3)
    assert [i for i, _ in lp.top] == [1, 2, 3]


# ----------------------------------------------------------------------------- properties

VOCAB = 8
LOGITS = st.lists(
    st.floats(-50, 50, allow_nan=False, allow_subnormal=False), min_size=VOCAB, max_size=VOCAB
)
IDS = st.lists(st.integers(0, VOCAB - 1), max_size=12)


def reference(
    logits: list[float], prompt: list[int], out: list[int], p: SamplingParams, ends: set[int]
) -> list[float]:
    """The same processing in plain Python, one token at a time."""
    res = list(logits)
    seen = set(prompt) | set(out)
    for i in range(VOCAB):
        if len(out) < p.min_tokens and i in ends:
            res[i] = -INF
            continue
        if p.repetition_penalty != 1.0 and i in seen:
            x = res[i]
            res[i] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = out.count(i)
        res[i] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return res


@settings(max_examples=examples(150), deadline=None)
@given(
    logits=LOGITS,
    prompt=IDS,
    out=IDS,
    rp=st.floats(0.1, 5.0),
    freq=st.floats(-2.0, 2.0),
    pres=st.floats(-2.0, 2.0),
    min_tokens=st.integers(0, 16),
    ends=st.sets(st.integers(0, VOCAB - 1), max_size=3),
)
def test_processing_matches_a_plain_python_reference(
    logits: list[float],
    prompt: list[int],
    out: list[int],
    rp: float,
    freq: float,
    pres: float,
    min_tokens: int,
    ends: set[int],
) -> None:
    p = params(
        repetition_penalty=rp, frequency_penalty=freq, presence_penalty=pres, min_tokens=min_tokens
    )
    proc = LogitsProcessor(p, prompt, ends, VOCAB)
    for token in out:
        proc.observe(token)
    got = proc(torch.tensor(logits, dtype=torch.float32)).tolist()
    # float32 on the engine's side, float64 here
    want = reference([float(torch.tensor(x)) for x in logits], prompt, out, p, ends)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


@settings(max_examples=examples(100), deadline=None)
@given(logits=LOGITS, prompt=IDS, rp=st.floats(1.0, 10.0))
def test_a_repetition_penalty_above_one_never_raises_a_seen_token(
    logits: list[float], prompt: list[int], rp: float
) -> None:
    proc = LogitsProcessor(params(repetition_penalty=rp), prompt, (), VOCAB)
    before = torch.tensor(logits)
    after = proc(before)
    for i in range(VOCAB):
        if i in prompt:
            assert after[i] <= before[i]
        else:
            assert after[i] == before[i]


@settings(max_examples=examples(100), deadline=None)
@given(logits=LOGITS, top=st.integers(0, VOCAB), token=st.integers(0, VOCAB - 1))
def test_logprobs_are_a_distribution_and_the_top_is_sorted(
    logits: list[float], top: int, token: int
) -> None:
    t = torch.tensor(logits)
    lp = token_logprob(t, token, top)
    assert lp.logprob <= 0.0
    assert math.fsum(math.exp(v) for _, v in token_logprob(t, token, VOCAB).top) == (
        pytest.approx(1.0, abs=1e-5)
    )
    values = [v for _, v in lp.top]
    assert len(values) == top and values == sorted(values, reverse=True)
    if top and lp.top[0][0] == token:
        assert lp.logprob == lp.top[0][1]
