"""Sampling: parameter validation, greedy and filtered sampling, per-request seeds, and stop
conditions (end tokens, stop strings split across tokens, max tokens)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from talaria.engine.sampling import make_generator, sample, sample_row
from talaria.errors import BadRequest, ConfigError
from talaria.generation import SamplingParams, StopChecker, StopUpdate

# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": "1"},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"top_k": 2.5},
        {"max_tokens": 0},
        {"max_tokens": True},
        {"seed": 1.5},
        {"stop": [""]},
        {"stop": [3]},
        {"stop_token_ids": [-1]},
        {"min_tokens": -1},
        {"min_tokens": 17},  # above max_tokens (16)
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("nan")},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"frequency_penalty": True},
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": True},
        {"ignore_eos": 1},
    ],
)
def test_bad_params_are_bad_requests(kwargs: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)


def test_params_defaults_and_conversions() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[7, 8])
    assert params.stop == ("END",) and params.stop_token_ids == (7, 8)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy and SamplingParams(stop=None).stop == ()


# ----------------------------------------------------------------------------- sample


def _logits(batch: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_top_k_one_is_greedy() -> None:
    logits = _logits()
    greedy = [SamplingParams(temperature=0.0)] * 4
    assert torch.equal(sample(logits, greedy, [None] * 4), logits.argmax(-1))
    top1 = [SamplingParams(temperature=1.5, top_k=1)] * 4
    gens = [make_generator(p) for p in top1]
    assert torch.equal(sample(logits, top1, gens), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    logits = _logits(batch=3)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]

    def draw(rows: list[int]) -> list[int]:
        gens = [make_generator(params[r]) for r in rows]
        out: list[int] = []
        for _ in range(20):
            out += sample(logits[rows], [params[r] for r in rows], gens).tolist()
        return out

    assert draw([0, 1, 2]) == draw([0, 1, 2])
    alone = draw([1])
    batched = draw([0, 1, 2])[1::3]
    assert alone == batched  # a request's tokens do not depend on its batch neighbours
    assert len(set(draw([0]))) > 1  # it does sample


def test_top_k_keeps_only_the_k_best() -> None:
    logits = _logits(batch=1, vocab=30)[0]
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    gen = make_generator(params)
    drawn = {sample_row(logits, params, gen) for _ in range(300)}
    assert drawn == set(torch.topk(logits, 3).indices.tolist())


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    gen = make_generator(params)
    counts = torch.bincount(
        torch.tensor([sample_row(logits, params, gen) for _ in range(4000)]), minlength=4
    )
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 reaches 0.8: the rest is cut
    assert abs(counts[0] / 4000 - 0.625) < 0.03  # renormalised 0.5 / 0.8
    small = SamplingParams(temperature=1.0, top_p=0.1, seed=0)
    assert {sample_row(logits, small, make_generator(small)) for _ in range(50)} == {0}
    wide = SamplingParams(temperature=1.0, top_p=0.81, seed=0)
    g = make_generator(wide)
    assert 2 in {sample_row(logits, wide, g) for _ in range(2000)}


def test_sample_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="one params"):
        sample(_logits(batch=2), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="without a generator"):
        sample(_logits(batch=1), [SamplingParams()], [None])


# ----------------------------------------------------------------------------- stop


class FakeStream:
    """Token id i decodes to ``pieces[i]``; holds nothing back."""

    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces

    def push(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def _run(checker: StopChecker, ids: list[int]) -> tuple[str, list[StopUpdate]]:
    updates: list[StopUpdate] = []
    for token in ids:
        updates.append(checker.update(token))
        if checker.finished:
            break
    return "".join(u.text for u in updates), updates


def test_stop_string_split_across_tokens_is_caught_and_trimmed() -> None:
    pieces = {0: "Hello ", 1: "wor", 2: "ld", 3: " E", 4: "N", 5: "D", 6: "after"}
    params = SamplingParams(stop=["END"], max_tokens=50)
    text, updates = _run(StopChecker(params, [99], FakeStream(pieces)), [0, 1, 2, 3, 4, 5, 6])
    assert text == "Hello world "
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_reason == "END"
    assert [u.text for u in updates] == ["Hello ", "wor", "ld", " ", "", ""]


def test_partial_match_that_fails_is_released() -> None:
    pieces = {0: "a<", 1: "/b", 2: "x", 3: "</stop>"}
    params = SamplingParams(stop=["</stop>"], max_tokens=50)
    text, updates = _run(StopChecker(params, [], FakeStream(pieces)), [0, 1, 2, 3])
    assert [u.text for u in updates] == ["a", "</b", "x", ""]
    assert text == "a</bx" and updates[-1].stop_reason == "</stop>"


def test_earliest_of_several_stop_strings_wins() -> None:
    pieces = {0: "one two three"}
    params = SamplingParams(stop=["three", "two"], max_tokens=5)
    _, updates = _run(StopChecker(params, [], FakeStream(pieces)), [0])
    assert updates[0] == StopUpdate("one ", "stop", "two")


def test_eos_stop_tokens_and_ignore_eos() -> None:
    pieces = {0: "a", 1: "b", 2: "<eos>", 3: "<stop>"}
    _, updates = _run(StopChecker(SamplingParams(), [2], FakeStream(pieces)), [0, 1, 2, 0])
    assert updates[-1] == StopUpdate("", "stop", 2) and len(updates) == 3
    params = SamplingParams(stop_token_ids=[3], ignore_eos=True, max_tokens=10)
    text, updates = _run(StopChecker(params, [2], FakeStream(pieces)), [0, 2, 1, 3])
    assert text == "a<eos>b" and updates[-1].stop_reason == 3


def test_max_tokens_gives_length_and_flushes_held_text() -> None:
    pieces = {0: "x", 1: "EN"}
    params = SamplingParams(stop=["END"], max_tokens=3)
    checker = StopChecker(params, [], FakeStream(pieces))
    text, updates = _run(checker, [0, 0, 1, 0])
    assert text == "xxEN" and updates[-1].finish_reason == "length"
    assert updates[-1].stop_reason is None and checker.num_tokens == 3
    with pytest.raises(RuntimeError):
        checker.update(0)


def test_eos_on_the_last_allowed_token_is_stop() -> None:
    checker = StopChecker(SamplingParams(max_tokens=2), [5])
    assert checker.update(1) == StopUpdate("")
    assert checker.update(5).finish_reason == "stop"


def test_min_tokens_makes_end_ids_text_and_defers_stop_strings() -> None:
    pieces = {0: "a", 1: "STOP", 2: "<eos>", 3: "b"}
    params = SamplingParams(stop=["STOP"], min_tokens=3, max_tokens=10)
    text, updates = _run(StopChecker(params, [2], FakeStream(pieces)), [2, 1, 3, 0, 2])
    # tokens 1..3 ("<eos>", "STOP", "b") are generated before min_tokens is reached: the end
    # id is text and the stop string ends nothing; the fifth token (eos) ends the output
    assert text == "<eos>STOPba" and updates[-1] == StopUpdate("", "stop", 2)
    assert len(updates) == 5


def test_a_stop_string_completed_at_min_tokens_ends_the_output() -> None:
    pieces = {0: "x", 1: "ST", 2: "OP", 3: "y"}
    params = SamplingParams(stop=["STOP"], min_tokens=3, max_tokens=10)
    text, updates = _run(StopChecker(params, [], FakeStream(pieces)), [0, 1, 2, 3])
    assert text == "x" and updates[-1] == StopUpdate("", "stop", "STOP") and len(updates) == 3


def test_an_end_id_right_after_min_tokens_ends_the_output() -> None:
    checker = StopChecker(SamplingParams(min_tokens=1, max_tokens=5), [5])
    assert checker.update(5) == StopUpdate("")  # the first token: still below min_tokens
    assert checker.update(5).finish_reason == "stop" and checker.num_tokens == 2


def test_stop_strings_need_a_stream() -> None:
    with pytest.raises(ConfigError):
        StopChecker(SamplingParams(stop=["x"]), [])


def test_stop_strings_with_a_real_tokenizer_stream() -> None:
    from talaria.engine.loader import gguf_tokenizer, smollm2_gguf

    tok = gguf_tokenizer(smollm2_gguf())
    ids = tok.encode("The answer is 42.\nObservation: done 😀")
    params = SamplingParams(stop=["\nObservation:"], max_tokens=100)
    text, updates = _run(StopChecker(params, [2], tok.stream()), ids)
    assert text == "The answer is 42." and updates[-1].finish_reason == "stop"
    emoji = tok.encode("hi 😀😀")
    text, updates = _run(StopChecker(SamplingParams(max_tokens=100), [2], tok.stream()), emoji)
    assert updates[-1].finish_reason is None and text == "hi 😀😀"


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 9.99e-6])
def test_a_temperature_near_zero_samples_greedily(temperature: float) -> None:
    # dividing by it would overflow the logits to inf and fail the draw (found by the fuzz)
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    logits = torch.tensor([[0.5, 3.0, -1.0]])
    assert sample(logits, [params], [make_generator(params)]).tolist() == [1]
    assert not SamplingParams(temperature=1e-5).greedy


def test_logits_that_overflow_over_the_temperature_still_draw() -> None:
    # float32 max over a temperature of 1e-5 is +inf; the draw caps it instead of failing
    params = SamplingParams(temperature=1e-5, seed=3)
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[big, 0.0, -big, float("-inf")]])
    assert sample(logits, [params], [make_generator(params)]).tolist() == [0]
